"""`finetune validate` semantics: every bad spec gets one line naming the field and the rule."""

from __future__ import annotations

import pytest
from finetune_operator.api.validation import SpecError, check, load_documents

from tests.builders import JobDoc

BAD = [
    # (id, builder, expected path, fragment of the message)
    ("missing-model", JobDoc().drop("spec.model"), "spec.model", "required"),
    ("unknown-field", JobDoc().set("spec.training.learningRat", 1e-4), "spec.training.learningRat", "unknown field"),
    ("lr-zero", JobDoc().set("spec.training.learningRate", 0), "spec.training.learningRate", "greater than 0"),
    ("bad-format", JobDoc().set("spec.dataset.format", "alpaca"), "spec.dataset.format", "alpaca"),
    ("bad-sharding", JobDoc().set("spec.training.fsdp.shardingStrategy", "zero3"), "spec.training.fsdp.shardingStrategy", "zero3"),
    ("eval-fraction", JobDoc().set("spec.dataset.evalFraction", 0.7), "spec.dataset.evalFraction", "less than 0.5"),
    (
        "micro-not-dividing",
        JobDoc().set("spec.training.globalBatchSize", 30).set("spec.training.microBatchSize", 4),
        "spec.training.globalBatchSize",
        "multiple of microBatchSize",
    ),
    (
        "dp-not-dividing",
        JobDoc().set("spec.training.globalBatchSize", 12),
        "spec.training.globalBatchSize",
        "data-parallel ranks (1 x 8 = 8)",
    ),
    (
        "gpus-do-not-fit",
        JobDoc().set("spec.cluster.workers.gpusPerWorker", 8),
        "spec.cluster.workers.gpusPerWorker",
        "do not fit g6.12xlarge (4 x L4)",
    ),
    (
        "efa-on-cpu-instance",
        JobDoc().set("spec.cluster.instanceType", "m5.2xlarge").set("spec.cluster.workers.gpusPerWorker", 0),
        "spec.network.efa",
        "no EFA interfaces",
    ),
    (
        "too-many-efa",
        JobDoc().set("spec.cluster.efaInterfacesPerWorker", 4),
        "spec.cluster.efaInterfacesPerWorker",
        "do not fit g6.12xlarge (1)",
    ),
    ("cpu-over-allocatable", JobDoc().set("spec.cluster.workers.cpu", "48"), "spec.cluster.workers.cpu", "allocatable"),
    ("memory-over-allocatable", JobDoc().set("spec.cluster.workers.memory", "190Gi"), "spec.cluster.workers.memory", "allocatable"),
    ("bad-quantity", JobDoc().set("spec.cluster.workers.memory", "lots"), "spec.cluster.workers.memory", "Kubernetes quantity"),
    (
        "require-efa-without-efa",
        JobDoc()
        .set("spec.network.efa", False)
        .set("spec.network.requireEFA", True),
        "spec.network.requireEFA",
        "needs efa: true",
    ),
    (
        "multi-node-without-storage",
        JobDoc().drop("spec.training.checkpoint"),
        "spec.training.checkpoint.storageUri",
        "required when cluster.workers.replicas > 1",
    ),
    ("bad-source", JobDoc().set("spec.model.source", "http://example.com/model"), "spec.model.source", "pattern"),
    ("name-too-long", JobDoc(name="x" * 48), "metadata.name", "at most 47"),
    ("name-not-dns1035", JobDoc(name="1job"), "metadata.name", "pattern"),
    ("wrong-kind", JobDoc().set("kind", "RayJob"), "kind", "must be FinetuneJob"),
    (
        "envfrom-both",
        JobDoc().set("spec.cluster.envFrom", [{"configMapRef": "a", "secretRef": "b"}]),
        "spec.cluster.envFrom[0].configMapRef",
        "exactly one",
    ),
    ("fp16-not-offered", JobDoc().set("spec.training.precision", "fp16"), "spec.training.precision", "fp16"),
    (
        "bf16-on-cpu",
        JobDoc()
        .set("spec.cluster.workers.gpusPerWorker", 0)
        .set("spec.network.efa", True)
        .set("spec.training.precision", "bf16"),
        "spec.training.precision",
        "bf16 needs GPUs",
    ),
    ("replicas-zero", JobDoc().set("spec.cluster.workers.replicas", 0), "spec.cluster.workers.replicas", "greater than or equal to 1"),
]


@pytest.mark.parametrize(("builder", "path", "fragment"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_names_field_and_rule(builder: JobDoc, path: str, fragment: str) -> None:
    job, issues = check(builder.obj())
    assert job is None
    errors = [i for i in issues if i.severity == "error"]
    assert errors, issues
    lines = [str(i) for i in errors]
    assert any(i.path == path for i in errors), lines
    assert any(fragment in i.message for i in errors if i.path == path), lines
    for line in lines:
        assert "\n" not in line and "Traceback" not in line


def test_good_spec_defaults() -> None:
    job, issues = check(JobDoc().obj())
    assert job is not None and issues == []
    spec = job.spec
    assert spec.cluster.instance_type == "g6.12xlarge"
    assert (spec.cluster.workers.replicas, spec.cluster.workers.gpus_per_worker) == (2, 4)
    assert spec.data_parallel_ranks == 8
    assert spec.gradient_accumulation_steps == 4  # 32 / (1 x 8)
    assert spec.network.efa and not spec.network.require_efa
    assert spec.model.trust_remote_code is False
    assert spec.training.fsdp.sharding_strategy.value == "hybrid"


def test_relative_paths_are_warnings_not_errors() -> None:
    doc = JobDoc().set("spec.model.source", "./examples/models/tiny").obj()
    job, issues = check(doc)
    assert job is not None
    assert [i.path for i in issues] == ["spec.model.source"]
    assert issues[0].severity == "warning"
    assert str(issues[0]).startswith("warning: spec.model.source: relative path")


def test_invalid_yaml_is_one_line() -> None:
    with pytest.raises(SpecError) as err:
        load_documents("spec: [unclosed\n")
    (issue,) = err.value.issues
    assert issue.path == "(document)" and "line" in issue.message


def test_every_error_of_a_document_is_reported() -> None:
    doc = (
        JobDoc()
        .set("spec.training.learningRate", -1)
        .set("spec.dataset.format", "nope")
        .set("spec.cluster.workers.replicas", 0)
        .obj()
    )
    _, issues = check(doc)
    assert {i.path for i in issues} >= {
        "spec.training.learningRate",
        "spec.dataset.format",
        "spec.cluster.workers.replicas",
    }
