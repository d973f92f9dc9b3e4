"""A keyed work queue (client-go semantics): a key is never reconciled twice at once, a burst of
events for one key collapses into one reconcile, and failures are retried with backoff.

Thread safety: `add` and `add_after` may be called from any thread (kopf runs synchronous handlers in
a thread pool; the progress flusher and the reconciles themselves run in worker threads). The queue's
state is only ever touched on its event loop: calls from other threads are handed over with
`call_soon_threadsafe`, so there is no lock and no check-then-act race.

Timers (client-go's delaying queue): a key has at most one pending timer, and the earliest wins: an
`add_after` due later than the pending one is dropped (the reconcile it brings reschedules what it still
needs), one due earlier replaces it. Callers need no bookkeeping of their own. `add_rate_limited` is
client-go's item exponential rate limiter, for a reconcile that asks to be retried while something outside
it blocks the job: base * 2^n for the key's n-th such requeue in a row, capped; `forget` starts it over.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

Key = tuple[str, str]
log = logging.getLogger("finetune.queue")


class WorkQueue:
    def __init__(self, work: Callable[[str, str], object], workers: int = 4, max_backoff: float = 60.0,
                 max_requeue_backoff: float = 300.0):
        self.work = work
        self.workers = workers
        self.max_backoff = max_backoff
        self.max_requeue_backoff = max_requeue_backoff
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._dirty: set[Key] = set()
        self._running: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._requeues: dict[Key, int] = {}  # add_rate_limited's count per key, until `forget`
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}  # the one pending timer per key (due, handle)
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    # --------------------------------------------------------------------------------- any thread
    def add(self, namespace: str, name: str) -> None:
        if self._on_loop():
            self._add((namespace, name))
        else:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._add, (namespace, name))

    def add_after(self, namespace: str, name: str, delay: float) -> None:
        if self._on_loop():
            self._add_after((namespace, name), delay)
        else:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._add_after, (namespace, name), delay)

    def add_rate_limited(self, namespace: str, name: str, base: float) -> None:
        """`add_after` with a delay that doubles at each call for the key (base, 2*base, ...), capped."""
        self._call(self._add_rate_limited, (namespace, name), base)

    def forget(self, namespace: str, name: str) -> None:
        """The key's next `add_rate_limited` waits `base` again."""
        self._call(self._forget, (namespace, name))

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        if self._on_loop():
            fn(*args)
        else:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)

    def _on_loop(self) -> bool:
        if self._loop is None:  # not started: bind to the caller's running loop
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        return threading.get_ident() == self._loop_thread

    # ------------------------------------------------------------------------------ loop thread only
    def _add(self, key: Key) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._running:
            self._queue.put_nowait(key)

    def _add_after(self, key: Key, delay: float) -> None:
        assert self._loop is not None
        if delay <= 0:
            self._add(key)
            return
        due = self._loop.time() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= due:
                return  # an earlier (or equal) one is pending: it brings the reconcile that reschedules
            pending[1].cancel()
        self._timers[key] = (due, self._loop.call_at(due, self._fire, key))

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._add(key)

    def _add_rate_limited(self, key: Key, base: float) -> None:
        n = self._requeues.get(key, 0)
        self._requeues[key] = n + 1
        self._add_after(key, min(self.max_requeue_backoff, base * 2 ** min(n, 30)))

    def _forget(self, key: Key) -> None:
        self._requeues.pop(key, None)

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._dirty.discard(key)
            self._running.add(key)
            try:
                await asyncio.to_thread(self.work, *key)
                self._failures.pop(key, None)
            except Exception as err:
                n = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(self.max_backoff, 0.5 * 2**n)
                log.warning("reconcile %s/%s failed (retry %d in %.1fs): %s", *key, n, delay, err)
                self._add_after(key, delay)
            finally:
                self._running.discard(key)
                if key in self._dirty:
                    self._queue.put_nowait(key)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def depth(self) -> int:
        """Keys waiting for a worker (the finetune_workqueue_depth metric)."""
        return self._queue.qsize()

    def idle(self) -> bool:
        return not self._dirty and not self._running and self._queue.empty()
