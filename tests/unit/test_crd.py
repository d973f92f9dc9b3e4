"""The committed CRD is generated from the models, is structural, and rendered RayJobs fit KubeRay's CRD."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from finetune_operator.api.crd import CRD_FILENAME, build_crd, crd_yaml

from tests.unit.rendering import EXAMPLES, render_example

ROOT = Path(__file__).resolve().parents[2]


def walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from walk(node["additionalProperties"], f"{path}{{}}")


def schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_committed_crd_has_not_drifted() -> None:
    committed = (ROOT / "crds" / CRD_FILENAME).read_text()
    assert committed == crd_yaml(), "crds/ is stale: run `finetune crd > crds/finetune.dev_finetunejobs.yaml`"


def test_schema_is_structural() -> None:
    text = crd_yaml()
    assert "$ref" not in text and "anyOf" not in text and "allOf" not in text
    for path, node in walk(schema()):
        if node.get("x-kubernetes-preserve-unknown-fields"):
            continue
        assert "type" in node, f"{path} has no type"
        assert node.get("additionalProperties") is not False, path
        assert "title" not in node, path


def test_every_spec_and_status_field_is_described() -> None:
    props = schema()["properties"]
    for top in ("spec", "status"):
        for path, node in walk(props[top], top):
            if path.endswith(("[]", "{}")):
                continue  # list items and map values are described by their field
            assert node.get("description"), f"{path} has no description (kubectl explain would be empty)"


def test_status_declares_everything_later_issues_fill() -> None:
    status = schema()["properties"]["status"]["properties"]
    for field in ("phase", "conditions", "observedGeneration", "rayJobName", "rayClusterName", "jobId",
                  "dashboardURL", "startTime", "completionTime", "attempt", "training", "network"):
        assert field in status, field
    for field in ("step", "totalSteps", "epoch", "loss", "evalLoss", "learningRate", "tokensPerSecond",
                  "mfu", "etaSeconds", "lastReportTime", "lastCheckpoint"):
        assert field in status["training"]["properties"], field
    for field in ("transport", "provider", "pluginVersion", "ncclVersion", "efaDevices", "busBandwidthGBps",
                  "healthy", "message"):
        assert field in status["network"]["properties"], field
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_names_and_printer_columns() -> None:
    crd = build_crd()
    names = crd["spec"]["names"]
    assert (names["plural"], names["shortNames"], crd["spec"]["scope"]) == ("finetunejobs", ["ftj"], "Namespaced")
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Step", "Loss", "Network", "Age"]


def test_cel_rules_cover_cross_field_and_immutability() -> None:
    spec = schema()["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("globalBatchSize %" in r for r in rules)
    for field in ("model", "dataset", "training", "cluster", "network"):
        assert any(r["rule"] == "self == oldSelf" for r in spec["properties"][field]["x-kubernetes-validations"]), field
    for mutable in ("suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "backoffLimit"):
        assert "x-kubernetes-validations" not in spec["properties"][mutable]


# ----------------------------------------------------------------------------- KubeRay's real RayJob CRD


def _strict(node: Any) -> Any:
    """KubeRay's schema, but unknown fields are errors (the API server would silently prune them)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def rayjob_schema() -> dict[str, Any]:
    if shutil.which("go") is None:
        pytest.fail("Go is required to fetch KubeRay's CRD from its Go module (see README)")
    from finetune_devcluster.kuberay import crd_path

    crd = yaml.safe_load(crd_path("rayjobs").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])  # type: ignore[no-any-return]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_rendered_rayjob_is_valid_against_kuberay_crd(example: Path, rayjob_schema: dict[str, Any]) -> None:
    doc = yaml.safe_load(example.read_text())
    doc["metadata"].update(namespace="ml", uid="u")
    rayjob = render_example(doc)[-1]
    jsonschema.validate(rayjob, rayjob_schema)


def test_kuberay_schema_check_can_fail(rayjob_schema: dict[str, Any]) -> None:
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    rayjob = render_example(doc)[-1]
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicaz"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rayjob, rayjob_schema)


def test_api_reference_doc_has_not_drifted() -> None:
    from finetune_operator.api.docs import reference_markdown

    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == reference_markdown(), "docs/api.md is stale: run `finetune crd --markdown > docs/api.md`"
