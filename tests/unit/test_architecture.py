"""Data flows one way: api -> render -> controller; only controller/k8s.py talks to the API server."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "operator" / "finetune_operator"


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = path.relative_to(PKG.parent).with_suffix("").parts[: -node.level]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
    return out


def modules(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py")) if sub else [PKG / "cli.py", PKG / "instance_types.py"]


def test_only_k8s_module_uses_the_kubernetes_client() -> None:
    offenders = []
    for path in PKG.rglob("*.py"):
        if "devcluster" in path.parts or path.name in ("k8s.py", "runner.py"):
            continue  # the dev-cluster harness and the process entry point wire clients; nothing else may
        if any(name == "kubernetes" or name.startswith("kubernetes.") for name in imports(path)):
            offenders.append(str(path.relative_to(PKG)))
    assert offenders == []


def test_api_and_render_are_pure() -> None:
    forbidden = ("kubernetes", "kopf", "aiohttp", "finetune_operator.controller", "finetune_operator.devcluster")
    for sub in ("api", "render"):
        for path in modules(sub):
            bad = [n for n in imports(path) if n.startswith(forbidden)]
            assert bad == [], f"{path.relative_to(PKG)} imports {bad}"


def test_kopf_only_in_handlers_and_runner() -> None:
    users = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "kopf" in imports(p)}
    assert users <= {"controller/handlers.py", "runner.py"}
