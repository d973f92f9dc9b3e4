"""The work queue under concurrent producers: kopf's handler thread pool, the flush thread and the
reconcile threads all call `add` at once. Real threads, a real event loop, no mocks."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable

from finetune_operator.controller.workqueue import WorkQueue

KEYS = [("ns", f"job-{i}") for i in range(8)]


def test_concurrent_adds_never_run_one_key_twice_at_once_and_lose_no_wakeup() -> None:
    """Order, not time: one counter numbers every add (taken just before the add) and every reconcile's
    start; each key's last reconcile must start after its last add (no lost wakeup)."""
    lock = threading.Lock()
    ticks = itertools.count(1)
    running: Counter[tuple[str, str]] = Counter()
    overlaps: list[tuple[str, str]] = []
    last_start: dict[tuple[str, str], int] = {k: 0 for k in KEYS}
    last_add: dict[tuple[str, str], int] = {k: 0 for k in KEYS}
    calls = Counter[tuple[str, str]]()

    def work(ns: str, name: str) -> None:
        key = (ns, name)
        with lock:
            running[key] += 1
            if running[key] > 1:
                overlaps.append(key)
            last_start[key] = next(ticks)
            calls[key] += 1
        time.sleep(0.002)  # long enough for other threads to pile in
        with lock:
            running[key] -= 1

    def woken() -> bool:
        with lock:
            return all(last_start[k] > last_add[k] for k in KEYS)

    async def main() -> None:
        q = WorkQueue(work, workers=8)
        q.start()

        def producer(seed: int) -> None:
            for i in range(1500):
                key = KEYS[(i * 7 + seed) % len(KEYS)]
                with lock:
                    last_add[key] = max(last_add[key], next(ticks))
                if i % 97 == 0:
                    q.add_after(*key, 0.01)
                else:
                    q.add(*key)

        threads = [threading.Thread(target=producer, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(0.01)
        for _ in range(3000):  # a guard against a hang (30 s), not a timing assertion
            if woken() and q.idle():
                break
            await asyncio.sleep(0.01)
        await q.stop()

    asyncio.run(main())
    assert overlaps == [], f"two reconciles of one key ran at once: {overlaps[:5]}"
    for key in KEYS:
        # Every key was reconciled after its producers' last add of it (no lost wakeup).
        assert last_start[key] > last_add[key], (key, last_start[key], last_add[key])
        # Bursts collapse: far fewer reconciles than adds.
        assert calls[key] < 1500, calls[key]


def test_add_from_a_worker_thread_during_reconcile_requeues_once() -> None:
    seen: list[str] = []

    async def main() -> None:
        q: WorkQueue

        def work(ns: str, name: str) -> None:
            seen.append(name)
            if len(seen) == 1:
                q.add(ns, name)  # an event arrives while the key is being reconciled
                q.add(ns, name)

        q = WorkQueue(work, workers=2)
        q.start()
        q.add("ns", "a")
        deadline = time.monotonic() + 10
        while len(seen) < 2 or not q.idle():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await q.stop()

    asyncio.run(main())
    assert seen == ["a", "a"]


def _timers_after(calls: Callable[[WorkQueue], None]) -> tuple[WorkQueue, dict[tuple[str, str], float]]:
    """The pending timers (seconds from now) a fresh queue holds after `calls`; nothing is reconciled."""
    out: dict[tuple[str, str], float] = {}

    async def main() -> WorkQueue:
        q = WorkQueue(lambda ns, name: None, workers=1)
        q.start()
        calls(q)
        loop = asyncio.get_running_loop()
        out.update({k: due - loop.time() for k, (due, _) in q._timers.items()})
        await q.stop()
        return q

    return asyncio.run(main()), out


def test_one_pending_timer_per_key_and_the_earliest_wins() -> None:
    """33 requeues of a Blocked job in one period were 33 timers; now they are one, due at the earliest."""
    def calls(q: WorkQueue) -> None:
        for _ in range(33):
            q.add_after("ns", "a", 10.0)
        q.add_after("ns", "a", 30.0)  # later than the pending one: dropped
        q.add_after("ns", "a", 4.0)  # earlier: replaces it
        q.add_after("ns", "b", 7.0)

    _, timers = _timers_after(calls)
    assert set(timers) == {("ns", "a"), ("ns", "b")}
    assert 3.0 < timers[("ns", "a")] <= 4.0 and 6.0 < timers[("ns", "b")] <= 7.0


def test_a_replaced_timer_never_fires() -> None:
    seen: list[str] = []

    async def main() -> None:
        q = WorkQueue(lambda ns, name: seen.append(name), workers=1)
        q.start()
        q.add_after("ns", "a", 0.3)
        q.add_after("ns", "a", 0.05)  # replaces the 0.3 s timer
        await asyncio.sleep(0.6)  # past both
        await q.stop()

    asyncio.run(main())
    assert seen == ["a"]


def test_rate_limited_requeues_back_off_exponentially_per_key_and_forget_resets() -> None:
    def delays(calls: Callable[[WorkQueue], None]) -> float:
        _, timers = _timers_after(calls)
        return timers[("ns", "a")]

    def n_requeues(n: int, forget_first: bool = False) -> Callable[[WorkQueue], None]:
        def calls(q: WorkQueue) -> None:
            for _ in range(n):
                q.add_rate_limited("ns", "a", 10.0)
                q._timers.pop(("ns", "a"))[1].cancel()  # as if it fired: the next one is scheduled afresh
            q.add_rate_limited("ns", "b", 10.0)  # another key's count is its own
            if forget_first:
                q.forget("ns", "a")
            q.add_rate_limited("ns", "a", 10.0)
        return calls

    assert 9.0 < delays(n_requeues(0)) <= 10.0
    assert 39.0 < delays(n_requeues(2)) <= 40.0  # the third in a row: 10 * 2^2
    assert 299.0 < delays(n_requeues(10)) <= 300.0  # capped (max_requeue_backoff)
    assert 9.0 < delays(n_requeues(10, forget_first=True)) <= 10.0  # no longer blocked: starts over
