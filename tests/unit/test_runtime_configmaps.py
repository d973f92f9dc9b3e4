"""The runtime ConfigMap collector's rules (controller/runtime_configmaps.py). The API server stands in as a small
recording object: what is under test is which ConfigMaps the rules delete; the real control plane runs the
same collector in tests/integration/test_operator.py."""

from __future__ import annotations

from typing import Any

from finetune_operator.controller.runtime_configmaps import Runtimes

from tests.unit.api_server import ApiServer

Obj = dict[str, Any]


class Recorder:
    """The namespace's ConfigMaps as the API server has them (`cms`; a test deletes from it to act as
    someone else), and what the rules asked for."""

    def __init__(self, cms: list[Obj]):
        self.cms = cms
        self.deleted: list[tuple[str, str | None]] = []
        self.created: list[str] = []
        self.gets = 0

    def list_metadata(self, gvr: Any, namespace: str | None, selector: str | None) -> list[Obj]:
        return [{"metadata": c["metadata"]} for c in self.cms if c["metadata"]["namespace"] == namespace]

    def delete(self, gvr: Any, namespace: str, name: str, kind: str, uid: str | None = None) -> None:
        self.deleted.append((name, uid))
        self.cms[:] = [c for c in self.cms if c["metadata"]["name"] != name]

    def get_metadata(self, gvr: Any, namespace: str | None, name: str) -> Obj | None:
        self.gets += 1
        return next(({"metadata": c["metadata"]} for c in self.cms
                     if (c["metadata"]["namespace"], c["metadata"]["name"]) == (namespace, name)), None)

    def create(self, gvr: Any, namespace: str | None, body: Obj, kind: str) -> Obj:
        self.created.append(body["metadata"]["name"])
        self.cms.append(body)
        return body


def cm(digest: str, owners: bool = False) -> Obj:
    meta: Obj = {"name": f"finetune-runtime-{digest}", "namespace": "ns", "uid": f"uid-{digest}",
                 "labels": {"finetune.dev/runtime": digest}}
    if owners:
        meta["ownerReferences"] = [{"kind": "FinetuneJob", "name": "old", "uid": "u"}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


def holder(kind: str, digest: str | None) -> Obj:
    labels = {"finetune.dev/job": "j", **({"finetune.dev/runtime": digest} if digest else {})}
    return {"kind": kind, "metadata": {"name": "j", "namespace": "ns", "labels": labels}}


JOB = {"metadata": {"name": "j", "namespace": "ns"}}


def test_the_current_runtime_stays_while_a_job_may_start_pods_and_goes_after() -> None:
    kube = Recorder([cm("cur"), cm("old")])
    assert Runtimes(kube).collect("ns", [JOB], [], "cur") == ["finetune-runtime-old"]  # type: ignore[arg-type]
    assert kube.deleted == [("finetune-runtime-old", "uid-old")]  # only that very object
    assert Runtimes(Recorder([cm("cur")])).collect("ns", [], [], "cur") == ["finetune-runtime-cur"]  # type: ignore[arg-type]


def test_a_runtime_a_rayjob_or_raycluster_carries_is_kept() -> None:
    kube = Recorder([cm("cur"), cm("old"), cm("older")])
    kept = Runtimes(kube).collect("ns", [], [holder("RayJob", "old"), holder("RayCluster", "older")], "cur")  # type: ignore[arg-type]
    assert kept == ["finetune-runtime-cur"]


def test_an_earlier_versions_rayjob_without_the_label_keeps_every_runtime() -> None:
    kube = Recorder([cm("cur"), cm("old")])
    assert Runtimes(kube).collect("ns", [], [holder("RayJob", None)], "cur") == []  # type: ignore[arg-type]
    assert kube.deleted == []


def test_a_runtime_with_owners_is_the_garbage_collectors() -> None:
    kube = Recorder([cm("legacy", owners=True)])
    assert Runtimes(kube).collect("ns", [], [], "cur") == []  # type: ignore[arg-type]


def test_ensure_asks_once_and_again_after_a_collection() -> None:
    kube = Recorder([])
    runtimes = Runtimes(kube)  # type: ignore[arg-type]
    obj = cm("cur")
    runtimes.ensure(obj)
    runtimes.ensure(obj)
    assert kube.gets == 1 and kube.created == ["finetune-runtime-cur"]
    runtimes.collect("ns", [], [], "cur")
    runtimes.ensure(obj)  # collected: this process no longer assumes it is there
    assert kube.gets == 2 and kube.created == ["finetune-runtime-cur"] * 2


def test_a_verifying_ensure_creates_again_what_someone_else_deleted() -> None:
    """`kubectl delete cm -l finetune.dev/runtime`, or the namespace deleted and re-created: this process
    still knew the ConfigMap. Without verify it trusts that (no request); verify asks, and creates it."""
    kube = Recorder([])
    runtimes = Runtimes(kube)  # type: ignore[arg-type]
    assert runtimes.ensure(cm("cur")) is True
    kube.cms.clear()  # deleted behind the operator's back
    assert runtimes.ensure(cm("cur")) is False and kube.gets == 1  # known: trusted, no request
    assert runtimes.ensure(cm("cur"), verify=True) is True
    assert (kube.gets, kube.created, runtimes.recreated) == (2, ["finetune-runtime-cur"] * 2, 1)
    assert runtimes.ensure(cm("cur"), verify=True) is False and kube.gets == 3  # there: no create


def test_a_collection_forgets_what_its_listing_lacks() -> None:
    """The namespace was deleted and re-created: its jobs' DELETED events bring a collection, which finds
    no runtime ConfigMap there; the next job's ensure asks again instead of trusting what it knew."""
    kube = Recorder([])
    runtimes = Runtimes(kube)  # type: ignore[arg-type]
    runtimes.ensure(cm("cur"))
    kube.cms.clear()
    assert runtimes.collect("ns", [], [], "cur") == []
    assert runtimes.ensure(cm("cur")) is True and kube.created == ["finetune-runtime-cur"] * 2


# ------------------------------------------------------------------ a job keeps the runtime it started with
OLD = {"finetune_training/__init__.py": "", "finetune_training/loop.py": "v1"}
NEW = {"finetune_training/__init__.py": "", "finetune_training/loop.py": "v2"}


def _operator(kube: ApiServer, files: dict[str, str]) -> Any:
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.config import RenderConfig

    return Reconciler(kube, RenderConfig(), files, clock=lambda: "2026-12-05T10:00:00Z")  # type: ignore[arg-type]


def _running_job(kube: ApiServer, name: str, files: dict[str, str]) -> Obj:
    """A job the operator running `files` created, whose RayJob KubeRay runs."""
    from finetune_operator.controller.k8s import FTJ

    from tests.builders import JobDoc

    kube._put(FTJ, JobDoc(name).obj())
    _operator(kube, files).reconcile("ns", name)
    rayjob = kube.objects[("rayjobs", name)]
    rayjob["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": f"{name}-abc",
                        "startTime": "2026-12-05T09:00:00Z"}
    _operator(kube, files).reconcile("ns", name)  # records the RayJob's UID in status
    assert kube.objects[("finetunejobs", name)]["status"]["rayJobUID"] == rayjob["metadata"]["uid"]
    return rayjob


def test_an_operator_upgrade_leaves_a_running_jobs_rayjob_and_runtime_alone() -> None:
    from finetune_operator.render.rayjob import RUNTIME_LABEL, runtime_hash

    kube = ApiServer()
    rayjob = _running_job(kube, "j", OLD)
    kube.calls.clear()
    upgraded = _operator(kube, NEW)
    upgraded.reconcile("ns", "j")
    # No re-apply: the RayJob still mounts, and its next retry or resume runs, the runtime it started with.
    assert [w for w in kube.calls if w[1] == "RayJob"] == []
    assert kube.objects[("rayjobs", "j")]["metadata"]["labels"][RUNTIME_LABEL] == runtime_hash(OLD)
    assert ("configmaps", f"finetune-runtime-{runtime_hash(NEW)}") not in kube.objects
    # A spec edit is applied, still on the old runtime.
    kube.objects[("finetunejobs", "j")]["spec"]["backoffLimit"] = 2
    upgraded.reconcile("ns", "j")
    assert [w for w in kube.calls if w[1] == "RayJob"] == [("apply", "RayJob", "j")]
    assert kube.objects[("rayjobs", "j")]["metadata"]["labels"][RUNTIME_LABEL] == runtime_hash(OLD)
    assert kube.objects[("rayjobs", "j")]["metadata"]["uid"] == rayjob["metadata"]["uid"]
    # A new job gets the new runtime; the old runtime's ConfigMap stays while the old job's RayJob names it.
    _running_job(kube, "k", NEW)
    assert kube.objects[("rayjobs", "k")]["metadata"]["labels"][RUNTIME_LABEL] == runtime_hash(NEW)
    jobs = [o for (res, _), o in kube.objects.items() if res == "finetunejobs"]
    holders = [o for (res, _), o in kube.objects.items() if res == "rayjobs"]
    assert upgraded.runtimes.collect("ns", jobs, holders, runtime_hash(NEW)) == []
    # Once the old job's RayJob is gone, its runtime goes.
    assert upgraded.runtimes.collect("ns", jobs, holders[1:], runtime_hash(NEW)) == [f"finetune-runtime-{runtime_hash(OLD)}"]


def test_an_earlier_runtime_is_read_back_once_and_checked_against_its_digest() -> None:
    from finetune_operator.render.rayjob import runtime_hash

    kube = ApiServer()
    _running_job(kube, "j", OLD)
    runtimes = Runtimes(kube)  # type: ignore[arg-type]
    rayjob = kube.objects[("rayjobs", "j")]
    assert runtimes.files_for("ns", rayjob, NEW) == OLD
    del kube.objects[("configmaps", f"finetune-runtime-{runtime_hash(OLD)}")]
    assert runtimes.files_for("ns", rayjob, NEW) == OLD  # read once: kept in memory (content-addressed)
    assert Runtimes(kube).files_for("ns", rayjob, NEW) == NEW  # gone, and not known: the operator's own  # type: ignore[arg-type]
    assert runtimes.files_for("ns", None, NEW) == NEW  # no RayJob yet
