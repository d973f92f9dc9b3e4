"""Every storage path against a real S3-protocol server (the session's `s3` fixture, moto_server on loopback,
reached through AWS_ENDPOINT_URL as on EKS): the dataset as one object (JSONL, Parquet) and as a prefix of
several files, the model source, checkpoints (save, list, resume, retention), the export's upload, and the
one-line errors for what cannot be read. The same source forms as local paths for comparison."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from finetune_operator.api.spec import DatasetSpec, FSDPSpec, ModelSpec, TrainingSpec
from finetune_training import checkpoint as ckpt
from finetune_training import data as D
from finetune_training import modelio, optim, storage
from finetune_training.parallel import apply_fsdp, build_mesh

from ..conftest import S3Bucket
from .conftest import export_ready_trainer, prompt_completion_records, write_jsonl


def dataset(source: str) -> DatasetSpec:
    return DatasetSpec(source=source, format="promptCompletion")


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


# --------------------------------------------------------------------------------------------- dataset


def test_the_runtime_reaches_the_server_through_aws_endpoint_url(s3: S3Bucket) -> None:
    import os

    fs, path = storage.filesystem(f"s3://{s3.bucket}/x")
    assert os.environ["AWS_ENDPOINT_URL"] == s3.server.endpoint and path == f"{s3.bucket}/x"
    assert type(fs).__name__ == "S3FileSystem" and fs.get_file_info(s3.bucket).type.name == "Directory"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_dataset_source_that_is_one_object(s3: S3Bucket, tmp_path: Path, kind: str) -> None:
    """The seed's form: `s3://bucket/datasets/instructions.jsonl` is that object (listing it as a prefix
    found nothing under `instructions.jsonl/`). Its neighbours are not read."""
    recs = prompt_completion_records(12)
    local = (write_jsonl(tmp_path / "d.jsonl", recs) if kind == "jsonl"
             else write_parquet(tmp_path / "d.parquet", recs))
    uri = s3.put(s3.uri(f"datasets/instructions.{kind}"), local)
    s3.put(uri.rsplit("/", 1)[0] + "/other.jsonl", write_jsonl(tmp_path / "o.jsonl", [{"prompt": "x"}]))
    assert D.read_records(dataset(uri), tmp_path / "cache") == recs
    assert D.read_records(dataset(uri), tmp_path / "cache") == recs  # the cached copy


def test_dataset_source_that_is_a_prefix_of_several_files(s3: S3Bucket, tmp_path: Path) -> None:
    recs = prompt_completion_records(30)
    prefix = s3.uri("datasets/parts")
    s3.put(f"{prefix}/a.jsonl", write_jsonl(tmp_path / "a.jsonl", recs[:10]))
    s3.put(f"{prefix}/b/c.parquet", write_parquet(tmp_path / "c.parquet", recs[10:20]))
    s3.put(f"{prefix}/d.jsonl", write_jsonl(tmp_path / "d.jsonl", recs[20:]))
    for source in (prefix, prefix + "/"):
        assert D.read_records(dataset(source), tmp_path / "cache") == recs  # files in path order


@pytest.mark.parametrize("form", ["object", "prefix"])
def test_local_and_pvc_sources_are_read_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      form: str) -> None:
    import finetune_operator.api.storage as api_storage

    recs = prompt_completion_records(6)
    write_jsonl(tmp_path / "claim" / "data" / "one.jsonl", recs[:3])
    write_jsonl(tmp_path / "claim" / "data" / "two.jsonl", recs[3:])
    monkeypatch.setattr(api_storage, "PVC_MOUNT_ROOT", str(tmp_path))
    sub = "data/one.jsonl" if form == "object" else "data"
    want = recs[:3] if form == "object" else recs
    assert D.read_records(dataset(str(tmp_path / "claim" / sub))) == want
    assert D.read_records(dataset(f"pvc://claim/{sub}")) == want


def missing_sources(s3: S3Bucket) -> dict[str, tuple[str, str]]:
    base = s3.uri("nothing-here")
    return {
        "object": (f"{base}/instructions.jsonl", "no such object or prefix"),
        "prefix": (f"{base}/", "no such object or prefix"),
        "bucket": ("s3://finetune-no-such-bucket/data.jsonl", "the bucket does not exist ('finetune-no-such-bucket')"),
    }


@pytest.mark.parametrize("what", ["object", "prefix", "bucket"])
def test_unreadable_dataset_is_one_line_naming_the_uri_and_the_cause(s3: S3Bucket, tmp_path: Path, what: str) -> None:
    uri, cause = missing_sources(s3)[what]
    with pytest.raises(storage.StorageError) as e:
        D.read_records(dataset(uri), tmp_path / "cache")
    assert str(e.value) == f"spec.dataset.source: {uri}: {cause}"
    with pytest.raises(storage.StorageError, match="^spec.dataset.source: "):
        storage.check_source(uri, "spec.dataset.source")  # what `finetune run` and the driver check first


@pytest.mark.parametrize(("text", "cause"), [
    ("AWS Error ACCESS_DENIED during HeadObject operation: Access Denied", "access denied"),
    ("AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation", "no valid AWS credentials"),
    ("AWS Error UNKNOWN (HTTP status 400) during HeadObject operation: No credentials provided",
     "no valid AWS credentials"),
    ("AWS Error UNKNOWN (HTTP status 301) during HeadBucket operation: PermanentRedirect", "another region"),
], ids=["access-denied", "bad-key", "no-credentials", "wrong-region"])
def test_aws_errors_are_named(text: str, cause: str) -> None:
    """Access and credential faults: moto does not check signatures unless its IAM mode is on for the whole
    server, so these go through the classifier with the AWS SDK's texts (as pyarrow raises them)."""
    assert cause in storage.explain(OSError(text))
    assert "\n" not in storage.explain(OSError(text + "\nDetail: x"))


# ----------------------------------------------------------------------------------------------- model


def test_model_source_from_s3_is_downloaded_once(s3: S3Bucket, tmp_path: Path, tiny_model_dir: Path) -> None:
    uri = s3.put(s3.uri("models/tiny"), tiny_model_dir)
    cache = tmp_path / "cache"
    path, local = modelio.resolve_source(uri, cache)
    assert local and (Path(path) / "config.json").is_file() and (Path(path) / ".complete").is_file()
    assert modelio.resolve_source(uri + "/", cache)[0] == path
    import torch

    model = modelio.load_model(ModelSpec(source=uri), torch.float32, cache)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(storage.StorageError, match=r"^spec.model.source: s3://.*/config.json: is one object"):
        modelio.resolve_source(f"{uri}/config.json", cache)
    with pytest.raises(storage.StorageError, match=r"^spec.model.source: s3://.*/tiny-nope: no such object or prefix$"):
        modelio.resolve_source(f"{uri}-nope", cache)


# ----------------------------------------------------------------------------------------- checkpoints


def sharded(model_dir: Path) -> tuple[Any, Any, Any]:
    import torch

    spec = TrainingSpec(learning_rate=1e-2, fsdp=FSDPSpec(sharding_strategy="full", activation_checkpointing=False))
    model = modelio.load_model(ModelSpec(source=str(model_dir)), torch.float32)
    model = apply_fsdp(model, build_mesh(spec.fsdp.sharding_strategy, 1, 1, "cpu"), spec.fsdp, torch.float32, False)
    opt, sched = optim.build(model, spec, total_steps=10)
    return model, opt, sched


def step(model: Any, opt: Any) -> None:
    import torch

    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def weights(model: Any) -> dict[str, Any]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}


def test_checkpoints_on_s3_save_list_resume_and_prune(process_group: None, s3: S3Bucket, tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    import torch

    run = s3.uri("store/checkpoints/train")
    model, opt, _ = sharded(tiny_model_dir)
    for n in (1, 2, 3):
        step(model, opt)
        ckpt.save_to(f"{run}/{ckpt.checkpoint_name(n)}", model, opt, {"step": n, "world_size": 1}, 0,
                     tmp_path / "staging")
    assert s3.keys(f"{run}/{ckpt.checkpoint_name(3)}") == [".metadata", "__0_0.distcp", ckpt.STATE_FILE]
    # An incomplete newer one (its shard only, as if the upload stopped) is listed but never chosen.
    s3.put(f"{run}/{ckpt.checkpoint_name(4)}/__0_0.distcp", write_jsonl(tmp_path / "shard", [{}]))
    assert ckpt.missing_files(f"{run}/{ckpt.checkpoint_name(4)}") == [".metadata", ckpt.STATE_FILE]
    assert ckpt.latest_uri(run) == (3, f"{run}/{ckpt.checkpoint_name(3)}")
    choice = ckpt.choose_resume(None, run)
    assert choice.step == 3 and choice.uri == f"{run}/{ckpt.checkpoint_name(3)}"

    model2, opt2, _ = sharded(tiny_model_dir)
    state = ckpt.load_from(choice.uri, model2, opt2, local_rank=0, staging=tmp_path / "resume-staging")
    assert state["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(weights(model).values(), weights(model2).values(), strict=True))
    assert not (tmp_path / "resume-staging" / "resume").exists()  # the node-local copy is removed

    removed = ckpt.prune(run, keep=2)
    assert sorted(p.rsplit("/", 1)[1] for p in removed) == [ckpt.checkpoint_name(1), ckpt.checkpoint_name(2)]
    assert sorted({k.split("/")[0] for k in s3.keys(run)}) == [ckpt.checkpoint_name(3), ckpt.checkpoint_name(4)]


def test_export_upload_to_s3(s3: S3Bucket, tmp_path: Path) -> None:
    """`Trainer.export` writes the Hugging Face files to a temporary directory and uploads them with
    `upload_dir` (the whole export runs in test_e2e_s3)."""
    (tmp_path / "final" / "sub").mkdir(parents=True)
    (tmp_path / "final" / "config.json").write_text(json.dumps({"a": 1}))
    (tmp_path / "final" / "sub" / "x.bin").write_bytes(b"\0" * 10)
    uri = s3.uri("store/final")
    storage.upload_dir(tmp_path / "final", uri)
    assert s3.keys(uri) == ["config.json", "sub/x.bin"]


def test_export_to_s3_leaves_no_file_of_the_previous_export(process_group: None, s3: S3Bucket, tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    """Issue 26.5(6): uploading over the previous export kept its files the new one lacks."""
    store = s3.uri("store")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    (tmp_path / "old" / "pytorch_model-00001-of-00002.bin").write_bytes(b"old shard")
    s3.put(f"{store}/final", tmp_path / "old")
    trainer = export_ready_trainer(tiny_model_dir, store)
    trainer.export()
    trainer.close()
    keys = s3.keys(f"{store}/final")
    assert "model.safetensors" in keys and "config.json" in keys, keys
    assert "pytorch_model-00001-of-00002.bin" not in keys, keys
