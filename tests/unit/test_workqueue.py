"""The work queue under concurrent producers: kopf's handler thread pool, the flush thread and the
reconcile threads all call `add` at once. Real threads, a real event loop, no mocks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from finetune_operator.controller.workqueue import WorkQueue

KEYS = [("ns", f"job-{i}") for i in range(8)]


def test_concurrent_adds_never_run_one_key_twice_at_once_and_lose_no_wakeup() -> None:
    lock = threading.Lock()
    running: Counter[tuple[str, str]] = Counter()
    overlaps: list[tuple[str, str]] = []
    started_at: dict[tuple[str, str], list[float]] = {k: [] for k in KEYS}
    calls = Counter[tuple[str, str]]()

    def work(ns: str, name: str) -> None:
        key = (ns, name)
        with lock:
            running[key] += 1
            if running[key] > 1:
                overlaps.append(key)
            started_at[key].append(time.monotonic())
            calls[key] += 1
        time.sleep(0.002)  # long enough for other threads to pile in
        with lock:
            running[key] -= 1

    async def main() -> float:
        q = WorkQueue(work, workers=8)
        q.start()
        last_add = [0.0]

        def producer(seed: int) -> None:
            for i in range(1500):
                ns, name = KEYS[(i * 7 + seed) % len(KEYS)]
                if i % 97 == 0:
                    q.add_after(ns, name, 0.01)
                else:
                    q.add(ns, name)
            last_add[0] = max(last_add[0], time.monotonic())

        threads = [threading.Thread(target=producer, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 30
        while not q.idle() or time.monotonic() < last_add[0] + 0.1:
            assert time.monotonic() < deadline, "queue never drained"
            await asyncio.sleep(0.01)
        await q.stop()
        return last_add[0]

    last_add = asyncio.run(main())
    assert overlaps == [], f"two reconciles of one key ran at once: {overlaps[:5]}"
    for key in KEYS:
        # Every key was reconciled at least once after its producers stopped adding it (no lost wakeup).
        assert started_at[key] and started_at[key][-1] >= last_add - 1.0, key
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
