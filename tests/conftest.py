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


# `make test` runs the suite in three concurrent lanes (pytest-xdist, `-n 3 --dist loadgroup`): each lane is one
# worker process with its own session fixtures, so the tests of a lane share that lane's dev cluster. Most of
# the integration tests' time is waiting (for controllers, timers, pods): three lanes on two cores overlap the
# waits. A lane: the real node's tests (one real-node cluster), or one kwok control plane's share of the
# integration tests, plus CPU-bound work spread for balance. Measured per file in the README ("The suite's
# time"); a file not listed falls into the lane of its kind.
LANES: dict[str, str] = {
    "tests/integration/test_e2e_real_node.py": "real-node",
    "tests/integration/test_real_node.py": "real-node",
    "tests/images/": "real-node",
    "tests/deploy/": "real-node",
    "tests/integration/test_lifecycle.py": "kwok-b",
    "tests/integration/test_lifecycle_faults.py": "kwok-b",
    "tests/integration/test_argocd.py": "kwok-b",
    "tests/training/": "kwok-b",
    "tests/integration/": "kwok-a",
    "tests/unit/": "kwok-a",
}


def lane(nodeid: str) -> str:
    """The lane of a test: the longest LANES prefix of its path (real-node tests elsewhere join the real node's)."""
    path = nodeid.split("::", 1)[0]
    match = max((p for p in LANES if path.startswith(p)), key=len, default="")
    return LANES.get(match, "kwok-a")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = "real-node" if item.get_closest_marker("real_node") else lane(item.nodeid)
        item.add_marker(pytest.mark.xdist_group(name))


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
