"""The Ray driver: build the TorchTrainer from a FinetuneJob, run it, summarise the outcome.

Used by `python -m finetune_training` inside the cluster (connects to the RayJob's cluster) and by
`finetune run` (embedded local Ray). Ray Train's run directory is `<storage>/<run name>` and the
sharded checkpoints go to `<storage>/checkpoints/<run name>/`. With resume: auto the run name is stable
(`train`), so a retried job (new Ray cluster, same storage) finds Ray's snapshot and the checkpoints
again and continues from the newest; with resume: never every attempt gets its own run name and starts
at step 0 (a worker-group restart within the attempt still resumes from the attempt's checkpoints).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from finetune_operator.api.spec import FinetuneJob, Resume
from finetune_operator.api.status import FinetuneJobStatus, NetworkHealth, Phase, TrainingProgress

from .loop import LoopConfig, train_func
from .storage import local_absolute

RUN_NAME = "train"


def run_name(job: FinetuneJob, attempt: int | None = None) -> str:
    if job.spec.training.resume == Resume.never:
        return f"{RUN_NAME}-{attempt}" if attempt else f"{RUN_NAME}-{time.strftime('%Y%m%d-%H%M%S')}"
    return RUN_NAME


def build_trainer(job: FinetuneJob, *, storage_uri: str, name: str, max_failures: int,
                  progress_interval: float | None = None, spread: bool = False) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .failfast import FailFast

    spec = job.spec
    gpus = spec.cluster.workers.gpus_per_worker
    storage = local_absolute(storage_uri)
    cfg = LoopConfig(job=job.wire(), storage=storage, storage_uri=storage_uri, run_name=name,
                     progress_interval=progress_interval)
    scaling = ScalingConfig(
        num_workers=spec.data_parallel_ranks,
        use_gpu=gpus > 0,
        resources_per_worker={"CPU": 1, "GPU": 1} if gpus > 0 else {"CPU": 1},
        placement_strategy="SPREAD" if spread else "PACK",
    )
    run = RunConfig(
        name=name,
        storage_path=storage,
        failure_config=FailureConfig(max_failures=max_failures),
        # Deterministic errors fail the run at once, not max_failures + 1 times. (Train v2 takes UserCallbacks;
        # the static type is v1's.)
        callbacks=[FailFast()],  # type: ignore[list-item]
        checkpoint_config=CheckpointConfig(num_to_keep=spec.training.checkpoint.keep),
    )
    return TorchTrainer(train_func, train_loop_config=asdict(cfg), scaling_config=scaling, run_config=run,
                        torch_config=TorchConfig(backend=process_group_backend(job)))


def process_group_backend(job: FinetuneJob) -> str:
    """gloo on CPU; NCCL on GPU, plus gloo for CPU tensors when FSDP offloads parameters to the CPU (the
    gradient-norm reduction of CPU-resident DTensor shards needs a CPU backend)."""
    if job.spec.cluster.workers.gpus_per_worker == 0:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if job.spec.training.fsdp.cpu_offload else "nccl"


def summary(phase: Phase, message: str, metrics: dict[str, Any] | None,
            training: TrainingProgress | None = None, network: NetworkHealth | None = None) -> FinetuneJobStatus:
    """The final status, in the same shape the operator writes to the FinetuneJob."""
    m = metrics or {}
    if training is None and m.get("training"):
        training = TrainingProgress.model_validate(m["training"])
    if network is None and m.get("network"):
        network = NetworkHealth.model_validate(m["network"])
    return FinetuneJobStatus(phase=phase, message=message, training=training, network=network)


def status_yaml(status: FinetuneJobStatus) -> str:
    import yaml

    return str(yaml.safe_dump({"status": status.wire()}, sort_keys=False, default_flow_style=False))
