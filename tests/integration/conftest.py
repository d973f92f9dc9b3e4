"""Fixtures for tests against the real local control plane (``finetune_devcluster``).

- ``control_plane`` (session): one :class:`DevCluster` per test session — etcd, kube-apiserver,
  kube-controller-manager, kube-scheduler, the KubeRay operator, kwok with 2 g6.12xlarge GPU/EFA nodes
  (``gpu-node-0``, ``gpu-node-1``) and one m5.2xlarge (``cpu-node-0``). Stopped at session end, also after
  failures; components die with the test process if it is killed. Logs: ``<workdir>/logs/``, named in
  the report of every failed test and at the end of the run.
- ``kube`` (session): kubernetes Python clients bound to its admin kubeconfig.
- ``namespace`` (function): a fresh namespace (with its ``default`` ServiceAccount), deleted afterwards.
- ``gpu_node`` (function): ``gpu_node()`` adds a simulated GPU node, removed after the test.
- ``ray_dashboard`` (function, opt-in): the Ray dashboard stand-in for the test's namespace (kwok pods run
  no Ray; see RayDashboardStandIn). Without it a RayJob on kwok stays Starting, as it would for real.

Missing binaries are built once before the first test runs (outside any test timeout); CI builds them
beforehand with ``scripts/build-control-plane``. ``FINETUNE_DEVCLUSTER_KEEP=1`` leaves the cluster
running after the session (``finetune dev-cluster down --workdir ...`` stops it).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from finetune_devcluster import DevCluster, build
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

_CLUSTER: DevCluster | None = None


@dataclass
class Kube:
    """Typed kubernetes clients for the dev cluster (all share one ApiClient)."""

    kubeconfig: Path
    api_client: client.ApiClient
    core: client.CoreV1Api
    apps: client.AppsV1Api
    batch: client.BatchV1Api
    custom: client.CustomObjectsApi
    apiext: client.ApiextensionsV1Api
    auth: client.AuthenticationV1Api
    rbac: client.RbacAuthorizationV1Api


def wait_for(what: str, check: Callable[[], object], timeout: float = 60, interval: float = 0.25) -> object:
    """Poll ``check`` until it returns something truthy; fail with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def _uses_cluster(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return "control_plane" in names or ("real" in names and item.get_closest_marker("real_node") is not None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.integration)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_build(*components): optional Go-built components the test runs (e.g. argocd)")


def pytest_collection_finish(session: pytest.Session) -> None:
    # Build before any test starts, so a cold build (minutes) never counts against a test's timeout.
    if session.config.option.collectonly:
        return
    if any("real" in getattr(i, "fixturenames", ()) and i.get_closest_marker("real_node") for i in session.items):
        # The real node's parts (kubelet, containerd, runc, ...): only when a real-node test is selected.
        missing_node = build.missing(build.NODE_COMPONENTS)
        if missing_node:
            print(f"dev cluster: building the real node's {', '.join(missing_node)}")
            build.build(missing_node)
    missing = build.missing() if any(_uses_cluster(i) for i in session.items) else []
    optional = sorted({n for i in session.items for m in i.iter_markers("needs_build") for n in m.args})
    missing += build.missing_optional(optional)
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        say = reporter.write_line if reporter else print
        say(f"dev cluster: building {', '.join(missing)} (cached in {build.cache_dir() / 'bin'})")
        build.build(missing, log=say)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _CLUSTER is not None and _uses_cluster(item):
        report.sections.append(("dev cluster", f"component logs: {_CLUSTER.logs_dir}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _CLUSTER is not None and (terminalreporter.stats.get("failed") or terminalreporter.stats.get("error")):
        terminalreporter.write_line(f"dev cluster component logs: {_CLUSTER.logs_dir}")


class RayDashboardStandIn:
    """What the Ray dashboard would tell KubeRay, on kwok's ghost pods -- a simulated step, and opt-in: a
    test that needs its Ray job to run asks for the ``ray_dashboard`` fixture (KubeRay's own tests likewise
    opt in to their fake dashboard client). KubeRay reports a RayJob's deployment status Running as soon as
    its submitter Job exists, and learns the Ray job's own status (`jobStatus`: PENDING, RUNNING, ...) from
    the head's dashboard, which kwok pods do not run: the operator (rightly) calls such a job
    Provisioning/Starting, not Running. This thread plays the dashboard's answer once the submitter exists:
    it writes `jobStatus: RUNNING` on every RayJob of its namespace (all namespaces when None: the
    benchmark) whose deployment status is Running and whose job status is still unknown -- a merge patch
    that carries the resourceVersion it read, so it never overwrites a status written meanwhile (by KubeRay,
    or by a test that simulates the end of a job). ``answered`` counts the RayJobs it wrote to. The real
    node's tests run real Ray and use no stand-in."""

    def __init__(self, kubeconfig: Path, namespace: str | None = None):
        api = config.new_client_from_config(config_file=str(kubeconfig))
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.answered: set[tuple[str, str]] = set()
        self.stop = threading.Event()
        self.watch: watch.Watch | None = None
        self.thread = threading.Thread(target=self._run, name="ray-dashboard-stand-in", daemon=True)

    def _answer(self, rj: dict[str, object]) -> None:
        st, meta = rj.get("status") or {}, rj["metadata"]
        assert isinstance(st, dict) and isinstance(meta, dict)
        if st.get("jobDeploymentStatus") != "Running" or st.get("jobStatus") or meta.get("deletionTimestamp"):
            return
        try:
            self.custom.patch_namespaced_custom_object_status(
                "ray.io", "v1", meta["namespace"], "rayjobs", meta["name"],
                {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": {"jobStatus": "RUNNING"}})
            self.answered.add((meta["namespace"], meta["name"]))
        except ApiException:  # 409: changed since (its event follows); 404: gone
            pass

    def _run(self) -> None:
        # A watch (its initial list replays every RayJob; it restarts every minute and after errors, such as
        # the fault tests' API server restarts), so a thousand RayJobs cost nothing while nothing changes.
        while not self.stop.is_set():
            self.watch = watch.Watch()
            if self.namespace is None:
                args: tuple[object, ...] = (self.custom.list_cluster_custom_object, "ray.io", "v1", "rayjobs")
            else:
                args = (self.custom.list_namespaced_custom_object, "ray.io", "v1", self.namespace, "rayjobs")
            try:
                for ev in self.watch.stream(*args, timeout_seconds=60):
                    if self.stop.is_set():
                        break
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._answer(ev["object"])
            except Exception:  # the API server restarting, the CRD not there yet
                self.stop.wait(1)

    def __enter__(self) -> RayDashboardStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.watch is not None:
            self.watch.stop()
        self.thread.join(timeout=5)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    global _CLUSTER
    keep = os.environ.get("FINETUNE_DEVCLUSTER_KEEP") == "1"
    cluster = DevCluster(tmp_path_factory.mktemp("dev-cluster"), nodes=2, die_with_parent=not keep)
    _CLUSTER = cluster
    try:
        cluster.up()
        yield cluster
    finally:
        if not keep:
            cluster.down()


@pytest.fixture(scope="session")
def kube(control_plane: DevCluster) -> Kube:
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    return Kube(
        kubeconfig=control_plane.kubeconfig,
        api_client=api,
        core=client.CoreV1Api(api),
        apps=client.AppsV1Api(api),
        batch=client.BatchV1Api(api),
        custom=client.CustomObjectsApi(api),
        apiext=client.ApiextensionsV1Api(api),
        auth=client.AuthenticationV1Api(api),
        rbac=client.RbacAuthorizationV1Api(api),
    )


def create_namespace(core: client.CoreV1Api, name: str, timeout: float = 60) -> None:
    """Create namespace ``name`` and wait for its ``default`` ServiceAccount (pods need it to be admitted)."""
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def default_sa() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    wait_for(f"ServiceAccount default in {name}", default_sa, timeout=timeout)


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{uuid.uuid4().hex[:6]}"
    create_namespace(kube.core, name, timeout=30)
    yield name
    kube.core.delete_namespace(name)

    def gone() -> bool:
        try:
            kube.core.read_namespace(name)
            return False
        except ApiException as e:
            return e.status == 404

    # Wait, so pods of this test release node capacity before the next test schedules.
    wait_for(f"namespace {name} deleted", gone, timeout=90)


@pytest.fixture
def ray_dashboard(control_plane: DevCluster, namespace: str) -> Iterator[RayDashboardStandIn]:
    """Opt in to the Ray dashboard stand-in (a simulated step) for the test's namespace: its RayJobs get
    `jobStatus: RUNNING` once KubeRay has created their submitter, so the job can reach Running on kwok."""
    with RayDashboardStandIn(Path(control_plane.kubeconfig), namespace) as stand_in:
        yield stand_in


@pytest.fixture
def gpu_node(control_plane: DevCluster) -> Iterator[Callable[..., str]]:
    """``gpu_node(name=None, instance_type=None) -> node name``; the nodes are deleted after the test."""
    added: list[str] = []

    def add(name: str | None = None, instance_type: str | None = None) -> str:
        node = control_plane.add_gpu_node(name, instance_type)
        added.append(node)
        return node

    yield add
    for node in added:
        control_plane.delete_node(node)


@dataclass
class RealNodeCluster:
    """The session's dev cluster with a real kubelet node, and the host as it was before ``up``."""

    cluster: DevCluster
    before: dict[str, object]


@pytest.fixture(scope="session")
def real_node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    """One dev cluster with a real node (``up --real-node``, ~1 min warm, and ``down`` up to 2.5 min) for every
    real-node test of the session: the end-to-end tests (tests/integration/test_e2e_real_node.py) and the node's
    own (test_real_node.py, whose last test takes it down and compares the host with ``before``). ``down`` is
    idempotent: the fixture's own is then a no-op."""
    from .host import host_snapshot

    workdir = tmp_path_factory.mktemp("real-node")
    before = host_snapshot(workdir)
    cluster = DevCluster(workdir, nodes=1, die_with_parent=True, real_node=True)
    try:
        cluster.up(timeout=600)
        yield RealNodeCluster(cluster, before)
    finally:
        cluster.down()
