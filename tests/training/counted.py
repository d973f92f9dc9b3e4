"""The runtime's Ray Train worker function, counting its starts in `<storage>/attempts` (test_failfast.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune_training.loop import train_func


def counted_train_func(config: dict[str, Any]) -> None:
    with open(Path(config["storage"]) / "attempts", "a") as f:
        f.write("started\n")
    train_func(config)
