"""What a FinetuneJob's status is derived from, and the conditions that only report. Pure: `now` is passed in.

The phase transitions themselves (which phase, and the condition that says why) are all in
transitions.py; this module holds what they are built from: the observations (`Observed`), the
conditions (`Conditions`, following the Kubernetes API conventions: lastTransitionTime changes only when
status does), the conditions that report what was seen without deciding a phase (network, capacity,
scheduling, pod health), and the stall window. Training progress and network health are not derived
here: they arrive through the progress channel and are carried over untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..api.validation import Issue
from .capacity import Capacity

Obj = dict[str, Any]

# Condition types, in the order they are listed.
SPEC_VALID = "SpecValid"
INSTANCE_TYPE_KNOWN = "InstanceTypeKnown"
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
KUBERAY = "KubeRayReconciling"
ORDER = [SPEC_VALID, INSTANCE_TYPE_KNOWN, RECONCILED, BLOCKED, KUBERAY, CAPACITY, SCHEDULED, PODS_HEALTHY, RUNNING, STALLED, SUSPENDED, COMPLETE,
         FAILED, NETWORK]

STALL_FLOOR_SECONDS = 900.0  # never call a job hung sooner than this without an explicit timeout
STALL_STEP_FACTOR = 10.0  # ... nor sooner than this many observed step times
_WATCHDOG = "watchdog caught collective operation timeout"

_IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CRASH = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
# A container still waiting in ContainerCreating this long after its pod was scheduled is stuck, not slow:
# a volume that cannot be mounted (FailedMount: a missing ConfigMap or Secret), a CNI or device plugin that
# does not answer. Its pod's own words are in its Events (Observed.pod_events), not in its status.
CREATING_STUCK_SECONDS = 180.0
# KubeRay acts on a RayJob within seconds of a change (its first reconcile gives it a status); one left
# without that this long is not being reconciled (the operator's --kuberay-timeout).
KUBERAY_TIMEOUT_SECONDS = 300.0


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
    # Judged before the RayJob exists: no figures for the instance type anywhere (built-in table, the admin's
    # ConfigMaps, the cluster's nodes); the message says how to add them. The job waits (never terminal).
    unknown_instance_type: str | None = None
    # The instance-type figures the job is judged and rendered against (status.instance, on the wire):
    # resolved while it has no RayJob, the recorded ones after.
    instance: Obj | None = None
    # The latest Warning Event (reason, message) of each pod stuck in ContainerCreating (`stuck_creating`):
    # FailedMount and its kind say there why the containers are not created.
    pod_events: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The stall window counts only silence this process saw (an operator outage is not the training's):
    # `watching_since`, when this process became the leader with its progress endpoint serving (None: no
    # such bound, e.g. tests of the pure functions); `held_report`, the time of the latest report this
    # process accepted for the job but has not written yet (a status write refused by 429s, say).
    watching_since: str | None = None
    held_report: str | None = None
    # (reason, message) when KubeRay cannot be doing its part: its RayJob CRD lacks fields the render uses
    # (`KubeRayTooOld`), or it left the RayJob without the status change it owes for too long
    # (`KubeRayNotReconciling`, see kuberay_overdue). Reported by condition KubeRayReconciling=False.
    kuberay: tuple[str, str] | None = None


# Carried over from the previous status untouched: progress (written by the progress flusher), the
# recorded child UID and times.
CARRIED = ("training", "network", "step", "runtimePhase", "rayJobUID", "startTime", "completionTime", "stallRestarts",
           "stallRestartPending", "instance")
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


class Conditions:
    """A status's conditions while it is derived: `set` moves lastTransitionTime only when the status changes,
    `listed` returns them in ORDER."""

    def __init__(self, prev: list[Obj] | None, now: str, generation: int | None) -> None:
        self.items: list[Obj] = [dict(c) for c in prev or []]
        self.now = now
        self.generation = generation

    def set(self, ctype: str, ok: bool | None, reason: str, message: str) -> None:
        set_condition(self.items, ctype, "Unknown" if ok is None else str(ok), reason, message, self.now,
                      self.generation)

    def drop(self, *ctypes: str) -> None:
        self.items[:] = [c for c in self.items if c["type"] not in ctypes]

    def get(self, ctype: str) -> Obj | None:
        return next((c for c in self.items if c["type"] == ctype), None)

    def has(self, ctype: str) -> bool:
        return self.get(ctype) is not None

    def listed(self) -> list[Obj]:
        return sorted(self.items, key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else 99)


def stuck_creating(pods: list[Obj], now: str) -> dict[str, float]:
    """The pods with a container waiting in ContainerCreating, and for how many seconds (since the pod was
    scheduled, else created). The reconciler checks the runtime ConfigMap for any of them, and reads the
    Events of those past CREATING_STUCK_SECONDS."""
    t_now = parse_time(now)
    out: dict[str, float] = {}
    for pod in pods:
        status = pod.get("status") or {}
        statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
        if not any(((cs.get("state") or {}).get("waiting") or {}).get("reason") == "ContainerCreating" for cs in statuses):
            continue
        scheduled = next((c.get("lastTransitionTime") for c in status.get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "True"), None)
        since = parse_time(scheduled or pod["metadata"].get("creationTimestamp"))
        out[pod["metadata"]["name"]] = (t_now - since).total_seconds() if t_now and since else 0.0
    return out


def _pod_problems(pods: list[Obj], now: str = "",
                  events: dict[str, tuple[str, str]] | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """(unschedulable messages, [(reason, message)] of container problems)."""
    unsched: list[str] = []
    broken: list[tuple[str, str]] = []
    stuck = {name: age for name, age in stuck_creating(pods, now).items() if age >= CREATING_STUCK_SECONDS}
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
        if name in stuck:
            why, said = (events or {}).get(name) or ("ContainerCreating", waiting_message(status))
            broken.append((why if why == "FailedMount" else "ContainerCreating",
                           f"{name}: containers not created {stuck[name]:.0f}s after scheduling: {why}: {said}"
                           .rstrip(": ")))
    return unsched, broken


def waiting_message(status: Obj) -> str:
    """What a pod's status says about why it is not ready (ContainerCreating carries no message itself)."""
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        msg = ((cs.get("state") or {}).get("waiting") or {}).get("message")
        if msg:
            return str(msg)
    return "no message in its status; see `kubectl describe pod` (its Events)"


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


def stall_check(status: Obj, conds: list[Obj], now: str, timeout_seconds: int | None,
                watching_since: str | None = None, held_report: str | None = None) -> tuple[str, str] | None:
    """(reason, message) when the running job looks hung; None while it progresses. Pure.
    Silence is counted from the latest of: the last stored report (or the Running transition), a report
    held unwritten (`held_report`), and when this process began watching (`watching_since`): an operator
    outage, or status writes refused, never count as the training's silence."""
    training: Obj = status.get("training") or {}
    net: Obj = status.get("network") or {}
    if _WATCHDOG in str(net.get("message") or "").lower():
        return "NcclWatchdogTimeout", f"the workers report an NCCL watchdog timeout: {net.get('message')}"[:1000]
    running = next((c for c in conds if c["type"] == RUNNING and c.get("status") == "True"), None)
    since = _latest(_stall_since(training, running), held_report, watching_since)
    t_since, t_now = parse_time(since), parse_time(now)
    if t_since is None or t_now is None:
        return None
    window = stall_window(timeout_seconds, training)
    if (t_now - t_since).total_seconds() <= window:
        return None
    if since == watching_since and since not in (training.get("lastReportTime"), held_report):
        last = training.get("lastReportTime") or "never"
        return ("NoProgress", f"no progress report for {window:.0f}s (the stall window) since this operator began "
                              f"watching at {since}; the last stored report is from {last}: the training may be "
                              "hung (NCCL, a stuck data loader, a dead node); see the workers' logs")
    if since in (training.get("lastReportTime"), held_report):
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


def _latest(*stamps: str | None) -> str | None:
    """The latest of the timestamps given (None and unparsable ones aside); the first of equal ones."""
    dated = [(t, ts) for ts in stamps if (t := parse_time(ts)) is not None]
    if not dated:
        return next((ts for ts in stamps if ts), None)
    return max(dated, key=lambda d: d[0])[1]  # max keeps the first of equal ones


def seconds_until_stall(status: Obj, now: str, timeout_seconds: int | None, watching_since: str | None = None,
                        held_report: str | None = None) -> float | None:
    """When to look again for a running job that is not stalled yet (None: nothing to watch)."""
    training: Obj = status.get("training") or {}
    running = next((c for c in status.get("conditions") or [] if c["type"] == RUNNING and c.get("status") == "True"), None)
    since = parse_time(_latest(_stall_since(training, running), held_report, watching_since))
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


@dataclass(frozen=True)
class PodTrouble:
    """What the pods and the Ray cluster say is wrong (it names the reason of a Provisioning job)."""

    unschedulable: list[str] = field(default_factory=list)  # the scheduler's messages
    broken: list[tuple[str, str]] = field(default_factory=list)  # (reason, message) of failing containers
    replica_failure: tuple[str, str] | None = None  # KubeRay could not create the Ray pods


def kuberay_owes(rayjob: Obj) -> str | None:
    """What KubeRay owes the RayJob and does at its next reconcile of it (rayjob_controller.go v1.6.1), or
    None. KubeRay sets no status.observedGeneration on RayJobs, so only these are sure signs: a status at
    all (New -> Initializing at once), and the suspend flag acted on (Initializing/Running -> Suspending
    when set, Suspended -> New when cleared)."""
    if (rayjob.get("metadata") or {}).get("deletionTimestamp"):
        return None
    deploy = str((rayjob.get("status") or {}).get("jobDeploymentStatus") or "")
    suspend = bool((rayjob.get("spec") or {}).get("suspend"))
    if not deploy:
        return "has given it no status yet"
    if suspend and deploy in ("Initializing", "Running"):
        return f"has not acted on spec.suspend: true (jobDeploymentStatus still {deploy})"
    if not suspend and deploy == "Suspended":
        return "has not acted on spec.suspend: false (jobDeploymentStatus still Suspended)"
    return None


def kuberay_overdue(rayjob: Obj, owed: str, since: str, now: str, timeout: float) -> tuple[float, tuple[str, str] | None]:
    """(seconds left until KubeRay is overdue, the condition's (reason, message) once it is): `owed` (from
    kuberay_owes) has been so since `since` (the RayJob's creation or spec change as this process saw it)."""
    start, at = parse_time(since), parse_time(now)
    waited = (at - start).total_seconds() if start and at else 0.0
    if waited < timeout:
        return timeout - waited, None
    meta = rayjob.get("metadata") or {}
    return 0.0, ("KubeRayNotReconciling",
                 f"KubeRay {owed} on RayJob {meta.get('namespace')}/{meta.get('name')} for {int(waited)} s (since "
                 f"{since}): check that the KubeRay operator is running and watches this namespace "
                 "(kubectl get deploy -A -l app.kubernetes.io/name=kuberay-operator; its logs)")


def report_observations(conds: Conditions, network: Obj, observed: Observed) -> PodTrouble:
    """The conditions that report what was observed and never decide a phase: NetworkHealthy,
    CapacityAvailable, WorkersScheduled, PodsHealthy, KubeRayReconciling (only while False)."""
    if observed.kuberay is not None:
        conds.set(KUBERAY, False, *observed.kuberay)
    else:
        conds.drop(KUBERAY)
    if network.get("healthy") is not None:
        conds.set(NETWORK, bool(network["healthy"]), _network_reason(network),
                  network.get("message") or f"collectives over {network.get('transport')}")
    if observed.capacity is not None:
        cap = observed.capacity
        conds.set(CAPACITY, cap.fits, cap.reason, cap.message)
    unsched, broken = _pod_problems(observed.pods, conds.now, observed.pod_events)
    worker_pods = [p for p in observed.pods if (p["metadata"].get("labels") or {}).get("ray.io/node-type") == "worker"]
    if unsched:
        conds.set(SCHEDULED, False, "Unschedulable", "; ".join(unsched)[:1000])
    elif worker_pods:
        conds.set(SCHEDULED, True, "Scheduled", f"{len(worker_pods)} worker pod(s) bound to nodes")
    replica_failure = _replica_failure(observed.raycluster)
    if broken:
        conds.set(PODS_HEALTHY, False, broken[0][0], "; ".join(m for _, m in broken)[:1000])
    elif replica_failure:
        conds.set(PODS_HEALTHY, False, replica_failure[0], replica_failure[1])
    elif observed.pods:
        conds.set(PODS_HEALTHY, True, "ContainersOK", "no image pull or container start failures")
    return PodTrouble(unsched, broken, replica_failure)


def strip_times(status: Obj) -> Obj:
    """Status without fields that change on every derivation (for change detection)."""
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return out
