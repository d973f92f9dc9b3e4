"""Status derivation and preflight: pure functions, table-driven."""

from __future__ import annotations

from typing import Any

import pytest
from finetune_operator.api.validation import Issue, parse_job
from finetune_operator.controller.capacity import check_capacity
from finetune_operator.controller.reconcile import plan_children, with_hash
from finetune_operator.controller.status import Observed, pods_of, seconds_until_stall
from finetune_operator.controller.transitions import derive_status, fail_stalled, restart_stalled

from tests.builders import JobDoc

NAMES = {"rayJob": "j", "configMap": "j-config", "runtimeConfigMap": "j-runtime"}
NOW = "2026-12-02T10:00:00Z"
LATER = "2026-12-02T10:05:00Z"


def rayjob(deploy: str = "", job: str = "", **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": "j"}, "status": {"jobDeploymentStatus": deploy, "jobStatus": job, **extra}}


def pod(name: str, node_type: str = "worker", *, unschedulable: str | None = None, waiting: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": []}
    if unschedulable:
        status["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": unschedulable})
    if waiting:
        status["containerStatuses"] = [{"name": "ray-worker", "state": {"waiting": {"reason": waiting, "message": "boom"}}}]
    return {"metadata": {"name": name, "labels": {"ray.io/node-type": node_type}}, "status": status}


def derive(observed: Observed, prev: dict[str, Any] | None = None, suspend: bool = False, now: str = NOW) -> dict[str, Any]:
    return derive_status(generation=1, suspend=suspend, names=NAMES, prev=prev or {}, observed=observed, now=now)


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


PHASES = [
    ("no-rayjob", Observed(), "Pending"),
    ("initializing", Observed(rayjob=rayjob("Initializing")), "Provisioning"),
    ("running", Observed(rayjob=rayjob("Running", "RUNNING", jobId="raysubmit_1")), "Running"),
    # KubeRay says Running once its submitter Job exists: starting until Ray runs the job or it reports.
    ("starting-unknown-job-status", Observed(rayjob=rayjob("Running")), "Provisioning"),
    ("starting-pending", Observed(rayjob=rayjob("Running", "PENDING")), "Provisioning"),
    ("finishing", Observed(rayjob=rayjob("Running", "SUCCEEDED")), "Running"),  # KubeRay waits for its submitter
    ("complete-succeeded", Observed(rayjob=rayjob("Complete", "SUCCEEDED", endTime=LATER)), "Succeeded"),
    ("complete-failed", Observed(rayjob=rayjob("Complete", "FAILED")), "Failed"),
    ("failed", Observed(rayjob=rayjob("Failed", "FAILED", reason="AppFailed", message="exit 1")), "Failed"),
    ("deadline", Observed(rayjob=rayjob("Failed", reason="DeadlineExceeded", message="past 5s")), "Failed"),
    ("validation-failed", Observed(rayjob=rayjob("ValidationFailed", message="bad spec")), "Failed"),
    ("suspended", Observed(rayjob=rayjob("Suspended")), "Suspended"),
    ("retrying", Observed(rayjob=rayjob("Retrying", failed=1)), "Provisioning"),
    ("invalid-spec", Observed(spec_issues=[Issue("spec.cluster.instanceType", "unknown")]), "Failed"),
    ("blocked", Observed(blocked=("ChildConflict", "RayJob j exists")), "Pending"),
    ("lost-no-report", Observed(rayjob_lost=True), "Failed"),
    ("lost-seen-succeeded", Observed(rayjob_lost=True, last_rayjob_status={"jobDeploymentStatus": "Complete",
                                                                          "jobStatus": "SUCCEEDED"}), "Succeeded"),
    ("lost-seen-failed", Observed(rayjob_lost=True, last_rayjob_status={"jobDeploymentStatus": "Failed",
                                                                       "jobStatus": "FAILED"}), "Failed"),
    ("lost-last-seen-running", Observed(rayjob_lost=True, last_rayjob_status={"jobDeploymentStatus": "Running"}), "Failed"),
]


@pytest.mark.parametrize(("observed", "phase"), [p[1:] for p in PHASES], ids=[p[0] for p in PHASES])
def test_phase(observed: Observed, phase: str) -> None:
    assert derive(observed)["phase"] == phase


def test_failure_reasons_are_actionable() -> None:
    st = derive(Observed(rayjob=rayjob("Failed", reason="DeadlineExceeded", message="past 5s")))
    assert cond(st, "Failed")["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds" in cond(st, "Failed")["message"]
    st = derive(Observed(rayjob=rayjob("Failed", "FAILED", failed=3)))
    assert cond(st, "Failed")["reason"] == "BackoffLimitExceeded"
    assert st["attempt"] == 3
    st = derive(Observed(rayjob=rayjob("ValidationFailed", message="bad spec")))
    assert cond(st, "Failed")["reason"] == "ValidationFailed"
    assert "bad spec" in cond(st, "Failed")["message"]


# Every JobFailedReason KubeRay v1.6.1 sets (apis/ray/v1/rayjob_types.go; rayjob_controller.go), as KubeRay
# writes it: (deployment status, job status, reason, message, status.failed) -> our reason, words the message
# must carry (what happened, KubeRay's words, what to do).
FAILURES = [
    ("app-failed", ("Failed", "FAILED", "AppFailed", "ValueError: boom", 1), "AppFailed",
     ("the training failed", "ValueError: boom", "kubectl logs job/j")),
    ("submission-failed", ("Failed", "", "SubmissionFailed", "Job submission has failed. Reason: BackoffLimitExceeded.", 1),
     "SubmissionFailed", ("could not be submitted", "Job submission has failed", "kubectl logs job/j")),
    ("deadline", ("Failed", "", "DeadlineExceeded", "The RayJob has passed the activeDeadlineSeconds.", 1),
     "DeadlineExceeded", ("spec.activeDeadlineSeconds passed", "raise spec.activeDeadlineSeconds")),
    ("deadline-after-retries", ("Failed", "", "DeadlineExceeded", "passed", 3), "DeadlineExceeded",
     ("spec.activeDeadlineSeconds passed",)),  # KubeRay never retries a deadline: not BackoffLimitExceeded
    ("pre-running-deadline", ("Failed", "", "PreRunningDeadlineExceeded", "The RayJob has passed the preRunningDeadlineSeconds.", 1),
     "PreRunningDeadlineExceeded", ("did not start", "Capacity and PodsHealthy")),
    ("grace-period", ("Failed", "FAILED", "JobDeploymentStatusTransitionGracePeriodExceeded",
                      "The RayJob submitter finished at 2026-12-05 10:00:00 but the ray job did not reach terminal state", 1),
     "RayJobOutcomeUnknown", ("could not establish the Ray job's outcome", "submitter finished", "head pod")),
    ("validation-failed", ("ValidationFailed", "", "ValidationFailed", "spec.entrypoint is required", 0), "ValidationFailed",
     ("KubeRay rejected the RayJob", "spec.entrypoint is required", "kubectl get rayjob j -o yaml")),
    ("retries-exhausted", ("Failed", "FAILED", "AppFailed", "exit 1", 3), "BackoffLimitExceeded",
     ("all 3 attempts failed", "spec.backoffLimit 2", "the training failed (AppFailed)", "exit 1", "kubectl logs job/j")),
    ("retries-exhausted-submission", ("Failed", "", "SubmissionFailed", "no dashboard", 2), "BackoffLimitExceeded",
     ("all 2 attempts failed", "(SubmissionFailed)", "no dashboard")),
    ("a-later-kuberay-reason", ("Failed", "", "SomethingNew", "why", 1), "SomethingNew", ("SomethingNew", "why")),
    ("stopped", ("Complete", "STOPPED", "", "", 0), "JobStopped", ("ended with status STOPPED",)),
]


@pytest.mark.parametrize(("rj", "reason", "words"), [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES])
def test_each_kuberay_failure_reason_maps_to_ours_with_what_happened_and_what_to_do(
        rj: tuple[str, str, str, str, int], reason: str, words: tuple[str, ...]) -> None:
    deploy, job, ray_reason, message, failed = rj
    st = derive(Observed(rayjob=rayjob(deploy, job, reason=ray_reason, message=message, failed=failed)))
    assert st["phase"] == "Failed"
    c = cond(st, "Failed")
    assert c["reason"] == reason, c
    for w in words:
        assert w in c["message"], (w, c["message"])
    assert st["message"] == c["message"]


def test_unschedulable_workers_surface_the_scheduler_message() -> None:
    msg = "0/3 nodes are available: 1 Insufficient vpc.amazonaws.com/efa, 2 node(s) didn't match selector."
    st = derive(Observed(rayjob=rayjob("Initializing"), pods=[pod("w-0"), pod("w-2", unschedulable=msg)]))
    assert st["phase"] == "Provisioning"
    c = cond(st, "WorkersScheduled")
    assert (c["status"], c["reason"]) == ("False", "Unschedulable")
    assert "Insufficient vpc.amazonaws.com/efa" in c["message"]
    assert "Insufficient vpc.amazonaws.com/efa" in st["message"]


def test_image_pull_failure_is_a_condition() -> None:
    st = derive(Observed(rayjob=rayjob("Initializing"), pods=[pod("h", "head", waiting="ImagePullBackOff")]))
    c = cond(st, "PodsHealthy")
    assert (c["status"], c["reason"]) == ("False", "ImagePullBackOff")


def test_last_transition_time_changes_only_with_status() -> None:
    first = derive(Observed(rayjob=rayjob("Initializing")))
    again = derive(Observed(rayjob=rayjob("Initializing")), prev=first, now=LATER)
    assert cond(again, "Running")["lastTransitionTime"] == NOW
    assert again == first
    running = derive(Observed(rayjob=rayjob("Running", "RUNNING")), prev=first, now=LATER)
    assert cond(running, "Running")["lastTransitionTime"] == LATER


def test_progress_fields_are_carried_over() -> None:
    prev = {"training": {"step": 5, "loss": 1.5}, "network": {"transport": "socket", "healthy": False,
                                                              "message": "fell back to sockets"}, "step": "5/10"}
    st = derive(Observed(rayjob=rayjob("Running", "RUNNING")), prev=prev)
    assert st["training"] == prev["training"] and st["step"] == "5/10"
    c = cond(st, "NetworkHealthy")
    assert c["status"] == "False" and c["reason"] == "TransportSocket"


@pytest.mark.parametrize(
    ("network", "reason"),
    [
        ({"transport": "efa", "healthy": True}, "Efa"),
        ({"transport": "intra-node", "healthy": True}, "TransportIntraNode"),
        ({"transport": "mixed:efa,socket", "healthy": False}, "TransportMixedEfaSocket"),
        ({"transport": "none", "healthy": False, "message": "requireEFA (caught by NCCL): NCCL_NET=Libfabric ..."},
         "EfaRequiredNcclRefused"),
        ({"transport": "socket", "healthy": False, "message": "requireEFA (caught by the probe): NCCL is not ..."},
         "EfaRequiredProbeFailed"),
    ],
    ids=["efa", "intra-node", "mixed", "require-efa-nccl", "require-efa-probe"],
)
def test_network_condition_reason(network: dict[str, Any], reason: str) -> None:
    st = derive(Observed(rayjob=rayjob("Running", "RUNNING")), prev={"network": network})
    assert cond(st, "NetworkHealthy")["reason"] == reason


def test_suspend() -> None:
    assert derive(Observed(), suspend=True)["phase"] == "Suspended"
    assert derive(Observed(rayjob=rayjob("Suspending")), suspend=True)["message"] == "suspending"


# ---------------------------------------------------------------------------------------- preflight


def node(name: str, itype: str = "g6.12xlarge", gpus: int = 4, efa: int = 1, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": itype}},
        "status": {
            "allocatable": {"cpu": "47810m", "memory": "186Gi", "nvidia.com/gpu": str(gpus),
                            "vpc.amazonaws.com/efa": str(efa), "hugepages-2Mi": "10Gi"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


SPEC = parse_job(JobDoc().obj()).spec


@pytest.mark.parametrize(
    ("nodes", "fits", "reason"),
    [
        ([node("a"), node("b")], True, "NodesAvailable"),
        ([node("a")], False, "InsufficientNodes"),
        ([node("a"), node("b", ready=False)], False, "InsufficientNodes"),
        ([node("a"), node("b", efa=0)], False, "InsufficientNodes"),
        ([node("a", itype="p5.48xlarge"), node("b", itype="p5.48xlarge")], False, "NoMatchingNodes"),
        ([], False, "NoMatchingNodes"),
    ],
    ids=["two-fit", "one-node", "not-ready", "no-efa", "wrong-type", "none"],
)
def test_preflight(nodes: list[dict[str, Any]], fits: bool, reason: str) -> None:
    cap = check_capacity(SPEC, nodes)
    assert (cap.fits, cap.reason) == (fits, reason), cap.message


def test_preflight_message_names_the_shortage() -> None:
    cap = check_capacity(SPEC, [node("a"), node("b", efa=0)])
    assert "vpc.amazonaws.com/efa on 1" in cap.message
    assert "2 worker pod(s) need 2 g6.12xlarge node(s)" in cap.message


# ----------------------------------------------------------------------------------------- children


def test_plan_children_is_idempotent_and_detects_foreign_objects() -> None:
    desired = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": "1"}}]
    (first,) = plan_children(desired, {"c": None}, "uid-1")
    assert first.apply
    applied = with_hash(desired[0])
    applied["metadata"]["ownerReferences"] = [{"uid": "uid-1"}]
    (again,) = plan_children(desired, {"c": applied}, "uid-1")
    assert not again.apply and again.blocked is None
    changed = [{**desired[0], "data": {"a": "2"}}]
    (third,) = plan_children(changed, {"c": applied}, "uid-1")
    assert third.apply
    foreign = dict(applied, metadata={**applied["metadata"], "ownerReferences": [{"uid": "other"}]})
    (fourth,) = plan_children(desired, {"c": foreign}, "uid-1")
    assert fourth.blocked and fourth.blocked[0] == "ChildConflict" and not fourth.apply


def test_a_child_changed_outside_the_operator_is_reapplied() -> None:
    desired = [{"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"},
                "spec": {"suspend": False, "backoffLimit": 0, "entrypoint": "python3 -m finetune_training",
                         "rayClusterSpec": {"headGroupSpec": {"template": {"spec": {"containers": []}}}}}}]
    live = with_hash(desired[0])
    live["metadata"]["ownerReferences"] = [{"uid": "uid-1"}]
    # What the API server and KubeRay add (defaults, a normalised nested spec) is no drift.
    live["spec"] = {**live["spec"], "submissionMode": "K8sJobMode", "rayClusterSpec": {"normalised": True}}
    (same,) = plan_children(desired, {"j": live}, "uid-1")
    assert not same.apply and same.drift == ()
    # KubeRay's own updates (its finalizer) serialise Go structs: `suspend: false`, `backoffLimit: 0` vanish.
    omitted = {**live, "spec": {k: v for k, v in live["spec"].items() if k not in ("suspend", "backoffLimit")}}
    (still,) = plan_children(desired, {"j": omitted}, "uid-1")
    assert not still.apply and still.drift == ()
    edited = {**live, "spec": {**live["spec"], "suspend": True, "backoffLimit": 5}}  # kubectl edit rayjob j
    (action,) = plan_children(desired, {"j": edited}, "uid-1")
    assert action.apply and action.drift == ("spec.suspend", "spec.backoffLimit")
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"job.yaml": "a"}}
    live_cm = {**with_hash(cm), "data": {"job.yaml": "edited"}}
    live_cm["metadata"]["ownerReferences"] = [{"uid": "uid-1"}]
    (cm_action,) = plan_children([cm], {"c": live_cm}, "uid-1")
    assert cm_action.apply and cm_action.drift == ("data",)


def test_a_previous_incarnations_child_blocks_until_it_is_gone() -> None:
    owner = {"apiVersion": "finetune.dev/v1alpha1", "kind": "FinetuneJob", "name": "j", "uid": "new"}
    desired = [{"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j", "ownerReferences": [owner]}}]
    old = with_hash(desired[0])
    old["metadata"].update(ownerReferences=[{**owner, "uid": "old"}], deletionTimestamp=NOW)
    (action,) = plan_children(desired, {"j": old}, "new")
    assert not action.apply and action.blocked is not None
    reason, message = action.blocked
    assert reason == "WaitingForPreviousChild"
    assert "previous FinetuneJob named j (uid old)" in message and "being deleted" in message
    (action,) = plan_children(desired, {"j": None}, "new")
    assert action.apply and action.blocked is None


def _rayjob(uid: str | None, changed: bool = False) -> dict[str, Any] | None:
    if uid is None:
        return None
    obj = with_hash({"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"},
                     "spec": {"entrypoint": "old" if changed else "train"}})
    obj["metadata"].update(uid=uid, ownerReferences=[{"uid": "owner"}])
    return obj


@pytest.mark.parametrize(
    ("observed_uid", "changed", "apply", "lost", "pinned"),
    [
        (None, False, False, True, None),  # recorded, then deleted (KubeRay, a user): never re-created
        ("other", False, False, True, None),  # someone else's RayJob of that name now: not ours either
        ("rec", False, False, False, "rec"),  # ours, unchanged: nothing to do
        ("rec", True, True, False, "rec"),  # ours, changed: updated with the UID in the body, so a
        # RayJob deleted after it was observed makes the apply fail (409), never creates another
    ],
    ids=["gone", "replaced", "unchanged", "update-pinned"],
)
def test_a_recorded_rayjob_is_never_created_again(observed_uid: str | None, changed: bool, apply: bool,
                                                  lost: bool, pinned: str | None) -> None:
    desired = [{"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"}, "spec": {"entrypoint": "train"}}]
    (action,) = plan_children(desired, {"j": _rayjob(observed_uid, changed)}, "owner", {"j": "rec"})
    assert (action.apply, action.lost, action.obj["metadata"].get("uid")) == (apply, lost, pinned)
    assert action.obj["metadata"]["annotations"] == with_hash(desired[0])["metadata"]["annotations"]


def test_blocked_is_not_terminal_and_clears() -> None:
    st = derive(Observed(blocked=("WaitingForPreviousChild", "RayJob j still belongs to a previous FinetuneJob")))
    assert st["phase"] == "Pending" and cond(st, "Blocked")["status"] == "True"
    assert not any(c["type"] == "Failed" for c in st["conditions"])
    later = derive(Observed(rayjob=rayjob("Initializing")), prev=st)
    assert later["phase"] == "Provisioning" and not any(c["type"] == "Blocked" for c in later["conditions"])


LOST_PREV = {"phase": "Running", "rayJobUID": "u1", "step": "40/50",
             "conditions": [{"type": "Running", "status": "True", "reason": "RayJobRunning", "message": "x",
                             "lastTransitionTime": NOW}]}


def test_a_lost_rayjob_is_decided_from_the_trainings_final_report() -> None:
    done = derive(Observed(rayjob_lost=True), prev={**LOST_PREV, "runtimePhase": "Done", "step": "50/50"})
    assert done["phase"] == "Succeeded"
    c = cond(done, "Complete")
    assert (c["status"], c["reason"]) == ("True", "TrainingReportedDone") and "50/50" in c["message"]
    assert done["rayJobUID"] == "u1" and done["completionTime"] == NOW
    failed = derive(Observed(rayjob_lost=True), prev={**LOST_PREV, "runtimePhase": "Failed"})
    assert failed["phase"] == "Failed" and cond(failed, "Failed")["reason"] == "TrainingReportedFailed"
    unknown = derive(Observed(rayjob_lost=True), prev=LOST_PREV)
    assert unknown["phase"] == "Failed"
    c = cond(unknown, "Failed")
    assert c["reason"] == "RayJobDeleted"
    assert "last known phase Running, step 40/50" in c["message"] and "re-create the FinetuneJob" in c["message"]
    assert cond(unknown, "Running")["status"] == "False"


def test_replica_failure_on_the_raycluster_is_surfaced() -> None:
    rc = {"metadata": {"name": "j-abcde"}, "status": {"conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreateWorkerPod",
         "message": 'pods "w" is forbidden: violates PodSecurity "baseline:latest": non-default capabilities (IPC_LOCK)'}]}}
    st = derive(Observed(rayjob=rayjob("Initializing", rayClusterName="j-abcde"), raycluster=rc))
    assert st["phase"] == "Provisioning"
    c = cond(st, "PodsHealthy")
    assert (c["status"], c["reason"]) == ("False", "FailedCreateWorkerPod") and "IPC_LOCK" in c["message"]
    assert "KubeRay cannot create the Ray pods" in st["message"] and "IPC_LOCK" in st["message"]


def test_provisioning_message_uses_the_raycluster() -> None:
    rc = {"metadata": {"name": "j-abcde"}, "status": {"readyWorkerReplicas": 1, "desiredWorkerReplicas": 2}}
    st = derive(Observed(rayjob=rayjob("Initializing", rayClusterName="j-abcde"), raycluster=rc))
    assert st["phase"] == "Provisioning"
    assert st["message"] == "waiting for the Ray cluster (1/2 workers ready)"
    assert st["rayClusterName"] == "j-abcde"


# ------------------------------------------------------------------------------------ hang detection

RUNNING_PREV = {"phase": "Running", "conditions": [{"type": "Running", "status": "True", "reason": "RayJobRunning",
                                                    "message": "x", "lastTransitionTime": "2026-12-02T09:00:00Z"}]}


def with_report(at: str, **training: Any) -> dict[str, Any]:
    return {**RUNNING_PREV, "training": {"lastReportTime": at, **training}}


@pytest.mark.parametrize(
    ("prev", "timeout", "now", "stalled"),
    [
        (with_report("2026-12-02T09:59:55Z", step=5), 8, NOW, None),
        (with_report("2026-12-02T09:59:50Z", step=5, totalSteps=10), 8, NOW, "NoProgress"),
        # default window: 10 x observed step time (eta 100 s for 10 steps = 10 s/step -> 100 s), floor 900 s
        (with_report("2026-12-02T09:50:00Z", step=0, totalSteps=10, etaSeconds=100), None, NOW, None),
        (with_report("2026-12-02T09:44:00Z", step=0, totalSteps=10, etaSeconds=100), None, NOW, "NoProgress"),
        # slow steps stretch the window past the floor: 600 s/step -> 6000 s
        (with_report("2026-12-02T09:00:00Z", step=0, totalSteps=10, etaSeconds=6000), None, NOW, None),
        # no report ever: measured from when the Ray job started running
        (RUNNING_PREV, None, NOW, "NoProgress"),
        (RUNNING_PREV, None, "2026-12-02T09:10:00Z", None),
        ({**RUNNING_PREV, "training": {"lastReportTime": NOW}, "network": {
            "healthy": False, "message": "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(...)"}},
         None, NOW, "NcclWatchdogTimeout"),
    ],
    ids=["recent", "past-timeout", "default-within", "default-past-floor", "slow-steps", "never-reported",
         "never-reported-young", "nccl-watchdog"],
)
def test_stalled(prev: dict[str, Any], timeout: int | None, now: str, stalled: str | None) -> None:
    st = derive_status(generation=1, suspend=False, names=NAMES, prev=prev, observed=Observed(rayjob=rayjob("Running", "RUNNING")),
                       now=now, stall_timeout_seconds=timeout)
    assert st["phase"] == "Running"
    c = next((c for c in st["conditions"] if c["type"] == "Stalled"), None)
    if stalled is None:
        assert c is None
        assert seconds_until_stall(st, now, timeout) is not None
    else:
        assert c is not None and (c["status"], c["reason"]) == ("True", stalled)
        assert st["message"].startswith("stalled: ")


@pytest.mark.parametrize(
    ("watching_since", "held_report", "now", "stalled"),
    [
        # An operator down from 09:59:00 to 09:59:58: the stored report (09:59:00) is 60 s old, the window
        # 8 s, yet this process has watched for 2 s only: not stalled (before: Stalled at its first look).
        ("2026-12-02T09:59:58Z", None, NOW, None),
        # ... and after one full window of its own without a report: stalled.
        ("2026-12-02T09:59:50Z", None, NOW, "watching"),
        # A report held unwritten (its status write refused) is a report: not stalled.
        (None, "2026-12-02T09:59:57Z", NOW, None),
        ("2026-12-02T09:00:00Z", "2026-12-02T09:59:57Z", NOW, None),
        # An old held report stalls as a stored one would.
        ("2026-12-02T09:00:00Z", "2026-12-02T09:59:30Z", NOW, "report"),
    ],
    ids=["outage-young-watch", "outage-full-window", "held-report", "held-report-long-watch", "held-report-old"],
)
def test_silence_counts_only_while_this_process_watches(watching_since: str | None, held_report: str | None,
                                                        now: str, stalled: str | None) -> None:
    prev = with_report("2026-12-02T09:59:00Z", step=5, totalSteps=10)
    observed = Observed(rayjob=rayjob("Running", "RUNNING"), watching_since=watching_since, held_report=held_report)
    st = derive_status(generation=1, suspend=False, names=NAMES, prev=prev, observed=observed, now=now,
                       stall_timeout_seconds=8)
    c = next((c for c in st["conditions"] if c["type"] == "Stalled"), None)
    if stalled is None:
        assert c is None, c
        left = seconds_until_stall(st, now, 8, watching_since, held_report)
        assert left is not None and 0 < left <= 9
    else:
        assert c is not None and c["reason"] == "NoProgress"
        if stalled == "watching":
            assert f"since this operator began watching at {watching_since}" in c["message"]
            assert "the last stored report is from 2026-12-02T09:59:00Z" in c["message"]
        else:
            assert f"no progress report since {held_report} at step 5/10" in c["message"]


def test_stalled_clears_and_leaves_with_running() -> None:
    prev = with_report("2026-12-02T09:59:00Z", step=5, totalSteps=10)
    hung = derive_status(generation=1, suspend=False, names=NAMES, prev=prev, observed=Observed(rayjob=rayjob("Running")),
                         now=NOW, stall_timeout_seconds=8)
    assert "at step 5/10" in cond(hung, "Stalled")["message"]
    again = {**hung, "training": {"lastReportTime": NOW, "step": 6, "totalSteps": 10}}
    ok = derive_status(generation=1, suspend=False, names=NAMES, prev=again, observed=Observed(rayjob=rayjob("Running")),
                       now=NOW, stall_timeout_seconds=8)
    assert (cond(ok, "Stalled")["status"], cond(ok, "Stalled")["reason"]) == ("False", "Progressing")
    done = derive(Observed(rayjob=rayjob("Complete", "SUCCEEDED")), prev=hung)
    assert not any(c["type"] == "Stalled" for c in done["conditions"])
    failed = fail_stalled(hung, LATER)
    assert failed["phase"] == "Failed" and cond(failed, "Failed")["reason"] == "Stalled"
    assert cond(failed, "Running")["status"] == "False" and not any(c["type"] == "Stalled" for c in failed["conditions"])


def test_a_stall_restart_is_counted_pending_then_a_new_window() -> None:
    """spec.stallPolicy.action Restart, the pure part (the reconciler's suspend/resume is in
    tests/integration/test_lifecycle.py): counted, pending and Provisioning while the cluster is replaced,
    then the window restarts from the new Running transition, not from the last (old) report."""
    prev = with_report("2026-12-02T09:59:00Z", step=5, totalSteps=10)
    hung = derive_status(generation=1, suspend=False, names=NAMES, prev=prev, observed=Observed(rayjob=rayjob("Running")),
                         now=NOW, stall_timeout_seconds=8)
    r1 = restart_stalled(hung, NOW, 3)
    assert (r1["phase"], r1["stallRestarts"], r1["stallRestartPending"]) == ("Provisioning", 1, True)
    assert cond(r1, "Running")["reason"] == "StallRestart" and "restart 1 of 3" in cond(r1, "Running")["message"]
    assert not any(c["type"] == "Stalled" for c in r1["conditions"])
    # While pending, whatever KubeRay says (Suspending, Suspended), the job is restarting, not Suspended.
    for deploy in ("Running", "Suspending", "Suspended"):
        mid = derive(Observed(rayjob={**rayjob(deploy), "spec": {"suspend": True}}), prev=r1)
        assert mid["phase"] == "Provisioning" and mid["message"].startswith("restarting after a stall (restart 1)"), mid
        assert mid["stallRestarts"] == 1 and mid["stallRestartPending"] is True
    # Resumed (pending mark gone, RayJob suspend false): KubeRay's Suspended -> New is not "Suspended".
    resumed = {k: v for k, v in r1.items() if k != "stallRestartPending"}
    assert derive(Observed(rayjob={**rayjob("Suspended"), "spec": {"suspend": False}}), prev=resumed)["phase"] == "Provisioning"
    assert derive(Observed(rayjob={**rayjob("Suspended"), "spec": {"suspend": True}}), prev=resumed)["phase"] == "Suspended"
    # Running again at LATER: the old report (09:59) is long past the window, the new transition is not.
    running = derive(Observed(rayjob=rayjob("Running")), prev=resumed, now=LATER)
    assert running["phase"] == "Running" and running["stallRestarts"] == 1
    assert not any(c["type"] == "Stalled" for c in running["conditions"])
    assert seconds_until_stall(running, LATER, 8) == pytest.approx(9.0)
    later = derive_status(generation=1, suspend=False, names=NAMES, prev=running,
                          observed=Observed(rayjob=rayjob("Running")), now="2026-12-02T10:05:30Z", stall_timeout_seconds=8)
    assert cond(later, "Stalled")["status"] == "True"
    assert cond(later, "Stalled")["message"].startswith("running since 2026-12-02T10:05:00Z without any progress report")
    r2 = restart_stalled(later, "2026-12-02T10:05:30Z", 3)
    assert r2["stallRestarts"] == 2
    failed = fail_stalled(later, "2026-12-02T10:05:30Z", "failed after 1 restart(s) by spec.stallPolicy.action Restart")
    assert failed["phase"] == "Failed" and "after 1 restart(s)" in cond(failed, "Failed")["message"]


def test_only_the_current_rayjobs_pods_are_observed() -> None:
    rj = {"metadata": {"name": "j", "creationTimestamp": "2026-12-02T10:00:00Z"}, "status": {"rayClusterName": "j-new"}}

    def p(name: str, created: str, cluster: str | None) -> dict[str, Any]:
        labels = {"ray.io/cluster": cluster} if cluster else {}
        return {"metadata": {"name": name, "creationTimestamp": created, "labels": labels}}

    pods = [p("new-worker", "2026-12-02T10:01:00Z", "j-new"), p("old-worker", "2026-12-02T09:00:00Z", "j-old"),
            p("new-submitter", "2026-12-02T10:02:00Z", None), p("old-submitter", "2026-12-02T09:01:00Z", None)]
    assert [x["metadata"]["name"] for x in pods_of(pods, rj)] == ["new-worker", "new-submitter"]


def test_starting_until_ray_runs_the_job_or_the_training_reports_from_this_cluster() -> None:
    cluster = {"metadata": {"name": "j-abcde", "creationTimestamp": "2026-12-02T09:58:00Z"}}
    starting = derive(Observed(rayjob=rayjob("Running", "PENDING"), raycluster=cluster))
    assert starting["phase"] == "Provisioning"
    assert cond(starting, "Running")["reason"] == "Starting" and "PENDING" in starting["message"]
    # A report from before this Ray cluster existed (an earlier attempt, before a suspend): still starting.
    old = {"training": {"step": 30, "lastReportTime": "2026-12-02T09:50:00Z"}}
    assert derive(Observed(rayjob=rayjob("Running", "PENDING"), raycluster=cluster), prev=old)["phase"] == "Provisioning"
    # A report from this cluster: the training runs even if KubeRay has not seen the job RUNNING yet.
    new = {"training": {"step": 1, "lastReportTime": "2026-12-02T09:59:00Z"}}
    running = derive(Observed(rayjob=rayjob("Running", "PENDING"), raycluster=cluster), prev=new)
    assert running["phase"] == "Running" and cond(running, "Running")["status"] == "True"
    ray_says = derive(Observed(rayjob=rayjob("Running", "RUNNING"), raycluster=cluster), prev=starting, now=LATER)
    assert ray_says["phase"] == "Running"
    # The stall window starts when the training started, not when KubeRay created its submitter.
    assert cond(ray_says, "Running")["lastTransitionTime"] == LATER
    # An image that cannot be pulled says so instead of "starting".
    broken = derive(Observed(rayjob=rayjob("Running", ""), raycluster=cluster, pods=[pod("j-head", "head", waiting="ErrImagePull")]))
    assert broken["phase"] == "Provisioning" and "ErrImagePull" in broken["message"]


def creating(name: str, scheduled_at: str) -> dict[str, Any]:
    """A pod scheduled at `scheduled_at` whose container the kubelet has not created yet."""
    return {"metadata": {"name": name, "labels": {"ray.io/node-type": "worker"}, "creationTimestamp": scheduled_at},
            "status": {"conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled_at}],
                       "containerStatuses": [{"name": "ray-worker", "state": {"waiting": {"reason": "ContainerCreating"}}}]}}


MOUNT = ("FailedMount", 'MountVolume.SetUp failed for volume "runtime" : configmap "finetune-runtime-abc" not found')
STUCK = [
    # (id, scheduled at, events, PodsHealthy status, reason, in the message)
    ("slow-not-stuck", "2026-12-02T09:58:00Z", {}, "True", "ContainersOK", "no image pull"),
    ("stuck-failed-mount", "2026-12-02T09:55:00Z", {"w-0": MOUNT}, "False", "FailedMount", 'configmap "finetune-runtime-abc" not found'),
    ("stuck-other-warning", "2026-12-02T09:55:00Z", {"w-0": ("FailedCreatePodSandBox", "cni timeout")}, "False",
     "ContainerCreating", "FailedCreatePodSandBox: cni timeout"),
    ("stuck-no-events", "2026-12-02T09:55:00Z", {}, "False", "ContainerCreating", "kubectl describe pod"),
]


@pytest.mark.parametrize(("scheduled", "events", "ok", "reason", "text"), [s[1:] for s in STUCK], ids=[s[0] for s in STUCK])
def test_a_pod_stuck_in_container_creating_is_surfaced_with_its_own_message(
        scheduled: str, events: dict[str, tuple[str, str]], ok: str, reason: str, text: str) -> None:
    """A deleted runtime ConfigMap kept pods in FailedMount, shown only as "waiting for the Ray cluster (0/2)"."""
    st = derive(Observed(rayjob=rayjob("Initializing"), pods=[creating("w-0", scheduled)], pod_events=events))
    c = cond(st, "PodsHealthy")
    assert (c["status"], c["reason"]) == (ok, reason) and text in c["message"], c
    if ok == "False":
        assert st["phase"] == "Provisioning" and text in st["message"] and "300s after scheduling" in st["message"]


def test_stuck_creating_ages() -> None:
    from finetune_operator.controller.status import stuck_creating

    unscheduled = {"metadata": {"name": "p", "creationTimestamp": "2026-12-02T09:59:00Z"},
                   "status": {"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    running = {"metadata": {"name": "r"}, "status": {"containerStatuses": [{"state": {"running": {}}}]}}
    assert stuck_creating([creating("w", "2026-12-02T09:55:00Z"), unscheduled, running], NOW) == {"w": 300.0, "p": 60.0}


class EventsKube:
    """The API server's Events of each pod, as `Kube.list_events` returns them (oldest first)."""

    def __init__(self, events: dict[str, list[dict[str, Any]]]) -> None:
        self.events = events
        self.asked: list[str] = []

    def list_events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        self.asked.append(name)
        return self.events.get(name, [])


def test_the_reconciler_reads_the_events_of_stuck_pods_only_and_looks_again_when_a_pod_would_be_stuck() -> None:
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.config import RenderConfig

    warning = {"type": "Warning", "reason": MOUNT[0], "message": MOUNT[1]}
    kube = EventsKube({"w-0": [{"type": "Normal", "reason": "Scheduled", "message": "ok"}, warning]})
    looks: list[float] = []
    rec = Reconciler(kube, RenderConfig(), {}, clock=lambda: NOW,  # type: ignore[arg-type]
                     requeue_after=lambda ns, name, delay: looks.append(delay))
    pods = [creating("w-0", "2026-12-02T09:55:00Z"), creating("w-1", "2026-12-02T09:59:00Z"),
            creating("w-2", "2026-12-02T09:59:30Z")]
    assert rec._stuck_pod_events("ns", "j", pods) == {"w-0": MOUNT}
    assert kube.asked == ["w-0"]  # w-1 and w-2 are not stuck yet: no Events read for them
    assert looks == [121.0]  # one look, when w-1 would be stuck (60 s in: 180 - 60 + 1)
    rec._stuck_pod_events("ns", "j", pods)
    assert looks == [121.0, 121.0]  # asked again: the work queue keeps one timer per job (test_workqueue.py)


OWES = [
    # (id, RayJob spec.suspend, jobDeploymentStatus, what KubeRay owes it, or None)
    ("no-status", False, "", "no status yet"),
    ("initializing", False, "Initializing", None),
    ("running", False, "Running", None),
    ("suspend-not-acted-on", True, "Running", "spec.suspend: true"),
    ("suspending", True, "Suspending", None),
    ("suspended", True, "Suspended", None),
    ("resume-not-acted-on", False, "Suspended", "spec.suspend: false"),
    ("complete-suspended-later", True, "Complete", None),
]


@pytest.mark.parametrize(("suspend", "deploy", "owed"), [o[1:] for o in OWES], ids=[o[0] for o in OWES])
def test_what_kuberay_owes_a_rayjob(suspend: bool, deploy: str, owed: str | None) -> None:
    from finetune_operator.controller.status import kuberay_owes

    rj = {**rayjob(deploy), "spec": {"suspend": suspend}}
    got = kuberay_owes(rj)
    assert (got is None) if owed is None else (got is not None and owed in got), got


def test_kuberay_not_reconciling_is_reported_after_the_timeout_and_cleared_once_it_acts() -> None:
    """A stopped KubeRay left jobs Provisioning with no signal: its RayJob never got a status."""
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.config import RenderConfig

    looks: list[float] = []
    clock = [NOW]
    rec = Reconciler(None, RenderConfig(), {}, clock=lambda: clock[0],  # type: ignore[arg-type]
                     requeue_after=lambda ns, name, delay: looks.append(delay))
    rec.kuberay_timeout = 120
    fresh = {"metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1}, "spec": {"suspend": False}}
    assert rec._kuberay_trouble("ns", "j", fresh, NOW) is None
    assert looks == [121.0]  # a look when it would be overdue
    clock[0] = "2026-12-02T10:02:00Z"
    trouble = rec._kuberay_trouble("ns", "j", fresh, clock[0])
    assert trouble is not None and trouble[0] == "KubeRayNotReconciling"
    assert "KubeRay has given it no status yet on RayJob ns/j for 120 s" in trouble[1] and "kuberay-operator" in trouble[1]
    st = derive(Observed(rayjob=fresh, kuberay=trouble), now=clock[0])
    c = cond(st, "KubeRayReconciling")
    assert (c["status"], c["reason"], st["phase"]) == ("False", "KubeRayNotReconciling", "Provisioning")
    # KubeRay is back: the RayJob has a status, the condition goes.
    acted = {**fresh, "status": {"jobDeploymentStatus": "Initializing"}}
    assert rec._kuberay_trouble("ns", "j", acted, clock[0]) is None
    assert not any(c["type"] == "KubeRayReconciling" for c in derive(Observed(rayjob=acted), prev=st)["conditions"])
    # A spec change it does not act on counts from when it was seen.
    suspended = {**acted, "metadata": {**fresh["metadata"], "generation": 2}, "spec": {"suspend": True}}
    assert rec._kuberay_trouble("ns", "j", suspended, clock[0]) is None
    trouble = rec._kuberay_trouble("ns", "j", suspended, "2026-12-02T10:04:00Z")
    assert trouble is not None and "has not acted on spec.suspend: true" in trouble[1]
    # A CRD too old for the render is said on every job, whatever its RayJob shows.
    rec.kuberay_incompatible = "the installed KubeRay is older than v1.5.0"
    assert rec._kuberay_trouble("ns", "j", acted, clock[0]) == ("KubeRayTooOld", "the installed KubeRay is older than v1.5.0")
