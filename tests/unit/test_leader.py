"""Leader election judged on the candidate's own monotonic clock (client-go's observedRecord/observedTime), never
by comparing the Lease's renewTime (another machine's wall clock) with its own. A fake API holds one Lease;
each replica has its own wall clock and monotonic clock, set by the test."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from finetune_operator.controller.k8s import ApiError
from finetune_operator.controller.leader import LeaderElector

T0 = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)


class LeaseApi:
    """One Lease, with resourceVersions and the API server's optimistic concurrency (409 on a stale PUT)."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.timeout = 10.0

    def get(self, gvr: Any, namespace: str | None, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body
        return copy.deepcopy(body)

    def create(self, gvr: Any, namespace: str | None, body: dict[str, Any], kind: str) -> dict[str, Any]:
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists")
        return self._store(body)

    def replace(self, gvr: Any, namespace: str | None, name: str, body: dict[str, Any], kind: str) -> dict[str, Any]:
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict")
        return self._store(body)


class Replica:
    def __init__(self, api: LeaseApi, identity: str, skew: timedelta = timedelta()) -> None:
        self.mono = 1000.0  # each process's monotonic clock has its own origin
        self.skew = skew
        self.elector = LeaderElector(api, "ns", "lease", identity,  # type: ignore[arg-type]
                                     wall=lambda: T0 + timedelta(seconds=self.mono - 1000.0) + self.skew,
                                     monotonic=lambda: self.mono)

    def tick(self, seconds: float) -> None:
        self.mono += seconds


@pytest.mark.parametrize("skew", [timedelta(hours=1), timedelta(hours=-1), timedelta()], ids=["ahead-1h", "behind-1h", "none"])
def test_a_candidate_takes_a_lease_only_after_its_duration_without_a_change_on_its_own_clock(skew: timedelta) -> None:
    api = LeaseApi()
    leader, candidate = Replica(api, "a"), Replica(api, "b", skew)
    assert leader.elector.try_acquire_or_renew()
    # The leader renews every 10 s: the candidate, whatever its wall clock says, never takes the Lease.
    for _ in range(12):
        assert not candidate.elector.try_acquire_or_renew()
        for r in (leader, candidate):
            r.tick(10)
        assert leader.elector.try_acquire_or_renew()
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "a"
    # The leader stops renewing: the candidate waits the lease's 30 s from when it last saw the record change.
    assert not candidate.elector.try_acquire_or_renew()  # sees the last renewal now
    candidate.tick(29)
    assert not candidate.elector.try_acquire_or_renew()
    candidate.tick(2)
    assert candidate.elector.try_acquire_or_renew()
    assert api.lease["spec"]["holderIdentity"] == "b"
    assert api.lease["spec"]["leaseTransitions"] == 1


def test_a_candidate_whose_clock_runs_behind_does_not_wait_longer_than_the_lease() -> None:
    """A renewTime far in this replica's future (its wall clock runs 1 h behind) does not keep a dead Lease."""
    api = LeaseApi()
    Replica(api, "a").elector.try_acquire_or_renew()
    candidate = Replica(api, "b", -timedelta(hours=1))
    assert not candidate.elector.try_acquire_or_renew()
    candidate.tick(31)
    assert candidate.elector.try_acquire_or_renew()
