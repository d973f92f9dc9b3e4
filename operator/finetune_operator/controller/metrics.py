"""Prometheus metrics, prefixed `finetune_`. Per-job series are bounded: past MAX_JOB_SERIES jobs, new jobs get no
per-job series (counted in a metric). A job's slot is freed when it is deleted, and when it finishes: a
finished job keeps only its finetune_job_phase series (the FinetuneJobFailed alert reads it), and only until
a job that is not finished needs the slot (the oldest finished job's series go first)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..api.status import Phase

MAX_JOB_SERIES = 500
_FINISHED = {Phase.succeeded.value, Phase.failed.value}


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_jobs: int = MAX_JOB_SERIES,
                 clock: Callable[[], float] = time.time):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.max_jobs = max_jobs
        self.clock = clock
        self._lock = threading.Lock()
        self._transports: dict[tuple[str, str], str] = {}
        self._phases: dict[tuple[str, str], str] = {}
        self._tracked: set[tuple[str, str]] = set()  # jobs not finished, with series
        self._finished: dict[tuple[str, str], None] = {}  # finished jobs with their phase series, oldest first
        self._untracked: set[tuple[str, str]] = set()
        self.reconciles = Counter("finetune_reconcile_total", "Reconciles by result.", ["result"], registry=r)
        for result in ("ok", "error"):  # both series exist from the start: rates and alerts see a 0, not nothing
            self.reconciles.labels(result)
        self.reconcile_seconds = Histogram(
            "finetune_reconcile_duration_seconds", "Reconcile latency.", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.reconcile_errors = Counter("finetune_reconcile_errors_total", "Reconciles that raised.", ["kind"], registry=r)
        self.api_writes = Counter("finetune_api_writes_total", "Writes to the API server.", ["verb", "kind"], registry=r)
        self.api_reads = Counter("finetune_api_reads_total", "GETs and LISTs sent to the API server (watches aside).",
                                 ["verb", "resource"], registry=r)
        self.cache_objects = Gauge("finetune_cache_objects", "Objects in the operator's read cache, by resource.",
                                   ["resource"], registry=r)
        self.jobs = Gauge("finetune_jobs", "FinetuneJobs by phase.", ["phase"], registry=r)
        for p in Phase:
            self.jobs.labels(p.value).set(0)
        self.progress_reports = Counter(
            "finetune_progress_reports_total", "Progress POSTs by HTTP result.", ["code"], registry=r
        )
        self.progress_write_delay = Histogram(
            "finetune_progress_write_delay_seconds",
            "From a progress report's arrival to the API server's answer to the status write that carries it "
            "(the operator's share of the time until `kubectl get` shows it; the rest is the watch/read).",
            registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
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
        self.stalled = Gauge(
            "finetune_job_stalled", "1 while a running job has stopped reporting progress (Stalled condition).",
            labels, registry=r,
        )
        self.eval_loss = Gauge("finetune_job_eval_loss", "Loss on the held-out split.", labels, registry=r)
        self.mfu = Gauge("finetune_job_mfu_ratio", "Model FLOPs utilisation (0..1).", labels, registry=r)
        self.eta = Gauge("finetune_job_eta_seconds", "Estimated seconds to the last step.", labels, registry=r)
        self.bus_bw = Gauge("finetune_job_network_bus_bandwidth_bytes_per_second",
                            "All-reduce bus bandwidth from the start-up probe.", labels, registry=r)
        self.transport = Gauge("finetune_job_network_transport_info",
                               "1 for the transport carrying inter-node collectives (label transport).",
                               [*labels, "transport"], registry=r)
        self.last_report = Gauge("finetune_job_last_progress_timestamp_seconds",
                                 "Unix time of the last training progress report.", labels, registry=r)
        self.job_phase = Gauge("finetune_job_phase", "1 for the job's current phase, 0 for the others.",
                               [*labels, "phase"], registry=r)
        # Set by the runner: this replica holds the Lease; keys waiting in the work queue.
        self.leader = Gauge("finetune_operator_leader", "1 while this replica holds the leader Lease.", registry=r)
        self.kuberay_compatible = Gauge(
            "finetune_kuberay_compatible", "1: the RayJob CRD has every field the operator renders; 0: it does not "
            "(KubeRay too old, or not installed); -1: it could not be read.", registry=r)
        self.queue_depth = Gauge("finetune_workqueue_depth", "Jobs waiting to be reconciled.", registry=r)
        self._per_job = [self.step, self.total_steps, self.loss, self.tokens, self.net_ok, self.eval_loss,
                         self.mfu, self.eta, self.bus_bw, self.last_report, self.stalled]

    def mirror_api_calls(self, kube: Any) -> None:
        """Copy the API client's request counters (k8s.Kube.writes/reads) into the counters above. Done at
        every scrape and after every reconcile: once only after reconciles, the Lease renewals and progress
        writes of a quiet stretch showed up late, in a lump (a benchmark's 60 idle seconds read 1, 5 or 11
        renewals where the audit log had 6)."""
        for key, n in list(kube.writes.items()):
            verb, kind = key.split(" ", 1)
            self.api_writes.labels(verb, kind)._value.set(n)
        for key, n in list(kube.reads.items()):
            verb, resource = key.split(" ", 1)
            self.api_reads.labels(verb, resource)._value.set(n)

    def set_stalled(self, namespace: str, name: str, stalled: bool) -> None:
        if self._track((namespace, name)):
            self.stalled.labels(namespace, name).set(1.0 if stalled else 0.0)

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
        key = (namespace, name)
        if phase in _FINISHED:
            if not self._finish(key):
                return
        elif phase is None or not self._track(key):
            return
        for p in Phase:
            self.job_phase.labels(namespace, name, p.value).set(1.0 if p.value == phase else 0.0)

    def _finish(self, key: tuple[str, str]) -> bool:
        """A finished job frees its slot: its per-job series go, its phase series stay (while there is room)."""
        with self._lock:
            if key in self._finished:
                return True
            had = key in self._tracked
            self._tracked.discard(key)
            self._untracked.discard(key)
            self.untracked.set(len(self._untracked))
            keep = had or len(self._tracked) + len(self._finished) < self.max_jobs
            if keep:
                self._finished[key] = None
        self._remove_series(key, phase=not keep)
        return keep

    def _track(self, key: tuple[str, str]) -> bool:
        evicted = None
        with self._lock:
            if key in self._tracked:
                return True
            if self._phases.get(key) in _FINISHED:
                return False  # a late report of a finished job: it holds no slot
            if len(self._tracked) + len(self._finished) >= self.max_jobs:
                if not self._finished:
                    self._untracked.add(key)
                    self.untracked.set(len(self._untracked))
                    return False
                evicted = next(iter(self._finished))
                del self._finished[evicted]
            self._tracked.add(key)
            self._untracked.discard(key)
            self.untracked.set(len(self._untracked))
        if evicted is not None:
            self._remove_series(evicted, phase=True)
        return True

    def observe_progress(self, namespace: str, name: str, training: dict[str, Any] | None, network: dict[str, Any] | None) -> None:
        key = (namespace, name)
        if not self._track(key):
            return
        t = training or {}
        for gauge, field in ((self.step, "step"), (self.total_steps, "totalSteps"), (self.loss, "loss"),
                             (self.tokens, "tokensPerSecond"), (self.eval_loss, "evalLoss"), (self.mfu, "mfu"),
                             (self.eta, "etaSeconds")):
            if t.get(field) is not None:
                gauge.labels(namespace, name).set(float(t[field]))
        if training is not None:
            self.last_report.labels(namespace, name).set(self.clock())
        net = network or {}
        if net.get("healthy") is not None:
            self.net_ok.labels(namespace, name).set(1.0 if net["healthy"] else 0.0)
        if net.get("busBandwidthGBps") is not None:
            self.bus_bw.labels(namespace, name).set(float(net["busBandwidthGBps"]) * 1e9)
        if net.get("transport"):
            self._set_transport(key, str(net["transport"]))

    def _set_transport(self, key: tuple[str, str], transport: str) -> None:
        with self._lock:
            old = self._transports.get(key)
            self._transports[key] = transport
        if old is not None and old != transport:
            self.transport.remove(*key, old)
        self.transport.labels(*key, transport).set(1.0)

    def watch_cache(self, sizes: Callable[[], dict[str, int]]) -> None:
        """Serve the read cache's sizes (controller/cache.py), read at scrape time."""
        def size_of(resource: str) -> Callable[[], float]:
            return lambda: float(sizes().get(resource, 0))

        for resource in sizes():
            self.cache_objects.labels(resource).set_function(size_of(resource))

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.set_phase(namespace, name, None)
        with self._lock:
            self._tracked.discard(key)
            self._finished.pop(key, None)
            self._untracked.discard(key)
            self.untracked.set(len(self._untracked))
        self._remove_series(key, phase=True)

    def _remove_series(self, key: tuple[str, str], phase: bool) -> None:
        namespace, name = key
        for gauge in self._per_job:
            try:
                gauge.remove(namespace, name)
            except KeyError:
                pass
        with self._lock:
            transport = self._transports.pop(key, None)
        if transport is not None:
            self.transport.remove(namespace, name, transport)
        if not phase:
            return
        for labels in [(namespace, name, p.value) for p in Phase]:
            try:
                self.job_phase.remove(*labels)
            except KeyError:
                pass
