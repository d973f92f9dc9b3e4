"""Derive a FinetuneJob's status from what was observed. Pure: `now` is passed in.

Conditions follow the Kubernetes API conventions (lastTransitionTime changes only when status does);
`phase` is derived from them for the printer column. Training progress and network health are not
derived here: they arrive through the progress channel and are carried over untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..api.status import Phase
from ..api.validation import Issue
from .preflight import Capacity

Obj = dict[str, Any]

# Condition types, in the order they are listed.
SPEC_VALID = "SpecValid"
CAPACITY = "CapacityAvailable"
SCHEDULED = "WorkersScheduled"
PODS_HEALTHY = "PodsHealthy"
RUNNING = "Running"
SUSPENDED = "Suspended"
COMPLETE = "Complete"
FAILED = "Failed"
NETWORK = "NetworkHealthy"
ORDER = [SPEC_VALID, CAPACITY, SCHEDULED, PODS_HEALTHY, RUNNING, SUSPENDED, COMPLETE, FAILED, NETWORK]

_IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CRASH = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass
class Observed:
    rayjob: Obj | None = None
    raycluster: Obj | None = None
    pods: list[Obj] = field(default_factory=list)
    capacity: Capacity | None = None
    spec_issues: list[Issue] = field(default_factory=list)
    conflict: str | None = None  # a child exists that another owner controls


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


def _attempt(rj_status: Obj, terminal_failed: bool) -> int:
    failed = int(rj_status.get("failed") or 0)
    return max(1, failed if terminal_failed and failed else failed + 1)


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
) -> Obj:
    conds: list[Obj] = [dict(c) for c in prev.get("conditions") or []]
    status: Obj = {k: v for k, v in prev.items() if k in ("training", "network", "step", "startTime", "completionTime")}
    status.update(
        observedGeneration=generation,
        rayJobName=names["rayJob"],
        configMapName=names["configMap"],
    )

    def cond(ctype: str, ok: bool | None, reason: str, message: str) -> None:
        set_condition(conds, ctype, "Unknown" if ok is None else str(ok), reason, message, now, generation)

    def finish(phase: Phase, message: str) -> Obj:
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
    if observed.conflict:
        cond(FAILED, True, "ChildConflict", observed.conflict)
        return finish(Phase.failed, observed.conflict)

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
    if broken:
        reason = broken[0][0]
        cond(PODS_HEALTHY, False, reason, "; ".join(m for _, m in broken)[:1000])
    elif observed.pods:
        cond(PODS_HEALTHY, True, "ContainersOK", "no image pull or container start failures")

    # -- the RayJob -----------------------------------------------------------------------------------
    rj = observed.rayjob
    if rj is None:
        _drop(conds, RUNNING)
        if suspend:
            cond(SUSPENDED, True, "Suspended", "spec.suspend is true")
            return finish(Phase.suspended, "suspended")
        return finish(Phase.pending, "creating the RayJob")
    rs: Obj = rj.get("status") or {}
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
    if suspend or deploy in ("Suspending", "Suspended"):
        cond(RUNNING, False, "Suspended", "suspended")
        cond(SUSPENDED, True, deploy or "Suspending", "spec.suspend is true: the Ray cluster is deleted")
        return finish(Phase.suspended, "suspended" if deploy == "Suspended" else "suspending")
    _drop(conds, SUSPENDED)
    if deploy == "Running":
        cond(RUNNING, True, "RayJobRunning", f"Ray job {rs.get('jobId') or ''} {job_status or 'submitted'}".replace("  ", " "))
        return finish(Phase.running, "training")
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
    elif observed.capacity is not None and not observed.capacity.fits:
        why = observed.capacity.message
    cond(RUNNING, False, "Provisioning", why)
    return finish(Phase.provisioning, why)


def strip_times(status: Obj) -> Obj:
    """Status without fields that change on every derivation (for change detection)."""
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return out
