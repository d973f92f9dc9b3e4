"""The CRDs a dev cluster starts with: every ``*.yaml`` of the checkout's ``crds/`` (or given directories)
plus KubeRay's, from the module the ray-operator binary was built from."""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from . import build
from .apiclient import FIELD_MANAGER, Api, status_message
from .supervisor import DevClusterError

BASE = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

Wait = Callable[[str, Callable[[], bool]], None]


def default_crd_dirs() -> list[Path]:
    """The repository's ``crds/`` when running from a checkout (or ``$FINETUNE_CRDS_DIR``)."""
    env = os.environ.get("FINETUNE_CRDS_DIR")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "crds").is_dir():
            return [parent / "crds"]
    return []


def crd_files(crd_dirs: Sequence[Path]) -> list[Path]:
    files = [f for d in crd_dirs for f in sorted(Path(d).glob("*.yaml")) + sorted(Path(d).glob("*.yml"))]
    return files + build.kuberay_crds()


def install(api: Api, files: Sequence[Path], wait: Wait) -> None:
    """Create every CustomResourceDefinition in ``files`` and ``wait`` until all are Established."""
    docs = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                docs.append(doc)

    def create(doc: dict[str, Any]) -> None:
        # Plain create (the cluster is fresh): no last-applied annotation, so KubeRay's ~1 MB CRDs
        # fit; server-side apply only when one already exists.
        try:
            api.request("POST", BASE, doc, timeout=120)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise DevClusterError(
                    f"the apiserver rejected CRD {doc['metadata']['name']}: {status_message(e)}"
                ) from None
            q = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
            api.request(
                "PATCH",
                f"{BASE}/{doc['metadata']['name']}?{q}",
                doc,
                content_type="application/apply-patch+yaml",
                timeout=120,
            )

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(create, docs))

    def established() -> bool:
        for doc in docs:
            crd = api.get(f"{BASE}/{doc['metadata']['name']}")
            conds = crd.get("status", {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                return False
        return True

    wait(f"{len(docs)} CRDs established", established)
