"""`finetune run FILE`: the whole training runtime on this machine, with embedded Ray.

    finetune run examples/local-tiny.yaml            # or: python -m finetune_training.cli run FILE

Starts a local Ray instance (no dashboard), runs `cluster.workers.replicas` CPU workers (FSDP2 over gloo)
with the job's model, data and hyper-parameters, shows a progress bar fed by the same progress messages
the operator receives in a cluster (through a small HTTP server on 127.0.0.1), writes checkpoints and
the final Hugging Face model under the storage directory, and prints a summary in the shape of the
FinetuneJob status. Ctrl-C stops it; running it again resumes from the last checkpoint (`--fresh` starts
over). `finetune_operator.cli` calls `register(subparsers)` to add the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

_LOCAL_PREFIXES = ("./", "../")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `run` subcommand to an argparse subparsers object; dispatch with `args.func(args)`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="run a FinetuneJob's training on this machine (embedded Ray, CPU workers)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("file", help="FinetuneJob YAML/JSON")
    p.add_argument("--workers", type=int, help="override cluster.workers.replicas (one CPU rank each)")
    p.add_argument("--max-steps", type=int, help="override training.maxSteps")
    p.add_argument("--storage", help="override training.checkpoint.storageUri (default ./.work/<job name>)")
    p.add_argument("--fresh", action="store_true",
                   help="delete this job's local checkpoints and export first, start at step 0")
    p.add_argument("--max-failures", type=int, default=0,
                   help="worker-group restarts from the last checkpoint before failing (default 0)")
    p.add_argument("--cpus", type=int, help="CPUs for the embedded Ray instance (default: max(cores, workers))")
    p.add_argument("--verbose", "-v", action="store_true", help="show Ray's and the workers' logs")
    p.set_defaults(func=run_command)
    return p


def _absolute(value: str, base: Path) -> str:
    return str((base / value).resolve()) if value.startswith(_LOCAL_PREFIXES) else value


def prepare_document(path: str, *, workers: int | None = None, max_steps: int | None = None,
                     storage: str | None = None, cwd: Path | None = None) -> tuple[Any, str]:
    """Read the job, apply the command-line overrides, make local paths absolute; (FinetuneJob, storage)."""
    import yaml
    from finetune_operator.api.spec import FinetuneJob

    base = cwd or Path.cwd()
    text = Path(path).read_text()
    doc = yaml.safe_load(text)  # JSON is YAML
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a FinetuneJob document")
    spec = doc.setdefault("spec", {})
    training = spec.setdefault("training", {})
    ckpt = training.setdefault("checkpoint", {})
    if workers is not None:
        spec.setdefault("cluster", {}).setdefault("workers", {})["replicas"] = workers
    if max_steps is not None:
        training["maxSteps"] = max_steps
    name = (doc.get("metadata") or {}).get("name", "job")
    storage_uri = storage or ckpt.get("storageUri") or f"./.work/{name}"
    if storage_uri.startswith(_LOCAL_PREFIXES) or not storage_uri.startswith(("/", "s3://", "pvc://")):
        storage_uri = str((base / storage_uri).resolve())
    ckpt["storageUri"] = storage_uri
    for section in ("model", "dataset"):
        src = (spec.get(section) or {}).get("source")
        if isinstance(src, str):
            spec[section]["source"] = _absolute(src, base)
    return FinetuneJob.model_validate(doc), storage_uri


def run_command(args: argparse.Namespace) -> int:
    from .stackcheck import UnsupportedStack, check

    try:
        check()
    except UnsupportedStack as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    from pydantic import ValidationError

    try:
        job, storage = prepare_document(args.file, workers=args.workers, max_steps=args.max_steps,
                                        storage=args.storage)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            print(f"{args.file}: {loc + ': ' if loc else ''}{err['msg']}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 2
    return run_local(job, storage, fresh=args.fresh, max_failures=args.max_failures, cpus=args.cpus,
                     verbose=args.verbose)


def run_local(job: Any, storage: str, *, fresh: bool = False, max_failures: int = 0, cpus: int | None = None,
              verbose: bool = False, out: Any = None) -> int:
    from finetune_operator.api.spec import Resume
    from finetune_operator.api.status import Phase, ProgressReport

    from . import checkpoint as ckpt
    from .launcher import build_trainer, run_name, status_yaml, summary
    from .loop import checkpoints_dir
    from .progress import ProgressBar, ProgressServer

    out = out or sys.stdout
    spec = job.spec
    workers = spec.data_parallel_ranks
    gpus = spec.cluster.workers.gpus_per_worker
    if gpus > 0:
        import torch

        if not torch.cuda.is_available():
            print("cluster.workers.gpusPerWorker > 0 but this machine has no GPU: set it to 0 for a local run",
                  file=sys.stderr)
            return 2
    from .storage import StorageError, check_source

    for field, src in (("spec.model.source", spec.model.source), ("spec.dataset.source", spec.dataset.source)):
        if src.startswith("/") and not Path(src).exists():  # fail before starting Ray
            print(f"{field}: {src} does not exist", file=sys.stderr)
            return 2
        try:
            check_source(src, field)
        except StorageError as e:
            print(e, file=sys.stderr)
            return 2
    name = run_name(job)
    run_dir = Path(checkpoints_dir(storage, name))
    if fresh:
        for d in (run_dir, Path(storage) / name, Path(storage) / "final"):
            if d.exists():
                shutil.rmtree(d)
                print(f"--fresh: removed {d}", file=out)
    print(f"finetune run {job.metadata.name}: {workers} {'GPU' if gpus else 'CPU'} worker(s), "
          f"model {spec.model.source}, data {spec.dataset.source}", file=out)
    print(f"storage: {storage}", file=out)
    for d in remove_partial_checkpoints(run_dir):
        print(f"removed partial checkpoint {d}", file=out)
    hit = ckpt.latest(run_dir) if spec.training.resume == Resume.auto else None
    if hit:
        print(f"resuming from step {hit[0]} ({hit[1]})", file=out)

    announced = f"resuming from step {hit[0]}" if hit else None  # said already; the workers confirm it
    bar = ProgressBar(stream=out)
    seen: dict[str, Any] = {}

    def on_report(report: ProgressReport) -> None:
        if report.network and "network" not in seen:
            seen["network"] = report.network
            n = report.network
            bw = f", all-reduce busbw {n.bus_bandwidth_g_bps} GB/s" if n.bus_bandwidth_g_bps else ""
            bar.update(ProgressReport(message=f"network: {n.transport}{bw} ({n.message})"))
        if report.phase and report.phase != seen.get("phase") and report.phase in ("Exporting", "Failed"):
            bar.finish()
        if report.phase:
            seen["phase"] = report.phase
        if report.message and report.phase != "Done" and report.message != announced:
            bar.update(ProgressReport(message=report.message))
        if report.training:
            bar.update(ProgressReport(training=report.training))
        seen["latest"] = report

    server = ProgressServer(on_report)
    env = {
        "FINETUNE_PROGRESS_URL": server.url,
        "FINETUNE_PROGRESS_INTERVAL": "0.5",
        "FINETUNE_JOB_NAME": job.metadata.name,
        "FINETUNE_JOB_NAMESPACE": job.metadata.namespace or "local",
        "FINETUNE_INSTANCE_TYPE": spec.cluster.instance_type,
        "FINETUNE_REQUIRE_EFA": "1" if spec.network.require_efa else "0",
        "PYTHONWARNINGS": "ignore",
    }
    # Other FINETUNE_* settings of this shell (cache dir, eval cap, fault injection) reach the workers too.
    env.update({k: v for k, v in os.environ.items() if k.startswith("FINETUNE_") and k not in env})
    import ray

    if not verbose:
        os.environ.setdefault("RAY_TRAIN_V2_LOG_LEVEL", "WARNING")
        logging.getLogger("ray").setLevel(logging.ERROR)
    started = time.monotonic()
    ray.init(num_cpus=cpus or max(os.cpu_count() or 1, workers), include_dashboard=False,
             log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR,
             runtime_env={"env_vars": env})
    trainer = build_trainer(job, storage_uri=storage, name=name, max_failures=max_failures,
                            progress_interval=0.5)
    code = 0
    try:
        result = _fit_interruptibly(trainer)
        latest = seen.get("latest")
        bar.finish()
        training = latest.training if latest and latest.training else None
        status = summary(Phase.succeeded, f"exported to {storage}/final", result.metrics,
                         training=training, network=seen.get("network"))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not break the cleanup
        bar.finish()
        last = ckpt.latest(run_dir)
        where = f"step {last[0]}" if last else "step 0 (no checkpoint yet)"
        print(f"\ninterrupted; run the same command again to resume from {where}", file=out)
        code = 130
        status = None
    except Exception as e:
        bar.finish()
        latest = seen.get("latest")
        msg = latest.message if latest is not None and latest.phase == "Failed" and latest.message else str(e)
        status = summary(Phase.failed, msg.strip().splitlines()[-1][:2000] if msg else type(e).__name__, None,
                         network=seen.get("network"))
        code = 1
    finally:
        ray.shutdown()
        server.close()
    if status is not None:
        print(status_yaml(status), file=out, end="")
        print(f"# {time.monotonic() - started:.0f}s", file=out)
    return code


def _fit_interruptibly(trainer: Any) -> Any:
    """`trainer.fit()` in a helper thread, so Ctrl-C reaches us as KeyboardInterrupt.

    (Ray Train installs its own SIGINT handler when fit() runs on the main thread; it aborts the run and
    may `sys.exit(0)`, which would hide the interruption from the user.) On Ctrl-C the caller shuts Ray
    down, which stops the workers; complete checkpoints stay, a partial one is ignored on resume.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if "error" in box:
        raise box["error"]
    return box["result"]


def remove_partial_checkpoints(run_dir: Path) -> list[Path]:
    """Delete checkpoint directories an interrupted run left half-written (local storage only)."""
    from . import checkpoint as ckpt

    removed = []
    if run_dir.is_dir():
        for d in run_dir.glob("checkpoint-step-*"):
            if d.is_dir() and not ckpt.is_complete(d):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
