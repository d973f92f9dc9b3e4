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


class StatusDoc:
    """A FinetuneJob status as the API server holds it (camelCase):
    StatusDoc("Running").running_since(T).reported(T, step=5).obj(). Each step returns a new builder, so a
    shared one can be varied per test case."""

    def __init__(self, phase: str | None = None) -> None:
        self.doc: dict[str, Any] = {"phase": phase} if phase else {}

    def set(self, key: str, value: Any) -> StatusDoc:
        out = StatusDoc()
        out.doc = {**copy.deepcopy(self.doc), key: value}
        return out

    def condition(self, ctype: str, status: str, reason: str, at: str, message: str = "x") -> StatusDoc:
        cond = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": at}
        return self.set("conditions", [*copy.deepcopy(self.doc.get("conditions") or []), cond])

    def running_since(self, at: str) -> StatusDoc:
        return self.condition("Running", "True", "RayJobRunning", at)

    def reported(self, at: str, **training: Any) -> StatusDoc:
        return self.set("training", {"lastReportTime": at, **training})

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self.doc)


class RayJobDoc:
    """A RayJob as KubeRay reports it: RayJobDoc("Failed", "FAILED").status(failed=3).suspend(True).obj()."""

    def __init__(self, deploy: str = "", job: str = "") -> None:
        self.doc: dict[str, Any] = {"metadata": {"name": "j", "uid": "rj-1"},
                                    "status": {"jobDeploymentStatus": deploy, "jobStatus": job}}

    def status(self, **fields: Any) -> RayJobDoc:
        self.doc["status"].update(fields)
        return self

    def suspend(self, on: bool) -> RayJobDoc:
        self.doc["spec"] = {"suspend": on}
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self.doc)
