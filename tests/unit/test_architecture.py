"""The architecture rules, read from the import statements (lazy imports inside functions count too).

- Data flows one way through the operator's layers: api -> render -> controller -> preflight -> the entry points
  (cli, runner). A module imports its own layer or lower ones, never a higher one, and no two modules import
  each other through any chain (no cycle).
- Only controller/k8s.py (and runner.py, which wires the process) uses the kubernetes client; kopf only in the
  handlers and the runner.
- The operator never imports the dev cluster (finetune_devcluster: development tooling, not shipped).
- The training runtime imports only the operator's API package (finetune_operator.api), which the runtime
  bundle ships to the Ray pods.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "operator" / "finetune_operator"
TRAINING = ROOT / "training" / "finetune_training"
DEVCLUSTER = ROOT / "devcluster" / "finetune_devcluster"

# Lower number = lower layer. A module may import modules of its own layer or of lower ones.
LAYERS = {"api": 0, "render": 1, "controller": 2, "preflight": 3, "cli": 4, "runner": 4, "__init__": 0}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = PKG) -> set[str]:
    """Every module named by an import in the file, relative imports resolved."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = path.relative_to(root.parent).with_suffix("").parts[: -node.level]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            # `from . import x` / `from .api import quantity` name submodules too
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def package_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


@cache
def graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports (names that are not modules, e.g. classes, dropped)."""
    files = {module_name(p, root): p for p in package_files(root)}
    return {mod: {n for n in imports(path, root) if n in files and n != mod} for mod, path in files.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    assert sorted({m.split(".")[1] for m in graph() if "." in m} - set(LAYERS)) == []


def test_no_upward_import_between_the_operators_layers() -> None:
    upward = [f"{m} -> {n}" for m, deps in graph().items() for n in sorted(deps) if layer(n) > layer(m)]
    assert upward == []


def test_no_import_cycle_in_the_operator() -> None:
    assert cycles(graph()) == []


def test_the_checks_see_a_planted_cycle_and_an_upward_import() -> None:
    # The rules' own machinery, on a graph with the two faults planted (a test that cannot fail proves nothing).
    planted = {**graph(), "finetune_operator.api.spec": graph()["finetune_operator.api.spec"]
               | {"finetune_operator.controller.status"}}
    assert any("finetune_operator.api.spec" in c for c in cycles(planted))
    assert layer("finetune_operator.controller.status") > layer("finetune_operator.api.spec")


@pytest.mark.parametrize("root", [PKG, TRAINING], ids=["operator", "training"])
def test_nothing_shipped_imports_the_dev_cluster(root: Path) -> None:
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in package_files(root) for n in sorted(imports(p, root))
           if n == "finetune_devcluster" or n.startswith("finetune_devcluster.")]
    assert bad == []


def test_the_operator_tree_holds_no_dev_cluster() -> None:
    assert [str(p.relative_to(ROOT)) for p in (ROOT / "operator").rglob("go.mod")] == []
    assert [str(p.relative_to(ROOT)) for p in (ROOT / "operator").rglob("*") if "devcluster" in p.name] == []


def test_the_training_runtime_imports_only_the_operators_api() -> None:
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in package_files(TRAINING) for n in sorted(imports(p, TRAINING))
           if n.startswith("finetune_operator") and n != "finetune_operator"
           and not n.startswith("finetune_operator.api")]
    assert bad == []


def test_only_k8s_module_uses_the_kubernetes_client() -> None:
    offenders = []
    for path in package_files(PKG):
        if path.name in ("k8s.py", "runner.py"):
            continue  # the process entry point wires clients; nothing else may
        if any(name == "kubernetes" or name.startswith("kubernetes.") for name in imports(path)):
            offenders.append(str(path.relative_to(PKG)))
    assert offenders == []


def test_api_and_render_are_pure() -> None:
    forbidden = ("kubernetes", "kopf", "aiohttp")
    for sub in ("api", "render"):
        for path in package_files(PKG / sub):
            bad = [n for n in imports(path) if n.startswith(forbidden)]
            assert bad == [], f"{path.relative_to(PKG)} imports {bad}"


def test_kopf_only_in_handlers_and_runner() -> None:
    users = {str(p.relative_to(PKG)) for p in package_files(PKG) if "kopf" in imports(p)}
    assert users <= {"controller/handlers.py", "runner.py"}
