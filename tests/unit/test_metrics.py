"""Per-job series of controller/metrics.py: values, label changes, removal, the series cap."""

from __future__ import annotations

import pytest
from finetune_operator.controller.metrics import Metrics


def sample(m: Metrics, metric: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(metric, labels)


@pytest.mark.parametrize(
    ("field", "value", "metric", "expected"),
    [
        ("evalLoss", 0.75, "finetune_job_eval_loss", 0.75),
        ("mfu", 0.41, "finetune_job_mfu_ratio", 0.41),
        ("etaSeconds", 3600, "finetune_job_eta_seconds", 3600.0),
        ("loss", 1.5, "finetune_job_loss", 1.5),
    ],
    ids=["eval-loss", "mfu", "eta", "loss"],
)
def test_training_fields_become_gauges(field: str, value: float, metric: str, expected: float) -> None:
    m = Metrics(clock=lambda: 1000.0)
    m.observe_progress("ml", "a", {field: value}, None)
    assert sample(m, metric, namespace="ml", name="a") == expected
    assert sample(m, "finetune_job_last_progress_timestamp_seconds", namespace="ml", name="a") == 1000.0


def test_network_fields_and_transport_changes() -> None:
    m = Metrics()
    m.observe_progress("ml", "a", None, {"transport": "socket", "healthy": False, "busBandwidthGBps": 1.5})
    assert sample(m, "finetune_job_network_healthy", namespace="ml", name="a") == 0.0
    assert sample(m, "finetune_job_network_bus_bandwidth_bytes_per_second", namespace="ml", name="a") == 1.5e9
    assert sample(m, "finetune_job_network_transport_info", namespace="ml", name="a", transport="socket") == 1.0
    assert sample(m, "finetune_job_last_progress_timestamp_seconds", namespace="ml", name="a") is None  # no training
    m.observe_progress("ml", "a", None, {"transport": "efa"})
    assert sample(m, "finetune_job_network_transport_info", namespace="ml", name="a", transport="socket") is None
    assert sample(m, "finetune_job_network_transport_info", namespace="ml", name="a", transport="efa") == 1.0


def test_phase_series_is_one_hot_and_forget_removes_everything() -> None:
    m = Metrics()
    m.set_phase("ml", "a", "Provisioning")
    m.set_phase("ml", "a", "Running")
    assert sample(m, "finetune_job_phase", namespace="ml", name="a", phase="Running") == 1.0
    assert sample(m, "finetune_job_phase", namespace="ml", name="a", phase="Provisioning") == 0.0
    assert sample(m, "finetune_jobs", phase="Running") == 1.0
    m.observe_progress("ml", "a", {"step": 3}, {"transport": "efa"})
    m.forget("ml", "a")
    text = [s for fam in m.registry.collect() for s in fam.samples if s.labels.get("name") == "a"]
    assert text == []
    assert sample(m, "finetune_jobs", phase="Running") == 0.0


def test_jobs_past_the_cap_get_no_series_and_are_counted_once() -> None:
    m = Metrics(max_jobs=1)
    m.set_phase("ml", "a", "Running")
    for _ in range(3):
        m.set_phase("ml", "b", "Running")
        m.observe_progress("ml", "b", {"step": 1}, None)
    assert sample(m, "finetune_job_phase", namespace="ml", name="b", phase="Running") is None
    assert sample(m, "finetune_jobs_without_series") == 1.0
    m.forget("ml", "b")
    assert sample(m, "finetune_jobs_without_series") == 0.0


def test_finished_jobs_free_their_slots_so_new_jobs_get_series() -> None:
    """Once MAX_JOB_SERIES jobs had finished, no new job got series and the stall alerts went blind."""
    m = Metrics(max_jobs=3, clock=lambda: 1000.0)
    for name in ("a", "b", "c"):
        m.set_phase("ml", name, "Running")
        m.observe_progress("ml", name, {"step": 5}, {"transport": "efa"})
        m.set_stalled("ml", name, False)
    m.set_phase("ml", "a", "Failed")
    m.set_phase("ml", "b", "Succeeded")
    m.set_stalled("ml", "a", False)  # the reconcile's calls after set_phase, and a late report, take no slot back
    m.observe_progress("ml", "b", {"step": 6}, None)
    # Finished: the per-job series are gone, the phase series stay (FinetuneJobFailed reads it).
    for name in ("a", "b"):
        assert sample(m, "finetune_job_step", namespace="ml", name=name) is None
        assert sample(m, "finetune_job_last_progress_timestamp_seconds", namespace="ml", name=name) is None
        assert sample(m, "finetune_job_stalled", namespace="ml", name=name) is None
        assert sample(m, "finetune_job_network_transport_info", namespace="ml", name=name, transport="efa") is None
    assert sample(m, "finetune_job_phase", namespace="ml", name="a", phase="Failed") == 1.0
    assert sample(m, "finetune_job_phase", namespace="ml", name="b", phase="Succeeded") == 1.0
    # New jobs get series: the oldest finished job's phase series make room first.
    m.set_phase("ml", "d", "Running")
    m.observe_progress("ml", "d", {"step": 1}, None)
    assert sample(m, "finetune_job_phase", namespace="ml", name="d", phase="Running") == 1.0
    assert sample(m, "finetune_job_last_progress_timestamp_seconds", namespace="ml", name="d") == 1000.0
    assert sample(m, "finetune_job_phase", namespace="ml", name="a", phase="Failed") is None
    assert sample(m, "finetune_job_phase", namespace="ml", name="b", phase="Succeeded") == 1.0
    m.set_phase("ml", "e", "Provisioning")
    assert sample(m, "finetune_job_phase", namespace="ml", name="e", phase="Provisioning") == 1.0
    assert sample(m, "finetune_job_phase", namespace="ml", name="b", phase="Succeeded") is None
    # All slots held by jobs not finished: the next one waits, counted, and gets series once one finishes.
    m.set_phase("ml", "f", "Provisioning")
    assert sample(m, "finetune_job_phase", namespace="ml", name="f", phase="Provisioning") is None
    assert sample(m, "finetune_jobs_without_series") == 1.0
    m.set_phase("ml", "c", "Succeeded")
    m.set_phase("ml", "f", "Running")
    assert sample(m, "finetune_job_phase", namespace="ml", name="f", phase="Running") == 1.0
    assert sample(m, "finetune_jobs_without_series") == 0.0
    assert sample(m, "finetune_jobs", phase="Failed") == 1.0  # the counts by phase keep every job


def test_a_deleted_finished_job_frees_its_slot() -> None:
    m = Metrics(max_jobs=1)
    m.set_phase("ml", "a", "Failed")
    m.forget("ml", "a")
    assert sample(m, "finetune_job_phase", namespace="ml", name="a", phase="Failed") is None
    m.set_phase("ml", "b", "Running")
    assert sample(m, "finetune_job_phase", namespace="ml", name="b", phase="Running") == 1.0


def test_api_call_counters_are_current_at_every_scrape_not_only_after_a_reconcile() -> None:
    """Lease renewals and progress writes happen outside reconciles: a scrape must show them as they are."""
    import asyncio

    from finetune_operator.controller.k8s import Kube
    from finetune_operator.controller.progress import ProgressServer
    from kubernetes import client

    kube, m = Kube(client.ApiClient()), Metrics()
    server = ProgressServer(kube, m)
    kube.writes["replace Lease"] += 6  # what the client counted since the last reconcile
    kube.reads["get leases"] += 6
    body = asyncio.run(server.metrics_view(None)).body  # type: ignore[arg-type]
    assert b'finetune_api_writes_total{kind="Lease",verb="replace"} 6.0' in body
    assert b'finetune_api_reads_total{resource="leases",verb="get"} 6.0' in body
    kube.writes["replace Lease"] += 1
    asyncio.run(server.metrics_view(None))  # type: ignore[arg-type]
    assert sample(m, "finetune_api_writes_total", verb="replace", kind="Lease") == 7.0
