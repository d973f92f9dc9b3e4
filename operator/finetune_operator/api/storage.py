"""Storage URIs in the spec, and where they appear inside the Ray pods.

`pvc://claim/sub/path` is mounted by the renderer at `PVC_MOUNT_ROOT/claim` in every Ray pod, so the
training runtime reads and writes `PVC_MOUNT_ROOT/claim/sub/path`. `s3://` URIs are passed through
(pyarrow/fsspec handle them). Absolute paths are used as they are; `./relative` paths only make sense
for `finetune run` on one machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .grammar import DNS1123_SUBDOMAIN_FMT

PVC_MOUNT_ROOT = "/mnt/finetune/pvc"
_PVC = re.compile(rf"^pvc://(?P<claim>{DNS1123_SUBDOMAIN_FMT})(?P<path>/.*)?$")  # a claim names a PVC


@dataclass(frozen=True)
class PVCRef:
    claim: str
    path: str  # inside the claim, "" or starting with "/"

    @property
    def mount_path(self) -> str:
        return f"{PVC_MOUNT_ROOT}/{self.claim}"

    @property
    def local_path(self) -> str:
        return f"{self.mount_path}{self.path}"


def parse_pvc(uri: str | None) -> PVCRef | None:
    if not uri:
        return None
    m = _PVC.match(uri)
    if not m:
        return None
    return PVCRef(claim=m.group("claim"), path=(m.group("path") or "").rstrip("/"))


def is_remote(uri: str) -> bool:
    return uri.startswith("s3://")


def is_local_path(uri: str) -> bool:
    return uri.startswith("/") or uri.startswith("./") or uri.startswith("../")


def resolve_in_pod(uri: str) -> str:
    """The path or URI the training processes use for a spec URI."""
    pvc = parse_pvc(uri)
    return pvc.local_path if pvc else uri
