"""Step time of the runtime's FSDP loop under Ray Train vs plain torchrun (2 CPU workers, gloo).

    .venv/bin/python benchmarks/bench_ray_vs_torchrun.py [--steps 40] [--warmup 5] [--repeats 3]
                                                          [--job examples/local-tiny.yaml] [--profile DIR]

Both sides run exactly the runtime's training step (`finetune_training.loop.Trainer.train_step`: FSDP2
forward/backward over the job's packed data, grad clipping, AdamW, the loss all-reduce) on the same
model, data and seed, one thread per rank; only the launcher differs. No progress endpoint and no
checkpoints inside the timed window. Prints each alternating pair's median step times and ratio, and
the median of those ratios (goal: Ray <= 1.10x). `--profile DIR` runs rank 0's timed steps under
cProfile on both sides and writes/prints the top functions by own time (DIR/{torchrun,ray}-N.txt).

Measured 2026-12-03 on this 2-core machine, idle (`--repeats 3`, the defaults): torchrun 104.6 / 107.4 /
102.2 ms per step, Ray Train 118.3 / 118.8 / 115.0 ms: ratios 1.131 / 1.105 / 1.125, median **1.125x**
(goal 1.10x, not met). Where it goes (`--profile`, rank 0, 40 steps): both sides make the same calls, the
same number of times (1.60 M function calls each; no per-step work of ours differs), but under Ray every
kernel runs 10-17 % slower (backward 1.02 s vs 0.88 s, linear 0.24 vs 0.21 s) and the ranks wait longer in
collectives (c10d wait 1.21 s vs 0.76 s): Ray's own processes (raylet, GCS, dashboard agent, the driver)
take CPU time from the two ranks on two cores. Nothing in the runtime's step is left to remove; on a GPU
node (ranks on GPUs, 48 cores for Ray's daemons) this contention does not arise.
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


def timed_steps(job_doc: dict[str, Any], rank: int, world: int, steps: int, warmup: int,
                profile: str | None = None) -> list[float]:
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
    prof = None
    for i in range(steps + warmup):
        if i == warmup and profile and rank == 0:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    if prof is not None and profile:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        Path(profile).write_text(buf.getvalue())
    return times[warmup:]


def ray_worker(config: dict[str, Any]) -> None:
    import ray.train

    ctx = ray.train.get_context()
    times = timed_steps(config["job"], ctx.get_world_rank(), ctx.get_world_size(), config["steps"], config["warmup"],
                        config.get("profile"))
    if ctx.get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps(times))


def run_ray(job_doc: dict[str, Any], steps: int, warmup: int, out: Path, profile: str | None = None) -> list[float]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        TorchTrainer(
            ray_worker,
            train_loop_config={"job": job_doc, "steps": steps, "warmup": warmup, "out": str(out), "profile": profile},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(name="bench", storage_path=str(out.parent / "ray")),
            torch_config=TorchConfig(backend="gloo"),
        ).fit()
    finally:
        ray.shutdown()
    return list(json.loads(out.read_text()))


def run_torchrun(job_file: Path, steps: int, warmup: int, out: Path, profile: str | None = None) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--torchrun-worker", "--job", str(job_file), "--steps", str(steps), "--warmup", str(warmup),
           "--out", str(out)] + (["--profile-out", profile] if profile else [])
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return list(json.loads(out.read_text()))


def torchrun_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    times = timed_steps(load_doc(args.job), rank, world, args.steps, args.warmup, args.profile_out)
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
    p.add_argument("--repeats", type=int, default=3, help="alternating torchrun/Ray runs (figures pooled)")
    p.add_argument("--out")
    p.add_argument("--profile", help="cProfile rank 0's timed steps on both sides; reports go to this directory")
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
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
        prof_dir = Path(args.profile).resolve() if args.profile else None
        if prof_dir:
            prof_dir.mkdir(parents=True, exist_ok=True)
        for i in range(args.repeats):  # alternate, so machine-wide noise hits both sides alike
            pt = str(prof_dir / f"torchrun-{i}.txt") if prof_dir else None
            pr = str(prof_dir / f"ray-{i}.txt") if prof_dir else None
            a = run_torchrun(job_file, args.steps, args.warmup, Path(tmp) / f"torchrun{i}.json", pt)
            b = run_ray(doc, args.steps, args.warmup, Path(tmp) / f"ray{i}.json", pr)
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
    ratios = [b / a for a, b in pairs]
    print(f"ratio Ray/torchrun: median of {len(ratios)} alternating run(s) {statistics.median(ratios):.3f}x "
          f"(pooled medians {med_r / med_t:.3f}x; goal <= 1.10x)")
    if args.profile:
        for f in sorted(Path(args.profile).glob("*-0.txt")):
            print(f"--- {f.name} (top by own time)")
            print("\n".join(f.read_text().splitlines()[:40]))


def q(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(f * len(s)))]


if __name__ == "__main__":
    main()
