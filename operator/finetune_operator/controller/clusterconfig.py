"""Configuration the operator reads from the cluster: instance-type figures and the allow-list.

One source for the API server and the operator: the admission policies in deploy/admission.yaml take
their parameters from the same ConfigMaps (labelled `finetune.dev/instance-types=true`, and
`finetune-operator-policy`) in the operator's namespace. An instance type no ConfigMap describes is
taken from the cluster's nodes of that type (their allocatable GPUs, EFA interfaces, CPU and memory),
so new types (g6e, p5e, trn1, ...) work without a release. Reads are cached for `ttl` seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..api import instance_types as it
from ..api.policy import POLICY_NAME, AllowList
from .k8s import CONFIGMAPS, NODES, Kube

Table = dict[str, it.InstanceType]


class ClusterConfig:
    def __init__(self, kube: Kube, namespace: str, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.namespace = namespace
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Any]] = {}
        self._loading: dict[str, threading.Lock] = {}

    def _cached(self, key: str, load: Callable[[], Any]) -> Any:
        """One load per key at a time: when the entry expires, the first reconcile reloads it and the others
        go on with the value they had (four workers used to list the ConfigMaps four times per expiry)."""
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit and hit[0] > now:
                return hit[1]
            loading = self._loading.setdefault(key, threading.Lock())
        if not loading.acquire(blocking=hit is None):
            return hit[1]  # type: ignore[index]  # another thread is reloading it: the previous value meanwhile
        try:
            with self._lock:
                again = self._cache.get(key)
                if again and again[0] > self.clock():
                    return again[1]  # reloaded while this thread waited for the first load
            value = load()
            with self._lock:
                self._cache[key] = (self.clock() + self.ttl, value)
            return value
        finally:
            loading.release()

    def _configured(self) -> Table:
        def load() -> Table:
            items = self.kube.list_objects(CONFIGMAPS, self.namespace, f"{it.PARAMS_LABEL}=true")
            layers = [
                it.from_params(cm.get("data") or {}, f"ConfigMap {self.namespace}/{cm['metadata']['name']}")
                for cm in sorted(items, key=lambda c: str(c["metadata"]["name"]))
            ]
            return it.merged(it.INSTANCE_TYPES, *layers)

        return self._cached("configured", load)  # type: ignore[no-any-return]

    def _from_nodes(self, itype: str) -> it.InstanceType | None:
        def load() -> it.InstanceType | None:
            nodes = self.kube.list_objects(NODES, None, f"node.kubernetes.io/instance-type={itype}")
            found = [t for t in (it.from_node(n) for n in sorted(nodes, key=lambda n: str(n["metadata"]["name"]))) if t]
            # The node offering the most: a partly used or cordoned node must not shrink the figures.
            return max(found, key=lambda t: (t.gpus, t.allocatable_memory_mib, t.allocatable_cpu_millis), default=None)

        return self._cached(f"nodes/{itype}", load)  # type: ignore[no-any-return]

    def instance_types(self, itype: str) -> Table:
        """The table for a job of instance type `itype`: built-in < ConfigMaps; the cluster's nodes for a
        type neither knows."""
        table = dict(self._configured())
        if itype not in table:
            node_type = self._from_nodes(itype)
            if node_type is not None:
                table[itype] = node_type
        return table

    def allow_list(self) -> AllowList:
        def load() -> AllowList:
            cm = self.kube.get(CONFIGMAPS, self.namespace, POLICY_NAME)
            if cm is None:
                return AllowList()
            return AllowList.from_data(cm.get("data") or {}, f"ConfigMap {self.namespace}/{POLICY_NAME}")

        return self._cached("policy", load)  # type: ignore[no-any-return]
