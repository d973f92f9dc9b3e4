"""Generate the shipped example data (deterministic; rerun to regenerate, output is committed).

    .venv/bin/python examples/make_data.py

Writes `examples/data/arithmetic.jsonl` (promptCompletion) and `examples/data/arithmetic-chat.jsonl`
(chat): two-digit additions where the completion restates the question and gives the sum. A randomly
initialised tiny model learns the format and the copying within a few dozen steps, so the loss drops
visibly; the sums themselves take far longer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

N = 400
HERE = Path(__file__).resolve().parent


def records(n: int = N, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"What is {a} plus {b}?", f"{a} + {b} = {a + b}"))
    return out


def main() -> None:
    data = HERE / "data"
    data.mkdir(exist_ok=True)
    recs = records()
    with open(data / "arithmetic.jsonl", "w") as f:
        for q, a in recs:
            f.write(json.dumps({"prompt": f"Question: {q}\nAnswer: ", "completion": a}) + "\n")
    with open(data / "arithmetic-chat.jsonl", "w") as f:
        for q, a in recs:
            msgs = [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    print(f"wrote {len(recs)} records to {data}")


if __name__ == "__main__":
    main()
