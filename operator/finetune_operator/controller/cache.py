"""What the operator reads, served from memory: the objects its watches deliver, kept per resource.

Every reconcile used to GET its FinetuneJob, RayJob, ConfigMap and RayCluster and LIST its pods and the
nodes: ~8 requests each, ~4 reconciles per job on its way to Running. The watches that trigger those
reconciles already carry the objects, so the reconciler reads them from here instead (an informer's
store, as client-go's controllers do).

How it stays right:
- Newest wins. Watch events and the responses to the operator's own writes both feed the store; an
  object is replaced only by one with a higher resourceVersion, so a late watch event never undoes a
  write the reconciler has just made, and a reconcile that follows its own write sees it.
- Deletions leave a tombstone (its resourceVersion) so an older copy arriving afterwards (the response
  to a write that was in flight) does not bring the object back.
- Nothing is assumed from absence before the store has seen it: a by-name read that misses is confirmed
  with a live GET (a recorded RayJob is never called lost on the cache's word), and the first list of a
  resource in a namespace after start is a live LIST (with the watch's selector) that primes it; later
  lists, and by-name reads of what the reconciler only observes (RayClusters), come from here.
- Deletions the watch never announces are caught by relisting. After a watch's resourceVersion expired
  (410 Gone) kopf lists the resource again and hands on every listed object as an event of type None:
  an object deleted meanwhile simply is not among them, and no DELETED event ever comes for it. So each
  store is relisted (a live LIST with the watch's selector, whose contents replace the store's for that
  scope) when a watch relists (`listed`), and every `relist_interval` seconds anyway; and an object a
  UID-guarded write found gone (404) is evicted at once (`gone`).
- Objects are kept slim: only what the reconciler reads (no managedFields, no pod specs, no Ray cluster
  spec), so a thousand jobs cost megabytes, not hundreds of them.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..render.rayjob import INSTANCE_LABEL, JOB_LABEL
from .k8s import FTJ, NODES, PODS, RAYCLUSTER, RAYJOB, Kube

Obj = dict[str, Any]
Gvr = tuple[str, str, str]
log = logging.getLogger("finetune.cache")
TOMBSTONE_SECONDS = 600.0
# Events of type None closer together than this belong to one listing (kopf hands them on one by one).
LISTING_GAP_SECONDS = 5.0

_META_DROP = ("managedFields",)


def _meta(obj: Obj) -> Obj:
    return {k: v for k, v in (obj.get("metadata") or {}).items() if k not in _META_DROP}


def _slim_rayjob(obj: Obj) -> Obj:
    # The reconciler reads the RayJob's metadata (UID, owners, render hash, deletion), its status, and the
    # top-level scalar spec fields (suspend, drift detection): not the Ray cluster spec it embeds.
    spec = {k: v for k, v in (obj.get("spec") or {}).items() if isinstance(v, (str, int, float, bool))}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": _meta(obj), "spec": spec,
            "status": obj.get("status") or {}}


def _slim_raycluster(obj: Obj) -> Obj:
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": _meta(obj),
            "status": obj.get("status") or {}}


def _slim_pod(obj: Obj) -> Obj:
    st = obj.get("status") or {}
    keep = ("phase", "conditions", "containerStatuses", "initContainerStatuses", "reason", "message")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": _meta(obj),
            "spec": {"nodeName": (obj.get("spec") or {}).get("nodeName")},
            "status": {k: st[k] for k in keep if k in st}}


def _slim_node(obj: Obj) -> Obj:
    st, spec = obj.get("status") or {}, obj.get("spec") or {}
    meta = _meta(obj)
    meta.pop("annotations", None)
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta,
            "spec": {k: spec[k] for k in ("taints", "unschedulable") if k in spec},
            "status": {k: st[k] for k in ("allocatable", "capacity", "conditions") if k in st}}


def _slim_plain(obj: Obj) -> Obj:
    return {**obj, "metadata": _meta(obj)}


SLIM: dict[Gvr, Callable[[Obj], Obj]] = {
    FTJ: _slim_plain,
    RAYJOB: _slim_rayjob,
    RAYCLUSTER: _slim_raycluster,
    PODS: _slim_pod,
    NODES: _slim_node,
}
# The label selector of each resource's watch (handlers.py gives kopf the same): a store holds only objects
# its watch delivers, so it never keeps one no event will ever update or delete.
WATCH_SELECTORS: dict[Gvr, str | None] = {
    FTJ: None,
    RAYJOB: JOB_LABEL,
    RAYCLUSTER: JOB_LABEL,
    PODS: JOB_LABEL,
    NODES: INSTANCE_LABEL,
}
KINDS: dict[str, Gvr] = {"FinetuneJob": FTJ, "RayJob": RAYJOB, "RayCluster": RAYCLUSTER, "Pod": PODS, "Node": NODES}


def _rv(obj: Obj) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:  # opaque resourceVersions (not etcd): newest received wins
        return 0


def parse_selector(selector: str | None) -> list[tuple[str, str | None]]:
    """`a=b,c` -> [(a, b), (c, None)]: equality and existence terms (all the operator uses)."""
    terms: list[tuple[str, str | None]] = []
    for part in (selector or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            terms.append((k.strip().rstrip("="), v.strip()))
        else:
            terms.append((part, None))
    return terms


def matches(obj: Obj, terms: list[tuple[str, str | None]]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(k in labels and (v is None or labels[k] == v) for k, v in terms)


class Store:
    """One resource's objects by (namespace, name). Thread-safe."""

    def __init__(self, gvr: Gvr, clock: Callable[[], float] = time.monotonic):
        self.gvr = gvr
        self.slim = SLIM.get(gvr, _slim_plain)
        self.terms = parse_selector(WATCH_SELECTORS.get(gvr))
        self.clock = clock
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], Obj] = {}
        self._tombstones: dict[tuple[str, str], tuple[int, float]] = {}

    @staticmethod
    def key(obj: Obj) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return str(meta.get("namespace") or ""), str(meta.get("name") or "")

    def upsert(self, obj: Obj) -> None:
        if not matches(obj, self.terms):
            return  # not what the watch delivers (e.g. a user's RayJob a live GET found): never kept
        key, rv = self.key(obj), _rv(obj)
        with self._lock:
            cur = self._objects.get(key)
            if cur is not None and rv and _rv(cur) > rv:
                return  # an older copy (a watch event behind a write this process made)
            dead = self._tombstones.get(key)
            if dead is not None:
                if rv and rv <= dead[0]:
                    return  # the object was deleted after this copy was taken
                del self._tombstones[key]
            self._objects[key] = self.slim(obj)

    def delete(self, obj: Obj) -> None:
        key, rv = self.key(obj), _rv(obj)
        with self._lock:
            cur = self._objects.get(key)
            if cur is not None and rv and _rv(cur) > rv:
                return  # a newer object of that name already replaced the deleted one
            self._objects.pop(key, None)
            self._tombstones[key] = (rv, self.clock())
            if len(self._tombstones) > 1024:
                cutoff = self.clock() - TOMBSTONE_SECONDS
                self._tombstones = {k: t for k, t in self._tombstones.items() if t[1] >= cutoff}

    def get(self, namespace: str | None, name: str) -> Obj | None:
        """A copy: callers may change what they read without changing the store."""
        with self._lock:
            obj = self._objects.get((namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def version(self, namespace: str | None, name: str) -> str | None:
        with self._lock:
            obj = self._objects.get((namespace or "", name))
        return str((obj.get("metadata") or {}).get("resourceVersion") or "") or None if obj is not None else None

    def select(self, namespace: str | None, selector: str | None) -> list[Obj]:
        terms = parse_selector(selector)
        with self._lock:
            objs = list(self._objects.items())
        return [copy.deepcopy(o) for (ns, _), o in objs if (namespace is None or ns == namespace) and matches(o, terms)]

    def replace(self, namespace: str | None, selector: str | None, items: list[Obj], list_rv: str = "") -> list[Obj]:
        """A live LIST of (namespace, selector) taken at resourceVersion `list_rv`: what it lacks is gone
        unless a watch event newer than the list brought it, what it has is current unless newer.
        Returns the objects it removed (each leaves a tombstone at the list's version)."""
        terms = parse_selector(selector)
        try:
            at = int(list_rv)
        except ValueError:
            at = 0
        listed = {self.key(o) for o in items}
        removed: list[Obj] = []
        with self._lock:
            for key in [k for k, o in self._objects.items()
                        if k not in listed and (namespace is None or k[0] == namespace) and matches(o, terms)
                        and (not at or _rv(o) <= at)]:
                removed.append(self._objects.pop(key))
                self._tombstones[key] = (at or _rv(removed[-1]), self.clock())
        for obj in items:
            self.upsert(obj)
        return removed

    def evict(self, namespace: str | None, name: str) -> Obj | None:
        """The API server said the object is gone: drop it, leaving a tombstone at the version held."""
        with self._lock:
            obj = self._objects.pop((namespace or "", name), None)
            if obj is not None:
                self._tombstones[(namespace or "", name)] = (_rv(obj), self.clock())
        return obj

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)


class Cache:
    """The stores of every resource the reconciler reads, and the read rules (see the module doc)."""

    def __init__(self, kube: Kube, namespaces: list[str] | None = None, relist_interval: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.stores: dict[Gvr, Store] = {gvr: Store(gvr) for gvr in SLIM}
        self._primed: set[tuple[Gvr, str | None, str | None]] = set()
        self._lock = threading.Lock()
        self.live_reads = 0  # GETs and LISTs that went to the API server (misses and priming)
        # What the watches cover (None: every namespace), so a relist lists what they deliver and no more.
        self.namespaces = namespaces or None
        self.relist_interval = relist_interval  # 0: only after a watch relisted
        self.clock = clock
        self._relisted: dict[Gvr, float] = {gvr: clock() for gvr in SLIM}
        self._relist_wanted: set[Gvr] = set()
        self._last_listed: dict[Gvr, float] = {}
        self.relists = 0
        self.evicted = 0

    # ------------------------------------------------------------------------------------- feeding
    def observe(self, gvr: Gvr, obj: Obj, deleted: bool = False) -> None:
        """A watch event's object (DELETED: its last state)."""
        store = self.stores.get(gvr)
        if store is None or not (obj.get("metadata") or {}).get("name"):
            return
        if deleted:
            store.delete(obj)
        else:
            store.upsert(obj)

    def written(self, obj: Obj) -> None:
        """The API server's answer to one of the operator's writes (the object as stored)."""
        gvr = KINDS.get(str(obj.get("kind") or ""))
        if gvr is not None and (obj.get("metadata") or {}).get("resourceVersion"):
            self.stores[gvr].upsert(obj)

    def gone(self, gvr: Gvr, namespace: str | None, name: str) -> None:
        """A write guarded by the object's UID was answered 404: the object no longer exists."""
        store = self.stores.get(gvr)
        if store is not None and store.evict(namespace, name) is not None:
            with self._lock:
                self.evicted += 1
            log.info("evicted %s %s/%s: a write found it gone", gvr[2], namespace, name)

    def listed(self, gvr: Gvr) -> None:
        """A watch event of type None: kopf is handing on a LIST of the resource, after (re)connecting. The
        first such event of a burst asks for a relist, unless the store is empty (then no object can be
        missing from the listing)."""
        now = self.clock()
        with self._lock:
            last, self._last_listed[gvr] = self._last_listed.get(gvr), now
            new_listing = last is None or now - last > LISTING_GAP_SECONDS
        store = self.stores.get(gvr)
        if new_listing and store is not None and len(store):
            with self._lock:
                self._relist_wanted.add(gvr)

    def relists_due(self) -> list[Gvr]:
        """The resources to relist now: after a watch relisted them, or `relist_interval` since the last."""
        now = self.clock()
        with self._lock:
            return [gvr for gvr in self.stores if gvr in self._relist_wanted
                    or self.relist_interval and now - self._relisted[gvr] >= self.relist_interval]

    def relist(self, gvr: Gvr) -> list[Obj]:
        """Replace the store's contents with a live LIST per watched scope (the watch's selector); returns
        the objects it held that the API server no longer has (deletions the watch never announced)."""
        store, selector = self.stores[gvr], WATCH_SELECTORS.get(gvr)
        scopes: list[str | None] = [None] if gvr == NODES or self.namespaces is None else list(self.namespaces)
        removed: list[Obj] = []
        with self._lock:
            self._relist_wanted.discard(gvr)  # a listing that starts during this LIST asks again
        try:
            for ns in scopes:
                with self._lock:
                    self.live_reads += 1
                removed += store.replace(ns, selector, *self.kube.list_with_version(gvr, ns, selector))
        except Exception:
            with self._lock:
                self._relist_wanted.add(gvr)  # tried again at the next look
            raise
        with self._lock:
            self._relisted[gvr] = self.clock()
            self.relists += 1
            self.evicted += len(removed)
        for obj in removed:
            meta = obj.get("metadata") or {}
            log.info("relist of %s: %s/%s is gone (its deletion was never watched)", gvr[2],
                     meta.get("namespace"), meta.get("name"))
        return removed

    # -------------------------------------------------------------------------------------- reading
    def get(self, gvr: Gvr, namespace: str | None, name: str) -> Obj | None:
        """From memory; a miss is confirmed by a live GET (the store may not have seen it yet)."""
        store = self.stores.get(gvr)
        if store is not None:
            hit = store.get(namespace, name)
            if hit is not None:
                return hit
        return self.get_live(gvr, namespace, name)

    def version(self, gvr: Gvr, namespace: str | None, name: str) -> str | None:
        """The resourceVersion the cache holds (no copy); a miss is confirmed by a live GET."""
        store = self.stores.get(gvr)
        found = store.version(namespace, name) if store is not None else None
        if found is None:
            live = self.get_live(gvr, namespace, name)
            found = str(((live or {}).get("metadata") or {}).get("resourceVersion") or "") or None
        return found

    def get_live(self, gvr: Gvr, namespace: str | None, name: str) -> Obj | None:
        with self._lock:
            self.live_reads += 1
        obj = self.kube.get(gvr, namespace, name)
        store = self.stores.get(gvr)
        if obj is not None and store is not None:
            store.upsert(obj)
            return store.get(namespace, name) or obj
        return obj

    def _prime(self, gvr: Gvr, namespace: str | None) -> Store:
        """The first read of a resource in a namespace (None: cluster-wide or cluster-scoped) after start is
        a live LIST with the watch's selector: from then on the watch keeps the store complete there."""
        store = self.stores[gvr]
        scope = WATCH_SELECTORS.get(gvr)
        key = (gvr, namespace, scope)
        if key not in self._primed:
            with self._lock:
                self.live_reads += 1
            store.replace(namespace, scope, *self.kube.list_with_version(gvr, namespace, scope))
            with self._lock:
                self._primed.add(key)
        return store

    def list_objects(self, gvr: Gvr, namespace: str | None, selector: str | None) -> list[Obj]:
        """Objects of `namespace` matching `selector` (which narrows the watch's own selector)."""
        if gvr not in self.stores:
            return self.kube.list_objects(gvr, namespace, selector)
        return self._prime(gvr, namespace).select(namespace, selector)

    def held(self, gvr: Gvr, namespace: str, selector: str | None) -> list[Obj]:
        """What the store holds now (watch events and write answers), without priming it: for the runtime
        collector (runtime_configmaps.py), which must not cost a LIST per namespace and whose mistakes heal (a job's
        next reconcile re-creates a runtime ConfigMap it needs)."""
        return self.stores[gvr].select(namespace, selector)

    def lookup(self, gvr: Gvr, namespace: str, name: str) -> Obj | None:
        """By name, from the primed store only: for objects whose absence the reconciler never acts on (a
        RayCluster not seen yet is waited for; its watch event queues the job again)."""
        return self._prime(gvr, namespace).get(namespace, name)

    def sizes(self) -> dict[str, int]:
        return {gvr[2]: len(store) for gvr, store in self.stores.items()}
