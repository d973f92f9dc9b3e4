"""Reconciler.reconcile against a small in-memory API server (the real control plane runs it in
tests/integration).

A stall's Fail releases the Ray cluster level-based (transitions.py rows 18, 20 and 22): the status says
Failed before the suspend patch goes out, so a patch that fails is sent again at the next reconcile, and
at every one after, until the RayJob is suspended. The API server stands in as a small in-memory object
whose RayJob patch fails once (a fault not provoked for real here: a 500 from the API server)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
from finetune_operator.api.instance_types import INSTANCE_TYPES
from finetune_operator.api.status import InstanceFigures
from finetune_operator.controller.k8s import FTJ, RAYJOB, ApiError
from finetune_operator.controller.reconcile import Reconciler
from finetune_operator.render.config import RenderConfig

from tests.builders import JobDoc, StatusDoc

Obj = dict[str, Any]
NOW = "2026-12-02T10:00:00Z"
HOUR_AGO = "2026-12-02T09:00:00Z"


class Api:
    """Objects by (resource, namespace, name); merge patches; one RayJob patch answered 500."""

    def __init__(self, objs: dict[tuple[str, str, str], Obj], fail_patches: int) -> None:
        self.objs = objs
        self.fail_patches = fail_patches
        self.patches: list[Obj] = []
        self.writes: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()

    def get(self, gvr: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        return copy.deepcopy(self.objs.get((gvr[2], namespace or "", name)))

    get_metadata = get

    def list_objects(self, gvr: Any, namespace: str | None, selector: str | None = None) -> list[Obj]:
        return []

    def list_events(self, namespace: str, kind: str, name: str) -> list[Obj]:
        return []

    def create(self, gvr: tuple[str, str, str], namespace: str | None, body: Obj, kind: str) -> Obj:
        self.objs[(gvr[2], namespace or "", body["metadata"]["name"])] = copy.deepcopy(body)
        return body

    def own_for_apply(self, obj: Obj) -> bool:
        return False

    def apply(self, obj: Obj) -> Obj:
        key = ("rayjobs" if obj["kind"] == "RayJob" else "configmaps", obj["metadata"]["namespace"], obj["metadata"]["name"])
        cur = self.objs.get(key) or {}
        self.objs[key] = {**copy.deepcopy(obj), "metadata": {**obj["metadata"], "uid": (cur.get("metadata") or {}).get("uid")},
                          "status": cur.get("status") or {}}
        return copy.deepcopy(self.objs[key])

    def patch(self, gvr: tuple[str, str, str], namespace: str, name: str, body: Obj, kind: str) -> Obj:
        if self.fail_patches:
            self.fail_patches -= 1
            raise ApiError(500, "etcdserver: request timed out", f"patch {kind} {name}")
        self.patches.append(body)
        obj = self.objs[(gvr[2], namespace, name)]
        obj["spec"] = {**obj.get("spec", {}), **{k: v for k, v in body["spec"].items() if v is not None}}
        return copy.deepcopy(obj)

    def patch_status(self, namespace: str, name: str, patch: Obj, uid: str | None = None, has_status: bool = True) -> Obj:
        obj = self.objs[(FTJ[2], namespace, name)]
        status = obj.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        return copy.deepcopy(obj)

    def event(self, *args: Any, **kw: Any) -> None:
        pass


def stalled_running_job() -> Api:
    job = JobDoc("j").set("metadata.namespace", "ns").set("metadata.uid", "ftj-1").set("metadata.generation", 1)
    job = job.spec(stallPolicy={"timeoutSeconds": 60, "action": "Fail"})
    status = (StatusDoc("Running").running_since(HOUR_AGO).reported(HOUR_AGO, step=5, totalSteps=10)
              .set("rayJobUID", "rj-1").set("instance", InstanceFigures.of(INSTANCE_TYPES["g6.12xlarge"]).wire()).obj())
    rayjob = {"apiVersion": "ray.io/v1", "kind": "RayJob",
              "metadata": {"name": "j", "namespace": "ns", "uid": "rj-1", "ownerReferences": [{"uid": "ftj-1"}]},
              "spec": {"suspend": False},
              "status": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "jobId": "r-1"}}
    return Api({(FTJ[2], "ns", "j"): {**job.obj(), "status": status}, (RAYJOB[2], "ns", "j"): rayjob}, fail_patches=1)


def test_a_stall_fail_whose_suspend_patch_failed_is_released_at_the_next_reconcile() -> None:
    api = stalled_running_job()
    rec = Reconciler(api, RenderConfig(progress_url="https://operator/progress"), {}, clock=lambda: NOW)  # type: ignore[arg-type]
    rec.watching_since = HOUR_AGO
    with pytest.raises(ApiError):  # Failed is written, then the suspend patch fails: the queue retries
        rec.reconcile("ns", "j")
    ftj = api.objs[(FTJ[2], "ns", "j")]
    assert ftj["status"]["phase"] == "Failed"
    assert next(c for c in ftj["status"]["conditions"] if c["type"] == "Failed")["reason"] == "Stalled"
    assert not api.objs[(RAYJOB[2], "ns", "j")]["spec"].get("suspend")  # the GPUs are still held
    assert rec.reconcile("ns", "j") == "Failed"
    assert [p["spec"]["suspend"] for p in api.patches] == [True]
    assert api.objs[(RAYJOB[2], "ns", "j")]["spec"]["suspend"] is True
    assert rec.reconcile("ns", "j") == "Failed"  # released: no more patches
    assert len(api.patches) == 1


def test_a_blocked_job_asks_for_backed_off_looks_and_forgets_the_backoff_once_unblocked() -> None:
    """Blocked (a RayJob of the job's name it does not own) -> requeue_rate_limited, the work queue's per-key
    exponential backoff (test_workqueue.py); not blocked any more -> requeue_forget."""
    job = JobDoc("j").set("metadata.namespace", "ns").set("metadata.uid", "ftj-1").set("metadata.generation", 1).obj()
    foreign = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j", "namespace": "ns", "uid": "x"}}
    api = Api({(FTJ[2], "ns", "j"): job, (RAYJOB[2], "ns", "j"): foreign}, fail_patches=0)
    calls: list[tuple[str, str, str]] = []
    rec = Reconciler(api, RenderConfig(), {}, clock=lambda: NOW)  # type: ignore[arg-type]
    rec.requeue_rate_limited = lambda ns, name, base: calls.append(("rate-limited", name, str(base)))
    rec.requeue_forget = lambda ns, name: calls.append(("forget", name, ""))
    for _ in range(2):
        assert rec.reconcile("ns", "j") == "Pending"
    assert calls == [("rate-limited", "j", "10.0")] * 2
    del api.objs[(RAYJOB[2], "ns", "j")]  # the other RayJob goes
    calls.clear()
    rec.reconcile("ns", "j")
    assert ("forget", "j", "") in calls and not [c for c in calls if c[0] == "rate-limited"]
