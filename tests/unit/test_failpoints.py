"""The fail-point facility (finetune_operator.api.failpoints): inert unless armed, armed by name, a bad
FINETUNE_FAILPOINTS refused in one line, and no fault-injection variable read anywhere else."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from finetune_operator.api import failpoints
from finetune_operator.api.failpoints import ENV, POINTS, Armed, FailpointError, FailpointSpecError, failpoint, parse

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV, raising=False)
    failpoints.reset()
    yield
    failpoints.reset()


def arm(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv(ENV, spec)
    failpoints.reset()


def test_every_point_is_inert_by_default() -> None:
    for name in POINTS:
        failpoint(name, step=5, rank=1)  # nothing happens
    assert failpoints.arm_from_env() == {}


@pytest.mark.parametrize(("spec", "expected"), [
    ("reconcile/after-create=exit(137)", {"reconcile/after-create": Armed("exit", 137)}),
    ("train/after-step=exit(17)@step=5,rank=1", {"train/after-step": Armed("exit", 17, {"step": "5", "rank": "1"})}),
    (" reconcile/after-create=raise ; train/after-step=sleep(0.5);", {
        "reconcile/after-create": Armed("raise"), "train/after-step": Armed("sleep", 0.5)}),
    ("", {}),
], ids=["exit", "conditions", "two-points", "empty"])
def test_parse(spec: str, expected: dict[str, Armed]) -> None:
    assert parse(spec) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("reconcile/after-crate=exit(1)", "unknown fail point 'reconcile/after-crate'; known: reconcile/after-create, "
                                      "train/after-step"),
    ("reconcile/after-create=explode", "unknown action; use exit(N), raise or sleep(SECONDS)"),
    ("reconcile/after-create=exit", "unknown action"),
    ("reconcile/after-create=exit(x)", "exit() takes a number, not 'x'"),
    ("reconcile/after-create", "is not NAME=ACTION[@KEY=VALUE,...]"),
    ("train/after-step=exit(1)@step", "condition 'step' is not KEY=VALUE"),
    ("train/after-step=raise;train/after-step=exit(1)", "armed twice"),
], ids=["unknown-point", "unknown-action", "exit-without-code", "exit-not-a-number", "no-action", "bad-condition",
        "twice"])
def test_a_bad_spec_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(FailpointSpecError, match="FINETUNE_FAILPOINTS") as err:
        parse(spec)
    assert message in str(err.value)


def test_armed_by_name_and_conditions(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    arm(monkeypatch, "train/after-step=raise@step=5,rank=1")
    failpoint("reconcile/after-create")  # another point: inert
    failpoint("train/after-step", step=4, rank=1)  # conditions not met
    failpoint("train/after-step", step=5, rank=0)
    with pytest.raises(FailpointError, match="fail point train/after-step"):
        failpoint("train/after-step", step=5, rank=1)
    armed = [r.getMessage() for r in caplog.records if "FAIL POINTS ARMED" in r.getMessage()]
    assert len(armed) == 1 and "train/after-step" in armed[0], caplog.text


def test_once_fires_a_single_time_across_processes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    arm(monkeypatch, "train/after-step=raise")
    marker = tmp_path / "run" / ".failpoint"
    with pytest.raises(FailpointError):
        failpoint("train/after-step", once=marker)
    assert marker.exists()
    failpoint("train/after-step", once=marker)  # the marker disarms it (a restarted process passes)


def test_an_unregistered_point_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match="not registered"):
        failpoint("nowhere/at-all")


def test_exit_ends_the_process_with_the_code(tmp_path: Path) -> None:
    code = "from finetune_operator.api.failpoints import failpoint; failpoint('reconcile/after-create'); print('past')"
    env = {"PATH": "/usr/bin:/bin", ENV: "reconcile/after-create=exit(137)", "PYTHONPATH": str(ROOT / "operator")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 137 and "past" not in out.stdout, out
    assert "fail point reconcile/after-create" in out.stdout + out.stderr


def test_the_operator_refuses_to_start_with_a_bad_spec() -> None:
    env = {"PATH": "/usr/bin:/bin", ENV: "reconcile/after-crate=exit(1)", "PYTHONPATH": str(ROOT / "operator")}
    out = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "operator", "--kubeconfig", "/nonexistent"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "unknown fail point 'reconcile/after-crate'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def _failpoint_calls(path: Path) -> set[str]:
    return {node.args[0].value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "failpoint"
            and node.args and isinstance(node.args[0], ast.Constant)}


def test_every_registered_point_is_placed_once_and_no_other_fault_variable_is_read() -> None:
    sources = [p for d in ("operator/finetune_operator", "training/finetune_training")
               for p in (ROOT / d).rglob("*.py") if p.name != "failpoints.py"]
    placed = [name for p in sources for name in _failpoint_calls(p)]
    assert sorted(placed) == sorted(POINTS)
    for p in sources:
        text = p.read_text()
        for old in ("FINETUNE_TEST_CRASH_AFTER_CREATE", "FINETUNE_CRASH_AT_STEP"):
            assert old not in text, f"{p}: {old} (use a fail point)"
