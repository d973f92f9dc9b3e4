"""Step time of the runtime's FSDP loop under Ray Train vs plain torchrun (2 CPU workers, gloo).

    .venv/bin/python benchmarks/bench_ray_vs_torchrun.py [--steps 40] [--warmup 5] [--repeats 3]
                                                          [--job examples/local-tiny.yaml]

Both sides run exactly the runtime's training step (`finetune_training.loop.Trainer.train_step`: FSDP2
forward/backward over the job's packed data, grad clipping, AdamW, the loss all-reduce) on the same
model, data and seed, one thread per rank; only the launcher differs. No progress endpoint and no
checkpoints inside the timed window. Prints the median step times and their ratio (goal: Ray <= 1.10x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def timed_steps(job_doc: dict[str, Any], rank: int, world: int, steps: int, warmup: int) -> list[float]:
    import torch
    from finetune_operator.api.spec import FinetuneJob
    from finetune_training.environment import RuntimeEnv
    from finetune_training.loop import LoopConfig, Trainer

    torch.set_num_threads(1)
    job = FinetuneJob.model_validate(job_doc)
    cfg = LoopConfig(job=job_doc, storage="/tmp/unused", storage_uri="/tmp/unused", run_name="bench")
    trainer = Trainer(job, cfg, rank=rank, world=world, local_rank=rank, local_world=world,
                      device=torch.device("cpu"), env=RuntimeEnv())
    trainer.setup()
    trainer.total = steps + warmup
    times = []
    for _ in range(steps + warmup):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def ray_worker(config: dict[str, Any]) -> None:
    import ray.train

    ctx = ray.train.get_context()
    times = timed_steps(config["job"], ctx.get_world_rank(), ctx.get_world_size(), config["steps"], config["warmup"])
    if ctx.get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps(times))


def run_ray(job_doc: dict[str, Any], steps: int, warmup: int, out: Path) -> list[float]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        TorchTrainer(
            ray_worker,
            train_loop_config={"job": job_doc, "steps": steps, "warmup": warmup, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(name="bench", storage_path=str(out.parent / "ray")),
            torch_config=TorchConfig(backend="gloo"),
        ).fit()
    finally:
        ray.shutdown()
    return list(json.loads(out.read_text()))


def run_torchrun(job_file: Path, steps: int, warmup: int, out: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--torchrun-worker", "--job", str(job_file), "--steps", str(steps), "--warmup", str(warmup),
           "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return list(json.loads(out.read_text()))


def torchrun_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    times = timed_steps(load_doc(args.job), rank, world, args.steps, args.warmup)
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def load_doc(job_file: str | Path) -> dict[str, Any]:
    from finetune_training.cli import prepare_document

    job, _ = prepare_document(str(job_file), cwd=ROOT)
    return job.wire()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=str(ROOT / "examples" / "local-tiny.yaml"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1, help="alternating torchrun/Ray runs (figures pooled)")
    p.add_argument("--out")
    p.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args)
        return
    doc = load_doc(args.job)
    t_torchrun: list[float] = []
    t_ray: list[float] = []
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(doc))
        for i in range(args.repeats):  # alternate, so machine-wide noise hits both sides alike
            a = run_torchrun(job_file, args.steps, args.warmup, Path(tmp) / f"torchrun{i}.json")
            b = run_ray(doc, args.steps, args.warmup, Path(tmp) / f"ray{i}.json")
            t_torchrun += a
            t_ray += b
            pairs.append((statistics.median(a), statistics.median(b)))
    med_t, med_r = statistics.median(t_torchrun), statistics.median(t_ray)
    t = doc["spec"]["training"]
    print(f"job {Path(args.job).name}: 2 CPU ranks (gloo, 1 thread each), FSDP2 "
          f"{t['fsdp']['shardingStrategy']}, globalBatch {t['globalBatchSize']} x seq {t['sequenceLength']}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, {args.repeats} alternating run(s) each")
    for i, (a, b) in enumerate(pairs):
        print(f"  run {i + 1}: torchrun {a * 1000:.1f} ms, Ray Train {b * 1000:.1f} ms, ratio {b / a:.3f}x")
    print(f"torchrun  median step {med_t * 1000:8.1f} ms   (p10 {q(t_torchrun, 0.1) * 1000:.1f}, "
          f"p90 {q(t_torchrun, 0.9) * 1000:.1f})")
    print(f"Ray Train median step {med_r * 1000:8.1f} ms   (p10 {q(t_ray, 0.1) * 1000:.1f}, "
          f"p90 {q(t_ray, 0.9) * 1000:.1f})")
    print(f"ratio Ray/torchrun: {med_r / med_t:.3f}x (goal <= 1.10x)")


def q(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(f * len(s)))]


if __name__ == "__main__":
    main()
