"""What deploy/observability/ holds, read for tests: the dashboard's and the alert rules' PromQL."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy" / "observability"
DASHBOARD = OBS / "finetune-dashboard.json"
RULES = OBS / "prometheusrule.yaml"
RULES_TEST = OBS / "prometheusrule-test.yaml"
METRIC = re.compile(r"\bfinetune_[a-z0-9_]+")
# Grafana's template variables, replaced by what Grafana would put there, so promtool can parse the query.
GRAFANA_VARS = {"$__rate_interval": "1m", "$namespace": "ml", "$job": "seed", "${datasource}": "prom"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels") or [])


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, template variables substituted."""
    out = []
    for p in _panels(dashboard()["panels"]):
        for t in p.get("targets") or []:
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((p["title"], expr))
    return out


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["spec"]["groups"]  # type: ignore[no-any-return]


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in rule_groups() for r in g["rules"]]


def metric_names(exprs: list[tuple[str, str]]) -> set[str]:
    return {m for _, e in exprs for m in METRIC.findall(e)}
