"""The operator's cached reads of its configuration ConfigMaps (controller/clusterconfig.py). The API
server stands in as a slow recording object: what is under test is how many reads the cache sends."""

from __future__ import annotations

import threading
import time
from typing import Any

from finetune_operator.controller.clusterconfig import ClusterConfig


class SlowLists:
    def __init__(self) -> None:
        self.lists = 0
        self.lock = threading.Lock()

    def list_objects(self, gvr: Any, namespace: str | None, selector: str | None) -> list[dict[str, Any]]:
        with self.lock:
            self.lists += 1
        time.sleep(0.2)
        return []


def test_an_expired_entry_is_reloaded_once_while_the_others_use_the_last_value() -> None:
    now = [0.0]
    kube = SlowLists()
    cfg = ClusterConfig(kube, "finetune-system", ttl=30.0, clock=lambda: now[0])  # type: ignore[arg-type]

    def many() -> None:
        threads = [threading.Thread(target=cfg.instance_types, args=("g6.12xlarge",)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    many()  # nothing cached yet: the others wait for the first load instead of loading too
    assert kube.lists == 1
    many()
    assert kube.lists == 1  # fresh
    now[0] = 31.0
    many()  # expired: one reload; the other workers went on with the previous table
    assert kube.lists == 2
    assert "g6.12xlarge" in cfg.instance_types("g6.12xlarge")
