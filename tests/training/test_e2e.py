"""The real thing: embedded Ray, 2 CPU workers, FSDP2 over gloo, a worker killed mid-run, a rerun.

Few tests on purpose (each Ray start costs ~20 s on 2 cores): the first covers Ray Train's FailureConfig
recovery from the last checkpoint, resume on rerun, the HF export and that training lowered the loss; the
second (one worker, two one-step runs) a job whose dataset is one S3 object and whose checkpoints and export
live on the session's S3 server: `finetune run` shows the truncation warning, and the rerun resumes from the
S3 checkpoint.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_training import checkpoint as ckpt
from finetune_training.cli import prepare_document, run_local

from ..conftest import S3Bucket
from .conftest import job_doc, prompt_completion_records, records_with_long_prompts, write_jsonl


def mean_loss(model_dir: Path, data: Any) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids, labels = data.train.input_ids[:16], data.train.labels[:16]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels).loss)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_run_survives_a_worker_crash_and_resumes_on_rerun(
    tmp_path: Path, tiny_model_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_file = write_jsonl(tmp_path / "data.jsonl", prompt_completion_records(200))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_doc(tiny_model_dir, data_file, tmp_path / "store")))
    job, storage = prepare_document(str(job_file))
    run_dir = Path(storage) / "checkpoints" / "train"

    # Run 1: rank 1 dies (os._exit) after step 5; Ray restarts the workers, which resume from step 4.
    monkeypatch.setenv("FINETUNE_FAILPOINTS", "train/after-step=exit(17)@step=5,rank=1")
    out = io.StringIO()
    assert run_local(job, storage, max_failures=1, out=out) == 0, out.getvalue()
    assert (Path(storage) / "train" / ".failpoint-after-step-5").exists()
    step, last = ckpt.latest(run_dir) or (None, None)
    state = ckpt.read_state(last)
    assert (step, state["step"], state["resumed_from"]) == (6, 6, [4]), state
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [4, 6]  # keep: 2
    status = yaml.safe_load(out.getvalue()[out.getvalue().index("status:"):].split("\n# ")[0])["status"]
    assert status["phase"] == "Succeeded" and status["training"]["step"] == 6
    assert status["network"]["transport"] == "gloo"

    # The export loads with from_pretrained and fits the data better than the base model.
    from finetune_training.data import prepare

    data = prepare(job.spec.dataset, tokenizer, 64, True, seed=1)
    assert mean_loss(Path(storage) / "final", data) < mean_loss(tiny_model_dir, data) - 0.3

    # Run 2 (a rerun of a finished job): picks up the last checkpoint, trains nothing, exports again.
    monkeypatch.delenv("FINETUNE_FAILPOINTS")
    out2 = io.StringIO()
    assert run_local(job, storage, out=out2) == 0, out2.getvalue()
    assert "resuming from step 6" in out2.getvalue()
    assert ckpt.read_state(ckpt.latest(run_dir)[1])["resumed_from"] == [4]  # no new checkpoint written


def status_of(output: str) -> dict[str, Any]:
    return dict(yaml.safe_load(output[output.index("status:"):].split("\n# ")[0])["status"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_finetune_run_on_s3_shows_the_truncation_warning_and_resumes_from_s3(
    s3: S3Bucket, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The seed's storage layout on a real S3 server: `dataset.source` is one object, `storageUri` a prefix.
    Run 1 (one step): 8 of the 36 training records lose every trained token at sequenceLength 24 (unpacked),
    and the warning reaches `finetune run`'s own output (the workers' stdout does not, without --verbose); the
    checkpoint and the export land on S3. Run 2 asks for 2 steps and resumes from the step-1 checkpoint on
    S3; `keep: 1` prunes it there."""
    data = s3.put(s3.uri("datasets/instructions.jsonl"),
                  write_jsonl(tmp_path / "data.jsonl", records_with_long_prompts(40, long=10)))
    store = s3.uri("store")
    doc = job_doc(tiny_model_dir, Path("unused"), Path("unused"), sequenceLength=24, packing=False, maxSteps=1,
                  globalBatchSize=1, microBatchSize=1, evalIntervalSteps=1,
                  checkpoint={"intervalSteps": 1, "keep": 1, "storageUri": store})
    doc["spec"]["dataset"]["source"] = data
    doc["spec"]["cluster"]["workers"]["replicas"] = 1
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    job, storage = prepare_document(str(job_file))
    assert (storage, job.spec.dataset.source) == (store, data)
    run = f"{store}/checkpoints/train"

    out = io.StringIO()
    assert run_local(job, storage, out=out) == 0, out.getvalue()
    warning = ("WARNING: data: 8 of 36 training records (22.2%) have no trained token left after truncation to "
               "sequenceLength 24, more than 2% (raise training.sequenceLength or enable training.packing)")
    assert [line for line in out.getvalue().splitlines() if "no trained token" in line] == [warning], out.getvalue()
    assert status_of(out.getvalue())["phase"] == "Succeeded"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(s3.keys(f"{store}/final"))
    assert ckpt.latest_uri(run) == (1, f"{run}/{ckpt.checkpoint_name(1)}")

    job2, _ = prepare_document(str(job_file), max_steps=2)
    out2 = io.StringIO()
    assert run_local(job2, storage, out=out2) == 0, out2.getvalue()
    assert "resuming from step 1" in out2.getvalue(), out2.getvalue()
    assert status_of(out2.getvalue())["training"]["step"] == 2
    assert {k.split("/")[0] for k in s3.keys(run)} == {ckpt.checkpoint_name(2)}  # keep: 1 pruned step 1
    with s3.fs().open_input_stream(f"{run.removeprefix('s3://')}/{ckpt.checkpoint_name(2)}/{ckpt.STATE_FILE}") as f:
        assert json.loads(f.read())["resumed_from"] == [1]
