"""The level-based reconcile: look at the world, close the gap, write status once.

`plan_children` and `derive_status` decide (pure); `Reconciler.reconcile` observes and executes via
the Kube client. Idempotent: with nothing changed it makes no write at all (children carry a hash of
what was rendered; status is compared before patching).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..api import spec as s
from ..api.policy import policy_issues
from ..api.status import Phase
from ..api.validation import Issue, SpecError, parse_job
from ..render.config import RenderConfig
from ..render.rayjob import JOB_LABEL, child_names, is_shared, render_children
from .clusterconfig import ClusterConfig
from .k8s import FTJ, NODES, PODS, RAYCLUSTER, RAYJOB, ApiError, Kube, gvr_of
from .metrics import Metrics
from .preflight import check_capacity
from .shared import ensure_shared
from .status import Observed, derive_status

Obj = dict[str, Any]
HASH_ANNOTATION = "finetune.dev/render-hash"
TERMINAL = {Phase.succeeded.value, Phase.failed.value}
log = logging.getLogger("finetune.reconcile")


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
    obj: Obj  # desired, with hash annotation
    apply: bool  # False: observed already matches
    conflict: str | None = None


def plan_children(desired: list[Obj], observed: Mapping[str, Obj | None], owner_uid: str) -> list[ChildAction]:
    """Pure: which children to (re)apply. `observed` is keyed by child name."""
    actions = []
    for obj in desired:
        want = with_hash(obj)
        name = obj["metadata"]["name"]
        cur = observed.get(name)
        if cur is None:
            actions.append(ChildAction(want, True))
            continue
        owners = {r.get("uid") for r in cur["metadata"].get("ownerReferences") or []}
        if owner_uid not in owners:
            actions.append(ChildAction(want, False, f"{obj['kind']} {name} already exists and is not owned by this FinetuneJob; "
                                                    "delete or rename it"))
            continue
        have = (cur["metadata"].get("annotations") or {}).get(HASH_ANNOTATION)
        actions.append(ChildAction(want, have != want["metadata"]["annotations"][HASH_ANNOTATION]))
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
        cluster_config: ClusterConfig | None = None,
    ):
        self.kube = kube
        self.cfg = cfg
        self.cluster_config = cluster_config
        self.runtime_files = dict(runtime_files)
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.phases: dict[tuple[str, str], str] = {}

    def forget(self, namespace: str, name: str) -> None:
        self.phases.pop((namespace, name), None)
        self.metrics.forget(namespace, name)

    def reconcile(self, namespace: str, name: str) -> str | None:
        """Returns the phase after reconciling (None if the job is gone)."""
        started = time.monotonic()
        result = "ok"
        try:
            return self._reconcile(namespace, name)
        except Exception as err:
            result = "error"
            self.metrics.reconcile_errors.labels(type(err).__name__).inc()
            raise
        finally:
            self.metrics.reconciles.labels(result).inc()
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)
            for key, n in list(self.kube.writes.items()):
                verb, kind = key.split(" ", 1)
                self.metrics.api_writes.labels(verb, kind)._value.set(n)  # mirror the client's counter

    def _reconcile(self, namespace: str, name: str) -> str | None:
        body = self.kube.get(FTJ, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        meta = body["metadata"]
        prev: Obj = body.get("status") or {}
        names = child_names(name)
        observed = Observed()
        job: s.FinetuneJob | None = None
        cfg = self.cfg
        try:
            job, cfg = self._parse(body)
        except SpecError as err:
            observed.spec_issues = err.issues

        if job is not None:
            if prev.get("phase") in TERMINAL:
                # Finished: observe only. Never re-create children KubeRay or a user cleaned up.
                observed.rayjob = self.kube.get(RAYJOB, namespace, names["rayJob"])
            else:
                self._ensure_children(job, prev, names, observed, cfg)

        if job is not None and observed.rayjob is not None:
            observed.pods = self.kube.list_objects(PODS, namespace, f"{JOB_LABEL}={name}")
            cluster_name = (observed.rayjob.get("status") or {}).get("rayClusterName")
            if cluster_name and prev.get("phase") not in TERMINAL:
                observed.raycluster = self.kube.get(RAYCLUSTER, namespace, cluster_name)
            if prev.get("phase") not in TERMINAL:
                observed.capacity = self._capacity(job, cfg)
        elif job is not None and not observed.conflict:
            observed.capacity = self._capacity(job, cfg)

        new = derive_status(
            generation=meta.get("generation"),
            suspend=bool((body.get("spec") or {}).get("suspend")),
            names=names,
            prev=prev,
            observed=observed,
            now=self.clock(),
        )
        if prev.get("phase") in TERMINAL and new.get("phase") not in TERMINAL and observed.rayjob is None:
            new = {**prev, "observedGeneration": meta.get("generation")}  # finished and cleaned up: keep the verdict
        self._write_status(body, prev, new)
        phase = str(new.get("phase"))
        self.phases[(namespace, name)] = phase
        self.metrics.set_phase(namespace, name, phase)
        return phase

    def _parse(self, body: Obj) -> tuple[s.FinetuneJob, RenderConfig]:
        """Validate against the cluster's instance-type figures and allow-list (clusterconfig.py); the
        render settings carry the same figures."""
        if self.cluster_config is None:
            return parse_job(job_document(body)), self.cfg
        itype = str(((body.get("spec") or {}).get("cluster") or {}).get("instanceType") or s.DEFAULT_INSTANCE_TYPE)
        table = self.cluster_config.instance_types(itype)
        job = parse_job(job_document(body), table)
        issues = policy_issues(job.spec, self.cluster_config.allow_list())
        if issues:
            raise SpecError(issues)
        return job, dataclasses.replace(self.cfg, instance_types=table)

    def _capacity(self, job: s.FinetuneJob, cfg: RenderConfig | None = None) -> Any:
        nodes = self.kube.list_objects(NODES, None, f"node.kubernetes.io/instance-type={job.spec.cluster.instance_type}")
        return check_capacity(job.spec, nodes, (cfg or self.cfg).instance_types)

    def _ensure_children(self, job: s.FinetuneJob, prev: Obj, names: dict[str, str], observed: Observed,
                         cfg: RenderConfig | None = None) -> None:
        ns = job.metadata.namespace or "default"
        if prev.get("rayJobName") != names["rayJob"]:
            # Record the child names before creating anything: a crash between create and record can
            # then never lead to a second, differently named child.
            self.kube.patch_status(ns, job.metadata.name, {"rayJobName": names["rayJob"], "configMapName": names["configMap"]})
            if os.environ.get("FINETUNE_TEST_CRASH_AFTER_NAMES") == "1":
                os._exit(137)  # test hook: die like a SIGKILL at the worst moment (see test_operator.py)
        try:
            desired = render_children(job, self.runtime_files, cfg or self.cfg)
        except SpecError as err:
            observed.spec_issues = err.issues
            return
        for obj in [o for o in desired if is_shared(o)]:
            ensure_shared(self.kube, obj)
        desired = [o for o in desired if not is_shared(o)]
        current = {o["metadata"]["name"]: self.kube.get(gvr_of(o), ns, o["metadata"]["name"]) for o in desired}
        for action in plan_children(desired, current, job.metadata.uid or ""):
            if action.conflict:
                observed.conflict = action.conflict
                return
            name = action.obj["metadata"]["name"]
            if action.apply:
                try:
                    current[name] = self.kube.apply(action.obj)
                except ApiError as err:
                    if err.status == 403 and "being terminated" in err.message:
                        return  # the namespace is going away, and this job with it
                    if err.status in (400, 422):
                        observed.spec_issues = [Issue(f"{action.obj['kind']} {name}", f"rejected by the API server: {err.message}")]
                        return
                    raise
        observed.rayjob = current.get(names["rayJob"])

    def _write_status(self, body: Obj, prev: Obj, new: Obj) -> None:
        meta = body["metadata"]
        managed_prev = {k: v for k, v in prev.items() if k not in ("training", "network", "step")}
        managed_new = {k: v for k, v in new.items() if k not in ("training", "network", "step")}
        if managed_prev == managed_new:
            return  # nothing changed: no write (an idle operator makes no API writes)
        patch = dict(managed_new)
        for k in managed_prev:
            if k not in managed_new:
                patch[k] = None
        self.kube.patch_status(meta["namespace"], meta["name"], patch)
        old_phase, new_phase = prev.get("phase"), new.get("phase")
        if old_phase != new_phase:
            self.kube.event(
                {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": meta},
                reason=str(new_phase),
                message=str(new.get("message") or new_phase),
                type_="Warning" if new_phase == Phase.failed.value else "Normal",
                now=self.clock(),
            )
