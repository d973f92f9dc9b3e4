"""Every phase transition (controller/transitions.py's table), one case or more per row."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from finetune_operator.api.instance_types import INSTANCE_TYPES
from finetune_operator.api.spec import StallAction, StallPolicy
from finetune_operator.api.status import FinetuneJobStatus, InstanceFigures
from finetune_operator.api.validation import Issue
from finetune_operator.controller import transitions
from finetune_operator.controller.status import Observed
from finetune_operator.controller.transitions import RayJobAction, decide

from tests.builders import RayJobDoc, StatusDoc

NAMES = {"rayJob": "j"}
NOW = "2026-12-02T10:00:00Z"
HOUR_AGO = "2026-12-02T09:00:00Z"
REPORT = StallPolicy(timeout_seconds=60)
FAIL = StallPolicy(timeout_seconds=60, action=StallAction.fail)
RESTART = StallPolicy(timeout_seconds=60, action=StallAction.restart, max_restarts=3)

# A running job whose last progress report is an hour old (past the 60 s window), and a fresh one.
HUNG = StatusDoc("Running").running_since(HOUR_AGO).reported(HOUR_AGO, step=5, totalSteps=10)
FRESH = StatusDoc("Running").running_since(HOUR_AGO).reported(NOW, step=6, totalSteps=10)
PENDING_RESTART = (StatusDoc("Provisioning").condition("Running", "False", "StallRestart", HOUR_AGO)
                   .set("stallRestarts", 1).set("stallRestartPending", True))
# The figures a job was judged against (status.instance), and other figures seen later.
FIGURES = InstanceFigures.of(INSTANCE_TYPES["g6.12xlarge"]).wire()
LATER = {**FIGURES, "gpus": 2, "source": "node n-1"}
RUNNING_JUDGED = FRESH.set("rayJobUID", "rj-1").set("instance", FIGURES)
NOT_ALLOWED = [Issue("spec.cluster.image", "x is not in the allowed images (y*; ConfigMap finetune-system/p)")]
UNKNOWN = "spec.cluster.instanceType: no figures for 'g7.big'; waiting for them. Add them to a ConfigMap ..."
# A job that first started an hour ago; KubeRay's RayJob says its current attempt started just now.
FIRST_STARTED = FRESH.set("startTime", HOUR_AGO)
LOST = StatusDoc("Running").running_since(HOUR_AGO).set("rayJobUID", "rj-1").set("step", "40/50")


def lost(last: dict[str, Any] | None = None) -> Observed:
    return Observed(rayjob_lost=True, last_rayjob_status=last)


def rayjob(deploy: str, job: str = "", *, suspend: bool | None = None, **status: Any) -> Observed:
    doc = RayJobDoc(deploy, job).status(**status)
    if suspend is not None:
        doc.suspend(suspend)
    return Observed(rayjob=doc.obj())


@dataclass
class Case:
    id: str
    row: int  # the row of transitions.py's table
    prev: StatusDoc
    observed: Observed
    to: str  # the next phase
    conds: tuple[tuple[str, str, str], ...]  # (type, status, reason) that must be there
    action: RayJobAction = RayJobAction.none
    suspend: bool = False
    policy: StallPolicy | None = REPORT
    fields: dict[str, Any] = field(default_factory=dict)  # status fields expected (None: absent)
    absent: tuple[str, ...] = ()  # condition types that must not be there
    deadline: int | None = None  # spec.activeDeadlineSeconds


CASES = [
    Case("invalid-spec", 1, StatusDoc(), Observed(spec_issues=[Issue("spec.cluster.instanceType", "unknown")]),
         "Failed", (("SpecValid", "False", "InvalidSpec"), ("Failed", "True", "InvalidSpec")), policy=None),
    Case("invalid-spec-while-running", 1, FRESH, Observed(spec_issues=[Issue("spec.training", "bad")]),
         "Failed", (("Failed", "True", "InvalidSpec"),), policy=None),
    Case("invalid-spec-records-no-verdict-on-figures", 1, StatusDoc(), Observed(spec_issues=NOT_ALLOWED, instance=FIGURES),
         "Failed", (("SpecValid", "False", "InvalidSpec"),), policy=None),
    Case("unknown-instance-type-waits", 23, StatusDoc(), Observed(unknown_instance_type=UNKNOWN), "Pending",
         (("InstanceTypeKnown", "False", "UnknownInstanceType"),), absent=("Failed", "SpecValid"), policy=None,
         fields={"message": UNKNOWN}),
    Case("unknown-instance-type-still-waiting", 23,
         StatusDoc("Pending").condition("InstanceTypeKnown", "False", "UnknownInstanceType", HOUR_AGO),
         Observed(unknown_instance_type=UNKNOWN), "Pending", (("InstanceTypeKnown", "False", "UnknownInstanceType"),),
         policy=None),
    Case("figures-appeared", 23, StatusDoc("Pending").condition("InstanceTypeKnown", "False", "UnknownInstanceType", HOUR_AGO),
         Observed(instance=FIGURES), "Pending", (("InstanceTypeKnown", "True", "Known"), ("SpecValid", "True", "Valid")),
         fields={"instance": FIGURES, "message": "creating the RayJob"}),
    Case("figures-recorded-before-the-rayjob", 8, StatusDoc(), Observed(instance=FIGURES), "Pending", (),
         absent=("InstanceTypeKnown",), fields={"instance": FIGURES}),
    Case("allow-list-tightened-while-running", 24, RUNNING_JUDGED,
         Observed(spec_issues=NOT_ALLOWED, rayjob=rayjob("Running", "RUNNING").rayjob), "Running",
         (("Running", "True", "RayJobRunning"),), absent=("Failed",), fields={"instance": FIGURES}),
    Case("figures-gone-while-running", 24, RUNNING_JUDGED,
         Observed(unknown_instance_type=UNKNOWN, rayjob=rayjob("Running", "RUNNING").rayjob), "Running",
         (("Running", "True", "RayJobRunning"),), absent=("InstanceTypeKnown", "Failed")),
    Case("figures-changed-while-running", 24, RUNNING_JUDGED,
         Observed(instance=LATER, rayjob=rayjob("Running", "RUNNING").rayjob), "Running",
         (("Running", "True", "RayJobRunning"),), fields={"instance": FIGURES}),
    Case("allow-list-tightened-after-success", 24,
         StatusDoc("Succeeded").set("rayJobUID", "rj-1").condition("Complete", "True", "Succeeded", HOUR_AGO),
         Observed(spec_issues=NOT_ALLOWED), "Succeeded", (("Complete", "True", "Succeeded"),), absent=("Failed",)),
    Case("blocked-previous-child", 2, StatusDoc(), Observed(blocked=("WaitingForPreviousChild", "old RayJob j")),
         "Pending", (("Blocked", "True", "WaitingForPreviousChild"),), absent=("Failed",)),
    Case("blocked-conflict", 2, StatusDoc(), Observed(blocked=("ChildConflict", "RayJob j exists")),
         "Pending", (("Blocked", "True", "ChildConflict"),)),
    Case("blocked-rejected", 2, StatusDoc("Pending"), Observed(blocked=("ChildRejected", "denied")),
         "Pending", (("Blocked", "True", "ChildRejected"),)),
    Case("lost-seen-succeeded", 3, LOST, lost({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}),
         "Succeeded", (("Complete", "True", "Succeeded"),)),
    Case("lost-seen-failed", 3, LOST, lost({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed"}),
         "Failed", (("Failed", "True", "AppFailed"),)),
    Case("lost-reported-done", 4, LOST.set("runtimePhase", "Done"), lost(),
         "Succeeded", (("Complete", "True", "TrainingReportedDone"), ("Running", "False", "Finished")),
         fields={"completionTime": NOW, "rayJobUID": "rj-1"}),
    Case("lost-reported-failed", 5, StatusDoc("Running").set("runtimePhase", "Failed"), lost(),
         "Failed", (("Failed", "True", "TrainingReportedFailed"),)),
    Case("lost-no-report", 6, LOST, lost(), "Failed", (("Failed", "True", "RayJobDeleted"), ("Running", "False", "Finished"))),
    Case("lost-last-seen-running", 6, LOST, lost({"jobDeploymentStatus": "Running"}),
         "Failed", (("Failed", "True", "RayJobDeleted"),)),
    Case("suspended-before-creation", 7, StatusDoc(), Observed(), "Suspended", (("Suspended", "True", "Suspended"),),
         suspend=True),
    Case("new", 8, StatusDoc(), Observed(), "Pending", (), absent=("Running",), fields={"message": "creating the RayJob"}),
    Case("succeeded", 9, FRESH, rayjob("Complete", "SUCCEEDED", endTime=NOW),
         "Succeeded", (("Complete", "True", "Succeeded"), ("Running", "False", "Finished")), absent=("Stalled",),
         fields={"completionTime": NOW}),
    Case("app-failed", 10, FRESH, rayjob("Failed", "FAILED", reason="AppFailed", message="exit 1"),
         "Failed", (("Failed", "True", "AppFailed"), ("Running", "False", "Finished"))),
    Case("deadline", 10, StatusDoc("Provisioning"), rayjob("Failed", reason="DeadlineExceeded", message="past 5s"),
         "Failed", (("Failed", "True", "DeadlineExceeded"),)),
    Case("validation-failed", 10, StatusDoc("Pending"), rayjob("ValidationFailed", message="bad spec"),
         "Failed", (("Failed", "True", "ValidationFailed"),)),
    Case("backoff-limit", 10, FRESH, rayjob("Failed", "FAILED", failed=3),
         "Failed", (("Failed", "True", "BackoffLimitExceeded"),), fields={"attempt": 3}),
    Case("complete-not-succeeded", 10, FRESH, rayjob("Complete", "STOPPED"), "Failed", (("Failed", "True", "JobStopped"),)),
    Case("stall-restart-under-way", 11, PENDING_RESTART, rayjob("Suspending", suspend=True),
         "Provisioning", (("Running", "False", "StallRestart"),), absent=("Suspended",),
         fields={"stallRestartPending": True}),
    Case("suspend-while-running", 12, FRESH, rayjob("Suspending", "RUNNING", suspend=True),
         "Suspended", (("Suspended", "True", "Suspending"), ("Running", "False", "Suspended")), suspend=True,
         fields={"message": "suspending"}),
    Case("suspended", 12, StatusDoc("Suspended"), rayjob("Suspended", suspend=True),
         "Suspended", (("Suspended", "True", "Suspended"),), suspend=True, fields={"message": "suspended"}),
    Case("suspended-rayjob-held-by-hand", 12, StatusDoc("Provisioning"), rayjob("Suspended"),
         "Suspended", (("Suspended", "True", "Suspended"),)),
    Case("starting", 13, StatusDoc("Provisioning"), rayjob("Running", "PENDING"),
         "Provisioning", (("Running", "False", "Starting"),)),
    Case("starting-job-status-unknown", 13, StatusDoc("Provisioning"), rayjob("Running"),
         "Provisioning", (("Running", "False", "Starting"),)),
    Case("running", 14, StatusDoc("Provisioning"), rayjob("Running", "RUNNING", jobId="raysubmit_1"),
         "Running", (("Running", "True", "RayJobRunning"),)),
    Case("running-reported-from-this-cluster", 14, StatusDoc("Provisioning").reported(NOW, step=1), rayjob("Running", "PENDING"),
         "Running", (("Running", "True", "RayJobRunning"),)),
    Case("finishing", 14, FRESH, rayjob("Running", "SUCCEEDED"), "Running", (("Running", "True", "RayJobRunning"),)),
    Case("stalled-no-progress", 15, HUNG, rayjob("Running", "RUNNING"),
         "Running", (("Stalled", "True", "NoProgress"),)),
    Case("stalled-nccl-watchdog", 15, FRESH.set("network", {"healthy": False, "message": "Watchdog caught collective operation timeout"}),
         rayjob("Running", "RUNNING"), "Running", (("Stalled", "True", "NcclWatchdogTimeout"),)),
    Case("stall-recovered", 16, FRESH.condition("Stalled", "True", "NoProgress", HOUR_AGO), rayjob("Running", "RUNNING"),
         "Running", (("Stalled", "False", "Progressing"),)),
    Case("initializing", 17, StatusDoc("Pending"), rayjob("Initializing"),
         "Provisioning", (("Running", "False", "Provisioning"),)),
    Case("retrying", 17, FRESH, rayjob("Retrying", failed=1), "Provisioning", (("Running", "False", "Provisioning"),),
         absent=("Stalled",), fields={"attempt": 2, "message": "retrying (attempt 2)"}),
    Case("resuming", 17, StatusDoc("Suspended"), rayjob("Suspended", suspend=False),
         "Provisioning", (("Running", "False", "Provisioning"),), absent=("Suspended",)),
    Case("stall-fails", 18, HUNG, rayjob("Running", "RUNNING"), "Failed",
         (("Failed", "True", "Stalled"), ("Running", "False", "Finished")), action=RayJobAction.release, policy=FAIL,
         absent=("Stalled",), fields={"completionTime": NOW}),
    Case("stall-restarts", 19, HUNG, rayjob("Running", "RUNNING"), "Provisioning",
         (("Running", "False", "StallRestart"),), action=RayJobAction.restart, policy=RESTART, absent=("Stalled",),
         fields={"stallRestarts": 1, "stallRestartPending": True}),
    Case("stall-restarts-again", 19, HUNG.set("stallRestarts", 2), rayjob("Running", "RUNNING"), "Provisioning",
         (("Running", "False", "StallRestart"),), action=RayJobAction.restart, policy=RESTART,
         fields={"stallRestarts": 3, "stallRestartPending": True}),
    Case("stall-restarts-exhausted", 20, HUNG.set("stallRestarts", 3), rayjob("Running", "RUNNING"), "Failed",
         (("Failed", "True", "Stalled"),), action=RayJobAction.release, policy=RESTART,
         fields={"stallRestarts": 3}),
    Case("stall-restart-resumes", 21, PENDING_RESTART, rayjob("Suspended", suspend=True), "Provisioning",
         (("Running", "False", "StallRestart"),), action=RayJobAction.resume, policy=RESTART,
         fields={"stallRestartPending": None, "stallRestarts": 1}),
    Case("stall-restart-already-resumed", 21, PENDING_RESTART, rayjob("Initializing", suspend=False), "Provisioning",
         (("Running", "False", "StallRestart"),), policy=RESTART, fields={"stallRestartPending": None}),
    Case("deadline-counts-from-the-first-start", 25, FIRST_STARTED.set("attempt", 2),
         rayjob("Running", "RUNNING", startTime=NOW, failed=1), "Failed",
         (("Failed", "True", "DeadlineExceeded"), ("Running", "False", "Finished")), action=RayJobAction.release,
         deadline=1800, fields={"startTime": HOUR_AGO, "completionTime": NOW}),
    Case("deadline-while-retrying", 25, FIRST_STARTED, rayjob("Retrying", failed=1), "Failed",
         (("Failed", "True", "DeadlineExceeded"),), action=RayJobAction.release, deadline=3600),
    Case("deadline-while-suspended", 25, StatusDoc("Suspended").set("startTime", HOUR_AGO), rayjob("Suspended", suspend=True),
         "Failed", (("Failed", "True", "DeadlineExceeded"),), action=RayJobAction.release, suspend=True, deadline=1800,
         absent=("Suspended",)),
    Case("deadline-before-a-stall-restart", 25, HUNG.set("startTime", HOUR_AGO), rayjob("Running", "RUNNING"), "Failed",
         (("Failed", "True", "DeadlineExceeded"),), action=RayJobAction.release, policy=RESTART, deadline=1800,
         absent=("Stalled",), fields={"stallRestarts": None, "stallRestartPending": None}),
    Case("deadline-during-a-stall-restart", 25, PENDING_RESTART.set("startTime", HOUR_AGO), rayjob("Suspended", suspend=True),
         "Failed", (("Failed", "True", "DeadlineExceeded"),), action=RayJobAction.release, policy=RESTART, deadline=1800,
         fields={"stallRestartPending": None}),
    Case("deadline-not-yet-first-start-kept", 14, FIRST_STARTED, rayjob("Running", "RUNNING", startTime=NOW),
         "Running", (("Running", "True", "RayJobRunning"),), deadline=7200, fields={"startTime": HOUR_AGO}),
    Case("failed-is-final", 22, StatusDoc("Failed").condition("Failed", "True", "Stalled", HOUR_AGO),
         rayjob("Suspended", suspend=True), "Failed", (("Failed", "True", "Stalled"),), absent=("Suspended",)),
    # Row 22: a job Failed as Stalled whose suspend patch never landed is released at each reconcile until it is.
    Case("stall-failed-release-retried", 22, StatusDoc("Failed").condition("Failed", "True", "Stalled", HOUR_AGO),
         rayjob("Running", "RUNNING", suspend=False), "Failed", (("Failed", "True", "Stalled"),),
         action=RayJobAction.release, policy=FAIL),
    Case("stall-failed-release-retried-no-suspend-field", 22, StatusDoc("Failed").condition("Failed", "True", "Stalled", HOUR_AGO),
         rayjob("Running", "RUNNING"), "Failed", (("Failed", "True", "Stalled"),), action=RayJobAction.release, policy=None),
    Case("stall-failed-released", 22, StatusDoc("Failed").condition("Failed", "True", "Stalled", HOUR_AGO),
         rayjob("Suspending", suspend=True), "Failed", (("Failed", "True", "Stalled"),), policy=FAIL),
    Case("other-failure-not-released", 22, StatusDoc("Failed").condition("Failed", "True", "RayJobDeleted", HOUR_AGO),
         rayjob("Running", "RUNNING"), "Failed", (("Failed", "True", "RayJobDeleted"),), policy=FAIL),
    Case("succeeded-is-final", 22, StatusDoc("Succeeded").condition("Complete", "True", "Succeeded", HOUR_AGO),
         Observed(), "Succeeded", (("Complete", "True", "Succeeded"),)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_transition(case: Case) -> None:
    d = decide(generation=1, suspend=case.suspend, names=NAMES, prev=case.prev.obj(), observed=case.observed, now=NOW,
               policy=case.policy, deadline_seconds=case.deadline)
    st = d.status
    assert (st["phase"], d.action) == (case.to, case.action), st.get("message")
    have = {c["type"]: (c["type"], c["status"], c["reason"]) for c in st.get("conditions") or []}
    for want in case.conds:
        assert have.get(want[0]) == want
    assert [t for t in case.absent if t in have] == []
    for key, value in case.fields.items():
        assert st.get(key) == value, key
    assert d.stalled == (case.row in (15, 19))
    FinetuneJobStatus.model_validate(st)  # every derived status is one the CRD accepts


def test_every_row_of_the_table_has_a_case() -> None:
    rows = {int(n) for n in re.findall(r"^\| (\d+) +\|", transitions.__doc__ or "", re.M)}
    assert rows == set(range(1, 26))
    assert {c.row for c in CASES} == rows


@pytest.mark.parametrize("status, deadline, left", [
    (StatusDoc("Running").set("startTime", HOUR_AGO), 7200, 3600.0),
    (StatusDoc("Running").set("startTime", HOUR_AGO), 60, 0.0),
    (StatusDoc("Running").set("startTime", HOUR_AGO), None, None),
    (StatusDoc("Provisioning"), 60, None),  # not started yet
    (StatusDoc("Failed").set("startTime", HOUR_AGO), 60, None),
], ids=["an-hour-left", "passed", "no-deadline", "not-started", "finished"])
def test_seconds_until_the_deadline_counts_from_the_first_start(status: StatusDoc, deadline: int | None,
                                                                left: float | None) -> None:
    """The reconciler looks at the job again when its deadline passes (no watch event would come then)."""
    assert transitions.seconds_until_deadline(status.obj(), NOW, deadline) == left


@pytest.mark.parametrize("deadline, phase, look_in", [(1800, "Failed", None), (7200, "Running", 3601.0)],
                         ids=["passed-over-two-attempts", "an-hour-left"])
def test_the_reconciler_enforces_the_deadline_over_attempts(deadline: int, phase: str, look_in: float | None) -> None:
    """KubeRay's second attempt started 10 minutes ago (its own deadline is far off); the job first started an
    hour ago. Past the deadline the job fails and its RayJob is suspended (the Ray cluster released); before
    it, the reconciler looks again when it passes."""
    from finetune_operator.controller.k8s import FTJ
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.config import RenderConfig

    from tests.builders import JobDoc
    from tests.unit.api_server import ApiServer

    kube, looks = ApiServer(), []
    rec = Reconciler(kube, RenderConfig(), {}, clock=lambda: NOW,  # type: ignore[arg-type]
                     requeue_after=lambda ns, name, delay: looks.append(delay))
    kube._put(FTJ, JobDoc("j").spec(activeDeadlineSeconds=deadline).obj())
    rec.reconcile("ns", "j")  # creates the RayJob
    kube.objects[("rayjobs", "j")]["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "failed": 1,
                                               "rayClusterName": "j-2", "startTime": "2026-12-02T09:50:00Z"}
    job = kube.objects[("finetunejobs", "j")]
    job["status"] = {**job["status"], "startTime": HOUR_AGO, "rayJobUID": kube.objects[("rayjobs", "j")]["metadata"]["uid"]}
    kube.calls.clear()
    looks.clear()
    assert rec.reconcile("ns", "j") == phase
    status = kube.objects[("finetunejobs", "j")]["status"]
    assert status["startTime"] == HOUR_AGO
    if phase == "Failed":
        assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "DeadlineExceeded"
        assert ("patch", "RayJob", "j") in kube.calls and kube.patches[-1]["spec"]["suspend"] is True
    assert look_in is None or look_in in looks, looks  # the work queue keeps the earliest of its looks
