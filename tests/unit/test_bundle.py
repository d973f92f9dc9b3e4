"""The training runtime shipped in the `<job>-runtime` ConfigMap is complete and self-contained."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from finetune_operator.render.bundle import MAX_BUNDLE_BYTES, runtime_files
from finetune_operator.render.rayjob import runtime_key

# What the Ray Train DLC image provides besides the standard library (flash_attn: its flash-attn 2.8.3, used
# only when importable, modelio.attention_implementation).
IMAGE_PACKAGES = {"torch", "ray", "transformers", "pydantic", "yaml", "numpy", "safetensors", "pyarrow", "tokenizers",
                  "huggingface_hub", "tqdm", "datasets", "boto3", "botocore", "fsspec", "flash_attn"}


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_bundle_contains_the_entrypoint_and_api() -> None:
    files = runtime_files()
    assert "finetune_training/__main__.py" in files
    assert "finetune_operator/api/spec.py" in files
    assert "finetune_operator/controller/k8s.py" not in files
    assert sum(len(v.encode()) for v in files.values()) < MAX_BUNDLE_BYTES
    assert all("/" not in runtime_key(p) for p in files)


def test_bundle_imports_nothing_outside_itself_and_the_image() -> None:
    files = runtime_files()
    shipped = {p.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".") for p in files}
    for path, source in files.items():
        for name in _imports(source):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in IMAGE_PACKAGES:
                continue
            assert name in shipped or any(s.startswith(name + ".") for s in shipped), f"{path} imports {name}, not shipped"


def test_bundle_runs_from_a_bare_directory(tmp_path: Path) -> None:
    """Lay the bundle out as the ConfigMap volume does and import the entrypoint from there only."""
    for path, source in runtime_files().items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    code = (
        "import sys; sys.path[:0] = [sys.argv[1]]\n"
        "import finetune_training, finetune_operator.api.spec as s\n"
        "assert finetune_training.__file__.startswith(sys.argv[1]), finetune_training.__file__\n"
        "print(s.KIND)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path)], capture_output=True, text=True,
                         check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "FinetuneJob"
