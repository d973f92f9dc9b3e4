"""The work queue under concurrent producers: kopf's handler thread pool, the flush thread and the
reconcile threads all call `add` at once. Real threads, a real event loop, no mocks."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter

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
