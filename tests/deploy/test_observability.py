"""The Grafana dashboard and the alert rules in deploy/observability/, checked with the real tools:
Grafana's published dashboard schema (grafana-foundation-sdk), promtool's rule checker and its
rule unit tests. That every metric they use exists on a real operator's /metrics after a job has run
is tests/integration/test_observability.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from finetune_operator.controller.metrics import Metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.observability import (
    DASHBOARD,
    RULES_TEST,
    dashboard,
    dashboard_queries,
    metric_names,
    rule_exprs,
    rule_groups,
)


def run(*cmd: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, check=False)


def test_dashboard_is_valid_for_grafanas_schema(grafana_dashboard_check: Path) -> None:
    res = run(grafana_dashboard_check, DASHBOARD)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith(": ok")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["panels"][1].__setitem__("titel", "typo"), "unexpected field 'titel'"),
        (lambda d: d["panels"][1]["options"].__setitem__("colourMode", "value"), "colourMode"),
        (lambda d: d["panels"][1].__setitem__("type", "no-such-panel"), "unknown panel type"),
        (lambda d: d.__setitem__("fiscalYearStartMonth", 12), "must be < 12"),
        (lambda d: d["panels"][1]["targets"][0].__setitem__("exprr", "up"), "exprr"),
    ],
    ids=["unknown-panel-field", "unknown-stat-option", "unknown-panel-type", "constraint", "unknown-query-field"],
)
def test_dashboard_check_rejects_what_grafanas_schema_rejects(grafana_dashboard_check: Path, tmp_path: Path,
                                                               mutate: object, expected: str) -> None:
    # The check above could pass by accepting anything; these prove it does not.
    d = dashboard()
    mutate(d)  # type: ignore[operator]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    res = run(grafana_dashboard_check, bad)
    assert res.returncode == 1 and expected in res.stdout, res.stdout + res.stderr


def test_dashboard_queries_parse_as_promql(promtool: Path, tmp_path: Path) -> None:
    # promtool parses PromQL when it checks rules: each query becomes a recording rule.
    rules = [{"record": f"dashboard:query{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = run(promtool, "check", "rules", path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    (tmp_path / "test.yaml").write_text(RULES_TEST.read_text())
    return tmp_path


def test_alert_rules_pass_promtool_check(promtool: Path, rules_dir: Path) -> None:
    res = run(promtool, "check", "rules", "--lint=all", "--lint-fatal", rules_dir / "rules.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in res.stdout


def test_alert_rules_pass_their_unit_tests(promtool: Path, rules_dir: Path) -> None:
    res = run(promtool, "test", "rules", rules_dir / "test.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_a_unit_test() -> None:
    tested = {t["alertname"] for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    assert {name for name, _ in rule_exprs()} == tested


def test_alert_rule_unit_tests_can_fail(promtool: Path, rules_dir: Path) -> None:
    # A rule that never fires makes the firing expectations fail: promtool really evaluates them.
    groups = rule_groups()
    groups[0]["rules"][0]["expr"] = "vector(0) == 1"
    (rules_dir / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    res = run(promtool, "test", "rules", rules_dir / "test.yaml")
    assert res.returncode == 1 and "FinetuneJobFailed" in res.stdout + res.stderr


def _declared_samples() -> set[str]:
    """Sample names the operator's registry exposes once every per-job series has a value."""
    m = Metrics()
    m.set_phase("ml", "seed", "Running")
    m.observe_progress("ml", "seed", {"step": 1, "totalSteps": 2, "loss": 1.0, "evalLoss": 1.1, "mfu": 0.4,
                                      "tokensPerSecond": 10.0, "etaSeconds": 5.0},
                       {"transport": "efa", "healthy": True, "busBandwidthGBps": 12.5})
    m.reconcile_seconds.observe(0.1)
    m.reconciles.labels("ok").inc()
    m.reconcile_errors.labels("ApiError").inc()
    m.api_writes.labels("patch", "FinetuneJob").inc()
    m.progress_reports.labels("202").inc()
    text = generate_latest(m.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_metric_names_are_declared_by_the_operator(source: str) -> None:
    names = metric_names(dashboard_queries() if source == "dashboard" else rule_exprs())
    assert names, "no finetune_ metric found: the extraction is broken"
    assert names - _declared_samples() == set()


def test_dashboard_covers_the_issue_list() -> None:
    titles = {p["title"] for p in dashboard()["panels"]}
    assert {"Loss", "Throughput", "MFU", "Step", "ETA", "Network transport", "All-reduce bus bandwidth", "Phase",
            "Reconciles", "Reconcile errors", "Reconcile latency", "Work queue depth", "API writes"} <= titles
