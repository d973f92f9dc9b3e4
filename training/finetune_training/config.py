"""Reading the FinetuneJob document the runtime is given, and the settings derived from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune_operator.api.spec import FinetuneJob


def load_job(path: str | Path) -> FinetuneJob:
    """Parse a FinetuneJob YAML/JSON file (the whole document, as `kubectl apply` takes it)."""
    text = Path(path).read_text()
    doc: Any
    if str(path).endswith(".json"):
        doc = json.loads(text)
    else:
        import yaml

        docs = [d for d in yaml.safe_load_all(text) if d]
        if len(docs) != 1:
            raise ValueError(f"{path}: expected exactly one YAML document, found {len(docs)}")
        doc = docs[0]
    return FinetuneJob.model_validate(doc)
