"""A keyed work queue (client-go semantics): a key is never reconciled twice at once, a burst of
events for one key collapses into one reconcile, and failures are retried with backoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

Key = tuple[str, str]
log = logging.getLogger("finetune.queue")


class WorkQueue:
    def __init__(self, work: Callable[[str, str], object], workers: int = 4, max_backoff: float = 60.0):
        self.work = work
        self.workers = workers
        self.max_backoff = max_backoff
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._dirty: set[Key] = set()
        self._running: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._running:
            self._queue.put_nowait(key)

    def add_after(self, namespace: str, name: str, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self.add, namespace, name)

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
                self.add_after(*key, delay)
            finally:
                self._running.discard(key)
                if key in self._dirty:
                    self._queue.put_nowait(key)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def depth(self) -> int:
        """Keys waiting for a worker (the finetune_workqueue_depth metric)."""
        return self._queue.qsize()

    def idle(self) -> bool:
        return not self._dirty and not self._running and self._queue.empty()
