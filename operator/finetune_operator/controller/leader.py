"""Leader election on a coordination.k8s.io Lease, so two replicas never both act.

Optimistic concurrency does the work: acquiring or renewing is a PUT with the resourceVersion that was
read, so of two replicas racing for an expired lease exactly one wins. A leader that cannot renew
before its lease expires stops acting (the runner exits and Kubernetes restarts it as a candidate).

Expiry is judged as client-go's leaderelection does (observedRecord/observedTime): never by comparing the
Lease's renewTime, written by another machine's wall clock, with this one's. A candidate remembers the
record it last saw (holder, renewTime, resourceVersion) and when it first saw it, on its own monotonic
clock; the Lease is free only once leaseDurationSeconds of that clock passed without the record changing.
Clock skew between replicas (or a wall clock stepped by NTP) then cannot make a live Lease look expired.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .k8s import LEASES, PODS, ApiError, Kube

log = logging.getLogger("finetune.leader")
_FMT = "%Y-%m-%dT%H:%M:%S.%fZ"
# Set by the leader on its own pod; the progress Service selects it, so reports reach the replica that
# flushes them. Removed by every replica when it starts (a restarted ex-leader keeps its pod and labels).
LEADER_LABEL = "finetune.dev/operator-leader"


def label_own_pod(kube: Kube, namespace: str, pod: str, leader: bool) -> None:
    """Mark (or unmark) this replica's pod as the leader's. Not fenced: it only concerns this replica.
    Best effort: a failure is logged (reports then wait for the label), never fatal."""
    try:
        kube.patch(PODS, namespace, pod, {"metadata": {"labels": {LEADER_LABEL: "true" if leader else None}}},
                   kind="Pod", fenced=False)
    except Exception as err:
        log.error("could not %s pod %s/%s: %s", "label" if leader else "unlabel", namespace, pod, err)


def _now() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str,
                 lease_seconds: int = 30, renew_seconds: float = 10.0, retry_seconds: float = 5.0,
                 wall: Callable[[], datetime] = _now, monotonic: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.retry_seconds = retry_seconds
        self.is_leader = False
        self.wall = wall  # only written into the Lease (renewTime, acquireTime) for people to read
        self.monotonic = monotonic  # every judgement of time
        self._last_renew: float | None = None  # monotonic
        self._observed: tuple[Any, ...] | None = None  # the Lease record last seen: holder, renewTime, resourceVersion
        self._observed_at = 0.0  # monotonic: when it was first seen
        self._valid_until = 0.0  # monotonic: the lease we hold surely has not expired before this

    def may_write(self) -> bool:
        """Fencing: True only while a write started now is sure to finish (the API client's timeout)
        before the lease we last renewed can expire. After a pause (SIGSTOP, a long GC, a frozen VM) this
        turns False at once, before the renewal loop has even noticed: a deposed leader never writes."""
        return self.is_leader and self.monotonic() + self.kube.timeout < self._valid_until

    def _spec(self, now: datetime, acquired: bool, prev: dict[str, Any]) -> dict[str, Any]:
        stamp = now.strftime(_FMT)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": stamp,
            "acquireTime": stamp if acquired else prev.get("acquireTime", stamp),
            "leaseTransitions": int(prev.get("leaseTransitions") or 0) + (1 if acquired and prev else 0),
        }
        return spec

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), (lease.get("metadata") or {}).get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.monotonic()

    def try_acquire_or_renew(self) -> bool:
        now = self.wall()
        started = self.monotonic()  # the lease runs from (no earlier than) when we asked
        lease = self.kube.get(LEASES, self.namespace, self.name)
        try:
            if lease is None:
                created = self.kube.create(LEASES, self.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, True, {}),
                }, kind="Lease")
                self._observe(created)
                self._last_renew = started
                self._valid_until = started + self.lease_seconds
                return True
            self._observe(lease)
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity")
            duration = int(spec.get("leaseDurationSeconds") or self.lease_seconds)
            # Expired only on this replica's own clock: the record has not changed for the lease's duration.
            expired = self.monotonic() > self._observed_at + duration
            if holder != self.identity and not expired and holder:
                return False
            lease["spec"] = self._spec(now, holder != self.identity, spec)
            written = self.kube.replace(LEASES, self.namespace, self.name, lease, kind="Lease")
            self._observe(written)
            self._last_renew = started
            self._valid_until = started + self.lease_seconds
            return True
        except ApiError as err:
            if err.status in (409, 422):  # somebody else won the race
                return False
            raise

    async def acquire(self) -> None:
        """Block until this replica holds the lease."""
        while True:
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    self.is_leader = True
                    log.info("became leader (%s/%s as %s)", self.namespace, self.name, self.identity)
                    return
            except Exception as err:
                log.warning("leader election: %s", err)
            await asyncio.sleep(self.retry_seconds)

    async def hold(self) -> None:
        """Renew until renewal fails past the lease duration; then return (leadership lost)."""
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    continue
                log.error("lost the lease to another replica")
            except Exception as err:
                log.warning("lease renewal failed: %s", err)
                if self._last_renew is not None and self.monotonic() < self._last_renew + self.lease_seconds - self.renew_seconds:
                    continue
            self.is_leader = False
            self._valid_until = 0.0
            return

    def release(self) -> None:
        lease = self.kube.get(LEASES, self.namespace, self.name)
        if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            try:
                self.kube.replace(LEASES, self.namespace, self.name, lease, kind="Lease")
            except ApiError:
                pass
