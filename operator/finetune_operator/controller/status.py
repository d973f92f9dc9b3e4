"""Derive a FinetuneJob's status from what was observed. Pure: `now` is passed in.

Conditions follow the Kubernetes API conventions (lastTransitionTime changes only when status does);
`phase` is derived from them for the printer column. Training progress and network health are not
derived here: they arrive through the progress channel and are carried over untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..api.status import Phase
from ..api.validation import Issue
from .capacity import Capacity

Obj = dict[str, Any]

# Condition types, in the order they are listed.
SPEC_VALID = "SpecValid"
BLOCKED = "Blocked"
RECONCILED = "Reconciled"
CAPACITY = "CapacityAvailable"
SCHEDULED = "WorkersScheduled"
PODS_HEALTHY = "PodsHealthy"
RUNNING = "Running"
SUSPENDED = "Suspended"
COMPLETE = "Complete"
FAILED = "Failed"
NETWORK = "NetworkHealthy"
STALLED = "Stalled"
ORDER = [SPEC_VALID, RECONCILED, BLOCKED, CAPACITY, SCHEDULED, PODS_HEALTHY, RUNNING, STALLED, SUSPENDED, COMPLETE,
         FAILED, NETWORK]

STALL_FLOOR_SECONDS = 900.0  # never call a job hung sooner than this without an explicit timeout
STALL_STEP_FACTOR = 10.0  # ... nor sooner than this many observed step times
_WATCHDOG = "watchdog caught collective operation timeout"

_IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CRASH = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass
class Observed:
    rayjob: Obj | None = None
    raycluster: Obj | None = None
    pods: list[Obj] = field(default_factory=list)
    capacity: Capacity | None = None
    spec_issues: list[Issue] = field(default_factory=list)
    # (reason, message): the children cannot be created or updated yet for a reason that can go away
    # (a child of the same name owned by someone else, e.g. a deleted FinetuneJob of the same name whose
    # RayJob still waits on KubeRay's finalizer; an admission rejection). Never terminal.
    blocked: tuple[str, str] | None = None
    # The RayJob recorded in status.rayJobUID is gone (deleted by KubeRay, a user or a cleanup).
    rayjob_lost: bool = False
    # The last status the watch saw of that RayJob (its DELETED event carries its final state).
    last_rayjob_status: Obj | None = None


# Carried over from the previous status untouched: progress (written by the progress flusher), the
# recorded child UID and times.
CARRIED = ("training", "network", "step", "runtimePhase", "rayJobUID", "startTime", "completionTime", "stallRestarts",
           "stallRestartPending")
# Written only by the progress flusher (never part of the reconcile's change detection).
PROGRESS_FIELDS = ("training", "network", "step", "runtimePhase")


def set_condition(conds: list[Obj], ctype: str, status: str, reason: str, message: str, now: str, gen: int | None) -> None:
    for c in conds:
        if c["type"] == ctype:
            if c.get("status") != status:
                c["lastTransitionTime"] = now
            c.update(status=status, reason=reason, message=message)
            if gen is not None:
                c["observedGeneration"] = gen
            return
    cond: Obj = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": now}
    if gen is not None:
        cond["observedGeneration"] = gen
    conds.append(cond)


def _drop(conds: list[Obj], ctype: str) -> None:
    conds[:] = [c for c in conds if c["type"] != ctype]


def _pod_problems(pods: list[Obj]) -> tuple[list[str], list[tuple[str, str]]]:
    """(unschedulable messages, [(reason, message)] of container problems)."""
    unsched: list[str] = []
    broken: list[tuple[str, str]] = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                unsched.append(f"{name}: {cond.get('message') or cond.get('reason') or 'unschedulable'}")
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in _IMAGE_PULL or reason in _CRASH:
                broken.append((reason, f"{name}/{cs.get('name')}: {reason}: {waiting.get('message', '')}".strip()))
    return unsched, broken


def _replica_failure(raycluster: Obj | None) -> tuple[str, str] | None:
    """KubeRay's RayCluster `ReplicaFailure` condition: pod creation refused (Pod Security admission,
    ResourceQuota, LimitRange, ...). The pods never exist, so only the RayCluster says why."""
    for c in ((raycluster or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            reason = str(c.get("reason") or "ReplicaFailure")
            return reason, f"KubeRay cannot create the Ray pods ({reason}): {c.get('message') or ''}".rstrip(": ")[:1000]
    return None


def pods_of(pods: list[Obj], rayjob: Obj) -> list[Obj]:
    """The job's pods that belong to this RayJob: its Ray cluster's, and cluster-less ones (the submitter)
    created after it; never a previous incarnation's (a deleted FinetuneJob of the same name)."""
    cluster = (rayjob.get("status") or {}).get("rayClusterName")
    born = str(rayjob["metadata"].get("creationTimestamp") or "")
    out = []
    for p in pods:
        labels = p["metadata"].get("labels") or {}
        if "ray.io/cluster" in labels:
            if cluster and labels["ray.io/cluster"] == cluster:
                out.append(p)
        elif str(p["metadata"].get("creationTimestamp") or "") >= born:
            out.append(p)
    return out


def _attempt(rj_status: Obj, terminal_failed: bool) -> int:
    failed = int(rj_status.get("failed") or 0)
    return max(1, failed if terminal_failed and failed else failed + 1)


def _decide_lost(status: Obj, conds: list[Obj], cond: Callable[[str, bool | None, str, str], None],
                 finish: Callable[[Phase, str], Obj], prev: Obj, names: dict[str, str], now: str) -> Obj:
    """The recorded RayJob vanished before its outcome was observed: it is never re-created (that would
    run the training again). Decide from what is known: the training runtime's own final report."""
    status["completionTime"] = status.get("completionTime") or now
    gone = (f"RayJob {names['rayJob']} was deleted before the operator saw its outcome (KubeRay's "
            f"DELETE_RAYJOB_CR_AFTER_JOB_FINISHES, a user or a cleanup, possibly while the operator was down)")
    step = status.get("step")
    runtime = status.get("runtimePhase")
    _drop(conds, SUSPENDED)
    if runtime == "Done":
        cond(RUNNING, False, "Finished", "the training reported it finished")
        cond(COMPLETE, True, "TrainingReportedDone",
             f"{gone}; the training had reported phase Done" + (f" at step {step}" if step else ""))
        _drop(conds, FAILED)
        return finish(Phase.succeeded, "fine-tuning succeeded (reported by the training; the RayJob is gone)")
    if runtime == "Failed":
        reason, why = "TrainingReportedFailed", f"{gone}; the training had reported phase Failed"
    else:
        last = prev.get("phase") or "unknown"
        reason = "RayJobDeleted"
        why = (f"{gone}; last known phase {last}" + (f", step {step}" if step else "") +
               "; no final report from the training. Not re-created, so the training does not run again: "
               "delete and re-create the FinetuneJob to run it again")
    _drop(conds, COMPLETE)
    cond(RUNNING, False, "Finished", "the RayJob is gone")
    cond(FAILED, True, reason, why)
    return finish(Phase.failed, why)


def parse_time(ts: str | None) -> datetime | None:
    if not ts:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return datetime.strptime(ts, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def stall_window(timeout_seconds: int | None, training: Obj) -> float:
    """Seconds without a progress report after which a running job is Stalled: the policy's timeout, else
    STALL_STEP_FACTOR x the step time observed from the training's own ETA, at least the floor."""
    if timeout_seconds:
        return float(timeout_seconds)
    eta, step, total = training.get("etaSeconds"), training.get("step"), training.get("totalSteps")
    if eta and step is not None and total and total > step:
        return max(STALL_FLOOR_SECONDS, STALL_STEP_FACTOR * float(eta) / float(total - step))
    return STALL_FLOOR_SECONDS


def stall_check(status: Obj, conds: list[Obj], now: str, timeout_seconds: int | None) -> tuple[str, str] | None:
    """(reason, message) when the running job looks hung; None while it progresses. Pure."""
    training: Obj = status.get("training") or {}
    net: Obj = status.get("network") or {}
    if _WATCHDOG in str(net.get("message") or "").lower():
        return "NcclWatchdogTimeout", f"the workers report an NCCL watchdog timeout: {net.get('message')}"[:1000]
    running = next((c for c in conds if c["type"] == RUNNING and c.get("status") == "True"), None)
    since = _stall_since(training, running)
    t_since, t_now = parse_time(since), parse_time(now)
    if t_since is None or t_now is None:
        return None
    window = stall_window(timeout_seconds, training)
    if (t_now - t_since).total_seconds() <= window:
        return None
    if since == training.get("lastReportTime"):
        step = training.get("step")
        total = training.get("totalSteps")
        at = f" at step {step}/{total}" if step is not None and total else (f" at step {step}" if step is not None else "")
        return ("NoProgress", f"no progress report since {since}{at} (window {window:.0f}s): the training may be hung "
                              "(NCCL, a stuck data loader, a dead node); see the workers' logs")
    return ("NoProgress", f"running since {since} without any progress report (window {window:.0f}s): the training "
                          "may be hung starting up (NCCL init, model download); see the workers' logs")


def _stall_since(training: Obj, running: Obj | None) -> str | None:
    """Where the stall window starts: the last progress report, or the Running transition if that is later
    (a Ray cluster replaced after a stall, or a resume, starts a new window; the old report is older)."""
    report, started = training.get("lastReportTime"), (running or {}).get("lastTransitionTime")
    t_report, t_started = parse_time(report), parse_time(started)
    if t_report is None or (t_started is not None and t_started > t_report):
        return str(started) if started else None
    return str(report)


def seconds_until_stall(status: Obj, now: str, timeout_seconds: int | None) -> float | None:
    """When to look again for a running job that is not stalled yet (None: nothing to watch)."""
    training: Obj = status.get("training") or {}
    running = next((c for c in status.get("conditions") or [] if c["type"] == RUNNING and c.get("status") == "True"), None)
    since = parse_time(_stall_since(training, running))
    t_now = parse_time(now)
    if since is None or t_now is None or status.get("phase") != "Running":
        return None
    left = stall_window(timeout_seconds, training) - (t_now - since).total_seconds()
    return left + 1.0 if left >= 0 else None


def training_started(job_status: str, training: Obj, raycluster: Obj | None) -> bool:
    """Whether the training runs (RayJob deployment status Running): Ray reports the job RUNNING (or already
    ended, KubeRay waiting for its submitter), or the training reported progress from the current Ray cluster
    (a report older than the cluster comes from an earlier attempt, before a suspend or a stall restart)."""
    if job_status in ("RUNNING", "SUCCEEDED", "FAILED", "STOPPED"):
        return True
    reported = parse_time(training.get("lastReportTime"))
    if reported is None:
        return False
    born = parse_time(((raycluster or {}).get("metadata") or {}).get("creationTimestamp"))
    return born is None or reported >= born


def _network_reason(net: Obj) -> str:
    """NetworkHealthy's reason: which layer enforced requireEFA (the runtime's netprobe message prefixes), else
    the transport in CamelCase (efa -> Efa, intra-node -> TransportIntraNode)."""
    msg = str(net.get("message") or "")
    if msg.startswith("requireEFA (caught by NCCL)"):
        return "EfaRequiredNcclRefused"  # NCCL_NET pinned: NCCL itself refused to fall back
    if msg.startswith("requireEFA (caught by the probe)"):
        return "EfaRequiredProbeFailed"
    transport = str(net.get("transport") or "unknown")
    return "Efa" if transport == "efa" else "Transport" + "".join(w.capitalize() for w in re.split(r"[^A-Za-z0-9]+", transport))


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
    conds: list[Obj] = [dict(c) for c in prev.get("conditions") or []]
    status: Obj = {k: v for k, v in prev.items() if k in CARRIED}
    status.update(
        observedGeneration=generation,
        rayJobName=names["rayJob"],
    )

    def cond(ctype: str, ok: bool | None, reason: str, message: str) -> None:
        set_condition(conds, ctype, "Unknown" if ok is None else str(ok), reason, message, now, generation)

    def finish(phase: Phase, message: str) -> Obj:
        if phase != Phase.running:
            _drop(conds, STALLED)
        status["phase"] = phase.value
        status["message"] = message
        status["conditions"] = sorted(conds, key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else 99)
        return {k: v for k, v in status.items() if v is not None}

    # -- spec -----------------------------------------------------------------------------------------
    if observed.spec_issues:
        text = "; ".join(str(i) for i in observed.spec_issues)
        cond(SPEC_VALID, False, "InvalidSpec", text)
        cond(FAILED, True, "InvalidSpec", text)
        return finish(Phase.failed, f"invalid spec: {text}")
    cond(SPEC_VALID, True, "Valid", "spec is valid for the instance type")
    _drop(conds, RECONCILED)  # this derivation is the outcome of a reconcile that did not fail
    if observed.blocked:
        reason, message = observed.blocked
        cond(BLOCKED, True, reason, message)
        _drop(conds, RUNNING)
        return finish(Phase.pending, message)
    _drop(conds, BLOCKED)

    net = status.get("network") or {}
    if net.get("healthy") is not None:
        cond(NETWORK, bool(net["healthy"]), _network_reason(net), net.get("message") or f"collectives over {net.get('transport')}")

    # -- capacity and pods ----------------------------------------------------------------------------
    if observed.capacity is not None:
        cap = observed.capacity
        cond(CAPACITY, cap.fits, cap.reason, cap.message)
    unsched, broken = _pod_problems(observed.pods)
    worker_pods = [p for p in observed.pods if (p["metadata"].get("labels") or {}).get("ray.io/node-type") == "worker"]
    if unsched:
        cond(SCHEDULED, False, "Unschedulable", "; ".join(unsched)[:1000])
    elif worker_pods:
        cond(SCHEDULED, True, "Scheduled", f"{len(worker_pods)} worker pod(s) bound to nodes")
    replica_failure = _replica_failure(observed.raycluster)
    if broken:
        reason = broken[0][0]
        cond(PODS_HEALTHY, False, reason, "; ".join(m for _, m in broken)[:1000])
    elif replica_failure:
        cond(PODS_HEALTHY, False, replica_failure[0], replica_failure[1])
    elif observed.pods:
        cond(PODS_HEALTHY, True, "ContainersOK", "no image pull or container start failures")

    # -- the RayJob -----------------------------------------------------------------------------------
    rj = observed.rayjob
    if rj is None and observed.rayjob_lost:
        last = observed.last_rayjob_status or {}
        if last.get("jobDeploymentStatus") in ("Complete", "Failed", "ValidationFailed"):
            rj = {"status": last}  # the watch saw its final state: decide from that
        else:
            return _decide_lost(status, conds, cond, finish, prev, names, now)
    if rj is None:
        _drop(conds, RUNNING)
        if suspend:
            cond(SUSPENDED, True, "Suspended", "spec.suspend is true")
            return finish(Phase.suspended, "suspended")
        return finish(Phase.pending, "creating the RayJob")
    rs: Obj = rj.get("status") or {}
    uid = (rj.get("metadata") or {}).get("uid")
    if uid:
        status["rayJobUID"] = uid
    deploy = rs.get("jobDeploymentStatus") or ""
    job_status = rs.get("jobStatus") or ""
    for key, src in (("rayClusterName", "rayClusterName"), ("jobId", "jobId"), ("dashboardURL", "dashboardURL")):
        if rs.get(src):
            status[key] = rs[src]
    if rs.get("startTime"):
        status["startTime"] = rs["startTime"]
    terminal_failed = deploy in ("Failed", "ValidationFailed") or (deploy == "Complete" and job_status != "SUCCEEDED")
    status["attempt"] = _attempt(rs, terminal_failed)
    ray_reason = rs.get("reason") or ""
    ray_message = rs.get("message") or ""

    if deploy == "Complete" and job_status == "SUCCEEDED":
        status["completionTime"] = rs.get("endTime") or status.get("completionTime") or now
        cond(RUNNING, False, "Finished", "the Ray job finished")
        cond(COMPLETE, True, "Succeeded", "the Ray job succeeded")
        _drop(conds, FAILED)
        return finish(Phase.succeeded, "fine-tuning succeeded")
    if terminal_failed:
        status["completionTime"] = rs.get("endTime") or status.get("completionTime") or now
        if deploy == "ValidationFailed":
            reason = "ValidationFailed"
        elif ray_reason:
            reason = ray_reason
        elif int(rs.get("failed") or 0) > 0 and status["attempt"] > 1:
            reason = "BackoffLimitExceeded"
        else:
            reason = f"Job{job_status.capitalize() or 'Failed'}"
        message = ray_message or f"RayJob {deploy} (job status {job_status or 'unknown'})"
        if reason == "DeadlineExceeded":
            message = f"activeDeadlineSeconds exceeded: {ray_message}".rstrip(": ")
        cond(RUNNING, False, "Finished", "the Ray job ended")
        cond(FAILED, True, reason, message)
        return finish(Phase.failed, message)
    _drop(conds, COMPLETE)
    _drop(conds, FAILED)
    if not suspend and status.get("stallRestartPending"):
        n = status.get("stallRestarts") or 1
        why = f"restarting after a stall (restart {n}): the Ray cluster is replaced, the training resumes from its last checkpoint"
        cond(RUNNING, False, "StallRestart", why)
        _drop(conds, SUSPENDED)
        return finish(Phase.provisioning, why)
    # Suspended with spec.suspend false on the RayJob: KubeRay is about to resume it (not suspended any more).
    if suspend or deploy == "Suspending" or (deploy == "Suspended" and (rj.get("spec") or {}).get("suspend", True)):
        cond(RUNNING, False, "Suspended", "suspended")
        cond(SUSPENDED, True, deploy or "Suspending", "spec.suspend is true: the Ray cluster is deleted")
        return finish(Phase.suspended, "suspended" if deploy == "Suspended" else "suspending")
    _drop(conds, SUSPENDED)
    if deploy == "Running" and not training_started(job_status, status.get("training") or {}, observed.raycluster):
        # KubeRay says Running as soon as its submitter Job exists; the training has not started until Ray
        # says the job runs (the driver is up) or the training reports from this Ray cluster.
        _drop(conds, STALLED)
        why = (f"starting: the Ray cluster is up and the job is submitted (Ray job status {job_status or 'not known yet'});"
               " waiting for the driver and the training to start (image pulls, runtime env, ray job submit)")
        if broken:
            why = broken[0][1]
        cond(RUNNING, False, "Starting", why)
        return finish(Phase.provisioning, why)
    if deploy == "Running":
        cond(RUNNING, True, "RayJobRunning", f"Ray job {rs.get('jobId') or ''} {job_status or 'submitted'}".replace("  ", " "))
        stalled = stall_check(status, conds, now, stall_timeout_seconds) if detect_stalls else None
        if stalled:
            cond(STALLED, True, *stalled)
            return finish(Phase.running, f"stalled: {stalled[1]}")
        if any(c["type"] == STALLED for c in conds):
            cond(STALLED, False, "Progressing", "progress reports are arriving")
        return finish(Phase.running, "training")
    _drop(conds, STALLED)
    # Initializing / Waiting / Retrying / New: the cluster is coming up.
    rc: Obj = (observed.raycluster or {}).get("status") or {}
    why = "waiting for the Ray cluster"
    if rc:
        ready = (rc.get("readyWorkerReplicas") or 0, rc.get("desiredWorkerReplicas") or 0)
        why = f"waiting for the Ray cluster ({ready[0]}/{ready[1]} workers ready)"
        if rc.get("reason"):
            why += f": {rc['reason']}"
    if deploy == "Retrying":
        why = f"retrying (attempt {status['attempt']})"
    if unsched:
        why = "worker pods unschedulable: " + unsched[0]
    elif broken:
        why = broken[0][1]
    elif replica_failure:
        why = replica_failure[1]
    elif observed.capacity is not None and not observed.capacity.fits:
        why = observed.capacity.message
    cond(RUNNING, False, "Provisioning", why)
    return finish(Phase.provisioning, why)


def fail_stalled(status: Obj, now: str, why: str = "failed by spec.stallPolicy.action Fail") -> Obj:
    """spec.stallPolicy.action Fail (or Restart with no restart left): the stalled running job becomes Failed
    (reason Stalled). Pure."""
    conds = [dict(c) for c in status.get("conditions") or []]
    stalled = next(c for c in conds if c["type"] == STALLED)
    gen = stalled.get("observedGeneration")
    message = f"stalled ({stalled['reason']}): {stalled['message']}; {why}"[:1000]
    set_condition(conds, RUNNING, "False", "Finished", "failed as stalled; the Ray cluster is released", now, gen)
    set_condition(conds, FAILED, "True", "Stalled", message, now, gen)
    _drop(conds, STALLED)
    out = {**status, "phase": Phase.failed.value, "message": message, "completionTime": now}
    out["conditions"] = sorted(conds, key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else 99)
    return out


def restart_stalled(status: Obj, now: str, max_restarts: int) -> Obj:
    """spec.stallPolicy.action Restart: count the restart and mark it pending (the reconciler suspends the
    RayJob, and resumes it once KubeRay has deleted the Ray cluster). Pure."""
    conds = [dict(c) for c in status.get("conditions") or []]
    stalled = next(c for c in conds if c["type"] == STALLED)
    gen = stalled.get("observedGeneration")
    n = int(status.get("stallRestarts") or 0) + 1
    message = (f"stalled ({stalled['reason']}): {stalled['message']}; restart {n} of {max_restarts} by "
               "spec.stallPolicy.action Restart: the Ray cluster is replaced, the training resumes from its last checkpoint")[:1000]
    set_condition(conds, RUNNING, "False", "StallRestart", message, now, gen)
    _drop(conds, STALLED)
    out = {**status, "phase": Phase.provisioning.value, "message": message[:300], "stallRestarts": n,
           "stallRestartPending": True}
    out["conditions"] = sorted(conds, key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else 99)
    return out


def strip_times(status: Obj) -> Obj:
    """Status without fields that change on every derivation (for change detection)."""
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return out
