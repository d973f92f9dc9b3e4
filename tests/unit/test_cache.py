"""The operator's read cache (controller/cache.py): newest wins, deletions stick, misses are confirmed.

The live reads go to a recording stand-in for the API client (the cache's rules are what is tested here;
tests/integration runs the operator with the cache against the real API server)."""

from __future__ import annotations

from typing import Any

import pytest
from finetune_operator.controller.cache import Cache, Store
from finetune_operator.controller.k8s import FTJ, NODES, PODS, RAYCLUSTER, RAYJOB

Obj = dict[str, Any]


def obj(kind: str, name: str, rv: int, ns: str = "ns", labels: dict[str, str] | None = None, **extra: Any) -> Obj:
    meta: Obj = {"name": name, "namespace": ns, "resourceVersion": str(rv), "uid": f"uid-{name}",
                 "labels": labels if labels is not None else {"finetune.dev/job": name},
                 "managedFields": [{"manager": "x"}]}
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, **extra}


class LiveReads:
    """Stands in for the API server's answers to GET and LIST, and counts them."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.calls: list[str] = []
        self.list_rv = "0"

    def get(self, gvr: Any, ns: str | None, name: str) -> Obj | None:
        self.calls.append(f"get {gvr[2]} {name}")
        return self.objects.get((gvr[2], ns or "", name))

    def list_with_version(self, gvr: Any, ns: str | None, selector: str | None) -> tuple[list[Obj], str]:
        self.calls.append(f"list {gvr[2]} {selector}")
        return [o for (plural, n, _), o in self.objects.items() if plural == gvr[2] and (ns is None or n == ns)], self.list_rv


def test_a_late_watch_event_never_undoes_a_newer_write() -> None:
    store = Store(RAYJOB)
    store.upsert(obj("RayJob", "a", 10, status={"jobDeploymentStatus": "Running"}))
    store.upsert(obj("RayJob", "a", 9, status={"jobDeploymentStatus": "Initializing"}))
    assert store.get("ns", "a")["status"]["jobDeploymentStatus"] == "Running"  # type: ignore[index]
    store.upsert(obj("RayJob", "a", 11, status={"jobDeploymentStatus": "Complete"}))
    assert store.get("ns", "a")["status"]["jobDeploymentStatus"] == "Complete"  # type: ignore[index]


def test_a_deleted_object_is_not_brought_back_by_an_older_copy() -> None:
    store = Store(RAYJOB)
    store.upsert(obj("RayJob", "a", 10))
    store.delete(obj("RayJob", "a", 12))
    store.upsert(obj("RayJob", "a", 11))  # the answer to a write that was in flight
    assert store.get("ns", "a") is None
    store.upsert(obj("RayJob", "a", 13))  # a new object of that name
    assert store.get("ns", "a") is not None


def test_reads_are_copies_and_objects_are_kept_slim() -> None:
    store = Store(RAYJOB)
    big = obj("RayJob", "a", 1, spec={"suspend": False, "entrypoint": "python -m x",
                                       "rayClusterSpec": {"headGroupSpec": {"template": {"spec": {"containers": []}}}}})
    store.upsert(big)
    got = store.get("ns", "a")
    assert got is not None
    assert got["spec"] == {"suspend": False, "entrypoint": "python -m x"}  # what drift and suspend read
    assert "managedFields" not in got["metadata"]
    got["metadata"]["uid"] = "changed"
    assert store.get("ns", "a")["metadata"]["uid"] == "uid-a"  # type: ignore[index]

    pods = Store(PODS)
    pods.upsert(obj("Pod", "p", 1, spec={"nodeName": "n1", "containers": [{"name": "c", "env": [1] * 50}]},
                    status={"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready"}]}))
    assert pods.get("ns", "p") == {"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "1",
                                                "uid": "uid-p", "labels": {"finetune.dev/job": "p"}},
                                   "spec": {"nodeName": "n1"},
                                   "status": {"phase": "Running", "conditions": [{"type": "Ready"}]}}


def test_only_what_the_watch_delivers_is_kept() -> None:
    # A user's RayJob carries no job label (the answer to a live GET may bring it): no watch event would
    # ever update or delete it.
    store = Store(RAYJOB)
    store.upsert(obj("RayJob", "hand-written", 1, labels={"team": "a"}))
    assert store.get("ns", "hand-written") is None
    nodes = Store(NODES)
    nodes.upsert(obj("Node", "cpu-1", 1, ns="", labels={}))
    nodes.upsert(obj("Node", "gpu-1", 1, ns="", labels={"node.kubernetes.io/instance-type": "g6.12xlarge"}))
    assert [n["metadata"]["name"] for n in nodes.select(None, "node.kubernetes.io/instance-type=g6.12xlarge")] == ["gpu-1"]
    assert nodes.select(None, "node.kubernetes.io/instance-type=p5.48xlarge") == []


def test_a_miss_is_confirmed_live_and_a_hit_is_not() -> None:
    live = LiveReads()
    cache = Cache(live)  # type: ignore[arg-type]
    assert cache.get(RAYJOB, "ns", "a") is None
    assert live.calls == ["get rayjobs a"]
    live.objects[("rayjobs", "ns", "a")] = obj("RayJob", "a", 5)
    assert cache.get(RAYJOB, "ns", "a") is not None  # created meanwhile: the live GET finds it
    assert cache.get(RAYJOB, "ns", "a") is not None  # and now it is kept
    assert live.calls == ["get rayjobs a", "get rayjobs a"]
    cache.written(obj("FinetuneJob", "a", 7, status={"phase": "Running"}))  # the answer to our own write
    assert cache.get(FTJ, "ns", "a")["status"] == {"phase": "Running"}  # type: ignore[index]
    assert len(live.calls) == 2


def test_the_first_list_in_a_namespace_primes_it_and_later_lists_come_from_the_watch() -> None:
    live = LiveReads()
    cache = Cache(live)  # type: ignore[arg-type]
    cache.observe(PODS, obj("Pod", "stale", 3))  # a pod the watch saw, gone by the time of the list
    live.objects[("pods", "ns", "head")] = obj("Pod", "head", 4, labels={"finetune.dev/job": "a"})
    live.list_rv = "5"
    cache.observe(PODS, obj("Pod", "newer", 6, labels={"finetune.dev/job": "a"}))  # after the list: must survive it
    names = sorted(p["metadata"]["name"] for p in cache.list_objects(PODS, "ns", "finetune.dev/job=a"))
    assert names == ["head", "newer"]
    assert live.calls == ["list pods finetune.dev/job"]  # the whole namespace, with the watch's selector
    cache.observe(PODS, obj("Pod", "worker", 7, labels={"finetune.dev/job": "b"}))
    cache.observe(PODS, obj("Pod", "head", 8, labels={"finetune.dev/job": "a"}), deleted=True)
    assert [p["metadata"]["name"] for p in cache.list_objects(PODS, "ns", "finetune.dev/job=a")] == ["newer"]
    assert [p["metadata"]["name"] for p in cache.list_objects(PODS, "ns", "finetune.dev/job=b")] == ["worker"]
    assert live.calls == ["list pods finetune.dev/job"]
    cache.list_objects(PODS, "other", "finetune.dev/job=c")  # another namespace is primed on its own
    assert live.calls == ["list pods finetune.dev/job", "list pods finetune.dev/job"]


def test_what_is_only_observed_is_looked_up_without_a_live_get() -> None:
    live = LiveReads()
    cache = Cache(live)  # type: ignore[arg-type]
    assert cache.lookup(RAYCLUSTER, "ns", "rc-1") is None  # not seen yet: waited for, its watch event follows
    cache.observe(RAYCLUSTER, obj("RayCluster", "rc-1", 3))
    assert cache.lookup(RAYCLUSTER, "ns", "rc-1") is not None
    assert live.calls == ["list rayclusters finetune.dev/job"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _kopf_event(type_: str | None, body: Obj) -> dict[str, Any]:
    return {"event": {"type": type_, "object": body}}


def test_a_watch_relist_after_410_evicts_the_deletions_it_never_announced() -> None:
    # kopf, after a 410 Gone, lists again and hands on each listed object as an event of type None: a job
    # deleted meanwhile is just not among them. The cache relists too, and drops it.
    from finetune_operator.controller.handlers import _fed

    live, clock = LiveReads(), Clock()
    cache = Cache(live, clock=clock)  # type: ignore[arg-type]
    for name in ("a", "b"):
        _fed(cache, FTJ, _kopf_event("ADDED", obj("FinetuneJob", name, 3, labels={})))
    assert cache.relists_due() == []
    clock.now = 100.0
    live.objects[("finetunejobs", "ns", "a")] = obj("FinetuneJob", "a", 3, labels={})  # b was deleted unseen
    live.list_rv = "9"
    _fed(cache, FTJ, _kopf_event(None, obj("FinetuneJob", "a", 3, labels={})))
    assert cache.stores[FTJ].get("ns", "b") is not None  # the listing alone cannot tell it is gone
    assert cache.relists_due() == [FTJ]
    gone = cache.relist(FTJ)
    assert [o["metadata"]["name"] for o in gone] == ["b"]
    assert cache.stores[FTJ].get("ns", "b") is None and cache.stores[FTJ].get("ns", "a") is not None
    assert live.calls == ["list finetunejobs None"] and cache.relists_due() == []
    cache.written(obj("FinetuneJob", "b", 8, labels={}))  # a write's answer from before the relist
    assert cache.stores[FTJ].get("ns", "b") is None  # does not bring it back (tombstone at the list's version)


def test_one_listing_asks_one_relist_and_an_empty_store_none() -> None:
    from finetune_operator.controller.handlers import _fed

    live, clock = LiveReads(), Clock()
    cache = Cache(live, relist_interval=0, clock=clock)  # type: ignore[arg-type]
    _fed(cache, PODS, _kopf_event(None, obj("Pod", "p1", 1)))  # the first listing after start: nothing held
    _fed(cache, PODS, _kopf_event(None, obj("Pod", "p2", 1)))
    assert cache.relists_due() == []
    clock.now = 400.0  # a later listing (410): its first event asks once, the rest of the burst does not
    _fed(cache, PODS, _kopf_event(None, obj("Pod", "p1", 2)))
    assert cache.relists_due() == [PODS]
    cache.relist(PODS)
    _fed(cache, PODS, _kopf_event(None, obj("Pod", "p2", 2)))
    assert cache.relists_due() == [] and live.calls == ["list pods finetune.dev/job"]


def test_stores_are_relisted_periodically_in_the_watched_namespaces() -> None:
    live, clock = LiveReads(), Clock()
    cache = Cache(live, namespaces=["ns", "other"], relist_interval=600, clock=clock)  # type: ignore[arg-type]
    cache.observe(RAYJOB, obj("RayJob", "ghost", 4))
    cache.observe(NODES, obj("Node", "gpu-1", 4, ns="", labels={"node.kubernetes.io/instance-type": "x"}))
    clock.now = 599.0
    assert cache.relists_due() == []
    clock.now = 600.0
    assert set(cache.relists_due()) == set(cache.stores)
    assert [o["metadata"]["name"] for o in cache.relist(RAYJOB)] == ["ghost"]
    assert [o["metadata"]["name"] for o in cache.relist(NODES)] == ["gpu-1"]
    # One LIST per watched namespace (what the operator's RBAC allows), nodes cluster-wide.
    assert live.calls == ["list rayjobs finetune.dev/job", "list rayjobs finetune.dev/job",
                          "list nodes node.kubernetes.io/instance-type"]
    assert RAYJOB not in cache.relists_due() and cache.evicted == 2


def test_a_uid_guarded_write_answered_404_evicts_the_object() -> None:
    import json

    from finetune_operator.controller.k8s import ApiError, Kube
    from kubernetes import client

    class GoneKube(Kube):
        def request(self, method: str, path: str, **kw: Any) -> Obj:
            raise ApiError(404, json.dumps({"kind": "Status", "reason": "NotFound",
                                            "details": {"name": "a", "kind": "finetunejobs"}}), f"{method} {path}")

    kube = GoneKube(client.ApiClient())
    cache = Cache(kube)
    kube.on_gone = cache.gone
    cache.observe(FTJ, obj("FinetuneJob", "a", 5, labels={}))
    with pytest.raises(ApiError) as err:
        kube.patch_status("ns", "a", {"phase": "Running"}, uid="uid-a")
    assert err.value.status == 404
    assert cache.stores[FTJ].get("ns", "a") is None and cache.evicted == 1
    cache.observe(FTJ, obj("FinetuneJob", "a", 4, labels={}))  # a late event of the old object
    assert cache.stores[FTJ].get("ns", "a") is None
