"""One inter-process lock: an exclusive ``flock`` on a file, held for a ``with`` block.

The caches under ``$FINETUNE_CACHE_DIR`` are shared by every process on the machine (two test sessions,
``make prebuild`` building images beside the Go builds): whoever fills or changes one holds its lock.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created, with its parents, when missing) until the block ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
