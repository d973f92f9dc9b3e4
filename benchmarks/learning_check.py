"""Does the tiny model learn its task? `finetune run examples/local-tiny.yaml` (embedded Ray, 2 CPU
workers), then greedy generation from the export and from the untrained base model on the held-out
records (the job's eval split), exact match:

    .venv/bin/python benchmarks/learning_check.py [--max-steps 40] [--storage /tmp/learning-check]

The completion restates the question and gives the sum (`51 + 29 = 80`). Printed: exact match of the
whole completion, of its part up to `=` (restating two numbers never seen together in training) and of
its first number. Measured so far (a loaded 2-core machine): 40 steps (the shipped job) give 0 % on all
three for both models; the 0.35 M-parameter model needs far more steps than two minutes allow to copy
the numbers (200 plain-torch steps at lr 3e-3: 10–20 % up to `=`, 0 % whole).

Searching for a task the same 0.33 M-parameter model (3 layers, hidden 96) learns in two minutes
(2026-12-02, plain torch with this runtime's encode/pack, AdamW betas (0.9, 0.95), 10 % warmup + cosine,
clip 1.0, global batch 8 packed sequences; 20 held-out records, 0 % for every untrained model):
- the shipped task with a digit-splitting tokenizer (as Qwen2's): 0 % whole and up to `=` after 240
  steps at lr 3e-3, and after 800 steps at lr 1e-2;
- three-digit additions without carries (`312 + 465 = 777`, digit tokens): up to `=` 0 / 15 / 80 /
  100 % after 100 / 200 / 300 / 400 steps at lr 3e-3, the sum still 0 % (loss 0.24); lr 1e-2 learns
  nothing in 300 steps;
- restating only (`Write 312 plus 465 in symbols.` → `312 + 465`): 0 % after 240 steps (lr 3e-3, batch 8;
  lr 5e-3, batch 16);
- counting on (`Count on: 37` → `38 39 40 41`, two-digit BPE tokens, 86 prompts, 20 % held out,
  sequence length 32): a 400-step schedule at lr 3e-3 gives 0 / 41 / 35 / 47 % after 100 / 200 / 300 /
  400 steps (loss 0.06: it memorises the 69 training prompts); a 200-step schedule ends at 18 %, a
  120-step one at 0 %, lr 1e-2 at 0 %, lr 5e-3 (300 steps) at 0 %, hidden 64 (300 steps) at 0 %. Bigger
  batches help: batch 16, 300 steps: 47 % after 150, 65 % after 300; batch 32 (1024 tokens a step, as
  the demo's 8 × 128), 150 steps: 29 % with model seed 0 but 0 % with seed 1; 100 steps: 6 %. Promising
  (more prompts against memorising, batch 16–32, ~300 steps) but not yet reliable across seeds.
- a last-digit map (2026-12-03; `last7`: `What is the last digit of 352 times 7?` → `4`, one answer token
  that depends only on the number's last digit, 10 classes, 40 held out; `last7s` the same with a shorter
  prompt; `lastsum`: the last digit of a two-number sum): the model first learns "a digit, then EOS"
  (loss ~1.14, 5–20 % held out) and then, sometimes, finds the attention to the last digit: `last7` batch
  16 / 120 steps: 95 % (seed 0), 50 % (seed 1), 10 % (seed 2); lr 5e-3: 5 % and 12 %; batch 8 / 240
  steps: 20 %; batch 32 / 80 steps: 15–18 %; `last7s` batch 16 / 120 steps: 42 / 5 / 5 %; `lastsum` 5 %.
  Learnable, but the jump does not come reliably within a two-minute budget.
Copying a number from the prompt (an induction-style attention pattern) is what takes this model
hundreds of steps; one real step through Ray + FSDP costs about 0.33 s here (8 × 128 tokens at the
~3100 tokens/s docs/training.md quotes) on top of Ray's start (the 40-step demo takes about a minute), so
none of these reaches 50 % exact match within two minutes yet. The search harness is
`benchmarks/learning_probe.py`.
"""

from __future__ import annotations

import argparse
import io
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def accuracy(model_dir: Path, records: list[dict[str, Any]]) -> tuple[float, float, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    full = restated = first = 0
    for r in records:
        ids = tok(r["prompt"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        want = r["completion"]
        full += text == want
        restated += text.split("=")[0].strip() == want.split("=")[0].strip()
        first += text.split(" ")[0] == want.split(" ")[0]
    return full / len(records), restated / len(records), first / len(records)


def main() -> int:
    from finetune_training.cli import prepare_document, run_local
    from finetune_training.data import read_records, split_records

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int)
    p.add_argument("--storage", default="/tmp/learning-check")
    a = p.parse_args()
    os.chdir(ROOT)
    job, storage = prepare_document("examples/local-tiny.yaml", max_steps=a.max_steps, storage=a.storage)
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
    base = accuracy(ROOT / "examples" / "models" / "tiny-qwen2", held_out)
    tuned = accuracy(Path(storage) / "final", held_out)
    print(f"finetune run: {train_s:.0f}s; held-out exact match on {len(held_out)} prompts "
          "(whole / up to '=' / first number):")
    print(f"  untrained  {base[0]:.0%} / {base[1]:.0%} / {base[2]:.0%}")
    print(f"  fine-tuned {tuned[0]:.0%} / {tuned[1]:.0%} / {tuned[2]:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
