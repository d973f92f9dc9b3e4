"""controller/kuberay_version.py: is the RayJob CRD the cluster serves new enough for what the render sets?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.controller.kuberay_version import MIN_KUBERAY, RENDERED_FIELDS, check, missing_fields

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def crd(*drop: str) -> dict[str, Any]:
    """A RayJob CRD with every rendered field (pod templates keep unknown fields, as a trimmed schema), less `drop`."""
    spec: dict[str, Any] = {f.split(".")[1]: {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            for f in RENDERED_FIELDS}
    spec["deletionStrategy"] = {"type": "object", "properties": {
        "onSuccess": {"type": "object"}, "onFailure": {"type": "object"},
        "deletionRules": {"type": "array", "items": {"type": "object", "properties": {"policy": {"type": "string"}}}}}}
    for path in drop:
        *parents, leaf = path.split(".")[1:]
        node = spec
        for p in parents:
            node = node[p]["properties"]
        del node[leaf]
    schema = {"type": "object", "properties": {"spec": {"type": "object", "properties": spec}}}
    return {"kind": "CustomResourceDefinition", "metadata": {"name": "rayjobs.ray.io"},
            "spec": {"versions": [{"name": "v1", "served": True, "schema": {"openAPIV3Schema": schema}}]}}


CASES = [
    ("current", crd(), []),
    ("v1.4-deletion-strategy", crd("spec.deletionStrategy.deletionRules"), ["spec.deletionStrategy.deletionRules"]),
    ("no-submitter-template", crd("spec.submitterPodTemplate"), ["spec.submitterPodTemplate"]),
    ("no-v1", {"spec": {"versions": [{"name": "v1alpha1"}]}}, list(RENDERED_FIELDS)),
]


@pytest.mark.parametrize(("obj", "missing"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_missing_fields(obj: dict[str, Any], missing: list[str]) -> None:
    assert missing_fields(obj) == missing


def test_the_golden_rayjobs_set_no_field_the_check_leaves_out() -> None:
    checked = {f.split(".")[1] for f in RENDERED_FIELDS}
    for path in sorted(GOLDEN.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "RayJob":
                assert set(doc["spec"]) <= checked, (path.name, set(doc["spec"]) - checked)


class CrdKube:
    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.obj = obj

    def get(self, gvr: Any, ns: str | None, name: str) -> dict[str, Any] | None:
        assert (gvr[2], ns, name) == ("customresourcedefinitions", None, "rayjobs.ray.io")
        return self.obj


def test_check_says_what_to_upgrade() -> None:
    ok, message = check(CrdKube(crd("spec.deletionStrategy.deletionRules")))  # type: ignore[arg-type]
    assert ok is False and MIN_KUBERAY in message and "spec.deletionStrategy.deletionRules" in message
    ok, message = check(CrdKube(None))  # type: ignore[arg-type]
    assert ok is False and "not installed" in message
    assert check(CrdKube(crd()))[0] is True  # type: ignore[arg-type]
