"""KubeRay's CRDs, taken from the Go module of the exact version the dev cluster runs.

The version is pinned once, ``versions.KUBERAY_VERSION`` (why that one: its comment there).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

from .versions import KUBERAY_VERSION

KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"


@functools.cache
def module_dir(version: str = KUBERAY_VERSION) -> Path:
    """Download (or find in the Go module cache) the ray-operator module and return its directory."""
    with tempfile.TemporaryDirectory() as tmp:
        # `go mod download` of a module@version needs a main module context: use an empty one.
        Path(tmp, "go.mod").write_text("module finetune.dev/kuberay-crds\n\ngo 1.22\n")
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{KUBERAY_MODULE}@{version}"],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
    if out.returncode != 0:
        raise RuntimeError(f"go mod download {KUBERAY_MODULE}@{version} failed: {out.stdout}{out.stderr}")
    info = json.loads(out.stdout)
    return Path(info["Dir"])


def crd_dir(version: str = KUBERAY_VERSION) -> Path:
    return module_dir(version) / "config" / "crd" / "bases"


def crd_path(plural: str, version: str = KUBERAY_VERSION) -> Path:
    """crd_path("rayjobs") -> .../config/crd/bases/ray.io_rayjobs.yaml"""
    return crd_dir(version) / f"ray.io_{plural}.yaml"
