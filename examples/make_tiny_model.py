"""Generate `examples/models/tiny-qwen2/` (committed; rerun to regenerate).

    .venv/bin/python examples/make_tiny_model.py

A Qwen2-architecture model (3 layers, hidden 96, 4 query / 2 KV heads, tied embeddings, ~0.35 M
parameters, random weights) and a 512-token byte-level BPE tokenizer trained with the `tokenizers`
library on the shipped data, with a ChatML chat template. Saved with `save_pretrained` (safetensors),
so `AutoModelForCausalLM.from_pretrained("examples/models/tiny-qwen2")` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune_training.tinymodel import write_tiny_model

HERE = Path(__file__).resolve().parent


def main() -> None:
    texts = []
    for name in ("arithmetic.jsonl", "arithmetic-chat.jsonl"):
        for line in (HERE / "data" / name).read_text().splitlines():
            rec = json.loads(line)
            if "messages" in rec:
                texts.extend(m["content"] for m in rec["messages"])
            else:
                texts.append(rec["prompt"] + rec["completion"])
    out = write_tiny_model(HERE / "models" / "tiny-qwen2", texts)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
