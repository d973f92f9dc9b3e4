"""Lifecycle defects, on the real control plane with the real KubeRay operator (kwok plays kubelet).

- A finished job never runs again: a RayJob the operator created and recorded (status.rayJobUID) that
  disappears -- KubeRay deleting it (its DeleteSelf deletion rule), a manual delete, the operator down
  while the job completes -- is never re-created; the outcome is decided from what is known.
- Delete-and-recreate with the same name waits for the previous incarnation's children.

Two simulated steps (as in test_operator.py), because kwok pods run no Ray: the tests that need a running
job ask for the Ray dashboard stand-in (ray_dashboard: jobStatus RUNNING once KubeRay's submitter exists),
and a Ray job cannot finish, so the tests write the terminal status KubeRay writes when a job succeeds to
the RayJob's status subresource (support.complete_rayjob). Everything else -- KubeRay deleting the RayJob,
the garbage collector, finalizers -- is the real thing.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.builders import ftj
from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import OperatorProcess, service_account_kubeconfig
from tests.integration.support import (
    LEASE_NS,
    G,
    P,
    V,
    complete_rayjob,
    condition,
    create,
    emptied_namespace,  # noqa: F401  (the namespace fixture)
    job_token,
    metric,
    phase_is,
    rayjobs,
    running_with_uid,
    status,
    stays,
    worker_pods,
)

# Failover tests wait for a Lease to expire: a 12 s lease (renewed every 4 s, API calls time out after 4 s)
# instead of the default 30 s keeps them short; the fencing arithmetic is the same.
SHORT_LEASE = ["--lease-duration", "12"]
HOLD = "test.finetune.dev/hold"  # a finalizer this test holds, like KubeRay's on a slow deletion


@pytest.fixture(scope="module")
def operator_kubeconfig(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")


@pytest.fixture(scope="module")
def operator(operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    op = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"), identity="op-life",
                         lease_namespace=LEASE_NS)
    op.start()
    yield op
    op.stop()


# ------------------------------------------------------------------------------- dev cluster control


# ----------------------------------------------------------------------------------------- helpers


def kuberay_deletes_it_when_done(kube: Kube, ns: str, name: str) -> None:
    """Add KubeRay's DeleteSelf deletion rule (TTL 0) to the RayJob, so KubeRay itself deletes it the moment
    it succeeds, as a platform's policy or a former render could. (KubeRay v1.6.1's older switch,
    DELETE_RAYJOB_CR_AFTER_JOB_FINISHES=true, has no effect on RayJobs that carry deletionRules, as the
    rendered ones do: `handleDeletionRules` takes precedence over `handleShutdownAfterJobFinishes`.)"""
    rj = kube.custom.get_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", name)
    rules = [*rj["spec"]["deletionStrategy"]["deletionRules"],
             {"policy": "DeleteSelf", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 0}}]
    kube.custom.patch_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", name,
                                               {"spec": {"deletionStrategy": {"deletionRules": rules}}},
                                               _content_type="application/merge-patch+json")


def report_done(kube: Kube, ns: str, name: str, operator: OperatorProcess, step: int = 50) -> None:
    """The training runtime's final report, posted as the runtime posts it (pod-bound job-audience token)."""
    pod = wait_for(f"{name} worker pod", lambda: (p := worker_pods(kube, ns, name)) and p[0], timeout=90)
    token = job_token(kube, ns, pod, f"finetune.dev/progress/{ns}/{name}")
    body = {"rank": 0, "phase": "Done", "training": {"step": step, "totalSteps": step, "loss": 0.5}}
    code, text = operator.post(ns, name, body, token)
    assert code == 202, text
    wait_for("runtimePhase Done flushed", lambda: status(kube, ns, name).get("runtimePhase") == "Done", timeout=30)


def no_rayjob(kube: Kube, ns: str) -> bool:
    return rayjobs(kube, ns) == []


# ------------------------------------------------------------------------------- 1. never runs again


@pytest.mark.usefixtures("ray_dashboard")
def test_rayjob_deleted_by_hand_while_running_is_not_recreated(kube: Kube, namespace: str,
                                                                operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("handdel"))
    running_with_uid(kube, namespace, "handdel")
    kube.custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "handdel")
    st = wait_for("Failed", lambda: phase_is(kube, namespace, "handdel", "Failed"), timeout=60)
    failed = condition(st, "Failed")  # type: ignore[arg-type]
    assert failed["reason"] == "RayJobDeleted", failed  # type: ignore[index]
    assert "last known phase Running" in failed["message"] and "re-create the FinetuneJob" in failed["message"]  # type: ignore[index]
    wait_for("the RayJob gone", lambda: no_rayjob(kube, namespace), timeout=60)
    stays("no RayJob is re-created", lambda: no_rayjob(kube, namespace), 6)
    assert status(kube, namespace, "handdel")["phase"] == "Failed"
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=handdel").items
    assert any(e.type == "Warning" and e.reason == "Failed" for e in events)


@pytest.mark.usefixtures("ray_dashboard")
def test_rayjob_deleted_after_the_training_reported_done_is_succeeded(kube: Kube, namespace: str,
                                                                       operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("reported"))
    running_with_uid(kube, namespace, "reported")
    report_done(kube, namespace, "reported", operator)
    kube.custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "reported")
    st = wait_for("Succeeded", lambda: phase_is(kube, namespace, "reported", "Succeeded"), timeout=60)
    complete = condition(st, "Complete")  # type: ignore[arg-type]
    assert complete["reason"] == "TrainingReportedDone" and "50/50" in complete["message"], complete  # type: ignore[index]
    stays("no RayJob is re-created", lambda: no_rayjob(kube, namespace) or all(
        r["metadata"].get("deletionTimestamp") for r in rayjobs(kube, namespace)), 6)


@pytest.mark.usefixtures("ray_dashboard")
def test_kuberay_deletes_the_finished_rayjob_at_once(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("ttl0"))
    running_with_uid(kube, namespace, "ttl0")
    kuberay_deletes_it_when_done(kube, namespace, "ttl0")
    complete_rayjob(kube, namespace, "ttl0")
    wait_for("KubeRay deleted the finished RayJob", lambda: no_rayjob(kube, namespace), timeout=60)
    st = wait_for("Succeeded", lambda: phase_is(kube, namespace, "ttl0", "Succeeded"), timeout=60)
    assert condition(st, "Complete")["status"] == "True"  # type: ignore[index]
    stays("no RayJob is re-created", lambda: no_rayjob(kube, namespace), 6)


@pytest.mark.usefixtures("ray_dashboard")
def test_operator_down_while_the_job_completes_and_kuberay_deletes_it(
        kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("offline"))
    running_with_uid(kube, namespace, "offline")
    create(kube, namespace, ftj("silent"))  # no GPU nodes left for it: it stays Provisioning
    wait_for("silent's RayJob recorded", lambda: status(kube, namespace, "silent").get("rayJobUID"), timeout=60)
    for name in ("offline", "silent"):
        kuberay_deletes_it_when_done(kube, namespace, name)
    report_done(kube, namespace, "offline", operator)
    operator.kill()  # down during completion: it sees neither the terminal state nor the deletion
    try:
        complete_rayjob(kube, namespace, "offline")
        complete_rayjob(kube, namespace, "silent")
        wait_for("KubeRay deleted both RayJobs", lambda: no_rayjob(kube, namespace), timeout=60)
    finally:
        operator.start()
    st = wait_for("offline Succeeded", lambda: phase_is(kube, namespace, "offline", "Succeeded"), timeout=60)
    assert condition(st, "Complete")["reason"] == "TrainingReportedDone"  # type: ignore[index]
    st = wait_for("silent Failed", lambda: phase_is(kube, namespace, "silent", "Failed"), timeout=60)
    assert condition(st, "Failed")["reason"] == "RayJobDeleted"  # type: ignore[index]
    stays("no RayJob is re-created", lambda: no_rayjob(kube, namespace), 6)


# ------------------------------------------------------------------------- 2. delete and re-create


@pytest.mark.usefixtures("ray_dashboard")
def test_delete_and_recreate_waits_for_the_previous_rayjob(kube: Kube, namespace: str,
                                                            operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("again"))
    old_uid = wait_for("RayJob UID recorded", lambda: status(kube, namespace, "again").get("rayJobUID"), timeout=60)
    # Hold the old RayJob's deletion like a slow finalizer (KubeRay's stops the Ray job first).
    kube.custom.patch_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "again",
                                               {"metadata": {"finalizers": [HOLD]}},
                                               _content_type="application/merge-patch+json")
    kube.custom.delete_namespaced_custom_object(G, V, namespace, P, "again")  # what `kubectl delete` does

    def old_deleting() -> bool:
        try:
            kube.custom.get_namespaced_custom_object(G, V, namespace, P, "again")
            return False
        except ApiException as e:
            if e.status != 404:
                raise
        return all(r["metadata"].get("deletionTimestamp") for r in rayjobs(kube, namespace))

    wait_for("old FinetuneJob gone, its RayJob being deleted", old_deleting, timeout=60)
    new = create(kube, namespace, ftj("again"))  # ... && kubectl apply
    st = wait_for("Blocked", lambda: (s := status(kube, namespace, "again")) and condition(s, "Blocked") and s,
                  timeout=60)
    blocked = condition(st, "Blocked")  # type: ignore[arg-type]
    assert blocked["reason"] == "WaitingForPreviousChild", blocked  # type: ignore[index]
    assert old_uid in blocked["message"] or "previous FinetuneJob" in blocked["message"]  # type: ignore[index,operator]
    assert st["phase"] == "Pending"  # type: ignore[index]

    def still_blocked() -> bool:
        s = status(kube, namespace, "again")
        rjs = rayjobs(kube, namespace)
        ok = (s.get("phase") == "Pending" and condition(s, "Failed") is None and not s.get("rayJobUID")
              and [r["metadata"]["uid"] for r in rjs] == [old_uid])
        if not ok:
            print(f"not blocked as expected: status {s}; RayJobs {[(r['metadata']['uid'], r['metadata'].get('ownerReferences')) for r in rjs]}")
        return ok

    stays("the new job waits, never Failed and never following the old RayJob", still_blocked, 8)
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=again").items
    assert any(e.reason == "WaitingForPreviousChild" and e.involved_object.uid == new["metadata"]["uid"]
               for e in events)
    kube.custom.patch_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "again",
                                               {"metadata": {"finalizers": None}},
                                               _content_type="application/merge-patch+json")

    def new_rayjob() -> Any:
        rjs = rayjobs(kube, namespace)
        return len(rjs) == 1 and rjs[0]["metadata"]["uid"] != old_uid and rjs[0]
    rj = wait_for("a new RayJob owned by the new FinetuneJob", new_rayjob, timeout=90)
    assert rj["metadata"]["ownerReferences"][0]["uid"] == new["metadata"]["uid"]  # type: ignore[index]
    st = wait_for("Running", lambda: phase_is(kube, namespace, "again", "Running"), timeout=180)
    assert condition(st, "Blocked") is None  # type: ignore[arg-type]
    assert st["rayJobUID"] == rj["metadata"]["uid"]  # type: ignore[index]


@pytest.mark.usefixtures("ray_dashboard")
def test_a_write_meant_for_a_deleted_job_never_lands_on_its_successor(
        kube: Kube, namespace: str, operator: OperatorProcess, operator_kubeconfig: Path) -> None:
    """A reconcile (or a progress flush) that read the job before `kubectl delete && kubectl apply` writes
    after it: that write must not give the new job the old one's status (its RayJob UID: the new job would
    then follow the old RayJob, or call its own RayJob lost once the old one is gone). Every status write is
    UID-guarded (a JSON patch that tests metadata.uid first). This test plays the operator's part in-process
    so the timing is exact: the one stand-in is the stale read itself (the reconcile is handed the old
    object), since the window between a reconcile's GET and its PATCH cannot be hit on demand."""
    from finetune_operator.controller.k8s import FTJ, ObjectReplaced, load_config
    from finetune_operator.controller.k8s import Kube as OperatorKube
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.bundle import runtime_files
    from finetune_operator.render.config import RenderConfig

    operator.stop()  # nobody else writes these objects during the test
    try:
        op = OperatorKube(load_config(str(operator_kubeconfig)))
        create(kube, namespace, ftj("again"))
        old = kube.custom.get_namespaced_custom_object(G, V, namespace, P, "again")
        old_uid = old["metadata"]["uid"]
        # The guard lets a write through to its own object (the first one adds the whole status)...
        op.patch_status(namespace, "again", {"phase": "Pending", "rayJobName": "again"}, uid=old_uid, has_status=False)
        op.patch_status(namespace, "again", {"phase": "Running", "rayJobUID": "rayjob-of-the-old-job"}, uid=old_uid)
        op.patch_status(namespace, "again", {"rayJobName": None}, uid=old_uid)  # None removes
        assert status(kube, namespace, "again") == {"phase": "Running", "rayJobUID": "rayjob-of-the-old-job"}
        old = kube.custom.get_namespaced_custom_object(G, V, namespace, P, "again")
        kube.custom.delete_namespaced_custom_object(G, V, namespace, P, "again")

        def gone() -> bool:
            try:
                kube.custom.get_namespaced_custom_object(G, V, namespace, P, "again")
                return False
            except ApiException as e:
                return e.status == 404
        wait_for("the old job gone", gone, timeout=30)
        create(kube, namespace, ftj("again"))

        # ... and refuses it on the successor.
        with pytest.raises(ObjectReplaced):
            op.patch_status(namespace, "again", {"phase": "Running", "rayJobUID": "rayjob-of-the-old-job"}, uid=old_uid)
        assert status(kube, namespace, "again") == {}

        # A reconcile that read the old job: it finds "its" RayJob gone and would write Failed; the write is
        # refused, the reconcile ends quietly and asks for another (of the new object).
        requeued: list[tuple[str, str, float]] = []
        rec = Reconciler(op, RenderConfig(), runtime_files(), requeue_after=lambda ns, n, d: requeued.append((ns, n, d)))
        real_get, stale = op.get, [old]

        def get_once_stale(gvr: Any, ns: str | None, name: str) -> Any:  # the reconcile's first read only
            return stale.pop() if gvr == FTJ and stale else real_get(gvr, ns, name)
        op.get = get_once_stale  # type: ignore[method-assign]
        assert rec.reconcile(namespace, "again") is None
        assert requeued == [(namespace, "again", 0.0)]
        assert status(kube, namespace, "again") == {}
        assert rayjobs(kube, namespace) == []

        # Why a JSON patch: a merge patch that carries the old UID in metadata is not refused by the status
        # subresource (it copies the stored metadata over the patched object before validating).
        op.request("PATCH", f"/apis/{G}/{V}/namespaces/{namespace}/{P}/again/status",
                   body={"metadata": {"uid": old_uid}, "status": {"rayJobUID": "rayjob-of-the-old-job"}},
                   content_type="application/merge-patch+json")
        assert status(kube, namespace, "again") == {"rayJobUID": "rayjob-of-the-old-job"}
    finally:
        operator.start()


# ------------------------------------------------------------------------------ 7. leader fencing


@pytest.mark.usefixtures("ray_dashboard")
def test_a_paused_leader_writes_nothing_after_a_standby_took_over(
        kube: Kube, namespace: str, operator: OperatorProcess, operator_kubeconfig: Path, tmp_path: Path) -> None:
    operator.stop()  # releases the Lease
    # Leader A writes a job's first report at once, then keeps later ones in memory (a flush interval
    # longer than the test); B flushes every second.
    a = OperatorProcess(operator_kubeconfig, tmp_path, identity="op-fence-a", lease_namespace=LEASE_NS,
                        extra_args=["--flush-interval", "600", *SHORT_LEASE])
    b = OperatorProcess(operator_kubeconfig, tmp_path, identity="op-fence-b", lease_namespace=LEASE_NS,
                        extra_args=SHORT_LEASE)
    try:
        a.start()
        create(kube, namespace, ftj("fence"))
        running_with_uid(kube, namespace, "fence")
        b.start(wait_ready=False)
        wait_for("B serving as a standby", lambda: b.readyz() == 503, timeout=60)
        pod = worker_pods(kube, namespace, "fence")[0]
        token = job_token(kube, namespace, pod, f"finetune.dev/progress/{namespace}/fence")
        code, text = a.post(namespace, "fence", {"rank": 0, "training": {"step": 6, "totalSteps": 50}}, token)
        assert code == 202, text
        wait_for("A's first report written at once", lambda: status(kube, namespace, "fence").get("step") == "6/50",
                 timeout=30)
        code, text = a.post(namespace, "fence", {"rank": 0, "training": {"step": 7, "totalSteps": 50}}, token)
        assert code == 202, text
        stays("A holds step 7 (due only in 600 s)", lambda: status(kube, namespace, "fence").get("step") == "6/50", 1)
        assert b.post(namespace, "fence", {"rank": 0, "training": {"step": 8}}, token)[0] == 503  # standby
        assert a.proc is not None
        a.proc.send_signal(signal.SIGSTOP)  # the leader freezes (GC pause, frozen VM) holding step 7
        b.wait_ready(timeout=90)  # the Lease expires; B takes over
        code, text = b.post(namespace, "fence", {"rank": 0, "training": {"step": 9, "totalSteps": 50}}, token)
        assert code == 202, text
        wait_for("B's step in status", lambda: status(kube, namespace, "fence").get("step") == "9/50", timeout=30)
        a.proc.send_signal(signal.SIGCONT)  # A wakes up believing it leads, with step 7 unflushed
        assert a.proc.wait(timeout=60) == 2  # it notices it lost the Lease and exits
        stays("A's stale step 7 never lands", lambda: status(kube, namespace, "fence").get("step") == "9/50", 4)
        assert status(kube, namespace, "fence")["training"]["step"] == 9
    finally:
        if a.proc is not None and a.proc.poll() is None:
            a.proc.send_signal(signal.SIGCONT)
        a.kill()
        b.stop()
        operator.start()


@pytest.mark.usefixtures("ray_dashboard")
def test_a_progress_write_paused_after_the_leader_check_is_refused_by_the_api_server(
        kube: Kube, namespace: str, operator: OperatorProcess, operator_kubeconfig: Path) -> None:
    """The Lease check before a write cannot fence a write that passed it and was then paused (SIGSTOP,
    a GC pause) before it left: it reaches the API server after the new leader's writes. Progress writes
    therefore test the job's resourceVersion, as the cache last saw it; a stale one is refused, and the
    retry on the fresh version asks the leader check again, which the paused replica no longer passes.
    The pause itself cannot be placed between the check and the send on demand, so the stand-in is the
    check (`may_write`): it lets the write through, and meanwhile "the new leader" (this test, through
    the API server) writes a later step. Everything else is the real flush against the real API server."""
    from finetune_operator.api.status import ProgressReport
    from finetune_operator.controller.k8s import Kube as OperatorKube
    from finetune_operator.controller.k8s import load_config
    from finetune_operator.controller.metrics import Metrics
    from finetune_operator.controller.progress import ProgressServer

    operator.stop()  # nobody else writes this object during the test
    try:
        create(kube, namespace, ftj("paused"))
        obj = kube.custom.patch_namespaced_custom_object_status(
            G, V, namespace, P, "paused", {"status": {"phase": "Running"}}, _content_type="application/merge-patch+json")
        uid, seen = obj["metadata"]["uid"], obj["metadata"]["resourceVersion"]

        def new_leader_writes(step: int) -> None:
            kube.custom.patch_namespaced_custom_object_status(
                G, V, namespace, P, "paused", {"status": {"step": f"{step}/50", "training": {"step": step}}},
                _content_type="application/merge-patch+json")

        def flusher() -> ProgressServer:
            srv = ProgressServer(OperatorKube(load_config(str(operator_kubeconfig))), Metrics(), flush_interval=0,
                                 current_uid=lambda ns, name: uid, current_version=lambda ns, name: seen)
            srv.accept(namespace, "paused", ProgressReport.model_validate(
                {"rank": 0, "training": {"step": 7, "totalSteps": 50}}))
            return srv

        # 1. A paused leader: the check passes, the new leader writes step 9 before the write arrives.
        paused = flusher()
        checks: list[bool] = []

        def check_then_pause() -> bool:
            if not checks:
                new_leader_writes(9)  # happens while this replica is frozen right after its check
            checks.append(not checks)  # after the pause the Lease has surely run out: refused from now on
            return checks[-1]
        paused.kube.may_write = check_then_pause
        assert paused.flush_once() == 0  # refused twice: by the API server, then by the leader check
        assert paused.conflicts == 1 and paused.pending[(namespace, "paused")].dirty and checks == [True, False]
        assert status(kube, namespace, "paused")["step"] == "9/50"  # the stale step 7 never landed

        # 2. The same stale version without a pause (the cache behind a write by somebody else): the
        #    retry on the version just read lands, so a live leader's progress is never lost to it.
        live = flusher()
        assert live.flush_once() == 1 and live.conflicts == 1
        assert status(kube, namespace, "paused")["step"] == "7/50"
    finally:
        operator.start()


# ------------------------------------------------------------------------------- 4. hang detection

REPORTER = """
import sys, time
from finetune_operator.api.status import ProgressReport, TrainingProgress
from finetune_training.progress import ProgressClient
client = ProgressClient(sys.argv[1], token_file=sys.argv[2], interval=0.3)
step = 0
while True:  # a training loop that reports every step, the way finetune_training's loop does
    step += 1
    client.publish(ProgressReport(rank=0, phase="Training",
                                  training=TrainingProgress(step=step, totalSteps=100000, loss=1.0, etaSeconds=0.2 * (100000 - step))))
    print(step, flush=True)
    time.sleep(0.2)
"""


@pytest.mark.usefixtures("ray_dashboard")
def test_a_sigstopped_training_becomes_stalled_then_recovers_then_fails_by_policy(
        kube: Kube, namespace: str, operator: OperatorProcess, tmp_path: Path) -> None:
    import subprocess
    import sys

    create(kube, namespace, ftj("hang", stallPolicy={"timeoutSeconds": 8}))
    running_with_uid(kube, namespace, "hang")
    pod = worker_pods(kube, namespace, "hang")[0]
    token_file = tmp_path / "token"
    token_file.write_text(job_token(kube, namespace, pod, f"finetune.dev/progress/{namespace}/hang"))
    url = f"{operator.url}/v1/progress/{namespace}/hang"
    trainer = subprocess.Popen([sys.executable, "-c", REPORTER, url, str(token_file)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    try:
        wait_for("progress in status", lambda: (status(kube, namespace, "hang").get("training") or {}).get("step"),
                 timeout=30)
        wait_for("not stalled once it reports", lambda: (c := condition(status(kube, namespace, "hang"), "Stalled")) is None
                 or c["status"] == "False", timeout=30)
        stays("not stalled while it reports", lambda: (c := condition(status(kube, namespace, "hang"), "Stalled")) is None
              or c["status"] == "False", 10)
        trainer.send_signal(signal.SIGSTOP)  # hung: alive, silent (as in an NCCL deadlock)
        stopped_at = (status(kube, namespace, "hang").get("training") or {}).get("step")
        st = wait_for("Stalled", lambda: (s := status(kube, namespace, "hang")) and (c := condition(s, "Stalled"))
                      and c["status"] == "True" and s, timeout=60)
        stalled = condition(st, "Stalled")  # type: ignore[arg-type]
        assert stalled["reason"] == "NoProgress" and "window 8s" in stalled["message"], stalled  # type: ignore[index]
        assert f"step {st['training']['step']}/100000" in stalled["message"]  # type: ignore[index]
        assert st["phase"] == "Running" and st["message"].startswith("stalled")  # type: ignore[index]
        assert st["training"]["step"] >= (stopped_at or 0)  # type: ignore[index]
        # The Event follows the status write: wait for it rather than race it.
        wait_for("a Warning Event Stalled", lambda: any(
            e.type == "Warning" and e.reason == "Stalled"
            for e in kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=hang").items),
            timeout=15)
        assert f'finetune_job_stalled{{name="hang",namespace="{namespace}"}} 1.0' in operator.metrics()
        trainer.send_signal(signal.SIGCONT)  # it recovers
        wait_for("Stalled=False", lambda: (c := condition(status(kube, namespace, "hang"), "Stalled"))
                 and c["status"] == "False" and c["reason"] == "Progressing", timeout=60)
        assert f'finetune_job_stalled{{name="hang",namespace="{namespace}"}} 0.0' in operator.metrics()
        # Policy Fail (stallPolicy is mutable): the next hang fails the job and releases the Ray cluster.
        kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "hang",
                                                   {"spec": {"stallPolicy": {"timeoutSeconds": 8, "action": "Fail"}}},
                                                   _content_type="application/merge-patch+json")
        time.sleep(2)
        trainer.send_signal(signal.SIGSTOP)
        st = wait_for("Failed as stalled", lambda: phase_is(kube, namespace, "hang", "Failed"), timeout=60)
        failed = condition(st, "Failed")  # type: ignore[arg-type]
        assert failed["reason"] == "Stalled" and "stallPolicy" in failed["message"], failed  # type: ignore[index]
        wait_for("RayJob suspended (cluster released)",
                 lambda: rayjobs(kube, namespace)[0]["spec"].get("suspend") is True, timeout=30)
    finally:
        trainer.send_signal(signal.SIGCONT)
        trainer.kill()
        trainer.wait()


# ------------------------------------------------------------------- 5. progress reaches the leader


@pytest.mark.usefixtures("ray_dashboard")
def test_a_stalled_job_gets_a_new_ray_cluster_by_policy_restart_then_fails_when_none_is_left(
        kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """stallPolicy action Restart: the stalled job's RayJob is suspended (KubeRay deletes the Ray cluster),
    then resumed (KubeRay creates a new one and submits again: the runtime resumes from its checkpoint, which
    tests/integration/test_e2e_real_node.py shows for a suspend on real pods). Here nobody reports at all,
    so each Ray cluster stalls after the 8 s window: one restart, then Failed with the count in the message."""
    create(kube, namespace, ftj("restart", stallPolicy={"timeoutSeconds": 8, "action": "Restart", "maxRestarts": 1}))
    running_with_uid(kube, namespace, "restart")
    first = rayjobs(kube, namespace)[0]["status"]["rayClusterName"]
    seen: dict[str, set[str]] = {"phases": set(), "clusters": {first}}

    def observe() -> dict[str, Any]:
        st = status(kube, namespace, "restart")
        seen["phases"].add(str(st.get("phase")))
        for rj in rayjobs(kube, namespace):
            if (rj.get("status") or {}).get("rayClusterName"):
                seen["clusters"].add(rj["status"]["rayClusterName"])
        return st

    st = wait_for("restart counted", lambda: (s := observe()).get("stallRestarts") == 1 and s, timeout=90)
    running = condition(st, "Running")  # type: ignore[arg-type]
    # The restart's own words ("stalled (NoProgress): ...; restart 1 of 1 by spec.stallPolicy.action Restart"),
    # or, once a later reconcile has looked while the restart is pending, "restarting after a stall (restart 1)".
    assert running["reason"] == "StallRestart" and "restart 1" in running["message"], running  # type: ignore[index]
    wait_for("the StallRestart event with the count", lambda: any(
        e.reason == "StallRestart" and "restart 1 of 1" in e.message
        for e in kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=restart").items), timeout=30)
    wait_for("a new Ray cluster", lambda: observe() and len(seen["clusters"]) >= 2, timeout=180)
    wait_for("Running on it", lambda: observe().get("phase") == "Running" and not observe().get("stallRestartPending"),
             timeout=180)
    assert status(kube, namespace, "restart")["rayClusterName"] != first
    try:
        st = wait_for("Failed after the restart", lambda: (s := observe()).get("phase") == "Failed" and s, timeout=120)
    except BaseException:
        print(status(kube, namespace, "restart"), rayjobs(kube, namespace))
        raise
    failed = condition(st, "Failed")  # type: ignore[arg-type]
    assert failed["reason"] == "Stalled" and "failed after 1 restart(s)" in failed["message"], failed  # type: ignore[index]
    assert st["stallRestarts"] == 1  # type: ignore[index]
    assert "Suspended" not in seen["phases"], seen  # a restart is never shown as a user's suspend
    wait_for("RayJob suspended (cluster released)",
             lambda: rayjobs(kube, namespace)[0]["spec"].get("suspend") is True, timeout=30)
    events = [e.reason for e in kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=restart").items]
    assert "StallRestart" in events and "Failed" in events, events


def test_the_service_routes_progress_to_the_leader_only(kube: Kube, operator: OperatorProcess,
                                                        operator_kubeconfig: Path, tmp_path: Path) -> None:
    """deploy/operator.yaml on the dev cluster: kwok plays the two operator pods (it runs no containers
    and reports them Ready without probes), two real operator processes act as those pods (--pod-name).
    The leader labels its own pod, the Service selects that label, and the EndpointSlice controller
    (kube-controller-manager) routes to the leader only, also after a failover. Requests go through the
    Service: each process listens on its pod's IP (added to lo; kwok's IPs lead nowhere), port 8080, and the
    API server's service proxy picks the endpoint; only the leader's /metrics say
    finetune_operator_leader 1 (a standby's say 0, and its /readyz 503)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "apply", "-f", str(root / "deploy" / "operator.yaml")],
                   check=True, capture_output=True, timeout=60)
    ns = "finetune-system"
    procs: list[OperatorProcess] = []
    added: list[str] = []
    try:
        out = subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "-n", ns, "rollout", "status",
                              "deploy/finetune-operator", "--timeout=120s"], capture_output=True, text=True, timeout=150)
        assert out.returncode == 0, out.stderr  # (kwok marks pods Ready without running probes: a weak check)

        def pods() -> list[Any]:
            return [p for p in kube.core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/name=finetune-operator").items
                    if p.metadata.deletion_timestamp is None and p.status.pod_ip]
        two = wait_for("two operator pods with IPs", lambda: (p := pods()) and len(p) == 2 and p, timeout=60)
        pod_a, pod_b = sorted(two, key=lambda p: p.metadata.name)  # type: ignore[call-overload]

        def endpoints() -> set[str]:
            slices = client_discovery(kube).list_namespaced_endpoint_slice(
                ns, label_selector="kubernetes.io/service-name=finetune-operator").items
            return {a for sl in slices for e in (sl.endpoints or []) if (e.conditions and e.conditions.ready)
                    for a in e.addresses}

        assert os.geteuid() == 0, "this test adds the operator pods' IPs to lo (ip addr add): run it as root, as CI does"
        for pod in (pod_a, pod_b):
            subprocess.run(["ip", "addr", "add", f"{pod.status.pod_ip}/32", "dev", "lo"], check=True, timeout=10)
            added.append(pod.status.pod_ip)

        def through_service(path: str) -> str:
            return str(kube.core.connect_get_namespaced_service_proxy_with_path("finetune-operator:http", ns, path))

        def leader_answers() -> bool:
            try:
                return through_service("readyz") == "leader" and metric(
                    through_service("metrics"), "finetune_operator_leader") == 1.0
            except ApiException:  # 503: a standby (or no endpoint yet) answered
                return False

        operator.stop()  # the module's operator releases the Lease; A and B compete for it
        a = OperatorProcess(operator_kubeconfig, tmp_path, identity=pod_a.metadata.name, lease_namespace=ns,
                            extra_args=["--pod-name", pod_a.metadata.name, *SHORT_LEASE], host=pod_a.status.pod_ip,
                            port=8080)
        b = OperatorProcess(operator_kubeconfig, tmp_path, identity=pod_b.metadata.name, lease_namespace=ns,
                            extra_args=["--pod-name", pod_b.metadata.name, *SHORT_LEASE], host=pod_b.status.pod_ip,
                            port=8080)
        procs += [a, b]
        a.start()
        b.start(wait_ready=False)
        wait_for("Service endpoints = the leader's pod", lambda: endpoints() == {pod_a.status.pod_ip}, timeout=60)
        assert "finetune.dev/operator-leader" not in (kube.core.read_namespaced_pod(pod_b.metadata.name, ns).metadata.labels or {})
        wait_for("B up, as a standby", lambda: b.readyz() == 503, timeout=60)
        assert metric(b.metrics(), "finetune_operator_leader") == 0.0  # what B would answer through the Service
        for _ in range(5):  # every request through the Service reaches the leader
            assert leader_answers()
        a.kill()  # the leader dies; its pod object (and label) stays, as when only the container restarts
        b.wait_ready(timeout=90)
        a.start(wait_ready=False)  # the container restarts: as a standby it drops its stale label
        wait_for("Service endpoints = the new leader's pod", lambda: endpoints() == {pod_b.status.pod_ip}, timeout=60)
        wait_for("A up again, as a standby", lambda: a.readyz() == 503, timeout=60)
        for _ in range(5):
            assert leader_answers()  # B now: A's /metrics say 0 and its /readyz 503
    finally:
        for p in procs:
            p.stop()
        for ip in added:
            subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=False, timeout=10)
        subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "delete", "--wait=false", "-f",
                        str(root / "deploy" / "operator.yaml")], capture_output=True, timeout=60)
        operator.start()


def client_discovery(kube: Kube) -> Any:
    from kubernetes import client

    return client.DiscoveryV1Api(kube.api_client)


# ---------------------------------------------------------------- 2b. a rejected child is not terminal


@pytest.mark.usefixtures("ray_dashboard")
def test_a_child_rejected_by_admission_blocks_until_the_policy_goes(kube: Kube, namespace: str,
                                                                     operator: OperatorProcess) -> None:
    """A real ValidatingAdmissionPolicy makes the API server answer 422 to the RayJob's apply; the job
    waits (Blocked/ChildRejected) and proceeds once the policy binding is removed."""
    from kubernetes import client

    adm = client.AdmissionregistrationV1Api(kube.api_client)
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": f"freeze-{namespace}"},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": ["ray.io"], "apiVersions": ["v1"],
                                                         "operations": ["CREATE", "UPDATE"], "resources": ["rayjobs"]}]},
                 "validations": [{"expression": "false", "reason": "Invalid",
                                  "message": "RayJobs are frozen in this namespace for maintenance"}]},
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": f"freeze-{namespace}"},
        "spec": {"policyName": f"freeze-{namespace}", "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}},
    }
    adm.create_validating_admission_policy(policy)
    adm.create_validating_admission_policy_binding(binding)
    try:
        def frozen() -> bool:  # the policy is in force (compiled, bound) before the test relies on it
            probe = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "probe"},
                     "spec": {"entrypoint": "true"}}
            try:
                kube.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", probe,
                                                            dry_run="All")
                return False
            except ApiException as e:
                return e.status == 422 and "frozen" in e.body
        wait_for("the admission policy in force", frozen, timeout=60)
        create(kube, namespace, ftj("frozen"))
        st = wait_for("Blocked/ChildRejected", lambda: (s := status(kube, namespace, "frozen"))
                      and (c := condition(s, "Blocked")) and c["reason"] == "ChildRejected" and s, timeout=60)
        assert "frozen in this namespace" in condition(st, "Blocked")["message"]  # type: ignore[arg-type,index]
        stays("waits, not Failed", lambda: (s := status(kube, namespace, "frozen"))["phase"] == "Pending"
              and condition(s, "Failed") is None and no_rayjob(kube, namespace), 5)
    finally:
        adm.delete_validating_admission_policy_binding(f"freeze-{namespace}")
        adm.delete_validating_admission_policy(f"freeze-{namespace}")
    st = wait_for("Running once the policy is gone", lambda: phase_is(kube, namespace, "frozen", "Running"), timeout=180)
    assert condition(st, "Blocked") is None  # type: ignore[arg-type]
    assert len(rayjobs(kube, namespace)) == 1


# ------------------------------------------------------------------ 3. reconcile errors are visible


@pytest.mark.usefixtures("ray_dashboard")
def test_a_reconcile_error_is_a_condition_until_it_is_fixed(kube: Kube, namespace: str, operator: OperatorProcess,
                                                             control_plane: Any, tmp_path: Path) -> None:
    """The operator runs with RBAC that lacks `patch` on RayJobs (a real 403 from the real authorizer):
    status says Reconciled=False/Forbidden naming the missing permission; with the shipped RBAC the
    condition goes away and the job runs."""
    import yaml
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    sa = "finetune-operator-no-rayjobs"
    shipped = rbac.read_cluster_role("finetune-operator")
    rules = []
    for r in shipped.rules:
        verbs = r.verbs
        if "rayjobs" in (r.resources or []):
            verbs = [v for v in verbs if v not in ("create", "patch")]
        rules.append(client.V1PolicyRule(api_groups=r.api_groups, resources=r.resources, verbs=verbs))
    kube.core.create_namespaced_service_account(LEASE_NS, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=sa)))
    rbac.create_cluster_role(client.V1ClusterRole(metadata=client.V1ObjectMeta(name=sa), rules=rules))
    subject = [client.RbacV1Subject(kind="ServiceAccount", name=sa, namespace=LEASE_NS)]
    rbac.create_cluster_role_binding(client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=sa), subjects=subject,
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=sa)))
    rbac.create_namespaced_role_binding(LEASE_NS, client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name=sa), subjects=subject,
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="finetune-operator-leader")))
    token = kube.core.create_namespaced_service_account_token(
        sa, LEASE_NS, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[],
                                                                                        expiration_seconds=3600))).status.token
    cfg = yaml.safe_load(Path(control_plane.kubeconfig).read_text())
    cluster = cfg["clusters"][0]
    kc = tmp_path / "kubeconfig"
    kc.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "clusters": [cluster],
                                  "users": [{"name": sa, "user": {"token": token}}],
                                  "contexts": [{"name": "c", "context": {"cluster": cluster["name"], "user": sa}}],
                                  "current-context": "c"}))
    operator.stop()
    weak = OperatorProcess(kc, tmp_path, identity="op-weak", lease_namespace=LEASE_NS)
    try:
        weak.start()
        create(kube, namespace, ftj("denied"))
        st = wait_for("Reconciled=False", lambda: (s := status(kube, namespace, "denied"))
                      and (c := condition(s, "Reconciled")) and c["status"] == "False" and s, timeout=60)
        c = condition(st, "Reconciled")  # type: ignore[arg-type]
        assert c["reason"] == "Forbidden" and "rayjobs" in c["message"] and "RBAC" in c["message"], c  # type: ignore[index]
        assert no_rayjob(kube, namespace)
    finally:
        weak.stop()
        operator.start()
        rbac.delete_cluster_role_binding(sa)
        rbac.delete_cluster_role(sa)
        rbac.delete_namespaced_role_binding(sa, LEASE_NS)
        kube.core.delete_namespaced_service_account(sa, LEASE_NS)
    st = wait_for("Running with the shipped RBAC", lambda: phase_is(kube, namespace, "denied", "Running"), timeout=180)
    assert condition(st, "Reconciled") is None  # type: ignore[arg-type]
