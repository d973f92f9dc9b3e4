"""The FinetuneJob health check (deploy/argocd/), evaluated by Argo CD's own Lua engine.

`argocd-lua-health` is a small Go program built from the argo-cd v3.6.1 module with the dev cluster's
binaries (tools/argocd/argocd-lua-health): it runs `util/lua` exactly as Argo CD does. Two ways, over
the same table (resource_customizations/finetune.dev/FinetuneJob/health_test.yaml, Argo CD's format):

- as shipped: `kubectl kustomize` of upstream's argocd-cm plus our Component, read by Argo CD's
  settings manager, evaluated with the standard Lua libraries closed (argocd-cm's default);
- as a built-in check: the layout upstream's util/lua/health_test.go walks (open libraries).

No cluster needed; only the build.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_devcluster import build
from finetune_operator.api.status import FinetuneJobStatus

ROOT = Path(__file__).resolve().parents[2]
ARGOCD_DIR = ROOT / "deploy" / "argocd"
CHECK_DIR = ARGOCD_DIR / "resource_customizations" / "finetune.dev" / "FinetuneJob"
TABLE = yaml.safe_load((CHECK_DIR / "health_test.yaml").read_text())["tests"]
CM_KEY = "resource.customizations.health.finetune.dev_FinetuneJob"

pytestmark = pytest.mark.needs_build("argocd")


def _run(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode in (0, 1), out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def harness() -> Path:
    return build.optional_binaries("argocd") / "argocd-lua-health"


@pytest.fixture(scope="module")
def argocd_cm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Upstream's argocd-cm (from the argo-cd module) with our Component applied by real kustomize."""
    work = tmp_path_factory.mktemp("argocd-cm")
    base = build.optional_binaries("argocd") / "config" / "argocd-cm.yaml"
    (work / "argocd-cm.yaml").write_text(base.read_text())
    component = os.path.relpath(ARGOCD_DIR, work)  # kustomize refuses absolute component paths
    (work / "kustomization.yaml").write_text(yaml.safe_dump(
        {"namespace": "argocd", "resources": ["argocd-cm.yaml"], "components": [component]}))
    out = subprocess.run(["kubectl", "kustomize", str(work)], capture_output=True, text=True, timeout=60, check=True)
    (cm,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    path = work / "rendered-argocd-cm.yaml"
    path.write_text(yaml.safe_dump(cm))
    return path


@pytest.fixture(scope="module")
def via_argocd_cm(harness: Path, argocd_cm: Path) -> dict[str, dict[str, Any]]:
    results = _run(str(harness), "cm", str(argocd_cm), *(str(CHECK_DIR / t["inputPath"]) for t in TABLE))
    return {str(Path(r["input"]).relative_to(CHECK_DIR)): r for r in results}


@pytest.fixture(scope="module")
def as_builtin(harness: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    results = _run(str(harness), "builtin", str(ARGOCD_DIR / "resource_customizations"))
    return {str(Path(r["input"]).relative_to(CHECK_DIR)): r for r in results}


def test_component_merges_the_script_into_argocd_cm(argocd_cm: Path) -> None:
    cm = yaml.safe_load(argocd_cm.read_text())
    assert cm["metadata"]["name"] == "argocd-cm"  # no hash suffix: Argo CD reads this exact name
    assert cm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "argocd"
    assert cm["data"][CM_KEY] == (CHECK_DIR / "health.lua").read_text()
    assert "resource.exclusions" in cm["data"]  # upstream's keys are kept
    assert not any(k.startswith("resource.customizations.useOpenLibs") for k in cm["data"])


@pytest.mark.parametrize("case", TABLE, ids=[Path(t["inputPath"]).stem for t in TABLE])
def test_health_as_argocd_cm_ships_it(case: dict[str, Any], via_argocd_cm: dict[str, dict[str, Any]]) -> None:
    got = via_argocd_cm[case["inputPath"]]
    assert "error" not in got, got["error"]
    assert {"status": got["status"], "message": got["message"]} == case["healthStatus"]


@pytest.mark.parametrize("case", TABLE, ids=[Path(t["inputPath"]).stem for t in TABLE])
def test_health_as_builtin_check(case: dict[str, Any], as_builtin: dict[str, dict[str, Any]]) -> None:
    got = as_builtin[case["inputPath"]]
    assert "error" not in got, got["error"]
    assert {"status": got["status"], "message": got["message"]} == got["expected"] == case["healthStatus"]


def test_table_covers_every_phase_and_condition() -> None:
    phases, conditions, statuses = set(), set(), set()
    for case in TABLE:
        obj = yaml.safe_load((CHECK_DIR / case["inputPath"]).read_text())
        st = obj.get("status") or {}
        FinetuneJobStatus.model_validate(st)  # testdata has the operator's real status shape
        phases.add(st.get("phase"))
        conditions |= {(c["type"], c["status"]) for c in st.get("conditions") or []}
        statuses.add(case["healthStatus"]["status"])
    assert phases >= {None, "Pending", "Provisioning", "Running", "Suspended", "Succeeded", "Failed"}
    assert conditions >= {("Stalled", "True"), ("Stalled", "False"), ("NetworkHealthy", "False"),
                          ("NetworkHealthy", "True"), ("Blocked", "True")}
    assert statuses == {"Healthy", "Progressing", "Degraded", "Suspended"}
    assert sorted(p.name for p in (CHECK_DIR / "testdata").iterdir()) == sorted(
        Path(c["inputPath"]).name for c in TABLE)


def test_a_broken_script_is_an_error_not_a_health(harness: Path, argocd_cm: Path, tmp_path: Path) -> None:
    # The harness must be able to fail: a script error comes back as an error from Argo CD's engine.
    cm = yaml.safe_load(argocd_cm.read_text())
    cm["data"][CM_KEY] = cm["data"][CM_KEY].replace("local hs = {}", "local hs = {}\nhs.x = string.format('%d', 1)")
    broken = tmp_path / "argocd-cm.yaml"
    broken.write_text(yaml.safe_dump(cm))
    (got,) = _run(str(harness), "cm", str(broken), str(CHECK_DIR / "testdata" / "running.yaml"))
    assert "string" in got.get("error", ""), got  # closed libraries: `string` is nil in argocd-cm scripts
