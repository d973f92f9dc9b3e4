"""Prometheus metrics, prefixed `finetune_`. Per-job series are removed when the job is deleted, and
bounded: past MAX_JOB_SERIES tracked jobs, new jobs get no per-job series (counted in a metric)."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..api.status import Phase

MAX_JOB_SERIES = 500


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_jobs: int = MAX_JOB_SERIES):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}
        self._tracked: set[tuple[str, str]] = set()
        self.reconciles = Counter("finetune_reconcile_total", "Reconciles by result.", ["result"], registry=r)
        self.reconcile_seconds = Histogram(
            "finetune_reconcile_duration_seconds", "Reconcile latency.", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.reconcile_errors = Counter("finetune_reconcile_errors_total", "Reconciles that raised.", ["kind"], registry=r)
        self.api_writes = Counter("finetune_api_writes_total", "Writes to the API server.", ["verb", "kind"], registry=r)
        self.jobs = Gauge("finetune_jobs", "FinetuneJobs by phase.", ["phase"], registry=r)
        for p in Phase:
            self.jobs.labels(p.value).set(0)
        self.progress_reports = Counter(
            "finetune_progress_reports_total", "Progress POSTs by HTTP result.", ["code"], registry=r
        )
        self.token_reviews = Counter(
            "finetune_progress_token_reviews_total", "TokenReviews the progress endpoint asked the API server for.",
            registry=r,
        )
        self.untracked = Gauge(
            "finetune_jobs_without_series", "Jobs beyond the per-job series cap.", registry=r
        )
        labels = ["namespace", "name"]
        self.step = Gauge("finetune_job_step", "Training step.", labels, registry=r)
        self.total_steps = Gauge("finetune_job_total_steps", "Planned training steps.", labels, registry=r)
        self.loss = Gauge("finetune_job_loss", "Training loss.", labels, registry=r)
        self.tokens = Gauge("finetune_job_tokens_per_second", "Training throughput.", labels, registry=r)
        self.net_ok = Gauge(
            "finetune_job_network_healthy", "1 when collectives use the expected transport.", labels, registry=r
        )
        self._per_job = [self.step, self.total_steps, self.loss, self.tokens, self.net_ok]

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        with self._lock:
            if phase is None:
                self._phases.pop((namespace, name), None)
            else:
                self._phases[(namespace, name)] = phase
            counts = {p.value: 0 for p in Phase}
            for ph in self._phases.values():
                counts[ph] = counts.get(ph, 0) + 1
        for ph, n in counts.items():
            self.jobs.labels(ph).set(n)

    def _track(self, key: tuple[str, str]) -> bool:
        with self._lock:
            if key in self._tracked:
                return True
            if len(self._tracked) >= self.max_jobs:
                self.untracked.inc()
                return False
            self._tracked.add(key)
            return True

    def observe_progress(self, namespace: str, name: str, training: dict[str, Any] | None, network: dict[str, Any] | None) -> None:
        key = (namespace, name)
        if not self._track(key):
            return
        t = training or {}
        for gauge, field in ((self.step, "step"), (self.total_steps, "totalSteps"), (self.loss, "loss"),
                             (self.tokens, "tokensPerSecond")):
            if t.get(field) is not None:
                gauge.labels(namespace, name).set(float(t[field]))
        if network and network.get("healthy") is not None:
            self.net_ok.labels(namespace, name).set(1.0 if network["healthy"] else 0.0)

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.set_phase(namespace, name, None)
        with self._lock:
            self._tracked.discard(key)
        for gauge in self._per_job:
            try:
                gauge.remove(namespace, name)
            except KeyError:
                pass
