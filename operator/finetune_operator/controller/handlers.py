"""kopf wiring: every handler is a one-liner that turns a watch event into a queued reconcile.

Only `on.event` handlers are used: they persist nothing on the objects (no kopf annotations, no
finalizers, no kopf-posted Events), so the operator's writes are exactly the ones it decides on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import kopf

from ..api import spec as s
from ..render.rayjob import JOB_LABEL
from .cache import WATCH_SELECTORS, Cache, Gvr
from .k8s import FTJ, NODES, PODS, RAYCLUSTER, RAYJOB
from .progress import ProgressServer
from .reconcile import Reconciler
from .runtime_configmaps import RUNTIMES_KEY
from .transitions import TERMINAL
from .workqueue import WorkQueue

NODE_DEBOUNCE_SECONDS = 10.0
# After a job, RayJob or RayCluster is deleted, its namespace's unused runtime ConfigMaps are collected
# (runtime_configmaps.py) once things have settled: a burst of deletions costs one collection.
COLLECT_DELAY_SECONDS = 10.0


def _fed(cache: Cache | None, gvr: tuple[str, str, str], kw: dict[str, Any]) -> bool:
    """Give the event's object to the cache; True if it was a deletion."""
    event = kw["event"]
    deleted = bool(event.get("type") == "DELETED")
    if cache is not None:
        if event.get("type") is None:  # a listing (kopf's first, or after a 410): the cache relists too
            cache.listed(gvr)
        cache.observe(gvr, event.get("object") or {}, deleted=deleted)
    return deleted


def evicted(queue: WorkQueue, reconciler: Reconciler, progress: ProgressServer) -> Callable[[Gvr, dict[str, Any]], None]:
    """What a watched deletion would have done, for an object a relist of the cache found gone."""
    def handle(gvr: Gvr, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        if gvr == FTJ:
            reconciler.forget(namespace, name)
            progress.forget(namespace, name)
        elif (job := (meta.get("labels") or {}).get(JOB_LABEL)) and gvr != NODES:
            queue.add(namespace, job)  # its reconcile confirms the absence with a live read
    return handle


def build_registry(queue: WorkQueue, reconciler: Reconciler, progress: ProgressServer,
                   cache: Cache | None = None) -> kopf.OperatorRegistry:
    """The watches: each event feeds the read cache (cache.py) first, then queues its job's reconcile."""
    registry = kopf.OperatorRegistry()
    last_node_sweep = [0.0]
    collect_due: dict[str, float] = {}

    def collect_later(namespace: str) -> None:
        now = time.monotonic()
        if collect_due.get(namespace, 0.0) > now:
            return  # one is scheduled already, and will see this deletion too
        collect_due[namespace] = now + COLLECT_DELAY_SECONDS
        queue.add_after(namespace, RUNTIMES_KEY, COLLECT_DELAY_SECONDS)

    @kopf.on.event(s.GROUP, s.VERSION, s.PLURAL, registry=registry)
    def finetunejob(**kw: Any) -> None:
        namespace, name = kw["namespace"], kw["name"]
        if _fed(cache, FTJ, kw):
            reconciler.forget(namespace, name)
            progress.forget(namespace, name)
            collect_later(namespace)
        elif not reconciler.progress_only(namespace, name, kw["event"].get("object") or {}):
            queue.add(namespace, name)

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def rayjob(**kw: Any) -> None:
        deleted = _fed(cache, RAYJOB, kw)
        reconciler.observe_rayjob(kw["namespace"], kw["labels"][JOB_LABEL], kw["event"].get("object") or {},
                                  deleted=deleted)
        queue.add(kw["namespace"], kw["labels"][JOB_LABEL])
        if deleted:
            collect_later(kw["namespace"])

    @kopf.on.event("ray.io", "v1", "rayclusters", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def raycluster(**kw: Any) -> None:
        # KubeRay copies the RayJob's labels onto its RayCluster: its conditions (ReplicaFailure) and
        # worker counts are seen as they change.
        if _fed(cache, RAYCLUSTER, kw):
            collect_later(kw["namespace"])
        queue.add(kw["namespace"], kw["labels"][JOB_LABEL])

    @kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def pod(**kw: Any) -> None:
        _fed(cache, PODS, kw)
        queue.add(kw["namespace"], kw["labels"][JOB_LABEL])

    @kopf.on.event("", "v1", "nodes", registry=registry)
    def node(**kw: Any) -> None:
        _fed(cache, NODES, kw)
        # New capacity may let waiting jobs proceed; heartbeats make this chatty, so sweep at most
        # once per debounce period, and only jobs that are not running or finished.
        now = time.monotonic()
        if now - last_node_sweep[0] < NODE_DEBOUNCE_SECONDS:
            return
        last_node_sweep[0] = now
        for (ns, nm), phase in list(reconciler.phases.items()):
            if phase not in TERMINAL and phase != "Running":
                queue.add(ns, nm)

    return registry


def _resource_is(group: str, plural: str) -> Callable[[Any], bool]:
    return lambda r: bool(r.group == group and r.plural == plural)


def settings_for_embedding() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # we post our own, meaningful Events
    settings.peering.standalone = True  # leadership comes from the Lease (leader.py), not kopf peering
    # Server-side label selectors: the handlers' `labels=` filters run in this process, so without these
    # the operator would stream every pod (and RayJob) of the cluster and drop most of them.
    selectors = settings.watching.label_selectors
    for (group, _, plural), selector in WATCH_SELECTORS.items():
        if selector:
            selectors[_resource_is(group, plural)] = selector
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings
