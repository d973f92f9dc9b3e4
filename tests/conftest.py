"""Shared pytest options, and the Go-built tools some tests run (helm, promtool, the Grafana schema check)."""

from __future__ import annotations

from pathlib import Path

import pytest

# fixture name -> (optional devcluster component, binary name)
TOOL_FIXTURES = {
    "helm": ("helm", "helm"),
    "promtool": ("promtool", "promtool"),
    "grafana_dashboard_check": ("grafana", "grafana-dashboard-check"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.yaml from the current renderer instead of comparing",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    # Build the tools the collected tests use before any test starts, so a cold build (minutes) never
    # counts against a test's timeout; nothing is built when no such test runs.
    if session.config.option.collectonly:
        return
    from finetune_devcluster import build
    from finetune_devcluster.versions import ALL_COMPONENTS

    wanted = sorted({TOOL_FIXTURES[f][0] for i in session.items for f in getattr(i, "fixturenames", ())
                     if f in TOOL_FIXTURES})
    missing = [n for n in wanted if not build.is_built(ALL_COMPONENTS[n])]
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        say = reporter.write_line if reporter else print
        say(f"tools: building {', '.join(missing)} (cached in {build.cache_dir() / 'bin'})")
        build.build(missing, log=say)


def _tool(fixture: str) -> Path:
    from finetune_devcluster import build

    component, binary = TOOL_FIXTURES[fixture]
    return build.optional_binaries(component) / binary


@pytest.fixture(scope="session")
def helm() -> Path:
    return _tool("helm")


@pytest.fixture(scope="session")
def promtool() -> Path:
    return _tool("promtool")


@pytest.fixture(scope="session")
def grafana_dashboard_check() -> Path:
    return _tool("grafana_dashboard_check")
