"""Children shared between jobs: the content-addressed, immutable runtime ConfigMap.

One per namespace and runtime version (`finetune-runtime-<digest>`), created by the first job that needs
it and never changed (`immutable: true`), so nothing is ever re-applied under running trainers.

It has no ownerReferences. Each job used to add itself as an owner (one patch per job, and a ConfigMap of
~165 KB rewritten in etcd each time, with up to one owner per job of the namespace) so that the garbage
collector would delete it with its last job. Instead this process collects it: `collect` deletes a
runtime ConfigMap once no FinetuneJob is left in its namespace that could still start pods on it and no
RayJob or RayCluster there carries its digest (the `finetune.dev/runtime` label; their pods mount it).
A runtime ConfigMap that does have owners was made by an earlier operator version: the garbage collector
keeps handling it.

`ensure` and `collect` of one namespace hold the same lock: a job's reconcile either finds the ConfigMap
known (and `collect`, which runs later, sees that job in the cache and keeps it) or, after a collection,
creates it again.

What this process knows to exist is only a hint: nothing watches ConfigMaps (a watch would stream every
runtime ConfigMap's ~200 KB at each start), and a runtime ConfigMap can go without this process seeing it:
its namespace deleted and re-created under the same name (per-PR namespaces, Argo CD), or
`kubectl delete cm -l finetune.dev/runtime`. So `ensure(verify=True)` asks the API server (metadata only)
and creates it again if it is missing; the reconciler verifies before the pods that will mount it exist (a
job whose RayJob is not created yet) and whenever one of the job's pods waits in ContainerCreating (a
missing ConfigMap shows as FailedMount there; the kubelet retries the mount, so the pod then starts). A
`collect` forgets whatever its listing does not show.

A job keeps the runtime its RayJob was created with for its whole life (the RayJob's `finetune.dev/runtime`
label records it): an operator upgrade would otherwise re-apply every running RayJob with the new runtime,
and the next retry or resume would run new code against a checkpoint the old code wrote. The reconciler
renders such a job from `files_of` its runtime (read back from its ConfigMap, once per digest), and since
the RayJob keeps its label, `collect` keeps that ConfigMap while the RayJob exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..render.rayjob import JOB_LABEL, RUNTIME_LABEL, runtime_hash
from .k8s import CONFIGMAPS, RAYJOB, ApiError, Kube, gvr_of

Obj = dict[str, Any]
log = logging.getLogger("finetune.runtime")
# The work-queue key (namespace, RUNTIMES_KEY) stands for "collect this namespace's runtime ConfigMaps":
# `~` is not allowed in object names, so it never meets a job's key.
RUNTIMES_KEY = "~runtimes"


class Runtimes:
    def __init__(self, kube: Kube):
        self.kube = kube
        self._known: set[tuple[str, str]] = set()  # (namespace, name) this process created or saw
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.collected = 0
        self.recreated = 0  # runtime ConfigMaps found missing though known, and created again
        self._files: dict[str, dict[str, str]] = {}  # earlier runtimes read back, by digest (content-addressed)

    def _lock(self, namespace: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(namespace, threading.Lock())

    def ensure(self, obj: Obj, verify: bool = False) -> bool:
        """Create `obj` unless it exists; returns whether it created it. No request once this process knows it
        is there, unless `verify`: then one GET of its metadata (see the module doc)."""
        meta = obj["metadata"]
        ns, name = meta.get("namespace") or "default", meta["name"]
        with self._lock(ns):
            if (ns, name) in self._known and not verify:
                return False
            gvr = gvr_of(obj)
            created = False
            if self.kube.get_metadata(gvr, ns, name) is None:
                if (ns, name) in self._known:
                    log.warning("%s: runtime ConfigMap %s was deleted behind the operator's back; creating it again",
                                ns, name)
                try:
                    self.kube.create(gvr, ns, obj, obj["kind"])
                    created = True
                    self.recreated += (ns, name) in self._known
                except ApiError as err:
                    if err.status != 409:  # 409: created a moment ago by another process
                        raise
            self._known.add((ns, name))
            return created

    def files_for(self, namespace: str, rayjob: Obj | None, current: Mapping[str, str]) -> Mapping[str, str]:
        """The runtime to render a job with: the one its recorded RayJob was created with (its runtime label),
        for the job's life; `current` (the operator's own) for a job without one yet. Should that runtime be
        unreadable (its ConfigMap deleted behind the operator's back), the job moves to `current` rather than
        wait for a mount that can never succeed."""
        digest = (((rayjob or {}).get("metadata") or {}).get("labels") or {}).get(RUNTIME_LABEL)
        if rayjob is None or not digest or digest == runtime_hash(current):
            return current
        files = self.files_of(namespace, rayjob["metadata"]["name"], digest)
        if files is None:
            log.warning("%s: RayJob %s: runtime %s unreadable; rendering the operator's own (%s)", namespace,
                        rayjob["metadata"]["name"], digest, runtime_hash(current))
        return files or current

    def files_of(self, namespace: str, rayjob_name: str, digest: str) -> dict[str, str] | None:
        """The runtime files (path -> source) of runtime `digest`, which the RayJob `rayjob_name` mounts: its
        paths from the RayJob's runtime volume (ConfigMap keys do not give them back: `__init__.py`), their
        source from the ConfigMap, checked against the digest. Read once per digest (two GETs); None if either
        object is gone or they do not make that digest."""
        with self._guard:
            hit = self._files.get(digest)
        if hit is not None:
            return hit
        cm_name = f"finetune-runtime-{digest}"  # render.rayjob.runtime_config_map_name
        rayjob = self.kube.get(RAYJOB, namespace, rayjob_name)
        head = ((((rayjob or {}).get("spec") or {}).get("rayClusterSpec") or {}).get("headGroupSpec") or {})
        volumes = ((head.get("template") or {}).get("spec") or {}).get("volumes") or []
        items = next((v["configMap"].get("items") or [] for v in volumes
                      if (v.get("configMap") or {}).get("name") == cm_name), [])
        cm = self.kube.get(CONFIGMAPS, namespace, cm_name) if items else None
        data = (cm or {}).get("data") or {}
        files = {str(i["path"]): str(data[i["key"]]) for i in items if i.get("key") in data}
        if not files or runtime_hash(files) != digest:
            log.warning("%s: runtime %s of RayJob %s could not be read back (%s)", namespace, digest, rayjob_name,
                        "its ConfigMap is gone" if items and cm is None else "it does not match its digest")
            return None
        with self._guard:
            self._files[digest] = files
        return files

    def collect(self, namespace: str, jobs: list[Obj], holders: list[Obj], current: str) -> list[str]:
        """Delete the runtime ConfigMaps of `namespace` that nothing needs any more; returns their names.

        `jobs`: the namespace's FinetuneJobs (any of them may still create pods: they run `current`).
        `holders`: its RayJobs and RayClusters (their pods mount the digest in their runtime label).
        A RayJob or RayCluster of the operator's without that label (rendered by an earlier version) may
        mount any of them: then none is deleted."""
        with self._lock(namespace):
            in_use: set[str] = {current} if jobs else set()
            for obj in holders:
                labels = (obj.get("metadata") or {}).get("labels") or {}
                if JOB_LABEL in labels and RUNTIME_LABEL not in labels:
                    log.info("%s: a %s without the %s label (an earlier operator version); runtime ConfigMaps kept",
                             namespace, obj.get("kind"), RUNTIME_LABEL)
                    return []
                if labels.get(RUNTIME_LABEL):
                    in_use.add(labels[RUNTIME_LABEL])
            deleted = []
            listed = self.kube.list_metadata(CONFIGMAPS, namespace, RUNTIME_LABEL)  # names, labels, owners: no data
            # What the listing lacks is gone (its namespace deleted and re-created, say): forget it.
            present = {str((cm.get("metadata") or {}).get("name")) for cm in listed}
            self._known -= {(ns, name) for ns, name in self._known if ns == namespace and name not in present}
            for cm in listed:
                meta = cm.get("metadata") or {}
                labels = meta.get("labels") or {}
                if meta.get("ownerReferences") or JOB_LABEL in labels or labels.get(RUNTIME_LABEL) in in_use:
                    continue
                self._known.discard((namespace, meta["name"]))
                try:
                    self.kube.delete(CONFIGMAPS, namespace, meta["name"], "ConfigMap", uid=meta.get("uid"))
                except ApiError as err:
                    if err.status != 409:  # 409: the name holds another object now; not ours to judge
                        raise
                    continue
                log.info("%s: deleted runtime ConfigMap %s (no job uses it)", namespace, meta["name"])
                deleted.append(meta["name"])
            self.collected += len(deleted)
            return deleted


def namespaces_with_runtimes(kube: Kube, namespaces: list[str] | None,
                             listing: Callable[..., list[Obj]] | None = None) -> set[str]:
    """Where runtime ConfigMaps exist (cluster-wide, or in the operator's namespaces): collected once after
    a start, as jobs may have been deleted while no operator ran. Their metadata only, in pages: a listing
    with data was ~225 KB per ConfigMap, all of them in one answer."""
    found: set[str] = set()
    for ns in namespaces or [None]:  # type: ignore[list-item]
        for cm in (listing or kube.list_metadata)(CONFIGMAPS, ns, RUNTIME_LABEL):
            found.add(str((cm.get("metadata") or {}).get("namespace") or ""))
    return {ns for ns in found if ns}
