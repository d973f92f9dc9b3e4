"""Does the tiny model learn its task? `finetune run JOB` (embedded Ray, 2 CPU workers, FSDP2 over gloo),
then greedy generation from the export and from the untrained base model on the job's held-out records
(its eval split), exact match:

    .venv/bin/python benchmarks/learning_check.py [JOB=examples/local-tiny-learns.yaml] [--max-steps N]

Printed: exact match of the whole completion, of its part up to `=` and of its first word.
tests/training/test_learning.py asserts it for the default job.

Measured 2026-12-03 (this 2-core machine, idle; `finetune run` time includes Ray's start):
- examples/local-tiny-learns.yaml (the last digit of a three-digit number times 7, one answer token,
  10 classes; 360 training records, 40 held out; batch 8 packed 128-token sequences, lr 3e-3 cosine):
  200 steps: 95 % in 56 s (untrained 0 %); 150 steps: 50 % (79 s, under load).
- examples/local-tiny.yaml (the demo: `51 + 29 = 80`, restating both numbers and their sum): 40 steps,
  0 % for both models. Restating copies two numbers and the sum needs carries: the 0.33 M-parameter
  model needs far more steps than the demo's minute (benchmarks/learning_probe.py `add2`: 0 % after 120).

benchmarks/learning_probe.py (plain torch, same encode/pack) is the search harness. Its figures before
2026-12-03 were wrong: the probe trained with `use_cache` on, so transformers skipped the packed-sequence
mask and every record attended across its pack -- copying the previous token (`copyq`) then stayed at 5 %
after 120 steps; with `use_cache` off (as the runtime has always loaded models, modelio.load_model) it is
100 % after 60, `last7` 100 % after 90 (batch 8), and unpacked runs agree.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.training.learning import exact_match


def main() -> int:
    from finetune_training.cli import prepare_document, run_local
    from finetune_training.data import read_records, split_records

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", nargs="?", default="examples/local-tiny-learns.yaml")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--storage", default="/tmp/learning-check")
    a = p.parse_args()
    os.chdir(ROOT)
    job, storage = prepare_document(a.job, max_steps=a.max_steps, storage=a.storage)
    t0 = time.perf_counter()
    out = io.StringIO()
    rc = run_local(job, storage, fresh=True, out=out)
    train_s = time.perf_counter() - t0
    if rc:
        print(out.getvalue())
        return rc
    spec = job.spec
    _, held_out = split_records(read_records(spec.dataset), spec.dataset.eval_fraction, spec.training.seed,
                                spec.dataset.max_samples)
    base = exact_match(Path(spec.model.source), held_out)
    tuned = exact_match(Path(storage) / "final", held_out)
    print(f"finetune run: {train_s:.0f}s; held-out exact match on {len(held_out)} prompts "
          "(whole / up to '=' / first number):")
    print(f"  untrained  {base[0]:.0%} / {base[1]:.0%} / {base[2]:.0%}")
    print(f"  fine-tuned {tuned[0]:.0%} / {tuned[1]:.0%} / {tuned[2]:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
