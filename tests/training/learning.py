"""Held-out exact match of greedy generation: does a model answer prompts it was not trained on?
(tests/training/test_learning.py and benchmarks/learning_check.py)"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def exact_match(model_dir: Path, records: list[dict[str, Any]], max_new_tokens: int = 16) -> tuple[float, float, float]:
    """(whole completion, its part up to `=`, its first word) exact-match shares over `records`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    full = restated = first = 0
    for r in records:
        ids = tok(r["prompt"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        want = r["completion"]
        full += text == want
        restated += text.split("=")[0].strip() == want.split("=")[0].strip()
        first += text.split(" ")[0] == want.split(" ")[0]
    n = max(1, len(records))
    return full / n, restated / n, first / n
