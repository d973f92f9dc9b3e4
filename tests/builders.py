"""The FinetuneJob builder for every test, unit and integration (Kueue's MakeJob(...).Obj() pattern).

- ``JobDoc(name)``: a small valid job (no example file), for unit tests;
  ``JobDoc.example(name, "qwen2.5-1.5b-g6-efa.yaml")``: a shipped example, renamed.
- ``.set("spec.cluster.workers.replicas", 3)`` / ``.spec(cluster__workers={...})`` / ``.drop(path)``, then ``.obj()``.
- ``ftj(name, source=SEED, **spec)``: ``JobDoc.example(name, source).spec(**spec).obj()``, the integration
  tests' shorthand.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SEED = "qwen2.5-1.5b-g6-efa.yaml"


def example(name: str) -> dict[str, Any]:
    """examples/<name>, parsed."""
    return yaml.safe_load((ROOT / "examples" / name).read_text())  # type: ignore[no-any-return]


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

    @classmethod
    def example(cls, name: str, source: str = SEED) -> JobDoc:
        """The shipped example ``examples/<source>``, named ``name`` (its other metadata dropped)."""
        built = cls(name)
        built.doc = {**example(source), "metadata": {"name": name}}
        return built

    def set(self, path: str, value: Any) -> JobDoc:
        """set("spec.cluster.workers.replicas", 3); creates intermediate mappings."""
        node = self.doc
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        return self

    def spec(self, **sets: Any) -> JobDoc:
        """spec(cluster__workers={"replicas": 3}, training__globalBatchSize=96): ``__`` separates levels."""
        for path, value in sets.items():
            self.set("spec." + path.replace("__", "."), value)
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


def ftj(name: str, source: str = SEED, **spec: Any) -> dict[str, Any]:
    """A FinetuneJob from ``examples/<source>`` named ``name``, with ``spec`` overrides (``a__b=value``)."""
    return JobDoc.example(name, source).spec(**spec).obj()


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
