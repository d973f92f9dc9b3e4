"""The level-based reconcile: look at the world, close the gap, write status once.

`plan_children` and `transitions.decide` decide (pure); `Reconciler.reconcile` observes, and carries out
their decisions via the Kube client. Idempotent: with nothing changed it makes no write at all (children
carry a hash of what was rendered; status is compared before patching).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..api import instance_types as it
from ..api import spec as s
from ..api.failpoints import failpoint
from ..api.policy import policy_issues
from ..api.status import InstanceFigures, Phase
from ..api.validation import SpecError, UnknownInstanceType, fit_issues, parse_model, unknown_type_message
from ..render.config import RenderConfig
from ..render.rayjob import JOB_LABEL, child_names, is_shared, render_children, runtime_hash, suspension_patch
from .cache import Cache
from .capacity import check_capacity
from .clusterconfig import ClusterConfig
from .k8s import FTJ, NODES, PODS, RAYCLUSTER, RAYJOB, ApiError, Kube, ObjectReplaced, gvr_of
from .metrics import Metrics
from .runtime_configmaps import RUNTIMES_KEY, Runtimes
from .status import (
    BLOCKED,
    CREATING_STUCK_SECONDS,
    KUBERAY_TIMEOUT_SECONDS,
    PROGRESS_FIELDS,
    RECONCILED,
    RUNNING,
    STALLED,
    Observed,
    kuberay_overdue,
    kuberay_owes,
    pods_of,
    seconds_until_stall,
    set_condition,
    stuck_creating,
)
from .transitions import TERMINAL, RayJobAction, decide, judged, rayjob_held_suspended, seconds_until_deadline

Obj = dict[str, Any]
HASH_ANNOTATION = "finetune.dev/render-hash"
log = logging.getLogger("finetune.reconcile")
BLOCKED_REQUEUE_SECONDS = 10.0


def utcnow() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_hash(obj: Obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(obj: Obj) -> Obj:
    out: Obj = json.loads(json.dumps(obj))
    out["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = render_hash(obj)
    return out


@dataclass(frozen=True)
class ChildAction:
    obj: Obj  # desired, with hash annotation (and the recorded UID, if any)
    apply: bool  # False: observed already matches (or is going away)
    blocked: tuple[str, str] | None = None  # (reason, message): wait, do not touch it
    lost: bool = False  # the recorded child is gone: never re-created
    drift: tuple[str, ...] = ()  # fields someone changed on the live child: re-applied (reverted)


def owned_by(obj: Obj | None, owner_uid: str) -> bool:
    return obj is not None and owner_uid in {r.get("uid") for r in obj["metadata"].get("ownerReferences") or []}


def _blocked_by(obj: Obj, cur: Obj, job_name: str) -> tuple[str, str]:
    """Why an existing object of a child's name that this job does not own blocks it."""
    what = f"{obj['kind']} {obj['metadata']['name']}"
    deleting = " and is being deleted" if cur["metadata"].get("deletionTimestamp") else ""
    for ref in cur["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == s.KIND and ref.get("name") == job_name:
            return ("WaitingForPreviousChild",
                    f"{what} still belongs to a previous FinetuneJob named {job_name} (uid {ref.get('uid')}){deleting}; "
                    "this job proceeds once it is gone")
    if deleting:
        return "WaitingForPreviousChild", f"{what} is being deleted; this job proceeds once it is gone"
    return "ChildConflict", f"{what} already exists and is not owned by this FinetuneJob; delete or rename it"


def drifted(want: Obj, cur: Obj) -> tuple[str, ...]:
    """What of `want` someone changed on the live object (`kubectl edit`, a script): a ConfigMap's data, and
    the top-level scalar fields of a RayJob's spec (suspend, entrypoint, backoffLimit, ...), none of which
    KubeRay changes. The nested Ray cluster spec is left out: the API server may normalise it, and KubeRay
    ignores edits there once the cluster exists. Pure."""
    if want.get("kind") == "ConfigMap":
        return ("data",) if (cur.get("data") or {}) != (want.get("data") or {}) else ()
    have = cur.get("spec") or {}
    # A field missing from the live object stands for its zero value: KubeRay updates its RayJobs from Go
    # structs (adding its finalizer), which drops `false`/`0`/`""` fields (`omitempty`) that were applied.
    return tuple(f"spec.{k}" for k, v in (want.get("spec") or {}).items()
                 if isinstance(v, (str, int, float, bool)) and have.get(k, type(v)()) != v)


def settled_fingerprint(meta: Obj, status: Obj) -> str:
    """A job as far as a reconcile is concerned: its identity, spec generation, metadata a user may change,
    and its status without the progress fields."""
    return json.dumps([meta.get("uid"), meta.get("generation"), meta.get("deletionTimestamp"), meta.get("labels"),
                       meta.get("annotations"), meta.get("finalizers"),
                       {k: v for k, v in status.items() if k not in PROGRESS_FIELDS and v is not None}],
                      sort_keys=True, default=str)


def plan_children(desired: list[Obj], observed: Mapping[str, Obj | None], owner_uid: str,
                  recorded: Mapping[str, str] | None = None) -> list[ChildAction]:
    """Pure: which children to (re)apply. `observed` and `recorded` (UIDs in status) are keyed by child name.

    A recorded child is applied with its UID in the body: server-side apply then only ever updates that
    very object, and answers 409 instead of creating a new one if it vanished after it was observed
    (apply is create-or-update). A recorded child that is not there is lost, not re-created."""
    actions = []
    for obj in desired:
        want = with_hash(obj)
        name = obj["metadata"]["name"]
        cur = observed.get(name)
        pinned = (recorded or {}).get(name)
        if pinned:
            if cur is None or cur["metadata"].get("uid") != pinned:
                actions.append(ChildAction(want, False, lost=True))
                continue
            want["metadata"]["uid"] = pinned  # after the hash: the hash covers only what was rendered
        if cur is None:
            actions.append(ChildAction(want, True))
            continue
        if not owned_by(cur, owner_uid):
            job_name = next((r.get("name") for r in obj["metadata"].get("ownerReferences") or []), "")
            actions.append(ChildAction(want, False, _blocked_by(obj, cur, str(job_name))))
            continue
        if cur["metadata"].get("deletionTimestamp"):
            actions.append(ChildAction(want, False))  # ours, going away: nothing to apply to
            continue
        have = (cur["metadata"].get("annotations") or {}).get(HASH_ANNOTATION)
        if have != want["metadata"]["annotations"][HASH_ANNOTATION]:
            actions.append(ChildAction(want, True))  # rendered differently now (spec or operator changed)
            continue
        drift = drifted(obj, cur)
        actions.append(ChildAction(want, bool(drift), drift=drift))
    return actions


def job_document(body: Obj) -> Obj:
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion", s.API_VERSION),
        "kind": body.get("kind", s.KIND),
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "generation") if k in meta},
        "spec": body.get("spec") or {},
    }


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        cfg: RenderConfig,
        runtime_files: Mapping[str, str],
        metrics: Metrics | None = None,
        clock: Callable[[], str] = utcnow,
        requeue_after: Callable[[str, str, float], None] | None = None,
        cluster_config: ClusterConfig | None = None,
        cache: Cache | None = None,
    ):
        self.kube = kube
        # Reads come from the watches' stores when there is a cache (the operator), else straight from the
        # API server (unit tests, one-off tools).
        self.cache = cache
        self.cfg = cfg
        self.cluster_config = cluster_config
        self.runtime_files = dict(runtime_files)
        self.metrics = metrics or Metrics()
        self.clock = clock
        # The work queue's timers: one pending per job, the earliest wins (workqueue.py), so a reconcile asks
        # for every look it needs and keeps no timers of its own. A Blocked job's looks back off
        # (requeue_rate_limited, BLOCKED_REQUEUE_SECONDS doubling) until it is not blocked (requeue_forget).
        self.requeue_after = requeue_after or (lambda ns, name, delay: None)
        self.requeue_rate_limited: Callable[[str, str, float], None] = self.requeue_after
        self.requeue_forget: Callable[[str, str], None] = lambda ns, name: None
        self.phases: dict[tuple[str, str], str] = {}
        # The last terminal status the watch saw per RayJob UID (a DELETED event carries the final state),
        # so a RayJob KubeRay deletes the moment it finishes still decides the outcome.
        self.final_rayjob_status: dict[str, Obj] = {}
        self._rayjob_uids: dict[tuple[str, str], set[str]] = {}
        # The RayCluster each job's RayJob runs on now (KubeRay names a new one per retry and after a resume).
        self.ray_clusters: dict[tuple[str, str], str] = {}
        # Silence counts toward a stall only while this process watches (status.stall_check): when it became
        # the leader with its progress endpoint serving (the runner sets it), and the latest report it holds
        # unwritten per job (the runner: the progress server's pending reports).
        self.watching_since: str | None = None
        self.held_report: Callable[[str, str], str | None] = lambda namespace, name: None
        # KubeRay's part (status.kuberay_owes): what each job's RayJob is owed, since when this process saw
        # it so; overdue after `kuberay_timeout` s. `kuberay_incompatible`: the runner's start-up check of the
        # RayJob CRD (kuberay_version.py) found it lacking, said on every job.
        self.kuberay_timeout = KUBERAY_TIMEOUT_SECONDS
        self.kuberay_incompatible: str | None = None
        self._kuberay_owed: dict[tuple[str, str], tuple[tuple[object, ...], str]] = {}
        self.uids: dict[tuple[str, str], str] = {}  # the FinetuneJob object last reconciled under each name
        # What the last reconcile of each job left it as (progress fields aside): a watch event of the job
        # that brings nothing else (a progress write) needs no reconcile of a running job. See progress_only.
        self._settled: dict[tuple[str, str], str] = {}
        # Shared children (the runtime ConfigMaps): created once per namespace, collected when unused.
        self.runtimes = Runtimes(kube)

    # ------------------------------------------------------------------------------------------ reads
    def _get(self, gvr: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        return self.cache.get(gvr, namespace, name) if self.cache else self.kube.get(gvr, namespace, name)

    def _peek(self, gvr: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        """From the cache only (its first read in a namespace is a LIST that primes it): for a child that,
        when missing, is created with a POST, which fails rather than take over one the cache did not see."""
        return self.cache.lookup(gvr, namespace or "default", name) if self.cache else self.kube.get(gvr, namespace, name)

    def _get_live(self, gvr: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        return self.cache.get_live(gvr, namespace, name) if self.cache else self.kube.get(gvr, namespace, name)

    def _list(self, gvr: tuple[str, str, str], namespace: str | None, selector: str) -> list[Obj]:
        return self.cache.list_objects(gvr, namespace, selector) if self.cache else self.kube.list_objects(gvr, namespace, selector)

    def forget(self, namespace: str, name: str) -> None:
        self.phases.pop((namespace, name), None)
        self._settled.pop((namespace, name), None)
        self.uids.pop((namespace, name), None)
        self._kuberay_owed.pop((namespace, name), None)
        self.ray_clusters.pop((namespace, name), None)
        for uid in self._rayjob_uids.pop((namespace, name), set()):
            self.final_rayjob_status.pop(uid, None)
        self.metrics.forget(namespace, name)

    def progress_only(self, namespace: str, name: str, obj: Obj) -> bool:
        """Whether a watch event's FinetuneJob differs from what this job's last reconcile left only in the
        progress fields (status.training/step/network/runtimePhase), while it runs and is not stalled: then a
        reconcile would change nothing, and none is queued. At 100 reporting jobs each progress write came
        back as a watch event and cost a full reconcile (20 a second). What progress does decide is still
        reconciled: the first report of a starting job (it is not Running yet), the recovery of a stalled
        one, network health (the flusher queues that itself), and the stall timer (scheduled separately)."""
        seen = self._settled.get((namespace, name))
        status: Obj = obj.get("status") or {}
        if seen is None or status.get("phase") != Phase.running.value:
            return False
        if any(c.get("type") == STALLED and c.get("status") == "True" for c in status.get("conditions") or []):
            return False
        return settled_fingerprint(obj.get("metadata") or {}, status) == seen

    def observe_rayjob(self, namespace: str, job_name: str, rayjob: Obj, deleted: bool = False) -> None:
        """Called with every watched RayJob (also the DELETED event's last state)."""
        meta = rayjob.get("metadata") or {}
        uid = meta.get("uid")
        st = rayjob.get("status") or {}
        key = (namespace, job_name)
        cluster = st.get("rayClusterName")
        if deleted or meta.get("deletionTimestamp"):
            # A RayJob on its way out (also the old one of a job deleted and re-created under its name)
            # never names the current cluster; forgetting its own entry only makes the fence permissive.
            if cluster and self.ray_clusters.get(key) == cluster:
                del self.ray_clusters[key]
        elif cluster and self.uids.get(key) and owned_by(rayjob, self.uids[key]):
            # Only the job's own RayJob names its cluster: a RayJob someone else labelled with the job (a
            # copy, a previous job's under the name) would fence off the real pods' reports. Before the job's
            # first reconcile here its UID is unknown: that reconcile records the cluster (below).
            self.ray_clusters[key] = cluster
        if uid and st.get("jobDeploymentStatus") in ("Complete", "Failed", "ValidationFailed"):
            self.final_rayjob_status[uid] = dict(st)
            self._rayjob_uids.setdefault((namespace, job_name), set()).add(uid)

    def reconcile(self, namespace: str, name: str) -> str | None:
        """Returns the phase after reconciling (None if the job is gone)."""
        if name == RUNTIMES_KEY:
            self.collect_runtimes(namespace)
            return None
        started = time.monotonic()
        result = "ok"
        try:
            return self._reconcile(namespace, name)
        except ObjectReplaced as err:
            # The job this reconcile read was deleted and another was created under its name meanwhile: its
            # status write was refused (UID-guarded); the new job gets a reconcile of its own.
            log.info("%s/%s: %s; reconciling the new object", namespace, name, err)
            self.requeue_after(namespace, name, 0.0)
            return None
        except Exception as err:
            result = "error"
            self.metrics.reconcile_errors.labels(type(err).__name__).inc()
            self._report_error(namespace, name, err)
            raise
        finally:
            self.metrics.reconciles.labels(result).inc()
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)
            self.metrics.mirror_api_calls(self.kube)

    def collect_runtimes(self, namespace: str) -> list[str]:
        """Delete the namespace's runtime ConfigMaps no job needs any more (runtime_configmaps.py), judged by the jobs,
        RayJobs and RayClusters the watches have delivered (no LIST of them: a collection follows deletions,
        and priming the cache there would cost three per namespace). Should the cache lack a job, the
        collection errs towards deleting, and the job's next reconcile creates the ConfigMap again."""
        def held(gvr: tuple[str, str, str], selector: str) -> list[Obj]:
            return self.cache.held(gvr, namespace, selector) if self.cache else self.kube.list_objects(gvr, namespace, selector)
        jobs = [j for j in held(FTJ, "") if (j.get("status") or {}).get("phase") not in TERMINAL
                and not (j.get("metadata") or {}).get("deletionTimestamp")]
        holders = held(RAYJOB, JOB_LABEL) + held(RAYCLUSTER, JOB_LABEL)
        return self.runtimes.collect(namespace, jobs, holders, runtime_hash(self.runtime_files))

    def _report_error(self, namespace: str, name: str, err: Exception) -> None:
        """Make a failing reconcile visible in the job's status (best effort: the API may be what fails)."""
        reason, message = error_reason(err)
        try:
            body = self._get(FTJ, namespace, name)
            if body is None:
                return
            prev = body.get("status") or {}
            conds = [dict(c) for c in prev.get("conditions") or []]
            old = next((c for c in conds if c["type"] == RECONCILED), None)
            if old and (old.get("reason"), old.get("message")) == (reason, message):
                return
            set_condition(conds, RECONCILED, "False", reason, message, self.clock(), body["metadata"].get("generation"))
            self.kube.patch_status(namespace, name, {"conditions": conds}, uid=body["metadata"].get("uid"),
                                   has_status=bool(body.get("status")))
        except Exception as again:  # the original error is what the queue retries and logs
            log.debug("could not record reconcile error for %s/%s: %s", namespace, name, again)

    def _reconcile(self, namespace: str, name: str) -> str | None:
        body = self._get(FTJ, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        meta = body["metadata"]
        self.uids[(namespace, name)] = meta.get("uid") or ""
        prev: Obj = body.get("status") or {}
        names = child_names(name)
        observed = Observed()
        job: s.FinetuneJob | None = None
        cfg = self.cfg
        try:
            job, cfg = self._parse(body, prev, observed)
        except SpecError as err:
            observed.spec_issues = err.issues
        except UnknownInstanceType as err:
            observed.unknown_instance_type = str(err)

        if judged(prev) and (job is None or prev.get("phase") in TERMINAL or not prev.get("instance")
                             and observed.instance is None):
            # Row 24: a judged job whose spec or figures cannot be rendered any more (an operator upgrade's
            # stricter model, an older status without figures whose type has none now), and every finished
            # job: its own RayJob observed, nothing (re-)created or applied.
            self._observe_recorded(namespace, name, names, prev, observed)
        elif job is not None and rayjob_held_suspended(prev, job.spec.suspend):
            held = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
            self._ensure_children(held, prev, names, observed, cfg)
        elif job is not None:
            self._ensure_children(job, prev, names, observed, cfg)

        if observed.rayjob is not None:
            cluster_name = (observed.rayjob.get("status") or {}).get("rayClusterName")
            if cluster_name and not observed.rayjob["metadata"].get("deletionTimestamp"):
                self.ray_clusters[(namespace, name)] = cluster_name  # the job's own RayJob (created or recorded)
            observed.pods = pods_of(self._list(PODS, namespace, f"{JOB_LABEL}={name}"), observed.rayjob)
            observed.pod_events = self._stuck_pod_events(namespace, name, observed.pods)
            if cluster_name and prev.get("phase") not in TERMINAL:
                # Observed only (never created or judged lost): from the cache; not seen yet -> waited for.
                rc = (self.cache.lookup(RAYCLUSTER, namespace, cluster_name) if self.cache
                      else self.kube.get(RAYCLUSTER, namespace, cluster_name))
                if owned_by(rc, observed.rayjob["metadata"].get("uid") or ""):
                    observed.raycluster = rc
            if job is not None and prev.get("phase") not in TERMINAL and prev.get("phase") != Phase.running.value:
                # Capacity matters until the job runs: a running job's Capacity condition stays as it was.
                observed.capacity = self._capacity(job, cfg)
        elif job is not None and not observed.blocked and not observed.rayjob_lost and not judged(prev):
            observed.capacity = self._capacity(job, cfg)

        now = self.clock()
        policy = job.spec.stall_policy if job is not None else None
        observed.watching_since = self.watching_since
        observed.held_report = self.held_report(namespace, name)
        observed.kuberay = self._kuberay_trouble(namespace, name, observed.rayjob, now)
        decision = decide(
            generation=meta.get("generation"),
            suspend=bool((body.get("spec") or {}).get("suspend")),
            names=names,
            prev=prev,
            observed=observed,
            now=now,
            policy=policy,
            detect_stalls=bool(self.cfg.progress_url),  # no progress channel: silence means nothing
            deadline_seconds=job.spec.active_deadline_seconds if job is not None else None,
        )
        new = decision.status
        if decision.action == RayJobAction.resume and job is not None:
            # Before the status write that drops the pending mark: a crash in between resumes it again.
            self.kube.patch(RAYJOB, namespace, names["rayJob"], suspension_patch(job.spec, False), kind="RayJob")
        self._write_status(body, prev, new)
        self._settled[(namespace, name)] = settled_fingerprint(meta, new)
        if decision.action in (RayJobAction.release, RayJobAction.restart) and job is not None:
            # KubeRay deletes the Ray cluster (and frees its GPUs) of a suspended RayJob.
            self.kube.patch(RAYJOB, namespace, names["rayJob"], suspension_patch(job.spec, True), kind="RayJob")
        if decision.action == RayJobAction.restart:
            self.kube.event({"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": meta}, reason="StallRestart",
                            message=str(next(c["message"] for c in new["conditions"] if c["type"] == RUNNING)),
                            type_="Warning", now=self.clock())
        phase = str(new.get("phase"))
        self.phases[(namespace, name)] = phase
        self.metrics.set_phase(namespace, name, phase)
        self.metrics.set_stalled(namespace, name, decision.stalled)
        if observed.blocked:
            self.requeue_rate_limited(namespace, name, BLOCKED_REQUEUE_SECONDS)
        else:
            self.requeue_forget(namespace, name)
        self._schedule_stall_check(namespace, name, new, now, policy.timeout_seconds if policy else None, observed)
        deadline_in = seconds_until_deadline(new, now, job.spec.active_deadline_seconds if job is not None else None)
        if deadline_in is not None:  # row 25: look again when the deadline passes (no event would come then)
            self.requeue_after(namespace, name, deadline_in + 1.0)
        return phase

    def _stuck_pod_events(self, namespace: str, name: str, pods: list[Obj]) -> dict[str, tuple[str, str]]:
        """The latest Warning Event of each pod stuck in ContainerCreating (status.CREATING_STUCK_SECONDS; at
        most 3 pods read); a pod not stuck that long yet brings a look when it would be. Nothing else
        changes on the pod while the kubelet retries a mount, so no watch event would."""
        out: dict[str, tuple[str, str]] = {}
        stuck = stuck_creating(pods, self.clock())
        young = [CREATING_STUCK_SECONDS - age + 1.0 for age in stuck.values() if age < CREATING_STUCK_SECONDS]
        if young:
            self.requeue_after(namespace, name, min(young))
        for pod_name, age in sorted(stuck.items()):
            if age < CREATING_STUCK_SECONDS:
                continue
            if len(out) >= 3:
                break
            try:
                events = self.kube.list_events(namespace, "Pod", pod_name)
            except ApiError as err:  # best effort (no RBAC to list Events, say): the status says less
                log.info("%s/%s: events of pod %s not read: %s", namespace, name, pod_name, err)
                continue
            warnings = [e for e in events if e.get("type") == "Warning"]
            if warnings:
                out[pod_name] = (str(warnings[-1].get("reason") or ""), str(warnings[-1].get("message") or ""))
        return out

    def _kuberay_trouble(self, namespace: str, name: str, rayjob: Obj | None, now: str) -> tuple[str, str] | None:
        """Condition KubeRayReconciling's (reason, message), or None; a look when KubeRay would be overdue."""
        if self.kuberay_incompatible:
            return "KubeRayTooOld", self.kuberay_incompatible
        owed = kuberay_owes(rayjob) if rayjob is not None else None
        if owed is None or rayjob is None:
            self._kuberay_owed.pop((namespace, name), None)
            return None
        meta = rayjob.get("metadata") or {}
        mark = (meta.get("uid"), meta.get("generation"), owed)
        seen = self._kuberay_owed.get((namespace, name))
        if seen is None or seen[0] != mark:  # created, or its spec changed, since: counted from now
            seen = self._kuberay_owed[(namespace, name)] = (mark, now)
        left, trouble = kuberay_overdue(rayjob, owed, seen[1], now, self.kuberay_timeout)
        if trouble is None:
            self.requeue_after(namespace, name, left + 1.0)
        return trouble

    def _schedule_stall_check(self, namespace: str, name: str, status: Obj, now: str, timeout: int | None,
                              observed: Observed) -> None:
        """Look again when the job would turn Stalled if no report arrives (the queue keeps one timer per job)."""
        left = (seconds_until_stall(status, now, timeout, observed.watching_since, observed.held_report)
                if self.cfg.progress_url else None)
        if left is not None:
            self.requeue_after(namespace, name, left)

    def _parse(self, body: Obj, prev: Obj, observed: Observed) -> tuple[s.FinetuneJob, RenderConfig]:
        """The job and the render settings for it (transitions.py rows 1, 23, 24).

        Not judged yet (no RayJob): validated against the instance-type figures (clusterconfig.py: built-in
        table < the admin's ConfigMaps < the cluster's nodes) and the allow-list; the figures go to
        `observed.instance`, to be recorded in status. Judged: never validated again; rendered from the
        figures recorded in status (an older status without them: looked up, recorded if found)."""
        doc = job_document(body)
        itype = str(((body.get("spec") or {}).get("cluster") or {}).get("instanceType") or s.DEFAULT_INSTANCE_TYPE)
        if judged(prev):
            job = parse_model(doc)
            recorded = prev.get("instance")
            if recorded:
                inst: it.InstanceType | None = InstanceFigures.model_validate(recorded).instance_type()
            else:
                inst = it.lookup(itype, self._table(itype))
                observed.instance = InstanceFigures.of(inst).wire() if inst is not None else None
            return job, dataclasses.replace(self.cfg, instance_types={itype: inst} if inst is not None else {})
        table = self._table(itype)
        job = parse_model(doc)
        issues = policy_issues(job.spec, self.cluster_config.allow_list()) if self.cluster_config else []
        if issues:
            raise SpecError(issues)
        inst = it.lookup(itype, table)
        if inst is None:
            raise UnknownInstanceType(unknown_type_message(itype, self.cluster_config.namespace if self.cluster_config
                                                           else "finetune-system"))
        errors = fit_issues(job.spec, table)
        if errors:
            raise SpecError(errors)
        observed.instance = InstanceFigures.of(inst).wire()
        return job, dataclasses.replace(self.cfg, instance_types={itype: inst})

    def _table(self, itype: str) -> Mapping[str, it.InstanceType]:
        if self.cluster_config is not None:
            return self.cluster_config.instance_types(itype)
        return it.INSTANCE_TYPES if self.cfg.instance_types is None else self.cfg.instance_types

    def _observe_recorded(self, ns: str, name: str, names: dict[str, str], prev: Obj, observed: Observed) -> None:
        """Look at the job's own RayJob only (row 24, and finished jobs): never create or apply anything."""
        recorded = prev.get("rayJobUID")
        rj = self._get(RAYJOB, ns, names["rayJob"])
        if prev.get("phase") in TERMINAL:
            # Finished: never re-create children KubeRay or a user cleaned up.
            if rj is not None and rj["metadata"].get("uid") == recorded:
                observed.rayjob = rj
            return
        if rj is None or rj["metadata"].get("uid") != recorded:
            rj = self._get_live(RAYJOB, ns, names["rayJob"])  # lost only on the API server's word
        if rj is None or rj["metadata"].get("uid") != recorded:
            self._lost(ns, name, names, str(recorded), observed)
            return
        observed.rayjob = rj

    def _capacity(self, job: s.FinetuneJob, cfg: RenderConfig | None = None) -> Any:
        nodes = self._list(NODES, None, f"node.kubernetes.io/instance-type={job.spec.cluster.instance_type}")
        return check_capacity(job.spec, nodes, (cfg or self.cfg).instance_types)

    def _ensure_children(self, job: s.FinetuneJob, prev: Obj, names: dict[str, str], observed: Observed,
                         cfg: RenderConfig | None = None) -> None:
        ns = job.metadata.namespace or "default"
        uid = job.metadata.uid or ""
        recorded = prev.get("rayJobUID")
        rayjob_now: Obj | None = None
        if recorded:
            rayjob_now = self._get(RAYJOB, ns, names["rayJob"])
            if rayjob_now is None or rayjob_now["metadata"].get("uid") != recorded:
                # Lost only on the API server's word, never on the cache's (it may lag behind).
                rayjob_now = self._get_live(RAYJOB, ns, names["rayJob"])
            if rayjob_now is None or rayjob_now["metadata"].get("uid") != recorded:
                self._lost(ns, job.metadata.name, names, recorded, observed)
                return
        # The child names are the job's own (child_names): a crash between creating a child and recording it
        # in status can never lead to a second, differently named child, so they are recorded by this
        # reconcile's status write, not by a write of their own before anything is created.
        try:
            # A job keeps the runtime its RayJob was created with (runtime_configmaps.py: Runtimes.files_for).
            desired = render_children(job, self.runtimes.files_for(ns, rayjob_now, self.runtime_files), cfg or self.cfg)
        except SpecError as err:
            observed.spec_issues = err.issues
            if recorded:
                observed.rayjob = rayjob_now  # row 24: a judged job is observed, not failed
            return
        # The runtime ConfigMap may have gone behind this process's back (runtime_configmaps.py): ask the API
        # server before the pods that mount it exist (no RayJob yet) and while a pod of the job waits to be
        # created (a missing ConfigMap keeps it in ContainerCreating: FailedMount); else trust what is known.
        verify = ((not recorded and self._peek(RAYJOB, ns, names["rayJob"]) is None)
                  or bool(stuck_creating(self._list(PODS, ns, f"{JOB_LABEL}={job.metadata.name}"), self.clock())))
        for obj in [o for o in desired if is_shared(o)]:
            self.runtimes.ensure(obj, verify=verify)
        desired = [o for o in desired if not is_shared(o)]
        # The RayJob observed above is the one judged: a second GET could see it gone and lead to its
        # re-creation (apply is create-or-update); the recorded UID in the apply body closes that race.
        # An unrecorded child is looked up in the cache only: if it is missing there, a POST creates it, and
        # the API server's 409 (the name is taken) is what sends this reconcile to look at the live object
        # (ours from a crashed reconcile: adopted; anyone else's: never taken over). One request instead of
        # a GET and an apply.
        current = {o["metadata"]["name"]: rayjob_now if recorded and o["metadata"]["name"] == names["rayJob"]
                   else self._peek(gvr_of(o), ns, o["metadata"]["name"]) for o in desired}
        pins = {names["rayJob"]: str(recorded)} if recorded else {}
        for obj in desired:
            name = obj["metadata"]["name"]
            (action,) = plan_children([obj], current, uid, pins)
            if action.apply and current[name] is None and name not in pins:
                log.info("%s/%s: creating %s %s", ns, job.metadata.name, obj["kind"], name)
                try:
                    current[name] = self.kube.create(gvr_of(obj), ns, action.obj, obj["kind"])
                    continue
                except ApiError as err:
                    if err.status != 409:
                        if self._refused(err, action, observed):
                            return
                        raise
                current[name] = self._get_live(gvr_of(obj), ns, name)
                (action,) = plan_children([obj], current, uid, pins)
            if action.blocked:
                observed.blocked = action.blocked
                return
            if action.lost:
                self._lost(ns, job.metadata.name, names, str(recorded), observed)
                return
            if action.apply:
                if action.drift:
                    why = (f"{action.obj['kind']} {name} was changed outside the operator ({', '.join(action.drift)}); "
                           "reverted to what the FinetuneJob says (change the FinetuneJob instead)")
                    log.info("%s/%s: %s", ns, job.metadata.name, why)
                    self.kube.event({"apiVersion": s.API_VERSION, "kind": s.KIND,
                                     "metadata": {"name": job.metadata.name, "namespace": ns, "uid": uid}},
                                    reason="DriftReverted", message=why, type_="Warning", now=self.clock())
                try:
                    log.info("%s/%s: applying %s %s (%s)", ns, job.metadata.name, action.obj["kind"], name,
                             "update" if current[name] is not None else "create")
                    if current[name] is not None:
                        self.kube.own_for_apply(action.obj)  # created by a POST: see Kube.own_for_apply
                    current[name] = self.kube.apply(action.obj)
                except ApiError as err:
                    if err.status == 409 and name in pins:
                        # The recorded RayJob vanished between the GET and the apply (the UID made the
                        # apply fail instead of creating a new one): it is lost.
                        self._lost(ns, job.metadata.name, names, pins[name], observed)
                        return
                    if self._refused(err, action, observed):
                        return
                    raise
        if recorded is None:
            failpoint("reconcile/after-create")  # created, not recorded: the worst moment to die
        # The RayJob's UID is recorded by this reconcile's status write (derive_status copies it from the
        # RayJob observed here, in the same reconcile as its creation): from then on, if it disappears, it
        # is never re-created. A failure before that write leaves an unrecorded RayJob this job owns, which
        # the next reconcile adopts.
        observed.rayjob = current.get(names["rayJob"])

    @staticmethod
    def _refused(err: ApiError, action: ChildAction, observed: Observed) -> bool:
        """A write of a child the API server refused for a reason to wait out, not to retry at once."""
        if err.status == 403 and "being terminated" in err.message:
            return True  # the namespace is going away, and this job with it
        if err.status in (400, 422):
            # Admission (a policy, a webhook, a KubeRay CRD of another version) refused it. The cause can go
            # away: not terminal, retried.
            observed.blocked = ("ChildRejected", f"{action.obj['kind']} {action.obj['metadata']['name']} rejected by the "
                                                 f"API server: {err.message}"[:1000])
            return True
        return False

    def _lost(self, ns: str, name: str, names: dict[str, str], recorded: str, observed: Observed) -> None:
        """Our RayJob is gone. Never create another one: that would run the training again."""
        observed.rayjob_lost = True
        observed.last_rayjob_status = self.final_rayjob_status.get(recorded)
        log.info("%s/%s: RayJob %s (uid %s) is gone; not re-created", ns, name, names["rayJob"], recorded)

    def _write_status(self, body: Obj, prev: Obj, new: Obj) -> None:
        meta = body["metadata"]
        managed_prev = {k: v for k, v in prev.items() if k not in PROGRESS_FIELDS}
        managed_new = {k: v for k, v in new.items() if k not in PROGRESS_FIELDS}
        if managed_prev == managed_new:
            return  # nothing changed: no write (an idle operator makes no API writes)
        patch = dict(managed_new)
        for k in managed_prev:
            if k not in managed_new:
                patch[k] = None
        self.kube.patch_status(meta["namespace"], meta["name"], patch, uid=meta.get("uid"), has_status=bool(prev))
        old_phase, new_phase = prev.get("phase"), new.get("phase")
        if old_phase != new_phase:
            self.kube.event(
                {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": meta},
                reason=str(new_phase),
                message=str(new.get("message") or new_phase),
                type_="Warning" if new_phase == Phase.failed.value else "Normal",
                now=self.clock(),
            )
        for ctype, reason_status in ((STALLED, "True"),):
            c_new = next((c for c in new.get("conditions") or [] if c["type"] == ctype), None)
            c_old = next((c for c in prev.get("conditions") or [] if c["type"] == ctype), None)
            if c_new and c_new["status"] == reason_status and (not c_old or c_old["status"] != reason_status):
                self.kube.event({"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": meta},
                                reason="Stalled", message=str(c_new["message"]), type_="Warning", now=self.clock())
        blocked = next((c for c in new.get("conditions") or [] if c["type"] == BLOCKED), None)
        was = next((c for c in prev.get("conditions") or [] if c["type"] == BLOCKED), None)
        if blocked and (not was or was.get("reason") != blocked.get("reason")):
            self.kube.event({"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": meta},
                            reason=str(blocked["reason"]), message=str(blocked["message"]), type_="Warning",
                            now=self.clock())


def error_reason(err: Exception) -> tuple[str, str]:
    """(reason, message) a user can act on, for an exception out of a reconcile."""
    if isinstance(err, ApiError):
        if err.status == 404 and "ray.io" in str(err):
            return ("KubeRayNotInstalled", "the API server does not serve ray.io/v1 RayJobs: install the KubeRay "
                                           f"operator and its CRDs ({err})"[:1000])
        if err.status == 403:
            return "Forbidden", f"the operator is not allowed to do this; check its RBAC (deploy/rbac.yaml): {err}"[:1000]
        if err.status == 401:
            return "Unauthorized", f"the API server rejected the operator's credentials: {err}"[:1000]
        return f"ApiError{err.status}", str(err)[:1000]
    return type(err).__name__, str(err)[:1000] or type(err).__name__
