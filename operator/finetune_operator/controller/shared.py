"""Children shared between jobs: the content-addressed, immutable runtime ConfigMap.

Created once per namespace and runtime version; every job that mounts it adds itself to its
ownerReferences (a strategic-merge patch keyed by uid, so concurrent jobs never drop each other), and the
garbage collector deletes it when its last owner is gone. Its data never changes (`immutable: true`),
so nothing is ever re-applied under running trainers.
"""

from __future__ import annotations

from typing import Any

from .k8s import ApiError, Kube, gvr_of

Obj = dict[str, Any]


def ensure_shared(kube: Kube, obj: Obj, exists: bool = False) -> Obj:
    """Create `obj` if absent; otherwise add its ownerReferences to the existing one. Returns the object.

    `exists`: this process has seen it (another job's owner was added): the owner is added with one
    patch, without reading it first; if it was collected meanwhile (404), it is created."""
    meta = obj["metadata"]
    ns, name, gvr = meta.get("namespace"), meta["name"], gvr_of(obj)
    if exists:
        try:
            return kube.patch(gvr, ns or "default", name, {"metadata": {"ownerReferences": meta.get("ownerReferences") or []}},
                              obj["kind"], content_type="application/strategic-merge-patch+json")
        except ApiError as err:
            if err.status != 404:
                raise
    current = kube.get(gvr, ns, name)
    if current is None:
        try:
            return kube.create(gvr, ns, obj, obj["kind"])
        except ApiError as err:
            if err.status != 409:  # another job's reconcile created it a moment ago
                raise
            current = kube.get(gvr, ns, name)
            if current is None:
                raise
    have = {r.get("uid") for r in current["metadata"].get("ownerReferences") or []}
    missing = [r for r in meta.get("ownerReferences") or [] if r["uid"] not in have]
    if not missing:
        return current
    return kube.patch(gvr, ns or "default", name, {"metadata": {"ownerReferences": missing}}, obj["kind"],
                      content_type="application/strategic-merge-patch+json")
