"""Every phase transition of a FinetuneJob, its trigger and the condition that says why. Pure: `now` is passed in.

`decide` is the one entry point: (previous status, observations, stall policy, now) -> `Decision`, the next
status and what to do to the RayJob. The reconciler (reconcile.py) observes, calls `decide`, patches the
status if it changed, and carries out the decision's RayJob action; it decides nothing itself. The
observations and the conditions that only report (network, capacity, scheduling, pod health) are in
status.py.

Rows 1-17 (with 23 and 24, listed where they are tried) are tried in this order and the first that matches
wins ("any": any phase that is not final; "unjudged": no RayJob recorded in status.rayJobUID and not final, see
`judged`); rows 18-21 then act on that outcome, and row 22 overrides every other row.

| #  | from                  | trigger                                                         | to           | condition=status (reason)                                            | RayJob action |
| -- | --------------------- | --------------------------------------------------------------- | ------------ | -------------------------------------------------------------------- | ------------- |
| 1  | unjudged              | spec invalid (schema, instance-type fit, allow-list)            | Failed       | SpecValid=False, Failed=True (InvalidSpec)                           |               |
| 23 | unjudged              | the instance type has no figures (table, ConfigMaps, nodes)     | Pending      | InstanceTypeKnown=False (UnknownInstanceType); True (Known) after    |               |
| 24 | judged (RayJob recorded) | allow-list tightened, figures gone, spec no longer parses    | as rows 2-17 | none from the judgement: it is never made again                      |               |
| 2  | any                   | a child's name is taken, or the API server refused a child      | Pending      | Blocked=True (WaitingForPreviousChild, ChildConflict, ChildRejected) |               |
| 3  | any                   | recorded RayJob gone, its final state seen by the watch         | as 9, 10     | as 9, 10 (from that final state)                                     |               |
| 4  | any                   | recorded RayJob gone, the training had reported Done            | Succeeded    | Complete=True (TrainingReportedDone)                                 |               |
| 5  | any                   | recorded RayJob gone, the training had reported Failed          | Failed       | Failed=True (TrainingReportedFailed)                                 |               |
| 6  | any                   | recorded RayJob gone, no final report                           | Failed       | Failed=True (RayJobDeleted)                                          |               |
| 7  | (none), Pending       | no RayJob, spec.suspend                                         | Suspended    | Suspended=True (Suspended)                                           |               |
| 8  | (none), Pending       | no RayJob yet                                                   | Pending      | (none: it is about to be created)                                    |               |
| 9  | any                   | RayJob Complete, job SUCCEEDED                                  | Succeeded    | Complete=True (Succeeded), Running=False (Finished)                  |               |
| 10 | any                   | RayJob Failed, ValidationFailed, or Complete without SUCCEEDED  | Failed       | Failed=True (`rayjob_failure`: KubeRay's reason mapped, BackoffLimitExceeded, Job<status>) |               |
| 11 | Provisioning          | a stall restart is pending (row 19), spec.suspend false         | Provisioning | Running=False (StallRestart)                                         |               |
| 12 | any                   | spec.suspend, or RayJob Suspending, or Suspended and held so    | Suspended    | Suspended=True (Suspending, Suspended), Running=False (Suspended)    |               |
| 13 | any                   | RayJob Running, the training has not started                    | Provisioning | Running=False (Starting)                                             |               |
| 14 | any                   | RayJob Running, the training started                            | Running      | Running=True (RayJobRunning)                                         |               |
| 15 | Running               | no progress report within the stall window, or an NCCL watchdog | Running      | Stalled=True (NoProgress, NcclWatchdogTimeout)                       |               |
| 16 | Running (stalled)     | progress reports again                                          | Running      | Stalled=False (Progressing)                                          |               |
| 17 | any                   | RayJob New, Initializing, Waiting, Retrying                     | Provisioning | Running=False (Provisioning)                                         |               |
| 18 | Running (stalled)     | stallPolicy Fail                                                | Failed       | Failed=True (Stalled), Running=False (Finished)                      | release       |
| 19 | Running (stalled)     | stallPolicy Restart, fewer than maxRestarts so far              | Provisioning | Running=False (StallRestart); stallRestarts+1, stallRestartPending   | restart       |
| 20 | Running (stalled)     | stallPolicy Restart, maxRestarts reached                        | Failed       | Failed=True (Stalled: "failed after N restart(s)")                   | release       |
| 21 | Provisioning (row 11) | RayJob Suspended (KubeRay deleted the Ray cluster)              | Provisioning | Running=False (StallRestart); stallRestartPending cleared            | resume        |
| 22 | Succeeded, Failed     | anything                                                        | unchanged    | unchanged (a verdict is final; only observedGeneration follows)      | release if Failed (Stalled, DeadlineExceeded) and the RayJob runs unsuspended |
| 25 | any                   | spec.activeDeadlineSeconds passed since status.startTime        | Failed       | Failed=True (DeadlineExceeded), Running=False (Finished)             | release       |

Rows 1-17, 23 and 24 are `derive_status` (what was observed); 18-22 and 25 are `decide` on top of it (the stall
policy, the restart's resume, final verdicts, the job's deadline). Row 10's reasons follow KubeRay's
(`_KUBERAY_FAILURES`: AppFailed, SubmissionFailed, DeadlineExceeded, PreRunningDeadlineExceeded, ValidationFailed,
and RayJobOutcomeUnknown for JobDeploymentStatusTransitionGracePeriodExceeded); BackoffLimitExceeded when the
failure came after retries (KubeRay always sets a reason, so it is the last attempt's reason that the message
names). Row 22 releases again while a job failed by the operator (Stalled, row 25's DeadlineExceeded) still has an
unsuspended RayJob. stallPolicy
Report stops at row 15. Row 21 also clears the mark without an action when the RayJob is already resumed
(the resume went out, the status write after it did not). A phase left behind takes its conditions with
it (Stalled leaves with Running, Blocked with Pending, ...). A reconcile that raises changes no phase: it
records Reconciled=False (reconcile.py).

Row 25: status.startTime is the job's first start (KubeRay's start of its first attempt, kept: KubeRay sets its
own anew on every retry and resume and counts activeDeadlineSeconds per attempt), so the deadline holds for
the job across retries, stall restarts and suspensions (the time suspended counts). It is tried after row 22
and before rows 18-21 (a job past its deadline is not restarted); the cluster is released as in row 18.

Rows 1, 23 and 24: a job is judged (its spec, its instance-type figures and the allow-list) only while it has no
RayJob; the figures it was judged against are recorded in status.instance and every later render of it uses
those. Once judged, nothing the admin changes (the allow-list, the figures ConfigMaps, the nodes of its type)
fails it: row 24 keeps deriving its phase from its RayJob. A job of an instance type nobody has figures for
waits in row 23 (on a cluster that scales from zero there is no node to read them from) and is judged again
when the operator's view of the figures refreshes.

RayJob actions, carried out by the reconciler: `release` suspends the RayJob (KubeRay deletes the Ray
cluster, the GPUs are free), level-based: rows 18 and 20 write Failed before the suspend patch goes out, so
row 22 asks for it again at every reconcile of a job Failed as Stalled whose RayJob (not finished) is not
suspended yet, until a patch lands; `restart` suspends it too and posts a Warning Event StallRestart; `resume`
sets its suspend back to false, before the status without the pending mark is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..api.spec import StallAction, StallPolicy
from ..api.status import FinetuneJobStatus, Phase
from .status import (
    BLOCKED,
    CARRIED,
    COMPLETE,
    FAILED,
    INSTANCE_TYPE_KNOWN,
    RECONCILED,
    RUNNING,
    SPEC_VALID,
    STALLED,
    SUSPENDED,
    Conditions,
    Observed,
    PodTrouble,
    parse_time,
    report_observations,
    stall_check,
    training_started,
)

Obj = dict[str, Any]
TERMINAL = {Phase.succeeded.value, Phase.failed.value}
_FINAL_DEPLOYMENT = ("Complete", "Failed", "ValidationFailed")


class RayJobAction(str, Enum):
    """What the reconciler does to the RayJob after a decision."""

    none = "None"
    release = "Release"  # suspend it: KubeRay deletes the Ray cluster and the GPUs are free (rows 18, 20)
    restart = "Restart"  # suspend it, and resume it once the cluster is gone (row 19, then row 21)
    resume = "Resume"  # set its suspend back to false: KubeRay creates a new cluster (row 21)


@dataclass(frozen=True)
class Decision:
    status: Obj  # the next status, on the wire (camelCase): compared with the previous one, patched if changed
    action: RayJobAction = RayJobAction.none
    stalled: bool = False  # the job counts as stalled (finetune_job_stalled): row 15 and not failed for it


def judged(prev: Obj) -> bool:
    """Whether the job was judged for good (rows 1, 23, 24): it has a RayJob recorded, or a final phase. A judged job's
    spec is never checked against the allow-list or instance-type figures again."""
    return bool(prev.get("rayJobUID")) or prev.get("phase") in TERMINAL


def rayjob_held_suspended(prev: Obj, suspend: bool) -> bool:
    """While a stall restart is pending (row 19 until row 21) the RayJob is rendered suspended: an apply of the
    plain spec would resume it before KubeRay saw the suspend."""
    return bool(prev.get("stallRestartPending")) and not suspend


def decide(
    *,
    generation: int | None,
    suspend: bool,
    names: dict[str, str],
    prev: Obj,
    observed: Observed,
    now: str,
    policy: StallPolicy | None = None,
    detect_stalls: bool = True,
    deadline_seconds: int | None = None,
) -> Decision:
    """The next status and RayJob action (rows 1-22, 25). `policy` is None when the spec did not parse;
    `deadline_seconds`: spec.activeDeadlineSeconds."""
    # The previous status, typed: what it was decides rows 11, 19-22 (the wire dict is what is derived on).
    prior = FinetuneJobStatus.model_validate(prev)
    new = derive_status(generation=generation, suspend=suspend, names=names, prev=prev, observed=observed, now=now,
                        stall_timeout_seconds=policy.timeout_seconds if policy else None, detect_stalls=detect_stalls)
    if prior.phase in (Phase.succeeded, Phase.failed) and new.get("phase") not in TERMINAL:
        # Row 22: finished and cleaned up (no RayJob), or a RayJob suspended to release a failed job's cluster
        # (rows 18, 20), which would otherwise read as Suspended.
        new = {**prev, "observedGeneration": generation}
    if prior.phase == Phase.failed and _unreleased(prev, observed.rayjob):  # row 22: the release did not land
        return Decision(new, RayJobAction.release)
    if seconds_until_deadline(new, now, deadline_seconds) == 0:  # row 25
        return Decision(fail_deadline(new, now, int(deadline_seconds or 0)), RayJobAction.release)
    stalled = any(c["type"] == STALLED and c["status"] == "True" for c in new.get("conditions") or [])
    action = RayJobAction.none
    if stalled and policy is not None and policy.action == StallAction.fail:  # row 18
        new, action = fail_stalled(new, now), RayJobAction.release
    elif stalled and policy is not None and policy.action == StallAction.restart:
        if int(new.get("stallRestarts") or 0) >= policy.max_restarts:  # row 20
            why = f"failed after {policy.max_restarts} restart(s) by spec.stallPolicy.action Restart"
            new, action = fail_stalled(new, now, why), RayJobAction.release
        else:  # row 19
            new, action = restart_stalled(new, now, policy.max_restarts), RayJobAction.restart
    if prior.stall_restart_pending and new.get("stallRestartPending") and not suspend and observed.rayjob is not None:
        # Row 21: the pending mark goes once the resume is sent (by this decision's action, or an earlier one).
        rj = observed.rayjob
        deploy = (rj.get("status") or {}).get("jobDeploymentStatus")
        if deploy == "Suspended":
            new, action = _without_pending(new), RayJobAction.resume
        elif not (rj.get("spec") or {}).get("suspend") and deploy not in ("Suspending", "Suspended"):
            # Already resumed (only our resume sets the RayJob's suspend back to false while the mark is pending).
            new = _without_pending(new)
    return Decision(new, action, stalled and action != RayJobAction.release)


def _unreleased(prev: Obj, rayjob: Obj | None) -> bool:
    """A job the operator failed (a stall, rows 18, 20; its deadline, row 25) whose RayJob still holds its Ray
    cluster: not suspended, not finished."""
    failed = next((c for c in prev.get("conditions") or [] if c.get("type") == FAILED), None)
    if rayjob is None or failed is None or failed.get("reason") not in ("Stalled", "DeadlineExceeded"):
        return False
    return (not (rayjob.get("spec") or {}).get("suspend")
            and (rayjob.get("status") or {}).get("jobDeploymentStatus") not in _FINAL_DEPLOYMENT)


def _without_pending(status: Obj) -> Obj:
    return {k: v for k, v in status.items() if k != "stallRestartPending"}


def derive_status(
    *,
    generation: int | None,
    suspend: bool,
    names: dict[str, str],
    prev: Obj,
    observed: Observed,
    now: str,
    stall_timeout_seconds: int | None = None,
    detect_stalls: bool = True,
) -> Obj:
    """Rows 1-17: the status that follows from what was observed."""
    conds = Conditions(prev.get("conditions"), now, generation)
    status: Obj = {k: v for k, v in prev.items() if k in CARRIED}
    status.update(observedGeneration=generation, rayJobName=names["rayJob"])

    if observed.instance is not None and not judged(prev):
        status["instance"] = observed.instance  # fixed from here on: CARRIED once the RayJob is recorded
    if observed.spec_issues and not judged(prev):  # row 1 (row 24: a judged job's issues are not its verdict)
        text = "; ".join(str(i) for i in observed.spec_issues)
        conds.set(SPEC_VALID, False, "InvalidSpec", text)
        conds.set(FAILED, True, "InvalidSpec", text)
        return _finish(status, conds, Phase.failed, f"invalid spec: {text}")
    if observed.unknown_instance_type and not judged(prev):  # row 23
        conds.set(INSTANCE_TYPE_KNOWN, False, "UnknownInstanceType", observed.unknown_instance_type)
        conds.drop(RECONCILED, BLOCKED, RUNNING)
        return _finish(status, conds, Phase.pending, observed.unknown_instance_type[:300])
    if conds.has(INSTANCE_TYPE_KNOWN):
        source = (status.get("instance") or {}).get("source") or "the cluster"
        conds.set(INSTANCE_TYPE_KNOWN, True, "Known", f"figures from {source}")
    if not observed.spec_issues:
        conds.set(SPEC_VALID, True, "Valid", "spec is valid for the instance type")
    conds.drop(RECONCILED)  # this derivation is the outcome of a reconcile that did not fail
    if observed.blocked:  # row 2
        reason, message = observed.blocked
        conds.set(BLOCKED, True, reason, message)
        conds.drop(RUNNING)
        return _finish(status, conds, Phase.pending, message)
    conds.drop(BLOCKED)
    trouble = report_observations(conds, status.get("network") or {}, observed)

    rj = observed.rayjob
    if rj is None and observed.rayjob_lost:
        last = observed.last_rayjob_status or {}
        if last.get("jobDeploymentStatus") in _FINAL_DEPLOYMENT:  # row 3
            rj = {"status": last}
        else:  # rows 4-6
            return _lost(status, conds, prev, names, now)
    if rj is None:
        conds.drop(RUNNING)
        if suspend:  # row 7
            conds.set(SUSPENDED, True, "Suspended", "spec.suspend is true")
            return _finish(status, conds, Phase.suspended, "suspended")
        return _finish(status, conds, Phase.pending, "creating the RayJob")  # row 8
    return _from_rayjob(status, conds, rj, observed, trouble, suspend, now, stall_timeout_seconds, detect_stalls)


def _from_rayjob(status: Obj, conds: Conditions, rj: Obj, observed: Observed, trouble: PodTrouble, suspend: bool,
                 now: str, stall_timeout_seconds: int | None, detect_stalls: bool) -> Obj:
    """Rows 9-17: one case per KubeRay job deployment status (as KubeRay's rayjob_controller.go has)."""
    rs: Obj = rj.get("status") or {}
    uid = (rj.get("metadata") or {}).get("uid")
    if uid:
        status["rayJobUID"] = uid
    deploy = rs.get("jobDeploymentStatus") or ""
    job_status = rs.get("jobStatus") or ""
    for key in ("rayClusterName", "jobId", "dashboardURL", "startTime"):
        if rs.get(key) and not (key == "startTime" and status.get(key)):  # the first attempt's start is kept (row 25)
            status[key] = rs[key]
    terminal_failed = deploy in ("Failed", "ValidationFailed") or (deploy == "Complete" and job_status != "SUCCEEDED")
    failed = int(rs.get("failed") or 0)
    status["attempt"] = max(1, failed if terminal_failed and failed else failed + 1)

    if deploy == "Complete" and job_status == "SUCCEEDED":  # row 9
        status["completionTime"] = rs.get("endTime") or status.get("completionTime") or now
        conds.set(RUNNING, False, "Finished", "the Ray job finished")
        conds.set(COMPLETE, True, "Succeeded", "the Ray job succeeded")
        conds.drop(FAILED)
        return _finish(status, conds, Phase.succeeded, "fine-tuning succeeded")
    if terminal_failed:  # row 10
        status["completionTime"] = rs.get("endTime") or status.get("completionTime") or now
        reason, message = rayjob_failure(deploy, job_status, rs, str(status["rayJobName"]))
        conds.set(RUNNING, False, "Finished", "the Ray job ended")
        conds.set(FAILED, True, reason, message)
        return _finish(status, conds, Phase.failed, message)
    conds.drop(COMPLETE, FAILED)
    if not suspend and status.get("stallRestartPending"):  # row 11
        n = status.get("stallRestarts") or 1
        why = f"restarting after a stall (restart {n}): the Ray cluster is replaced, the training resumes from its last checkpoint"
        conds.set(RUNNING, False, "StallRestart", why)
        conds.drop(SUSPENDED)
        return _finish(status, conds, Phase.provisioning, why)
    # Row 12. Suspended with spec.suspend false on the RayJob: KubeRay is about to resume it (not suspended any more).
    if suspend or deploy == "Suspending" or (deploy == "Suspended" and (rj.get("spec") or {}).get("suspend", True)):
        conds.set(RUNNING, False, "Suspended", "suspended")
        conds.set(SUSPENDED, True, deploy or "Suspending", "spec.suspend is true: the Ray cluster is deleted")
        return _finish(status, conds, Phase.suspended, "suspended" if deploy == "Suspended" else "suspending")
    conds.drop(SUSPENDED)
    if deploy == "Running" and not training_started(job_status, status.get("training") or {}, observed.raycluster):
        # Row 13. KubeRay says Running as soon as its submitter Job exists; the training has not started until
        # Ray says the job runs (the driver is up) or the training reports from this Ray cluster.
        conds.drop(STALLED)
        why = (f"starting: the Ray cluster is up and the job is submitted (Ray job status {job_status or 'not known yet'});"
               " waiting for the driver and the training to start (image pulls, runtime env, ray job submit)")
        if trouble.broken:
            why = trouble.broken[0][1]
        conds.set(RUNNING, False, "Starting", why)
        return _finish(status, conds, Phase.provisioning, why)
    if deploy == "Running":  # row 14
        conds.set(RUNNING, True, "RayJobRunning", f"Ray job {rs.get('jobId') or ''} {job_status or 'submitted'}".replace("  ", " "))
        stalled = (stall_check(status, conds.items, now, stall_timeout_seconds, observed.watching_since, observed.held_report)
                   if detect_stalls else None)
        if stalled:  # row 15
            conds.set(STALLED, True, *stalled)
            return _finish(status, conds, Phase.running, f"stalled: {stalled[1]}")
        if conds.has(STALLED):  # row 16
            conds.set(STALLED, False, "Progressing", "progress reports are arriving")
        return _finish(status, conds, Phase.running, "training")
    # Row 17. New / Initializing / Waiting / Retrying: the cluster is coming up.
    conds.drop(STALLED)
    rc: Obj = (observed.raycluster or {}).get("status") or {}
    why = "waiting for the Ray cluster"
    if rc:
        why = f"waiting for the Ray cluster ({rc.get('readyWorkerReplicas') or 0}/{rc.get('desiredWorkerReplicas') or 0} workers ready)"
        if rc.get("reason"):
            why += f": {rc['reason']}"
    if deploy == "Retrying":
        why = f"retrying (attempt {status['attempt']})"
    if trouble.unschedulable:
        why = "worker pods unschedulable: " + trouble.unschedulable[0]
    elif trouble.broken:
        why = trouble.broken[0][1]
    elif trouble.replica_failure:
        why = trouble.replica_failure[1]
    elif observed.capacity is not None and not observed.capacity.fits:
        why = observed.capacity.message
    conds.set(RUNNING, False, "Provisioning", why)
    return _finish(status, conds, Phase.provisioning, why)


# KubeRay v1.6.1's JobFailedReason values (apis/ray/v1/rayjob_types.go) and where rayjob_controller.go sets
# them -> (our reason, what happened, what to do). {rj} is the RayJob's name, also its submitter Job's.
_KUBERAY_FAILURES: dict[str, tuple[str, str, str]] = {
    # The Ray job ended FAILED (the driver, i.e. the training, raised or exited non-zero), or its submitter
    # Job failed after the Ray job was seen FAILED, or the head pod was gone (sidecar mode).
    "AppFailed": ("AppFailed", "the training failed",
                  "read the driver's log (kubectl logs job/{rj}) and fix the cause, then delete and re-create the FinetuneJob"),
    # The submitter Job failed before the Ray job ran (dashboard unreachable, submitter image or resources).
    "SubmissionFailed": ("SubmissionFailed", "the training could not be submitted to the Ray cluster",
                         "read the submitter's log (kubectl logs job/{rj}) and the Ray head's events; then re-create the job"),
    # activeDeadlineSeconds passed (KubeRay never retries this one).
    "DeadlineExceeded": ("DeadlineExceeded", "spec.activeDeadlineSeconds passed",
                         "raise spec.activeDeadlineSeconds (it counts per attempt, from each start or resume) or "
                         "shorten the training; the checkpoints are kept"),
    # preRunningDeadlineSeconds passed before the Ray job ran (the operator does not set it; a webhook might).
    "PreRunningDeadlineExceeded": ("PreRunningDeadlineExceeded", "the Ray job did not start within the RayJob's "
                                   "preRunningDeadlineSeconds", "look at the Capacity and PodsHealthy conditions and "
                                   "the Ray pods' events (GPUs, image pulls), then re-create the job"),
    # The submitter finished but the Ray job never reached a final state, or it did and KubeRay's own status
    # did not follow within the grace period: the outcome is not known (the Ray head died, say).
    "JobDeploymentStatusTransitionGracePeriodExceeded": (
        "RayJobOutcomeUnknown", "KubeRay could not establish the Ray job's outcome in time",
        "the Ray head may have died or its dashboard be unreachable: read the head pod's events and log; the "
        "training resumes from its last checkpoint when the job is re-created"),
    # KubeRay's validation refused the RayJob the operator rendered (deployment status ValidationFailed).
    "ValidationFailed": ("ValidationFailed", "KubeRay rejected the RayJob the operator rendered",
                         "the operator and the installed KubeRay disagree (check their versions); report it with "
                         "kubectl get rayjob {rj} -o yaml"),
}


def rayjob_failure(deploy: str, job_status: str, rs: Obj, rayjob_name: str) -> tuple[str, str]:
    """Row 10: (reason, message) of a failed RayJob, from KubeRay's reason (_KUBERAY_FAILURES); an attempt that
    failed after retries (status.failed > 1, anything but DeadlineExceeded, which KubeRay never retries) is
    BackoffLimitExceeded, naming the last attempt's reason."""
    ray_reason = "ValidationFailed" if deploy == "ValidationFailed" else str(rs.get("reason") or "")
    ray_message = str(rs.get("message") or "").strip()
    known = _KUBERAY_FAILURES.get(ray_reason)
    if known is not None:
        reason, what, todo = known
    elif ray_reason:  # a reason of a later KubeRay: passed on as it is
        reason, what, todo = ray_reason, f"KubeRay failed the RayJob ({ray_reason})", "see kubectl describe rayjob {rj}"
    else:  # none (KubeRay before 1.1, or Complete without SUCCEEDED: the Ray job was STOPPED)
        reason = f"Job{job_status.capitalize() or 'Failed'}"
        what = f"the Ray job ended with status {job_status or 'unknown'} (RayJob {deploy})"
        todo = "see kubectl describe rayjob {rj}"
    failed = int(rs.get("failed") or 0)
    if failed > 1 and reason not in ("DeadlineExceeded", "ValidationFailed"):
        what = f"all {failed} attempts failed (spec.backoffLimit {failed - 1}); the last: {what}"
        if ray_reason:
            what += f" ({ray_reason})"
        reason = "BackoffLimitExceeded"
    message = f"{what}: {ray_message}" if ray_message else what
    return reason, f"{message}; {todo.format(rj=rayjob_name)}"[:1000]


def _lost(status: Obj, conds: Conditions, prev: Obj, names: dict[str, str], now: str) -> Obj:
    """Rows 4-6. The recorded RayJob vanished before its outcome was observed: it is never re-created (that
    would run the training again). Decided from what is known: the training runtime's own final report."""
    prior = FinetuneJobStatus.model_validate(prev)
    status["completionTime"] = status.get("completionTime") or now
    gone = (f"RayJob {names['rayJob']} was deleted before the operator saw its outcome (KubeRay's "
            f"DELETE_RAYJOB_CR_AFTER_JOB_FINISHES, a user or a cleanup, possibly while the operator was down)")
    step = prior.step
    conds.drop(SUSPENDED)
    if prior.runtime_phase == "Done":  # row 4
        conds.set(RUNNING, False, "Finished", "the training reported it finished")
        conds.set(COMPLETE, True, "TrainingReportedDone",
                  f"{gone}; the training had reported phase Done" + (f" at step {step}" if step else ""))
        conds.drop(FAILED)
        return _finish(status, conds, Phase.succeeded, "fine-tuning succeeded (reported by the training; the RayJob is gone)")
    if prior.runtime_phase == "Failed":  # row 5
        reason, why = "TrainingReportedFailed", f"{gone}; the training had reported phase Failed"
    else:  # row 6
        last = prior.phase.value if prior.phase else "unknown"
        reason = "RayJobDeleted"
        why = (f"{gone}; last known phase {last}" + (f", step {step}" if step else "") +
               "; no final report from the training. Not re-created, so the training does not run again: "
               "delete and re-create the FinetuneJob to run it again")
    conds.drop(COMPLETE)
    conds.set(RUNNING, False, "Finished", "the RayJob is gone")
    conds.set(FAILED, True, reason, why)
    return _finish(status, conds, Phase.failed, why)


def _finish(status: Obj, conds: Conditions, phase: Phase, message: str) -> Obj:
    if phase != Phase.running:
        conds.drop(STALLED)  # Stalled leaves with Running
    status["phase"] = phase.value
    status["message"] = message
    status["conditions"] = conds.listed()
    return {k: v for k, v in status.items() if v is not None}


def seconds_until_deadline(status: Obj, now: str, deadline_seconds: int | None) -> float | None:
    """Seconds until a job that is not finished passes spec.activeDeadlineSeconds counted from its first start
    (row 25; 0: passed), None if there is no deadline or the job has not started or is finished."""
    started, t_now = parse_time(status.get("startTime")), parse_time(now)
    if not deadline_seconds or started is None or t_now is None or status.get("phase") in TERMINAL:
        return None
    return max(0.0, deadline_seconds - (t_now - started).total_seconds())


def fail_deadline(status: Obj, now: str, deadline_seconds: int) -> Obj:
    """Row 25: the job ran past its deadline (over all its attempts); a pending stall restart is dropped."""
    conds = Conditions(status.get("conditions"), now, status.get("observedGeneration"))
    message = (f"activeDeadlineSeconds exceeded: {deadline_seconds}s since the job first started at "
               f"{status.get('startTime')} (attempt {status.get('attempt') or 1}); the Ray cluster is released")
    conds.set(RUNNING, False, "Finished", "failed past its deadline; the Ray cluster is released")
    conds.set(FAILED, True, "DeadlineExceeded", message)
    conds.drop(STALLED, SUSPENDED)
    return {**_without_pending(status), "phase": Phase.failed.value, "message": message, "completionTime": now,
            "conditions": conds.listed()}


def fail_stalled(status: Obj, now: str, why: str = "failed by spec.stallPolicy.action Fail") -> Obj:
    """Rows 18 and 20: the stalled running job becomes Failed (reason Stalled)."""
    stalled = next(c for c in status.get("conditions") or [] if c["type"] == STALLED)
    conds = Conditions(status.get("conditions"), now, stalled.get("observedGeneration"))
    message = f"stalled ({stalled['reason']}): {stalled['message']}; {why}"[:1000]
    conds.set(RUNNING, False, "Finished", "failed as stalled; the Ray cluster is released")
    conds.set(FAILED, True, "Stalled", message)
    conds.drop(STALLED)
    return {**status, "phase": Phase.failed.value, "message": message, "completionTime": now,
            "conditions": conds.listed()}


def restart_stalled(status: Obj, now: str, max_restarts: int) -> Obj:
    """Row 19: count the restart and mark it pending (the RayJob is suspended now, and resumed by row 21 once
    KubeRay has deleted the Ray cluster)."""
    stalled = next(c for c in status.get("conditions") or [] if c["type"] == STALLED)
    conds = Conditions(status.get("conditions"), now, stalled.get("observedGeneration"))
    n = int(status.get("stallRestarts") or 0) + 1
    message = (f"stalled ({stalled['reason']}): {stalled['message']}; restart {n} of {max_restarts} by "
               "spec.stallPolicy.action Restart: the Ray cluster is replaced, the training resumes from its last checkpoint")[:1000]
    conds.set(RUNNING, False, "StallRestart", message)
    conds.drop(STALLED)
    return {**status, "phase": Phase.provisioning.value, "message": message[:300], "stallRestarts": n,
            "stallRestartPending": True, "conditions": conds.listed()}
