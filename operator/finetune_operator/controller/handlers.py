"""kopf wiring: every handler is a one-liner that turns a watch event into a queued reconcile.

Only `on.event` handlers are used: they persist nothing on the objects (no kopf annotations, no
finalizers, no kopf-posted Events), so the operator's writes are exactly the ones it decides on.
"""

from __future__ import annotations

import time
from typing import Any

import kopf

from ..api import spec as s
from ..render.rayjob import INSTANCE_LABEL, JOB_LABEL
from .progress import ProgressServer
from .reconcile import TERMINAL, Reconciler
from .workqueue import WorkQueue

NODE_DEBOUNCE_SECONDS = 10.0


def build_registry(queue: WorkQueue, reconciler: Reconciler, progress: ProgressServer) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    last_node_sweep = [0.0]

    @kopf.on.event(s.GROUP, s.VERSION, s.PLURAL, registry=registry)
    def finetunejob(**kw: Any) -> None:
        namespace, name = kw["namespace"], kw["name"]
        if kw["event"].get("type") == "DELETED":
            reconciler.forget(namespace, name)
            progress.forget(namespace, name)
        else:
            queue.add(namespace, name)

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def rayjob(**kw: Any) -> None:
        reconciler.observe_rayjob(kw["namespace"], kw["labels"][JOB_LABEL], kw["event"].get("object") or {},
                                  deleted=kw["event"].get("type") == "DELETED")
        queue.add(kw["namespace"], kw["labels"][JOB_LABEL])

    @kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def pod(**kw: Any) -> None:
        queue.add(kw["namespace"], kw["labels"][JOB_LABEL])

    @kopf.on.event("", "v1", "nodes", registry=registry)
    def node(**kw: Any) -> None:
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


def settings_for_embedding() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # we post our own, meaningful Events
    settings.peering.standalone = True  # leadership comes from the Lease (leader.py), not kopf peering
    # Server-side label selectors: the handlers' `labels=` filters run in this process, so without these
    # the operator would stream every pod (and RayJob) of the cluster and drop most of them.
    selectors = settings.watching.label_selectors
    selectors[lambda r: r.group == "" and r.plural == "pods"] = JOB_LABEL
    selectors[lambda r: r.group == "ray.io" and r.plural == "rayjobs"] = JOB_LABEL
    selectors[lambda r: r.group == "" and r.plural == "nodes"] = INSTANCE_LABEL
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings
