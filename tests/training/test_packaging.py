"""The runtime ships as source next to the DLC image: cheap to import, and only the pydantic-only parts
of the operator package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "training" / "finetune_training"
ALLOWED = ("finetune_operator.api", "finetune_operator.instance_types")


def test_importing_the_package_does_not_import_torch_or_ray() -> None:
    code = (
        "import sys, finetune_training, finetune_training.cli, finetune_training.netprobe, "
        "finetune_training.progress, finetune_training.metrics, finetune_training.data; "
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_only_pydantic_only_operator_modules_are_imported() -> None:
    offenders = []
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.startswith("finetune_operator") and not name.startswith(ALLOWED):
                    offenders.append(f"{path.name}: {name}")
    assert not offenders
