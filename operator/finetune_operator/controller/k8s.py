"""The one module that talks to the API server.

A thin REST layer over the kubernetes client's connection handling (kubeconfig / in-cluster auth,
TLS), returning plain dicts. Every write goes through `_write`, which counts it (by verb and kind) so
the benchmark can show how quiet the operator is when nothing changes.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client, config
from urllib3.util.retry import Retry

from ..api import spec as s
from ..render.config import FIELD_MANAGER

Obj = dict[str, Any]

FTJ = ("finetune.dev", "v1alpha1", "finetunejobs")
RAYJOB = ("ray.io", "v1", "rayjobs")
RAYCLUSTER = ("ray.io", "v1", "rayclusters")


class NotLeader(Exception):
    """A write refused because this replica may no longer hold the leader Lease (fencing)."""


class ApiError(Exception):
    def __init__(self, status: int, body: str, what: str, retry_after: float | None = None):
        self.status = status
        self.body = body
        # Seconds the server asked us to wait (Retry-After on a 429 from API Priority and Fairness, or on a
        # 503/504 of an overloaded server); None when it did not say.
        self.retry_after = retry_after
        try:
            self.message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            self.message = body
        super().__init__(f"{what}: HTTP {status}: {self.message}")


class ObjectReplaced(ApiError):
    """A UID-guarded write found another object under the name: the one it was meant for was deleted and
    a new one (`kubectl delete && kubectl apply`, Argo CD Replace) was created in its place."""


class Conflict(ApiError):
    """A write guarded by a resourceVersion found the object changed since that version. `current` is the
    object as the API server has it now (read to tell this apart from ObjectReplaced)."""

    def __init__(self, status: int, body: str, what: str, current: Obj):
        super().__init__(status, body, what)
        self.current = current


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the API server sends whole seconds; an HTTP date is not expected from it)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


# Retries inside urllib3, per request: none. Its default, Retry(3), tried a request that timed out or lost
# its connection three more times, each with the full timeout, so one call could last 4 x Kube.timeout and
# outlive the leader Lease it began under (leader.py's arithmetic assumes one timeout per call). Every
# caller here has its own retry with backoff: the work queue, the flusher, the leader loop.
URLLIB3_RETRIES = Retry(total=0)


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(client_configuration=cfg)
    cfg.retries = URLLIB3_RETRIES
    return client.ApiClient(cfg)


def _path(gvr: tuple[str, str, str], namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    group, version, plural = gvr
    base = f"/api/{version}" if group == "" else f"/apis/{group}/{version}"
    if namespace:
        base += f"/namespaces/{quote(namespace)}"
    base += f"/{plural}"
    if name:
        base += f"/{quote(name)}"
    if sub:
        base += f"/{sub}"
    return base


CONFIGMAPS = ("", "v1", "configmaps")
PODS = ("", "v1", "pods")
NODES = ("", "v1", "nodes")
EVENTS = ("", "v1", "events")
LEASES = ("coordination.k8s.io", "v1", "leases")
TOKENREVIEWS = ("authentication.k8s.io", "v1", "tokenreviews")


def _object_not_found(body: str) -> bool:
    """A 404 about the object (a Status naming it), not about the resource type ("404 page not found")."""
    try:
        status = json.loads(body)
    except ValueError:
        return False
    return (isinstance(status, dict) and status.get("kind") == "Status" and status.get("reason") == "NotFound"
            and bool((status.get("details") or {}).get("name")))


def gvr_of(obj: Obj) -> tuple[str, str, str]:
    api_version, kind = obj["apiVersion"], obj["kind"]
    group, _, version = api_version.rpartition("/")
    plural = {"ConfigMap": "configmaps", "RayJob": "rayjobs", "RayCluster": "rayclusters", "FinetuneJob": "finetunejobs"}[kind]
    return group, version, plural


class Kube:
    def __init__(self, api: client.ApiClient, timeout: float = 10.0):
        # The timeout stays well below the leader Lease's renew deadline (leader.py: 30 s lease, renewed
        # every 10 s, given up 20 s after the last renewal), so no call outlives the leadership it began in.
        self.api = api
        self.timeout = timeout
        self.writes: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()  # "get pods", "list nodes", ...: what the read cache spares
        self._lock = threading.Lock()
        # Fencing (leader.py): every write but the Lease's own asks this first; None: always allowed.
        self.may_write: Callable[[], bool] | None = None
        # Every write's answer (the object as stored) goes here: the read cache (cache.py) keeps it.
        self.on_written: Callable[[Obj], None] | None = None
        # A UID-guarded write answered 404 (the object is gone): the read cache evicts it.
        self.on_gone: Callable[[tuple[str, str, str], str, str], None] | None = None

    # ------------------------------------------------------------------------------------------ REST
    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: dict[str, Any] | None = None,
        what: str = "",
        accept: str = "application/json",
    ) -> Obj:
        headers = {"Accept": accept, "Content-Type": content_type}
        method_, url, headers, _, _ = self.api.param_serialize(
            method=method, resource_path=path, header_params=headers, auth_settings=["BearerToken"]
        )
        if query:
            url += "?" + urlencode(query)
        resp = self.api.call_api(method_, url, header_params=headers, body=body, _request_timeout=self.timeout)
        raw = resp.read()
        text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
        if resp.status >= 400:
            raise ApiError(resp.status, text, what or f"{method} {path}",
                           retry_after=parse_retry_after(resp.getheader("Retry-After")))
        return json.loads(text) if text else {}

    def _write(self, verb: str, kind: str, method: str, path: str, fenced: bool = True, **kw: Any) -> Obj:
        if fenced and kind != "Lease" and self.may_write is not None and not self.may_write():
            raise NotLeader(f"{verb} {kind} refused: this replica no longer surely holds the leader Lease")
        with self._lock:
            self.writes[f"{verb} {kind}"] += 1
        out = self.request(method, path, **kw)
        if self.on_written is not None and isinstance(out, dict) and out.get("metadata"):
            self.on_written(out)
        return out

    def _read(self, verb: str, gvr: tuple[str, str, str]) -> None:
        with self._lock:
            self.reads[f"{verb} {gvr[2]}"] += 1

    def get(self, gvr: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        self._read("get", gvr)
        try:
            return self.request("GET", _path(gvr, namespace, name))
        except ApiError as err:
            if err.status == 404 and _object_not_found(err.body):
                return None
            raise  # a 404 for the resource type itself (e.g. the KubeRay CRDs are missing) is an error

    def get_metadata(self, gvr: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        """The object's metadata only (a PartialObjectMetadata): whether it exists, without its data (a
        runtime ConfigMap is ~200 KB)."""
        self._read("get", gvr)
        try:
            return self.request("GET", _path(gvr, namespace, name),
                                accept="application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1")
        except ApiError as err:
            if err.status == 404 and _object_not_found(err.body):
                return None
            raise

    def list_events(self, namespace: str, kind: str, name: str) -> list[Obj]:
        """The core/v1 Events about one object (a pod's FailedMount, say), oldest first."""
        self._read("list", EVENTS)
        out = self.request("GET", _path(EVENTS, namespace),
                           query={"fieldSelector": f"involvedObject.kind={kind},involvedObject.name={name}"})
        items = list(out.get("items") or [])
        return sorted(items, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))

    def list_objects(self, gvr: tuple[str, str, str], namespace: str | None = None, selector: str | None = None) -> list[Obj]:
        return self.list_with_version(gvr, namespace, selector)[0]

    def list_with_version(self, gvr: tuple[str, str, str], namespace: str | None = None,
                          selector: str | None = None) -> tuple[list[Obj], str]:
        """The items and the list's resourceVersion (the point in time the list shows)."""
        self._read("list", gvr)
        query = {"labelSelector": selector} if selector else None
        out = self.request("GET", _path(gvr, namespace), query=query)
        kind = str(out.get("kind") or "").removesuffix("List")
        items = list(out.get("items") or [])
        for item in items:  # a list's items carry no apiVersion/kind
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", out.get("apiVersion"))
        return items, str((out.get("metadata") or {}).get("resourceVersion") or "")

    def list_metadata(self, gvr: tuple[str, str, str], namespace: str | None = None, selector: str | None = None,
                      limit: int = 500) -> list[Obj]:
        """The objects' metadata only (a PartialObjectMetadataList), `limit` per page (`continue`): to find
        runtime ConfigMaps (~200 KB of data each) without reading their data, nor all of them in one answer."""
        items: list[Obj] = []
        token = ""
        while True:
            self._read("list", gvr)
            query: dict[str, Any] = {"limit": limit}
            if selector:
                query["labelSelector"] = selector
            if token:
                query["continue"] = token
            out = self.request("GET", _path(gvr, namespace), query=query,
                               accept="application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1")
            items.extend(out.get("items") or [])
            token = str((out.get("metadata") or {}).get("continue") or "")
            if not token:
                return items

    # ----------------------------------------------------------------------------------------- writes
    def apply(self, obj: Obj) -> Obj:
        """Server-side apply under the operator's field manager."""
        meta = obj["metadata"]
        return self._write(
            "apply",
            obj["kind"],
            "PATCH",
            _path(gvr_of(obj), meta.get("namespace"), meta["name"]),
            body=obj,
            content_type="application/apply-patch+yaml",
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    def patch_status(self, namespace: str, name: str, status: Obj, uid: str | None = None,
                     has_status: bool = True, resource_version: str | None = None) -> Obj:
        """Merge `status` into the FinetuneJob's status (a None value removes the field).

        With `uid`, the write lands only on that object: a JSON patch whose first operation tests
        `metadata.uid`, so a reconcile or a progress flush that began before the job was deleted and
        re-created under the same name can never write the old job's status (its RayJob UID, its phase)
        onto the new one. (A merge patch carrying `metadata.uid` is no guard: the status subresource
        copies the stored metadata over the patched object before validating.) `has_status=False` (the
        object read had no status yet) writes the whole status in one operation, as JSON patch cannot
        add below a missing `/status`. Raises ObjectReplaced when the UID differs.

        With `resource_version` as well, the patch also tests `metadata.resourceVersion`: it lands only if
        nobody wrote the object since that version was read, else Conflict. This is what fences a write
        that passed the leader check and was then paused before it left (SIGSTOP, a GC pause): by the time
        it reaches the API server the new leader has written, so the version no longer matches.
        (Checking the Lease first cannot close that window; only the server can.)"""
        if uid is None:
            return self._write("patch-status", s.KIND, "PATCH", _path(FTJ, namespace, name, "status"),
                               body={"status": status}, content_type="application/merge-patch+json")
        ops: list[Obj] = [{"op": "test", "path": "/metadata/uid", "value": uid}]
        if resource_version:
            ops.append({"op": "test", "path": "/metadata/resourceVersion", "value": resource_version})
        if has_status:
            for key, value in status.items():
                ptr = "/status/" + key.replace("~", "~0").replace("/", "~1")
                ops.append({"op": "remove", "path": ptr} if value is None else {"op": "add", "path": ptr, "value": value})
        else:
            ops.append({"op": "add", "path": "/status", "value": {k: v for k, v in status.items() if v is not None}})
        try:
            return self._write("patch-status", s.KIND, "PATCH", _path(FTJ, namespace, name, "status"), body=ops,
                               content_type="application/json-patch+json")
        except ApiError as err:
            if err.status == 404 and _object_not_found(err.body) and self.on_gone is not None:
                self.on_gone(FTJ, namespace, name)
            # A failed `test` comes back as a bare 422 ("the server rejected our request ..."; no details),
            # like any other operation that does not apply: look whose object it is.
            if err.status == 422:
                now = self.get(FTJ, namespace, name)
                if now is not None and now["metadata"].get("uid") != uid:
                    raise ObjectReplaced(err.status, err.body, f"status of {namespace}/{name} (uid {uid}; now "
                                                               f"{now['metadata'].get('uid')})") from None
                if now is not None and resource_version and now["metadata"].get("resourceVersion") != resource_version:
                    raise Conflict(409, err.body, f"status of {namespace}/{name} (resourceVersion {resource_version}; "
                                                  f"now {now['metadata'].get('resourceVersion')})", now) from None
            raise

    def patch(self, gvr: tuple[str, str, str], namespace: str, name: str, body: Obj, kind: str,
              content_type: str = "application/merge-patch+json", fenced: bool = True) -> Obj:
        return self._write("patch", kind, "PATCH", _path(gvr, namespace, name), body=body,
                           content_type=content_type, fenced=fenced)

    def create(self, gvr: tuple[str, str, str], namespace: str | None, body: Obj, kind: str) -> Obj:
        """POST: fails with 409 if any object holds the name (never takes one over), in one request."""
        return self._write("create", kind, "POST", _path(gvr, namespace), body=body,
                           query={"fieldManager": FIELD_MANAGER})

    def own_for_apply(self, obj: Obj) -> bool:
        """Before the first server-side apply to an object this operator created with a POST: make the
        fields the create set owned by the operator's *apply* (managedFields operation Update -> Apply).
        Server-side apply keys field ownership by manager and operation, so without this a field the
        renderer stops producing would stay (owned by the create) instead of being removed. One GET, and a
        JSON patch only when there is an Update entry of ours and no Apply entry (what client-go's
        csaupgrade does for kubectl). Returns whether it patched."""
        meta = obj["metadata"]
        gvr, ns, name = gvr_of(obj), meta.get("namespace"), meta["name"]
        # KubeRay writes the RayJob's status all the time: a patch tested against a version that moved on
        # is tried again on the new one (giving up would leave the create's fields in place for good).
        for _ in range(5):
            live = self.get(gvr, ns, name)
            if live is None:
                return False
            entries = live["metadata"].get("managedFields") or []
            ours = [(i, e) for i, e in enumerate(entries) if e.get("manager") == FIELD_MANAGER]
            if any(e.get("operation") == "Apply" for _, e in ours):
                return False
            created = [(i, e) for i, e in ours if e.get("operation") == "Update" and not e.get("subresource")]
            if not created:
                return False
            i = created[0][0]
            ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": live["metadata"]["resourceVersion"]},
                   {"op": "test", "path": f"/metadata/managedFields/{i}/manager", "value": FIELD_MANAGER},
                   {"op": "replace", "path": f"/metadata/managedFields/{i}/operation", "value": "Apply"}]
            try:
                self.patch(gvr, ns or "default", name, ops, obj["kind"], content_type="application/json-patch+json")  # type: ignore[arg-type]
                return True
            except ApiError as err:
                if err.status not in (409, 422):
                    raise
        return False

    def replace(self, gvr: tuple[str, str, str], namespace: str | None, name: str, body: Obj, kind: str) -> Obj:
        return self._write("update", kind, "PUT", _path(gvr, namespace, name), body=body)

    def delete(self, gvr: tuple[str, str, str], namespace: str, name: str, kind: str, uid: str | None = None) -> None:
        """Delete (gone already is fine). With `uid`, only that very object (409 if the name now holds another)."""
        body: Obj = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._write("delete", kind, "DELETE", _path(gvr, namespace, name), body=body)
        except ApiError as err:
            if err.status != 404:
                raise

    def event(self, involved: Obj, reason: str, message: str, type_: str = "Normal", now: str = "") -> None:
        meta = involved["metadata"]
        ns = meta.get("namespace") or "default"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": ns},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", s.API_VERSION),
                "kind": involved.get("kind", s.KIND),
                "name": meta["name"],
                "namespace": ns,
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": "finetune-operator"},
            "reportingComponent": "finetune-operator",
            "firstTimestamp": now or None,
            "lastTimestamp": now or None,
            "count": 1,
        }
        self._write("create", "Event", "POST", _path(EVENTS, ns), body=body)

    # ------------------------------------------------------------------------------------------- auth
    def token_review(self, token: str, audiences: list[str]) -> Obj:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": audiences}}
        # Not counted as a write: TokenReview is a read-only query that happens to be a POST.
        return self.request("POST", _path(TOKENREVIEWS, None), body=body).get("status") or {}
