"""Shared pytest options, the Go-built tools some tests run (helm, promtool, the Grafana schema check), and a
real S3-protocol server (`s3`: moto's standalone server, `finetune_devcluster.s3server`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# fixture name -> (optional devcluster component, binary name)
TOOL_FIXTURES = {
    "helm": ("helm", "helm"),
    "promtool": ("promtool", "promtool"),
    "grafana_dashboard_check": ("grafana", "grafana-dashboard-check"),
}


# `make test` runs the suite in three concurrent lanes (scripts/test-lanes: one pytest process per lane, `--lane
# NAME`), so the tests of a lane share that process's session fixtures, its dev cluster among them. Most of the
# integration tests' time is waiting (for controllers, timers, pods): three lanes on two cores overlap the
# waits. A lane: the real node's tests (one real-node cluster), or one kwok control plane's share of the
# integration tests, plus CPU-bound work spread for balance (per-file times: README, "The suite's time"). A
# file not listed falls into the lane of its kind; every test is in exactly one lane.
LANES: dict[str, str] = {
    "tests/integration/test_e2e_real_node.py": "real-node",
    "tests/integration/test_real_node.py": "real-node",
    "tests/images/": "real-node",
    "tests/deploy/": "real-node",
    "tests/integration/test_lifecycle.py": "kwok-b",
    "tests/integration/test_lifecycle_faults.py": "kwok-a",
    "tests/integration/test_operator_outages.py": "kwok-b",
    "tests/integration/test_argocd.py": "kwok-b",
    "tests/training/": "kwok-b",
    "tests/integration/": "kwok-a",
    "tests/unit/": "kwok-a",
}
LANE_NAMES = ("real-node", "kwok-a", "kwok-b")


def lane(item: pytest.Item) -> str:
    """The lane of a test: real-node tests join the real node's; else the longest LANES prefix of its path."""
    if item.get_closest_marker("real_node"):
        return "real-node"
    path = item.nodeid.split("::", 1)[0]
    match = max((p for p in LANES if path.startswith(p)), key=len, default="")
    return LANES.get(match, "kwok-a")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("lane")
    if not wanted:
        return
    keep = [i for i in items if lane(i) == wanted]
    dropped = [i for i in items if lane(i) != wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--lane", choices=LANE_NAMES, default=None,
                     help="run only this lane's tests (scripts/test-lanes runs the lanes side by side)")
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
    # The dev package is imported only when something is needed from it: tests/training also runs on the
    # DLC's stack (scripts/test-training-dlc), which has the operator and the runtime but not the dev cluster.
    wanted = sorted({TOOL_FIXTURES[f][0] for i in session.items for f in getattr(i, "fixturenames", ())
                     if f in TOOL_FIXTURES})
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter else print
    if wanted:
        from finetune_devcluster import build
        from finetune_devcluster.versions import ALL_COMPONENTS

        missing = [n for n in wanted if not build.is_built(ALL_COMPONENTS[n])]
        if missing:
            say(f"tools: building {', '.join(missing)} (cached in {build.cache_dir() / 'bin'})")
            build.build(missing, log=say)
    if not os.environ.get(S3_ENDPOINT_ENV) and any("s3" in getattr(i, "fixturenames", ()) for i in session.items):
        from finetune_devcluster import s3server

        s3server.install(log=say)  # moto's own venv, once (~40 s cold); a no-op when cached


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


S3_BUCKET = "finetune-tests"
# Where the S3 server was started outside pytest (scripts/test-training-dlc starts one on the host for the
# chroot: the chroot shares the host's loopback), its endpoint; the bucket S3_BUCKET must exist there.
S3_ENDPOINT_ENV = "FINETUNE_TEST_S3_ENDPOINT"


class ExternalS3:
    """An S3 server this process did not start: the same `env` as S3Server's, and nothing to stop."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        # The credentials and region come with the endpoint, from whoever started the server.
        self.env = {"AWS_ENDPOINT_URL": endpoint, **{k: os.environ[k] for k in
                    ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}}

    def stop(self) -> None:
        pass


class S3Bucket:
    """The session's S3 server and its bucket, as a test sees them: `uri()` gives a fresh prefix per call."""

    def __init__(self, server: Any, bucket: str) -> None:
        self.server = server
        self.bucket = bucket

    def uri(self, name: str = "") -> str:
        """`s3://<bucket>/<unique>/<name>`: tests sharing the server never see each other's objects."""
        return f"s3://{self.bucket}/{uuid.uuid4().hex[:10]}/{name}".rstrip("/")

    def fs(self) -> Any:
        import pyarrow.fs as pafs

        return pafs.FileSystem.from_uri(f"s3://{self.bucket}")[0]

    def put(self, uri: str, local: str | Path) -> str:
        """Upload a local file (to `uri`) or directory tree (under `uri`)."""
        from finetune_training.storage import upload_dir

        src = Path(local)
        if src.is_dir():
            upload_dir(src, uri)
        else:
            with self.fs().open_output_stream(uri.removeprefix("s3://")) as out:
                out.write(src.read_bytes())
        return uri

    def keys(self, uri: str) -> list[str]:
        """Every object under a prefix, relative to it, sorted."""
        import pyarrow.fs as pafs

        base = uri.removeprefix("s3://").rstrip("/")
        infos = self.fs().get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return sorted(i.path[len(base) + 1 :] for i in infos if i.type == pafs.FileType.File)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Bucket]:
    """A real S3-protocol server (moto_server on loopback) for the whole session, started only when a test
    asks for it. The standard AWS variables point every client at it, as an EKS pod's would at S3
    (AWS_ENDPOINT_URL for the endpoint; pyarrow and Ray Train read them; Ray workers inherit them)."""
    if os.environ.get(S3_ENDPOINT_ENV):  # a server started outside this process (the DLC run's chroot)
        server: Any = ExternalS3(os.environ[S3_ENDPOINT_ENV])
    else:
        from finetune_devcluster.s3server import S3Server

        server = S3Server(tmp_path_factory.mktemp("s3server")).start(buckets=[S3_BUCKET])
    with pytest.MonkeyPatch.context() as mp:
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN",
                    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
            mp.delenv(key, raising=False)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never wait for an instance metadata service here
        for key, value in server.env.items():
            mp.setenv(key, value)
        try:
            yield S3Bucket(server, S3_BUCKET)
        finally:
            server.stop()
