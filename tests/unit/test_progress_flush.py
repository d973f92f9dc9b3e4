"""The progress flusher's retries (controller/progress.py): a failed status write backs off per job,
exponentially with jitter and a cap, honours Retry-After, resets on success, and nothing is written or
tried while this replica may not write (not the leader). A fake clock and a scripted writer stand in for
time and the API server (the API server's own 429s need APF in the dev cluster; see docs/operator.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from finetune_operator.api.status import ProgressReport
from finetune_operator.controller.k8s import ApiError, NotLeader
from finetune_operator.controller.metrics import Metrics
from finetune_operator.controller.progress import (
    RETRY_AFTER_MAX_SECONDS,
    RETRY_CAP_SECONDS,
    RETRY_JITTER,
    ProgressServer,
    retry_delay,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def too_many(retry_after: float | None = None) -> ApiError:
    return ApiError(429, '{"message": "too many requests"}', "patch ns/a/status", retry_after=retry_after)


class ScriptedKube:
    """Status writes answer from `script` in turn (an exception is raised; None succeeds), then succeed;
    `leader` stands for leader.py's fencing check (the runner gives it to the flusher). Records when each
    write was tried."""

    def __init__(self, clock: Clock, script: list[BaseException | None] | None = None,
                 fail_always: Callable[[], BaseException] | None = None) -> None:
        self.clock = clock
        self.script = list(script or [])
        self.fail_always = fail_always
        self.tried: list[float] = []
        self.leader = True

    def patch_status(self, ns: str, name: str, patch: dict[str, object], uid: str | None = None,
                     has_status: bool = True, resource_version: str | None = None) -> dict[str, object]:
        self.tried.append(self.clock.now)
        if self.fail_always is not None:
            raise self.fail_always()
        outcome = self.script.pop(0) if self.script else None
        if outcome is not None:
            raise outcome
        return {}


def _server(kube: ScriptedKube, clock: Clock, jitter: float = 0.0) -> ProgressServer:
    return ProgressServer(kube, Metrics(), monotonic=clock, jitter=lambda: jitter,  # type: ignore[arg-type]
                          leader_check=lambda: kube.leader)


def _report(server: ProgressServer, step: int = 1) -> None:
    server.accept("ns", "a", ProgressReport.model_validate({"rank": 0, "training": {"step": step}}))


def _run_until_written(server: ProgressServer, clock: Clock, limit: int = 50) -> list[float]:
    """Drive the flusher's dispatch as flush_forever does, jumping the clock to each next due time;
    returns the gaps between consecutive tries."""
    kube: ScriptedKube = server.kube  # type: ignore[assignment]
    for _ in range(limit):
        busy: set[tuple[str, str]] = set()
        due = server.dispatch_due(busy)
        for key, p in due:
            server._flush_one(key, p)
        if due and not server.pending[("ns", "a")].dirty:
            break
        wait = server._next_due()
        assert wait is not None and wait > 0, "a failed write must never be due again at once"
        clock.now += wait
    return [b - a for a, b in zip(kube.tried, kube.tried[1:], strict=False)]


BACKOFF = [  # with a base (the flush interval) of 5 s
    ("first-failure", 1, None, 0.0, 5.0),
    ("doubles", 4, None, 0.0, 40.0),
    ("capped", 5, None, 0.0, RETRY_CAP_SECONDS),
    ("huge-count-capped", 10_000, None, 0.0, RETRY_CAP_SECONDS),
    ("jitter-shortens", 3, None, 1.0, 20.0 * (1 - RETRY_JITTER)),
    ("retry-after-larger-wins", 2, 30.0, 0.0, 30.0),
    ("retry-after-smaller-loses", 3, 1.0, 0.0, 20.0),
    ("retry-after-bounded", 1, 86400.0, 0.0, RETRY_AFTER_MAX_SECONDS),
]


@pytest.mark.parametrize(("failures", "retry_after", "jitter", "delay"), [b[1:] for b in BACKOFF], ids=[b[0] for b in BACKOFF])
def test_retry_delay(failures: int, retry_after: float | None, jitter: float, delay: float) -> None:
    assert retry_delay(failures, retry_after, jitter, base=5.0) == pytest.approx(delay)


def test_consecutive_failures_back_off_exponentially_up_to_the_cap() -> None:
    clock = Clock()
    kube = ScriptedKube(clock, [too_many() for _ in range(9)])
    server = _server(kube, clock)
    _report(server)
    gaps = _run_until_written(server, clock)
    assert gaps == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0, 60.0, 60.0]  # flush interval 5 s
    assert len(kube.tried) == 10 and not server.pending[("ns", "a")].dirty
    assert server.write_failures == 9


def test_jitter_spreads_the_retries() -> None:
    clock = Clock()
    kube = ScriptedKube(clock, [too_many() for _ in range(3)])
    server = _server(kube, clock, jitter=0.5)
    _report(server)
    # Never sooner than the flush interval (the first), then shortened by half the jitter range.
    assert _run_until_written(server, clock) == pytest.approx([5.0] + [x * (1 - RETRY_JITTER / 2) for x in (10.0, 20.0)])


def test_retry_after_wins_when_it_asks_for_longer() -> None:
    clock = Clock()
    kube = ScriptedKube(clock, [too_many(retry_after=7.0), too_many(retry_after=1.0), too_many(), None])
    server = _server(kube, clock)
    _report(server)
    assert _run_until_written(server, clock) == [7.0, 10.0, 20.0]


def test_a_success_resets_the_backoff() -> None:
    clock = Clock()
    kube = ScriptedKube(clock, [too_many(), too_many(), too_many(), None])
    server = _server(kube, clock)
    _report(server)
    assert _run_until_written(server, clock) == [5.0, 10.0, 20.0]
    p = server.pending[("ns", "a")]
    assert p.failures == 0
    # The next report (an interval later: the normal pace) fails once: its retry starts from the base again.
    clock.now += server.flush_interval
    kube.script = [too_many(), None]
    kube.tried.clear()
    _report(server, 2)
    assert _run_until_written(server, clock) == [5.0]


def test_no_write_is_tried_while_not_the_leader_and_the_reports_are_kept() -> None:
    clock = Clock()
    kube = ScriptedKube(clock)
    server = _server(kube, clock)
    kube.leader = False
    _report(server, 5)
    for _ in range(3):
        assert server.dispatch_due(set()) == [] and server.flush_once() == 0 and server.flush_once(due_only=True) == 0
        clock.now += 100.0
    assert kube.tried == [] and server.pending[("ns", "a")].dirty
    kube.leader = True  # leader again (a standby that won the Lease): the kept report goes out
    assert server.flush_once(due_only=True) == 1 and len(kube.tried) == 1


def test_a_write_refused_as_not_leader_backs_off() -> None:
    """The fencing check can turn False between the flusher's look and the write (kube._write raises
    NotLeader): that is a failure like any other, never retried at once."""
    clock = Clock()
    kube = ScriptedKube(clock, [NotLeader("lease lost"), NotLeader("lease lost"), None])
    server = _server(kube, clock)
    _report(server)
    assert _run_until_written(server, clock) == [5.0, 10.0]


def _spin_check(kube: ScriptedKube, server: ProgressServer, seconds: float = 0.3) -> int:
    """Run flush_forever for `seconds` of real time with the (fake) clock frozen; returns how many passes
    its loop made. With the clock frozen, a backoff never runs out: a correct flusher tries once and waits."""
    passes = [0]
    dispatch = server.dispatch_due

    def counting(busy: set[tuple[str, str]]) -> list[tuple[tuple[str, str], object]]:
        passes[0] += 1
        return dispatch(busy)  # type: ignore[return-value]

    server.dispatch_due = counting  # type: ignore[assignment,method-assign]

    async def run() -> None:
        flusher = asyncio.create_task(server.flush_forever())
        await asyncio.sleep(0.01)
        _report(server)
        # The report is older than the flush interval when the flusher first looks (a job reporting less
        # often than the interval): the old code's failed write was due again at once, for ever.
        kube.clock.now += 2 * server.flush_interval
        await asyncio.sleep(seconds)
        flusher.cancel()

    asyncio.run(run())
    return passes[0]


def test_flush_forever_tries_a_failing_write_once_per_backoff_not_in_a_loop() -> None:
    """Retried at once, one job sent 355 PATCHes in 2 s into APF's 429s."""
    clock = Clock()
    kube = ScriptedKube(clock, fail_always=too_many)
    server = _server(kube, clock)
    passes = _spin_check(kube, server)
    assert len(kube.tried) == 1, len(kube.tried)
    assert passes <= 4, passes


def test_flush_forever_does_not_spin_while_not_the_leader() -> None:
    """After the Lease was lost, every write raised NotLeader at once and the loop spun the CPU (starving
    the Lease renewal on the same event loop)."""
    clock = Clock()
    kube = ScriptedKube(clock)
    kube.leader = False
    server = _server(kube, clock)
    passes = _spin_check(kube, server)
    assert kube.tried == [] and server.pending[("ns", "a")].dirty
    assert passes <= 4, passes
