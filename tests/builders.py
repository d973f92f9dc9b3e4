"""Small builders for FinetuneJob documents (Kueue's MakeJob(...).Obj() pattern)."""

from __future__ import annotations

import copy
from typing import Any


class JobDoc:
    def __init__(self, name: str = "demo") -> None:
        self.doc: dict[str, Any] = {
            "apiVersion": "finetune.dev/v1alpha1",
            "kind": "FinetuneJob",
            "metadata": {"name": name},
            "spec": {
                "model": {"source": "Qwen/Qwen2.5-1.5B"},
                "dataset": {"source": "s3://bucket/data.jsonl"},
                "training": {"checkpoint": {"storageUri": "s3://bucket/ckpt"}},
            },
        }

    def set(self, path: str, value: Any) -> JobDoc:
        """set("spec.cluster.workers.replicas", 3); creates intermediate mappings."""
        node = self.doc
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        return self

    def drop(self, path: str) -> JobDoc:
        node = self.doc
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self.doc)
