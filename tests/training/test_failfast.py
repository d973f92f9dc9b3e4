"""Deterministic errors fail the run once instead of max_failures + 1 times (issue 26.5(4), `failfast`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from finetune_operator.api.spec import FinetuneJob, ModelSpec
from finetune_training import modelio

from .conftest import job_doc, prompt_completion_records, write_jsonl


def test_the_runtimes_deterministic_errors_are_recognised_through_rays_wrapper() -> None:
    from finetune_training.checkpoint import ResumeError
    from finetune_training.data import DataError
    from finetune_training.errors import DeterministicError, deterministic_cause
    from finetune_training.loop import NonFiniteError
    from finetune_training.netprobe import NetworkProbeError, RequireEFAError
    from finetune_training.parallel import UnevenShardingError
    from finetune_training.storage import StorageError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    for cls in (NonFiniteError, DataError, ResumeError, UnevenShardingError, StorageError, RequireEFAError):
        err = cls("x")
        assert deterministic_cause(UserExceptionWithTraceback(err, "Traceback ...")) is err, cls
    for transient in (NetworkProbeError("all-reduce failed"), RuntimeError("NCCL timeout"), OSError("reset")):
        assert deterministic_cause(UserExceptionWithTraceback(transient, "Traceback ...")) is None
    assert isinstance(DataError("x"), ValueError) and isinstance(DataError("x"), DeterministicError)


@pytest.mark.slow  # starts Ray (~20-40 s on 2 shared cores)
@pytest.mark.timeout(300)
def test_a_non_finite_loss_fails_the_run_once_not_max_failures_plus_one_times(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real Ray Train (embedded, one CPU worker), max_failures 2, a base model with an infinite weight: the
    first step's loss is not finite on every attempt, so the run must stop after the first."""
    import ray
    import torch
    from finetune_training import launcher
    from transformers import AutoModelForCausalLM

    from .counted import counted_train_func

    broken = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    broken.save_pretrained(tmp_path / "broken")
    modelio.load_tokenizer(ModelSpec(source=str(tiny_model_dir))).save_pretrained(tmp_path / "broken")
    data = write_jsonl(tmp_path / "d.jsonl", prompt_completion_records(20))
    store = tmp_path / "store"
    store.mkdir()
    doc = job_doc(tmp_path / "broken", data, store, globalBatchSize=2, microBatchSize=1, maxSteps=2)
    doc["spec"]["cluster"]["workers"]["replicas"] = 1
    monkeypatch.setattr(launcher, "train_func", counted_train_func)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        trainer = launcher.build_trainer(FinetuneJob.model_validate(doc), storage_uri=str(store), name="train",
                                         max_failures=2)
        with pytest.raises(Exception) as failed:
            trainer.fit()
    finally:
        ray.shutdown()
    attempts = (store / "attempts").read_text().splitlines()
    assert len(attempts) == 1, f"{len(attempts)} attempts: {failed.value}"
    from finetune_training.failfast import failure_message

    message = failure_message(failed.value)  # the driver's Failed status message
    assert message.startswith("rank 0: NonFiniteError: step 1: loss nan"), message
    assert message.endswith("(deterministic: not retried)"), message
