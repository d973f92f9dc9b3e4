"""Every metric the Grafana dashboard and the alert rules use exists on the real operator's /metrics
after a job has run: the operator runs as its ServiceAccount against the dev cluster, a FinetuneJob
runs (kwok plays kubelet), a pod-bound job token posts a full progress report, /metrics is scraped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.builders import ftj
from tests.deploy.observability import dashboard_queries, metric_names, rule_exprs
from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import OperatorProcess, service_account_kubeconfig
from tests.integration.support import LEASE_NS, create, job_token, phase_is, worker_pods


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    kubeconfig = service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator-logs"), identity="op-obs", lease_namespace=LEASE_NS)
    op.start()
    yield op
    op.stop()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


@pytest.mark.usefixtures("ray_dashboard")
def test_dashboard_and_alert_metrics_exist_after_a_job_ran(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("observed"))
    wait_for("Running", lambda: phase_is(kube, namespace, "observed", "Running"), timeout=120)
    pod = worker_pods(kube, namespace, "observed")[0]
    token = job_token(kube, namespace, pod, f"finetune.dev/progress/{namespace}/observed")
    report = {"rank": 0,
              "training": {"step": 40, "totalSteps": 100, "loss": 1.25, "evalLoss": 1.5, "tokensPerSecond": 12000.0,
                           "mfu": 0.38, "etaSeconds": 900.0},
              "network": {"transport": "efa", "provider": "efa", "healthy": True, "busBandwidthGBps": 21.5}}
    code, text = operator.post(namespace, "observed", report, token)
    assert code == 202, text

    def scraped() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        s = samples(operator.metrics())
        return s if {n for n, _ in s} >= {"finetune_job_mfu_ratio", "finetune_reconcile_total"} else None

    got = wait_for("per-job series on /metrics", scraped, timeout=30)
    assert isinstance(got, dict)
    names = {n for n, _ in got}
    used = metric_names(dashboard_queries()) | metric_names(rule_exprs())
    assert used - names == set(), f"used by the dashboard/alerts but not on /metrics: {sorted(used - names)}"

    job = frozenset({("namespace", namespace), ("name", "observed")})
    assert got[("finetune_job_phase", job | {("phase", "Running")})] == 1.0
    assert got[("finetune_job_phase", job | {("phase", "Failed")})] == 0.0
    assert got[("finetune_job_network_transport_info", job | {("transport", "efa")})] == 1.0
    assert got[("finetune_job_network_bus_bandwidth_bytes_per_second", job)] == pytest.approx(21.5e9)
    assert got[("finetune_job_eval_loss", job)] == 1.5 and got[("finetune_job_mfu_ratio", job)] == 0.38
    assert got[("finetune_job_eta_seconds", job)] == 900.0
    assert got[("finetune_job_last_progress_timestamp_seconds", job)] > 1.7e9
    assert got[("finetune_operator_leader", frozenset())] == 1.0
    assert got[("finetune_workqueue_depth", frozenset())] >= 0


JOB_RESOURCES = ("finetunejobs", "rayjobs", "rayclusters", "pods", "nodes")


@pytest.mark.usefixtures("ray_dashboard")
def test_reconciles_of_a_settled_job_read_only_from_the_watch_cache(kube: Kube, namespace: str,
                                                                     operator: OperatorProcess) -> None:
    """The operator reads what its watches delivered (controller/cache.py): once a running job has settled,
    its reconciles (the fixture resyncs every 15 s) send no GET or LIST of the job's objects or the nodes
    to the API server. The operator's own request counter on /metrics says so: reconciles go up, reads of
    those resources do not. (Without the cache every reconcile sent ~7.)"""
    create(kube, namespace, ftj("cached"))
    wait_for("Running", lambda: phase_is(kube, namespace, "cached", "Running"), timeout=120)

    def figures() -> tuple[float, float]:
        s = samples(operator.metrics())
        reads = sum(v for (n, labels), v in s.items()
                    if n == "finetune_api_reads_total" and dict(labels).get("resource") in JOB_RESOURCES)
        return s[("finetune_reconcile_total", frozenset({("result", "ok")}))], reads

    got = samples(operator.metrics())
    for resource in ("finetunejobs", "rayjobs", "rayclusters", "pods", "nodes"):
        assert got[("finetune_cache_objects", frozenset({("resource", resource)}))] >= 1, resource
    assert figures()[1] > 0  # the counter counts: the first reconciles primed the cache with live reads
    # Settled: no such read for 5 s (pods becoming ready, KubeRay's last status updates).
    last = [figures()[1], 0.0]

    def quiet() -> bool:
        now = figures()[1]
        if now != last[0]:
            last[:] = [now, 0.0]
            return False
        last[1] += 1
        return last[1] >= 5

    wait_for("no reads of the job's objects for 5 s", quiet, timeout=90, interval=1.0)
    reconciles, reads = figures()
    wait_for("two more reconciles (resync)", lambda: figures()[0] >= reconciles + 2, timeout=60)
    assert figures()[1] == reads, "a reconcile of the settled job read from the API server instead of the cache"


@pytest.mark.usefixtures("ray_dashboard")
def test_progress_writes_of_a_running_job_cost_no_reconcile(kube: Kube, namespace: str, operator: OperatorProcess,
                                                            tmp_path: Path) -> None:
    """Each progress write comes back to the operator as a watch event of the job. For a running job that
    event brings nothing a reconcile acts on, so none is queued (at 100 reporting jobs they were 20
    reconciles a second). The operator here watches only this test's namespace and resyncs hourly, so its
    reconcile counter counts this job's reconciles and no periodic one: six progress writes must add none
    (before, each write added a reconcile). Counts and order only, no clock."""
    operator.stop()  # releases the Lease to the scoped operator below; started again afterwards
    scoped = OperatorProcess(operator.kubeconfig, tmp_path, identity="op-quiet", lease_namespace=LEASE_NS,
                             extra_args=["--namespace", namespace, "--resync-interval", "3600"])
    try:
        scoped.start()
        _writes_cost_no_reconcile(kube, namespace, scoped)
    finally:
        scoped.stop()
        operator.start()


def _writes_cost_no_reconcile(kube: Kube, namespace: str, op: OperatorProcess) -> None:
    create(kube, namespace, ftj("quiet"))
    wait_for("Running", lambda: phase_is(kube, namespace, "quiet", "Running"), timeout=120)
    pod = worker_pods(kube, namespace, "quiet")[0]
    token = job_token(kube, namespace, pod, f"finetune.dev/progress/{namespace}/quiet")

    def reconciles() -> float:
        return sum(v for (n, _), v in samples(op.metrics()).items() if n == "finetune_reconcile_total")

    def step() -> Any:
        got = kube.custom.get_namespaced_custom_object("finetune.dev", "v1alpha1", namespace, "finetunejobs", "quiet")
        return (got.get("status") or {}).get("step")

    # The first report moves nothing but progress too, yet let the job settle first (pods Ready, KubeRay's
    # last status updates each queue a reconcile of their own).
    assert op.post(namespace, "quiet", {"rank": 0, "training": {"step": 1, "totalSteps": 100}}, token)[0] == 202
    wait_for("step 1 shown", lambda: step() == "1/100", timeout=30)
    last = [reconciles(), 0.0]

    def quiet() -> bool:
        now = reconciles()
        if now != last[0]:
            last[:] = [now, 0.0]
            return False
        last[1] += 1
        return last[1] >= 3

    wait_for("no reconciles for 3 s", quiet, timeout=90, interval=1.0)
    assert reconciles() > 0  # the counter is live: this operator did reconcile the job
    writes, before = 6, reconciles()
    for n in range(2, 2 + writes):
        code, text = op.post(namespace, "quiet", {"rank": 0, "training": {"step": n, "totalSteps": 100}}, token)
        assert code == 202, text
        wait_for(f"step {n} shown", lambda n=n: step() == f"{n}/100", timeout=10, interval=0.1)
        time.sleep(1.1)  # past the flush interval (1 s): each report is a status write of its own
    extra = reconciles() - before
    assert extra == 0, f"{writes} progress writes of a running job queued {extra} reconciles"
    assert phase_is(kube, namespace, "quiet", "Running")
