"""`python -m finetune_training --config FILE`: the RayJob entrypoint inside the Ray cluster.

FILE is the whole FinetuneJob document (YAML or JSON) the operator puts in the job's ConfigMap. The
driver connects to the running Ray cluster (`ray.init()` picks up RAY_ADDRESS), runs the TorchTrainer
and prints the final summary (the shape of the CR status). Exit status 0 on success, 1 on failure,
2 on an invalid document, 3 when the image's Python stack is outside the supported versions
(`finetune_training.stackcheck`; checked first, before torch or Ray is imported). The environment is described in `finetune_training.environment`.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from .stackcheck import UnsupportedStack, check, describe

    try:
        print(f"finetune_training: {describe(check())}", file=sys.stderr, flush=True)
    except UnsupportedStack as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    from finetune_operator.api.status import Phase
    from pydantic import ValidationError

    from .config import load_job
    from .environment import RuntimeEnv
    from .launcher import build_trainer, run_name, status_yaml, summary

    p = argparse.ArgumentParser(prog="python -m finetune_training", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="FinetuneJob YAML/JSON file")
    p.add_argument("--max-failures", type=int, default=int(os.environ.get("FINETUNE_MAX_FAILURES", "2")),
                   help="worker-group restarts from the last checkpoint before the run fails (default 2)")
    args = p.parse_args(argv)
    try:
        job = load_job(args.config)
    except (ValidationError, ValueError, OSError) as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    env = RuntimeEnv.from_environ()
    storage = job.spec.training.checkpoint.storage_uri or f"/tmp/finetune/{job.metadata.name}"
    from .storage import StorageError, check_source

    try:  # an unreadable s3:// source fails the job here, once, before any worker starts
        check_source(job.spec.model.source, "spec.model.source")
        check_source(job.spec.dataset.source, "spec.dataset.source")
    except StorageError as e:
        print(status_yaml(summary(Phase.failed, str(e)[:2000], None)), flush=True)
        return 1
    import ray

    ray.init()
    name = run_name(job, env.attempt)
    trainer = build_trainer(job, storage_uri=storage, name=name, max_failures=args.max_failures,
                            spread=job.spec.cluster.workers.gpus_per_worker == 0)
    try:
        result = trainer.fit()
    except Exception as e:
        from .failfast import failure_message

        print(status_yaml(summary(Phase.failed, failure_message(e)[:2000], None)), flush=True)
        return 1
    print(status_yaml(summary(Phase.succeeded, f"exported to {storage.rstrip('/')}/final", result.metrics)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
