"""Which task does the tiny model learn, and how fast? A plain-torch stand-in for `finetune run` (one
process, this runtime's encode/pack and split, AdamW betas (0.9, 0.95), linear warmup + cosine, clip 1.0)
that prints held-out exact match (whole completion / part before `=`) as it trains:

    .venv/bin/python benchmarks/learning_probe.py TASK [steps=240] [lr=3e-3] [gbs=8] [seq=128] [evalf=0.05]
        [digits=1] [hidden=96] [layers=3] [heads=4] [kv=2] [inter=256] [n=400] [seed=0]

TASK: `add2` (the shipped data: `51 + 29 = 80`), `nocarry3` (three-digit sums without carries),
`restate` (`Write 312 plus 465 in symbols.` → `312 + 465`), `count` (`Count on: 37` → `38 39 40 41`),
`last7` (`What is the last digit of 352 times 7?` → `4`), `last7s` (the same, shorter prompt), `lastsum`
(`What is the last digit of 51 plus 29?` → `0`).
`digits=1` trains the BPE with single-digit pre-tokenization (as Qwen2's tokenizer does). Figures
measured with it are in `benchmarks/learning_check.py`.
"""

from __future__ import annotations

import math
import random
import sys
import time
from typing import Any


def tokenizer(texts: list[str], vocab: int = 512, digits: bool = True) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    pts = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([*pts, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=tr)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def one(name: str, rng: random.Random) -> tuple[tuple[int, int], str, str]:
    if name == "add2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return (a, b), f"Question: What is {a} plus {b}?\nAnswer: ", f"{a} + {b} = {a + b}"
    if name == "nocarry3":
        da = [rng.randint(1, 8), rng.randint(0, 9), rng.randint(0, 9)]
        db = [rng.randint(1, 9 - da[0]), rng.randint(0, 9 - da[1]), rng.randint(0, 9 - da[2])]
        a, b = int("".join(map(str, da))), int("".join(map(str, db)))
        return (a, b), f"Question: What is {a} plus {b}?\nAnswer: ", f"{a} + {b} = {a + b}"
    if name == "restate":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return (a, b), f"Question: Write {a} plus {b} in symbols.\nAnswer: ", f"{a} + {b}"
    if name == "last7":
        a = rng.randint(100, 999)
        return (a, 7), f"Question: What is the last digit of {a} times 7?\nAnswer: ", str(a * 7 % 10)
    if name == "last7s":
        a = rng.randint(100, 999)
        return (a, 7), f"Question: Last digit of 7 x {a}?\nAnswer: ", str(a * 7 % 10)
    if name == "last7q":  # the digit right after the prompt's last token: previous-token attention
        a = rng.randint(100, 999)
        return (a, 7), f"Question: What is the last digit of 7 times {a}?", str(a * 7 % 10)
    if name == "copyq":  # the prompt's last digit itself (copying the previous token)
        a = rng.randint(100, 999)
        return (a, 1), f"Question: What is the last digit of {a}?", str(a % 10)
    if name == "lastsum":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return (a, b), f"Question: What is the last digit of {a} plus {b}?\nAnswer: ", str((a + b) % 10)
    if name == "count":
        a = rng.randint(10, 95)
        return (a, 1), f"Count on: {a}", " ".join(str(a + i) for i in range(1, 5))
    raise SystemExit(f"unknown task {name}")


def task(name: str, n: int, seed: int = 7) -> list[dict[str, str]]:
    """`n` records with distinct operands (`count` has only 86 distinct prompts)."""
    rng = random.Random(seed)
    n = min(n, 86) if name == "count" else n
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        key, prompt, completion = one(name, rng)
        if key not in seen:
            seen.add(key)
            out.append({"prompt": prompt, "completion": completion})
    return out


def accuracy(model: Any, tok: Any, recs: list[dict[str, str]]) -> tuple[float, float]:
    import torch

    model.eval()
    full = restated = 0
    for r in recs:
        ids = tok(r["prompt"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            o = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(o[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        full += text == r["completion"]
        restated += text.split("=")[0].strip() == r["completion"].split("=")[0].strip()
    model.train()
    return full / len(recs), restated / len(recs)


def main(name: str, **kw: str) -> None:
    import torch
    from finetune_operator.api.spec import DatasetSpec
    from finetune_training.data import encode, split_records, to_sequences
    from finetune_training.tinymodel import build_model

    torch.set_num_threads(1)
    i = {k: int(kw.get(k, d)) for k, d in (("n", 400), ("steps", 240), ("gbs", 8), ("seq", 128), ("hidden", 96),
                                            ("layers", 3), ("heads", 4), ("kv", 2), ("inter", 256), ("digits", 1),
                                            ("seed", 0), ("pack", 1))}
    lr, evalf = float(kw.get("lr", 3e-3)), float(kw.get("evalf", 0.05))
    recs = task(name, i["n"])
    tok = tokenizer([r["prompt"] + r["completion"] for r in recs], digits=bool(i["digits"]))
    train, held_out = split_records(recs, evalf, 42, None)
    seqs = to_sequences(encode(train, DatasetSpec(source="x", format="promptCompletion"), tok), i["seq"], bool(i["pack"]), 0)
    model = build_model(len(tok), hidden=i["hidden"], layers=i["layers"], heads=i["heads"], kv_heads=i["kv"],
                        intermediate=i["inter"], seed=i["seed"])
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = cfg.eos_token_id = tok.eos_token_id
    # As the runtime does (modelio.load_model): with use_cache a training forward builds a cache, and
    # transformers then skips the packed-sequence mask -- every record would attend across the pack.
    model.config.use_cache = False
    print(f"{name}: {len(seqs)} train sequences, {len(held_out)} held out, "
          f"{sum(p.numel() for p in model.parameters())} params; untrained {accuracy(model, tok, held_out)}",
          flush=True)
    steps = i["steps"]
    warm = max(1, steps // 10)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    g = torch.Generator().manual_seed(i["seed"])
    t0 = time.time()
    for s in range(steps):
        idx = torch.randint(len(seqs), (i["gbs"],), generator=g)
        kw = {"position_ids": seqs.position_ids[idx]} if seqs.position_ids is not None else {"attention_mask": seqs.attention_mask[idx]}
        out = model(input_ids=seqs.input_ids[idx], labels=seqs.labels[idx], **kw)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if (s + 1) % max(1, steps // 4) == 0:
            print(f"  step {s + 1} loss {out.loss.item():.3f} held-out exact (whole, before '=') "
                  f"{accuracy(model, tok, held_out)} {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], **dict(a.split("=", 1) for a in sys.argv[2:]))
