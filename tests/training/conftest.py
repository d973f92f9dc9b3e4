"""Shared builders for the training-runtime tests: a tiny Qwen2 model saved with save_pretrained."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STACK_PACKAGES = ("ray", "torch", "transformers", "pydantic", "PyYAML", "pyarrow", "safetensors", "tokenizers",
                  "datasets", "accelerate", "numpy")


def stack_line() -> str:
    """The Python and package versions this test run uses (the two stacks print different lines)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    py = ".".join(str(p) for p in sys.version_info[:3])
    return f"Python {py} ({sys.executable}); " + ", ".join(f"{n} {version(n)}" for n in STACK_PACKAGES)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"training stack: {stack_line()}")


# FINETUNE_TESTS_EXIT_AFTER_SESSION=1 (scripts/test-training-dlc sets it): once pytest has reported, leave with
# its exit status and skip the interpreter's teardown. Why: on the DLC stack (Python 3.13, Ray 2.58, torch 2.13)
# a CI run printed "179 passed" and then the process died of SIGSEGV during teardown (exit 245 = -11; stop 19),
# which failed a run whose every test had passed; 3 reruns here did not repeat it. The session's result is
# pytest's; a crash *during* a test still fails it (and PYTHONFAULTHANDLER, set by the runner, prints the stacks).
_session_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _session_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("FINETUNE_TESTS_EXIT_AFTER_SESSION") == "1" and _session_status:
        print(f"tests/training: exit status {_session_status[-1]} from pytest; interpreter teardown skipped "
              "(FINETUNE_TESTS_EXIT_AFTER_SESSION=1)", flush=True)
        sys.stderr.flush()
        os._exit(_session_status[-1])


TEXTS = [f"Question: What is {a} plus {b}?\nAnswer: {a} + {b} = {a + b}" for a in range(10, 40) for b in (11, 57)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune_training.tinymodel import write_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen2")
    return write_tiny_model(out, TEXTS + ["You add numbers."], vocab_size=300, hidden=32, layers=2, heads=2,
                            kv_heads=1, intermediate=64, max_positions=256)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from finetune_operator.api.spec import ModelSpec
    from finetune_training.modelio import load_tokenizer

    return load_tokenizer(ModelSpec(source=str(tiny_model_dir)))


def job_doc(model_dir: Path, data: Path, storage: Path, **training: Any) -> dict[str, Any]:
    """A FinetuneJob document for a 2-worker CPU run (JobBuilder-style: override what a test needs)."""
    t: dict[str, Any] = {
        "maxSteps": 6, "learningRate": 0.003, "warmupRatio": 0.0, "globalBatchSize": 4, "microBatchSize": 1,
        "sequenceLength": 64, "evalIntervalSteps": 3,
        "fsdp": {"shardingStrategy": "full", "activationCheckpointing": False},
        "checkpoint": {"intervalSteps": 2, "keep": 2, "storageUri": str(storage)},
    }
    t.update(training)
    return {
        "apiVersion": "finetune.dev/v1alpha1", "kind": "FinetuneJob", "metadata": {"name": "tjob"},
        "spec": {
            "model": {"source": str(model_dir)},
            "dataset": {"source": str(data), "format": "promptCompletion", "evalFraction": 0.1},
            "training": t,
            "cluster": {"instanceType": "m5.2xlarge", "workers": {"replicas": 2, "gpusPerWorker": 0}},
            "network": {"efa": False},
        },
    }


def prompt_completion_records(n: int = 120) -> list[dict[str, str]]:
    out = []
    for i in range(n):
        a, b = 10 + i % 50, 20 + (i * 7) % 60
        out.append({"prompt": f"Question: What is {a} plus {b}?\nAnswer: ", "completion": f"{a} + {b} = {a + b}"})
    return out


def records_with_long_prompts(n: int = 40, long: int = 10) -> list[dict[str, str]]:
    """`prompt_completion_records(n)` whose first `long` prompts are 43 tokens (the others 16, plus a
    10-token completion): without packing, a sequenceLength of 24 leaves those `long` records with no
    trained token (issue 11.11), one of 64 keeps every completion."""
    recs = prompt_completion_records(n)
    for r in recs[:long]:
        r["prompt"] = "Question: " + "What is one plus one? " * 3 + "\nAnswer: "
    return recs


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def export_ready_trainer(model_dir: Path, storage: str) -> Any:
    """A one-rank `Trainer` holding the tiny model (unsharded) and its tokenizer: enough for `export()`
    without `setup()` (needs the `process_group` fixture)."""
    import torch
    from finetune_operator.api.spec import FinetuneJob, ModelSpec
    from finetune_training import modelio
    from finetune_training.environment import RuntimeEnv
    from finetune_training.loop import LoopConfig, Trainer

    doc = job_doc(model_dir, model_dir / "unused.jsonl", Path("/unused"))
    doc["spec"]["cluster"]["workers"]["replicas"] = 1
    cfg = LoopConfig(job=doc, storage=storage, storage_uri=storage, run_name="train")
    trainer = Trainer(FinetuneJob.model_validate(doc), cfg, rank=0, world=1, local_rank=0, local_world=1,
                      device=torch.device("cpu"), env=RuntimeEnv())
    spec = ModelSpec(source=str(model_dir))
    trainer.model = modelio.load_model(spec, torch.float32)
    trainer.model_config, trainer.compute_dtype = trainer.model.config, torch.float32
    trainer.tokenizer, trainer.generation_config = modelio.load_tokenizer(spec), None
    return trainer
