"""CRDs of projects whose objects deploy/ ships but the dev cluster does not run (the Prometheus
Operator's PodMonitor/PrometheusRule, Karpenter's NodePool/EC2NodeClass), so that the API server
can check those objects (server-side dry run). Taken from each project's Go module at the pinned
version: a module download through the Go module proxy, nothing built."""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .build import BuildError, _go_env, find_go
from .versions import KARPENTER_AWS_VERSION, KARPENTER_GO_TOOLCHAIN, PROMETHEUS_OPERATOR_VERSION


@dataclass(frozen=True)
class CrdSource:
    module: str
    version: str
    directory: str
    names: tuple[str, ...] = ()  # file names to take; empty: every *.yaml in directory
    toolchain: str = ""  # GOTOOLCHAIN when the module's go.mod needs a newer Go than the installed one


SOURCES: dict[str, CrdSource] = {
    "prometheus-operator": CrdSource(
        "github.com/prometheus-operator/prometheus-operator", PROMETHEUS_OPERATOR_VERSION,
        "example/prometheus-operator-crd",
        ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml"),
    ),
    # The AWS provider's module carries the core CRDs (karpenter.sh) next to its own (karpenter.k8s.aws).
    # Its go.mod says go 1.26.11: `go mod download` refuses it under Go 1.26.8 without that toolchain
    # (fetched once through the Go module proxy, like any module).
    "karpenter": CrdSource("github.com/aws/karpenter-provider-aws", KARPENTER_AWS_VERSION, "pkg/apis/crds",
                           toolchain=KARPENTER_GO_TOOLCHAIN),
}


def module_dir(module: str, version: str, toolchain: str = "") -> Path:
    """Where the Go module cache holds ``module@version`` (downloaded first if needed)."""
    env = {**_go_env(), **({"GOTOOLCHAIN": toolchain} if toolchain else {})}
    with tempfile.TemporaryDirectory() as tmp:  # outside any module: GOFLAGS=-mod=readonly has nothing to read
        res = subprocess.run([find_go(), "mod", "download", "-json", f"{module}@{version}"], cwd=tmp,
                             env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise BuildError(f"go mod download {module}@{version} failed:\n{res.stdout}{res.stderr}")
    return Path(json.loads(res.stdout)["Dir"])


def crd_files(name: str) -> list[Path]:
    src = SOURCES[name]
    d = module_dir(src.module, src.version, src.toolchain) / src.directory
    files = [d / n for n in src.names] if src.names else sorted(d.glob("*.yaml"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise BuildError(f"{name}: CRD files not found in {d}: {missing or 'none'}")
    return files
