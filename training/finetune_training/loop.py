"""The per-worker training function Ray Train runs on every rank (`train_func`).

Order of work: network probe → load tokenizer/model → prepare data → FSDP2 → optimizer → resume →
steps (eval and checkpoints at their intervals, progress every step through the non-blocking client)
→ final eval + checkpoint → Hugging Face export. Ray sees a `ray.train.report` only with a checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from finetune_operator.api.failpoints import arm_from_env, failpoint
from finetune_operator.api.instance_types import lookup
from finetune_operator.api.spec import FinetuneJob, FinetuneJobSpec
from finetune_operator.api.status import NetworkHealth, ProgressReport, TrainingProgress

from . import checkpoint as ckpt
from .data import (
    IGNORE,
    PreparedData,
    check_enough_sequences,
    prepare,
    step_sequences,
    steps_per_epoch,
    truncation_notice,
)
from .environment import RuntimeEnv
from .errors import DeterministicError
from .loss import loss_sum, shift_targets
from .metrics import Throughput, mfu, model_shape, peak_memory_gib
from .progress import ProgressClient

log = logging.getLogger("finetune.train")
EVAL_MAX_BATCHES = int(os.environ.get("FINETUNE_EVAL_MAX_BATCHES", "50"))


class NonFiniteError(DeterministicError, RuntimeError):
    """The loss or the gradient norm is NaN/inf: the job stops before the optimizer step."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class LoopConfig:
    """What the driver passes to every worker (as a plain dict through Ray)."""

    job: dict[str, Any]  # the FinetuneJob document (wire form)
    storage: str  # resolved storage: absolute local path or s3:// URI
    storage_uri: str  # the same as written in the spec (for status)
    run_name: str  # Ray Train run name: checkpoints live in <storage>/<run_name>/
    progress_interval: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.run_name}"

    @property
    def checkpoints_dir(self) -> str:
        return checkpoints_dir(self.storage, self.run_name)

    @property
    def final_dir(self) -> str:
        return f"{self.storage.rstrip('/')}/final"


def checkpoints_dir(storage: str, run_name: str) -> str:
    return f"{storage.rstrip('/')}/{ckpt.CHECKPOINTS_DIR}/{run_name}"


def total_steps(spec: FinetuneJobSpec, num_train_sequences: int) -> int:
    t = spec.training
    if t.max_steps:
        return int(t.max_steps)
    return int(t.epochs) * steps_per_epoch(num_train_sequences, int(t.global_batch_size))


class Trainer:
    """State of one rank. Split from `train_func` so tests can drive it in a plain process group."""

    def __init__(self, job: FinetuneJob, cfg: LoopConfig, *, rank: int, world: int, local_rank: int,
                 local_world: int, device: Any, env: RuntimeEnv | None = None) -> None:
        self.job, self.spec, self.cfg = job, job.spec, cfg
        self.rank, self.world, self.local_rank, self.local_world = rank, world, local_rank, local_world
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.env = env or RuntimeEnv.from_environ()
        interval = cfg.progress_interval if cfg.progress_interval is not None else self.env.progress_interval
        self.progress = ProgressClient(self.env.progress_url if rank == 0 else None, self.env.progress_token_file,
                                       interval=interval, attempt=self.env.attempt)
        self.network: NetworkHealth | None = None
        self.step = 0
        self.total = 0
        self.eval_loss: float | None = None
        self.last_checkpoint: str | None = None
        self.last_checkpoint_step: int | None = None
        self.last: TrainingProgress | None = None
        self.resumed_from: list[int] = []

    # ------------------------------------------------------------------------------------ setup

    def say(self, msg: str) -> None:
        if self.rank == 0:
            # Written to the process's stdout directly: Ray Train patches print() into its logger, which
            # shows every line twice in the job log.
            out = sys.__stdout__ or sys.stdout
            out.write(f"{self.env.log_prefix()} {msg}\n")
            out.flush()

    def probe(self) -> NetworkHealth:
        from .netprobe import run_probe

        require = self.env.require_efa if self.env.require_efa is not None else self.spec.network.require_efa
        efa_expected = self.spec.network.efa and self.on_gpu
        health = run_probe(self.device, efa_expected=efa_expected, require_efa=require,
                           nodes=max(1, self.world // max(1, self.local_world)))
        self.network = health
        self.say(f"network: {health.transport} ({health.message})"
                 + (f", busbw {health.bus_bandwidth_g_bps} GB/s" if health.bus_bandwidth_g_bps else ""))
        self.progress.publish(ProgressReport(phase="Starting", network=health))
        return health

    def setup(self) -> None:
        import torch
        import torch.distributed as dist

        from . import modelio, optim
        from .parallel import apply_fsdp, build_mesh

        t = self.spec.training
        torch.manual_seed(t.seed)
        self.compute_dtype = modelio.compute_dtype(t.precision, self.on_gpu)
        load_dtype = modelio.load_dtype(self.spec.model.dtype, t.precision, self.on_gpu)
        cache = self.env.cache_dir
        # Local rank 0 fetches (hub download, s3 copy) first; the others then hit the cache. Only rank 0
        # loads the weights into host memory; the other ranks build the model on the meta device and
        # receive their shards from rank 0 after sharding (`modelio.load_sharded`).
        if self.local_rank != 0:
            dist.barrier()
        self.tokenizer = modelio.load_tokenizer(self.spec.model, cache)
        attn = modelio.attention_implementation(t.packing, self.on_gpu, self.compute_dtype)
        model, full_sd = modelio.load_for_sharding(self.spec.model, load_dtype, cache, self.rank, self.world, attn)
        if attn and self.rank == 0:
            self.say(f"attention: {attn} (packed records through the varlen kernel)")
        self.generation_config = modelio.load_generation_config(self.spec.model, cache) if self.rank == 0 else None
        if self.local_rank == 0:
            dist.barrier()
        self.data: PreparedData = prepare(self.spec.dataset, self.tokenizer, t.sequence_length, t.packing,
                                          t.seed, cache)
        self.say(f"data: {self.data.stats}")
        check_enough_sequences(len(self.data.train), t.micro_batch_size, self.spec.gradient_accumulation_steps,
                               self.world)
        notice = truncation_notice(self.data.stats, t.sequence_length)
        if notice is not None:
            level, text = notice
            self.say(text)
            if level >= logging.WARNING:
                log.warning(text.removeprefix("WARNING: "))
                # Also as a progress message: `finetune run` shows those, not the workers' stdout.
                self.progress.publish(ProgressReport(phase="Starting", message=text))
        self.shape = model_shape(model)
        self.model_config = model.config
        self.flops_per_token = self.shape.flops_per_token(t.sequence_length)
        mesh = build_mesh(t.fsdp.sharding_strategy, self.world, self.local_world, self.device.type)
        self.mesh = mesh
        self.model = apply_fsdp(model, mesh, t.fsdp, self.compute_dtype, self.on_gpu)
        modelio.fill_sharded(self.model, full_sd, self.device, self.rank, self.world, t.fsdp.cpu_offload)
        del full_sd
        if not self.on_gpu:
            self.model.to(self.device)
        self.model.train()
        self.total = total_steps(self.spec, len(self.data.train))
        self.optimizer, self.scheduler = optim.build(self.model, t, self.total)
        itype = lookup(self.env.instance_type or self.spec.cluster.instance_type)
        self.peak_tflops = itype.gpu_bf16_tflops if (itype and self.on_gpu) else 0.0
        self.say(f"model: {self.shape.non_embedding_params / 1e6:.2f}M non-embedding params, "
                 f"{self.total} steps, mesh {tuple(mesh.shape)} ({t.fsdp.sharding_strategy.value}), "
                 f"grad accumulation {self.spec.gradient_accumulation_steps}")

    # ----------------------------------------------------------------------------------- resume

    def resume(self, ray_checkpoint: Any | None) -> int:
        """Load the newest complete checkpoint and return its step (`checkpoint.choose_resume`).

        Candidates: Ray's (`ray.train.get_checkpoint()`: after a worker-group restart, or a rerun/retry
        with the same run directory), whose pointed-to checkpoint is itself checked, and always a scan of
        this run's checkpoint directory (Ray registers a checkpoint asynchronously, so a run killed right
        after writing one can leave it complete on storage but not in Ray's snapshot). The choice and the
        reason are logged; a Ray checkpoint with nothing usable behind it is an error, never step 0.
        """
        pointer = None
        if ray_checkpoint is not None:
            with ray_checkpoint.as_directory() as d:
                pointer = ckpt.read_pointer(d) or {"step": None, "uri": f"{ray_checkpoint.path} (no pointer.json)"}
        choice = ckpt.choose_resume(pointer, self.cfg.checkpoints_dir)
        self.say(f"resume: {choice.why}")
        if choice.uri is None:
            return 0
        staging = Path(self.env.staging_dir or tempfile.gettempdir()) / "finetune-staging" / self.cfg.run_name
        state = ckpt.load_from(choice.uri, self.model, self.optimizer, self.local_rank, staging)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.eval_loss = state.get("eval_loss")
        self.last_checkpoint = state.get("uri")
        self.last_checkpoint_step = self.step
        self.resumed_from = [*state.get("resumed_from", []), self.step]
        self.say(f"resuming from step {self.step} ({choice.uri})")
        self.progress.publish(ProgressReport(phase="Starting", message=f"resuming from step {self.step}"))
        return self.step

    # ------------------------------------------------------------------------------------ steps

    def _batch(self, seqs: Any, idx: list[int]) -> dict[str, Any]:
        """Model inputs of one micro-batch: shifted targets; packed sequences flattened to one row with
        per-record position ids (block-diagonal attention; the varlen kernel with flash-attention)."""
        ids = seqs.input_ids[idx]
        targets = shift_targets(seqs.labels[idx])
        batch: dict[str, Any] = {"input_ids": ids, "targets": targets}
        if seqs.position_ids is not None:
            batch = {"input_ids": ids.reshape(1, -1), "targets": targets.reshape(1, -1),
                     "position_ids": seqs.position_ids[idx].reshape(1, -1)}
        elif seqs.attention_mask is not None:
            batch["attention_mask"] = seqs.attention_mask[idx]
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _loss_sum(self, batch: dict[str, Any]) -> Any:
        return loss_sum(self.model, **batch)

    def train_step(self) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        from .parallel import gradient_sync

        t = self.spec.training
        seqs = self.data.train
        batch = step_sequences(self.step, len(seqs), t.global_batch_size, t.seed)
        # Global count of target tokens, from the data every rank holds: no collective needed. Each
        # micro-batch's summed loss is scaled so FSDP's gradient averaging yields the mean over all targets.
        global_targets = max(1, int((seqs.labels[batch][:, 1:] != IGNORE).sum()))
        per_rank = t.global_batch_size // self.world
        mine = batch[self.rank * per_rank : (self.rank + 1) * per_rank]
        loss_acc = torch.zeros((), device=self.device, dtype=torch.float32)
        starts = range(0, per_rank, t.micro_batch_size)
        for i in starts:
            # Gradients cross replicas (HSDP's inter-node all-reduce) only on the last micro-batch.
            gradient_sync(self.model, t.fsdp.sharding_strategy, last=i == starts[-1])
            loss_sum = self._loss_sum(self._batch(seqs, mine[i : i + t.micro_batch_size]))
            (loss_sum * (self.world / global_targets)).backward()
            loss_acc += loss_sum.detach()
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        dist.all_reduce(loss_acc)
        loss, grad_norm = float(loss_acc) / global_targets, float(norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # Every rank sees the same reduced figures, so every rank stops here, before the update.
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"step {self.step + 1}: loss {loss} / gradient norm {grad_norm} is not finite; stopped before "
                f"the optimizer step, nothing checkpointed or exported after step {self.last_checkpoint_step or 0} "
                "(lower training.learningRate or training.maxGradNorm, check the data)")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": float(lr)}

    def evaluate(self) -> float | None:
        import torch
        import torch.distributed as dist

        ev = self.data.eval
        if ev is None:
            return None
        mb = self.spec.training.micro_batch_size
        per = self.world * mb
        batches = min(math.ceil(len(ev) / per), EVAL_MAX_BATCHES)
        acc = torch.zeros(2, device=self.device, dtype=torch.float64)
        self.model.eval()
        with torch.no_grad():
            for b in range(batches):
                idx = [i for i in range(b * per + self.rank * mb, b * per + (self.rank + 1) * mb) if i < len(ev)]
                # Every rank runs the same number of forwards (FSDP all-gathers); a rank out of data runs
                # a dummy batch that contributes no tokens.
                b_in = self._batch(ev, idx or [0])
                if not idx:
                    b_in["targets"] = torch.full_like(b_in["targets"], IGNORE)
                acc[0] += self._loss_sum(b_in).double()
                acc[1] += (b_in["targets"] != IGNORE).sum()
        self.model.train()
        dist.all_reduce(acc)
        self.eval_loss = float(acc[0] / acc[1]) if acc[1] > 0 else None
        return self.eval_loss

    # ------------------------------------------------------------------------------- checkpoints

    def trainer_state(self) -> dict[str, Any]:
        spe = steps_per_epoch(len(self.data.train), self.spec.training.global_batch_size)
        return {
            "step": self.step,
            "total_steps": self.total,
            "epoch": self.step // max(1, spe),
            "samples_seen": self.step * self.spec.training.global_batch_size,
            "world_size": self.world,
            "scheduler": self.scheduler.state_dict(),
            "eval_loss": self.eval_loss,
            "resumed_from": self.resumed_from,
            "uri": self.checkpoint_uri(self.step),
            "training": self.last.wire() if self.last else None,
            "network": self.network.wire() if self.network else None,
            "job": f"{self.job.metadata.namespace or 'default'}/{self.job.metadata.name}",
            "time": _now(),
        }

    def checkpoint_uri(self, step: int) -> str:
        """As the user wrote the storage (pvc://..., s3://..., a path), for status."""
        return f"{checkpoints_dir(self.cfg.storage_uri, self.cfg.run_name)}/{ckpt.checkpoint_name(step)}"

    def save_checkpoint(self, report: Any) -> None:
        """Write the sharded checkpoint to storage, prune to `keep`, and report a pointer to Ray.

        `report(metrics, pointer_dir | None, name)` is ray.train.report in a worker (a stub in tests); it
        is a barrier, so the step after it starts only once every rank's shard is written.
        """
        name = ckpt.checkpoint_name(self.step)
        uri = f"{self.cfg.checkpoints_dir}/{name}"
        staging = Path(self.env.staging_dir or tempfile.gettempdir()) / "finetune-staging" / self.cfg.run_name
        self.last_checkpoint = self.checkpoint_uri(self.step)
        self.last_checkpoint_step = self.step
        if self.last is not None:
            self.last = self.last.model_copy(update={"last_checkpoint": self.last_checkpoint,
                                                     "last_checkpoint_step": self.step})
        t0 = time.perf_counter()
        ckpt.save_to(uri, self.model, self.optimizer, self.trainer_state(), self.rank, staging)
        metrics = {
            "step": self.step,
            "training": self.last.wire() if self.last else {},
            "network": self.network.wire() if self.network else {},
        }
        pointer = None
        if self.rank == 0:
            ckpt.prune(self.cfg.checkpoints_dir, self.spec.training.checkpoint.keep)
            pointer = ckpt.write_pointer(staging / f"pointer-{name}", self.step, uri)
        report(metrics, pointer, name)
        if pointer is not None:
            shutil.rmtree(pointer, ignore_errors=True)
        self.say(f"checkpoint step {self.step} -> {self.last_checkpoint} ({time.perf_counter() - t0:.1f}s)")

    # ------------------------------------------------------------------------------------ export

    def export(self) -> str:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from .modelio import export_hf

        self.progress.publish(ProgressReport(phase="Exporting"))
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        final = self.cfg.final_dir
        if self.rank == 0:
            dtype = self.compute_dtype if self.compute_dtype != torch.float32 else self.model_config.dtype
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
            from .storage import replace_dir

            # The previous export stays in place until the new one is complete (and S3 keeps no stale file).
            replace_dir(final, lambda out: export_hf(full, self.model_config, self.tokenizer, out, dtype,
                                                     self.generation_config))
        dist.barrier()
        uri = f"{self.cfg.storage_uri.rstrip('/')}/final"
        self.say(f"exported Hugging Face model to {uri}")
        return uri

    # -------------------------------------------------------------------------------------- run

    def progress_snapshot(self, m: dict[str, float] | None, tput: Throughput) -> TrainingProgress:
        t = self.spec.training
        tps = tput.tokens_per_second
        spe = steps_per_epoch(len(self.data.train), t.global_batch_size)
        return TrainingProgress(
            step=self.step, total_steps=self.total, epoch=round(self.step / max(1, spe), 4),
            loss=round(m["loss"], 6) if m else (self.last.loss if self.last else None),
            eval_loss=round(self.eval_loss, 6) if self.eval_loss is not None else None,
            learning_rate=m["lr"] if m else None, grad_norm=round(m["grad_norm"], 6) if m else None,
            tokens_per_second=round(tps, 1) if tps else None,
            mfu=round(x, 4) if tps and (x := mfu(self.flops_per_token, tps, self.peak_tflops, self.world)) else None,
            peak_memory_gib=round(peak_memory_gib(self.on_gpu), 3),
            eta_seconds=round(e, 1) if (e := tput.eta(self.total - self.step)) is not None else None,
            last_report_time=_now(), last_checkpoint=self.last_checkpoint,
            last_checkpoint_step=self.last_checkpoint_step,
        )

    def run(self, report: Any) -> dict[str, Any]:
        t = self.spec.training
        tokens_per_step = t.global_batch_size * t.sequence_length
        tput = Throughput()
        interval = t.checkpoint.interval_steps
        saved_at = self.step if self.last_checkpoint_step == self.step else None
        first = True
        while self.step < self.total:
            m = self.train_step()
            if first:  # the first step (allocations, lazy init) is not representative
                tput.reset_clock()
                first = False
            else:
                tput.step(tokens_per_step)
            self._maybe_crash()
            if self.step % t.eval_interval_steps == 0 and self.step < self.total:
                self.evaluate()
                tput.reset_clock()
            self.last = self.progress_snapshot(m, tput)
            if self.rank == 0:
                self.progress.publish(ProgressReport(phase="Training", training=self.last))
            if self.step % interval == 0 and self.step < self.total:
                self.save_checkpoint(report)
                saved_at = self.step
                tput.reset_clock()  # keep checkpoint time out of the step-time figures
        self.evaluate()
        self.last = self.progress_snapshot(None, tput) if self.last is None else self.last.model_copy(
            update={"eval_loss": round(self.eval_loss, 6) if self.eval_loss is not None else None,
                    "eta_seconds": 0.0, "last_report_time": _now()})
        if saved_at != self.step:
            self.save_checkpoint(report)
        final = self.export()
        self.progress.publish(ProgressReport(phase="Done", training=self.last, network=self.network,
                                             message=f"exported to {final}"))
        return {"final": final, "training": self.last.wire(), "network": self.network.wire() if self.network else {}}

    def _maybe_crash(self) -> None:
        """The fail point ``train/after-step`` (finetune_operator.api.failpoints), e.g.
        ``FINETUNE_FAILPOINTS="train/after-step=exit(17)@step=5,rank=1"``: a real process death (os._exit),
        so Ray Train's failure handling and the resume path are exercised for real. A marker in the run
        directory makes it fire once, so the restarted workers get past the step (not on s3://, where the
        point is not reached)."""
        if self.cfg.run_dir.startswith("s3://"):
            return
        failpoint("train/after-step", once=Path(self.cfg.run_dir) / f".failpoint-after-step-{self.step}",
                  step=self.step, rank=self.rank)

    def close(self) -> None:
        self.progress.close()


def train_func(config: dict[str, Any]) -> None:
    """Ray Train worker entry point (one per rank)."""
    import ray.train
    import torch

    from .netprobe import NetworkProbeError, ensure_nccl_debug_file

    arm_from_env()  # a bad FINETUNE_FAILPOINTS fails here, before any work
    cfg = LoopConfig(**config)
    job = FinetuneJob.model_validate(cfg.job)
    ctx = ray.train.get_context()
    use_gpu = job.spec.cluster.workers.gpus_per_worker > 0 and torch.cuda.is_available()
    if use_gpu:
        ensure_nccl_debug_file()  # before the first NCCL call (the probe's all-reduce)
        import ray.train.torch

        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    trainer = Trainer(job, cfg, rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                      local_rank=ctx.get_local_rank(), local_world=ctx.get_local_world_size(), device=device)

    def report(metrics: dict[str, Any], pointer_dir: Path | None, name: str) -> None:
        from ray.train import Checkpoint

        checkpoint = Checkpoint.from_directory(str(pointer_dir)) if pointer_dir is not None else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)

    try:
        trainer.probe()
        trainer.setup()
        trainer.resume(ray.train.get_checkpoint())
        trainer.run(report)
    except NetworkProbeError as e:
        trainer.progress.publish(ProgressReport(phase="Failed", network=e.health or trainer.network,
                                                message=str(e)[:2000]))
        raise
    except Exception as e:
        trainer.progress.publish(ProgressReport(phase="Failed", message=f"{type(e).__name__}: {e}"[:2000]))
        raise
    finally:
        trainer.close()
