"""A stand-in for the API server for unit tests of whole reconciles (controller/reconcile.py)."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


class ApiServer:
    """The API server as far as a reconcile of a running job goes (one namespace): objects by (resource, name),
    with UIDs and resourceVersions; records the writes in `calls`. For unit tests of Reconciler.reconcile;
    the real control plane runs the same code in tests/integration."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Obj] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.patches: list[Obj] = []  # the bodies of `patch` calls
        self.writes: dict[str, int] = {}  # Kube's request counters (Metrics.mirror_api_calls)
        self.reads: dict[str, int] = {}
        self.n = 0

    def _put(self, gvr: Any, body: Obj) -> Obj:
        self.n += 1
        obj = {**body, "metadata": {**body["metadata"], "namespace": "ns", "resourceVersion": str(self.n)}}
        obj["metadata"].setdefault("uid", f"uid-{gvr[2]}-{self.n}")
        self.objects[(gvr[2], obj["metadata"]["name"])] = obj
        return obj

    def get(self, gvr: Any, namespace: str | None, name: str) -> Obj | None:
        return self.objects.get((gvr[2], name))

    def get_metadata(self, gvr: Any, namespace: str | None, name: str) -> Obj | None:
        hit = self.get(gvr, namespace, name)
        return {"metadata": hit["metadata"]} if hit else None

    def list_objects(self, gvr: Any, namespace: str | None, selector: str | None) -> list[Obj]:
        return [o for (res, _), o in self.objects.items() if res == gvr[2]]

    def list_metadata(self, gvr: Any, namespace: str | None = None, selector: str | None = None,
                      limit: int = 500) -> list[Obj]:
        return [{"metadata": o["metadata"]} for o in self.list_objects(gvr, namespace, selector)]

    def create(self, gvr: Any, namespace: str | None, body: Obj, kind: str) -> Obj:
        self.calls.append(("create", kind, body["metadata"]["name"]))
        return self._put(gvr, body)

    def own_for_apply(self, body: Obj) -> None:
        pass

    def delete(self, gvr: Any, namespace: str, name: str, kind: str, uid: str | None = None) -> None:
        self.calls.append(("delete", kind, name))
        del self.objects[(gvr[2], name)]

    def apply(self, body: Obj) -> Obj:
        self.calls.append(("apply", body["kind"], body["metadata"]["name"]))
        old = self.objects[("rayjobs", body["metadata"]["name"])]
        return self._put(("ray.io", "v1", "rayjobs"), {**body, "status": old.get("status")})

    def patch(self, gvr: Any, namespace: str, name: str, patch: Obj, kind: str = "") -> Obj:
        self.calls.append(("patch", kind, name))
        self.patches.append(patch)
        return self.objects[(gvr[2], name)]

    def patch_status(self, namespace: str, name: str, patch: Obj, uid: str | None = None,
                     has_status: bool = True, resource_version: str | None = None) -> Obj:
        job = self.objects[("finetunejobs", name)]
        job["status"] = {k: v for k, v in {**(job.get("status") or {}), **patch}.items() if v is not None}
        return job

    def event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def list_events(self, *args: Any) -> list[Obj]:
        return []
