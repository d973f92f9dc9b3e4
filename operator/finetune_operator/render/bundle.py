"""Collect the training runtime's Python source for the `<job>-runtime` ConfigMap (reads files).

The Ray Train DLC is used as published; our code rides along as source. Only modules that need
nothing beyond the image's packages (pydantic, pyyaml, torch, ray, transformers) are shipped:
the training package and the API models it validates its config with.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# ConfigMaps are capped at 1 MiB; stay well below so the object (and its YAML) fits comfortably.
MAX_BUNDLE_BYTES = 768 * 1024

_OPERATOR_FILES = ["__init__.py", "api"]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name} is not importable; install finetune-operator with its training extra")
    return Path(next(iter(spec.submodule_search_locations)))


def _collect(root: Path, rel: Path, out: dict[str, str]) -> None:
    path = root / rel
    if path.is_dir():
        for child in sorted(path.rglob("*.py")):
            if "__pycache__" not in child.parts:
                out[str(Path(root.name) / child.relative_to(root))] = child.read_text()
    elif path.exists():
        out[str(Path(root.name) / rel)] = path.read_text()


def runtime_files() -> dict[str, str]:
    """{"finetune_training/__init__.py": source, ...} relative to the PYTHONPATH root."""
    out: dict[str, str] = {}
    _collect(_package_dir("finetune_training"), Path("."), out)
    op = _package_dir("finetune_operator")
    for rel in _OPERATOR_FILES:
        _collect(op, Path(rel), out)
    out = {k.replace("/./", "/"): v for k, v in out.items()}
    size = sum(len(v.encode()) for v in out.values())
    if size > MAX_BUNDLE_BYTES:
        raise RuntimeError(f"training runtime bundle is {size} bytes, over the {MAX_BUNDLE_BYTES} ConfigMap budget")
    return dict(sorted(out.items()))
