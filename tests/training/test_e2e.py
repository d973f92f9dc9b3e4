"""The real thing: embedded Ray, 2 CPU workers, FSDP2 over gloo, a worker killed mid-run, a rerun.

One test on purpose (each Ray start costs ~20 s on 2 cores): it covers Ray Train's FailureConfig
recovery from the last checkpoint, resume on rerun, the HF export and that training lowered the loss.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_training import checkpoint as ckpt
from finetune_training.cli import prepare_document, run_local

from .conftest import job_doc, prompt_completion_records, write_jsonl


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
    monkeypatch.setenv("FINETUNE_CRASH_AT_STEP", "5")
    out = io.StringIO()
    assert run_local(job, storage, max_failures=1, out=out) == 0, out.getvalue()
    assert (Path(storage) / "train" / ".crashed-at-step-5").exists()
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
    monkeypatch.delenv("FINETUNE_CRASH_AT_STEP")
    out2 = io.StringIO()
    assert run_local(job, storage, out=out2) == 0, out2.getvalue()
    assert "resuming from step 6" in out2.getvalue()
    assert ckpt.read_state(ckpt.latest(run_dir)[1])["resumed_from"] == [4]  # no new checkpoint written
