"""The progress channel: training pods POST progress here; the operator mirrors it into status.

Why this shape (see docs/operator.md): training pods get no Kubernetes write permission. Each Ray pod
carries a projected service-account token whose audience names its job
(`finetune.dev/progress/<ns>/<name>`). The server checks it with a TokenReview for exactly that
audience, then checks the pod the token is bound to still exists and is labelled with that job, and finds
the FinetuneJob object (UID) the pod belongs to through its owners (Pod -> RayCluster -> RayJob ->
FinetuneJob). The audience names the job by namespace/name only: a pod of a job deleted and re-created
under its name holds a token the new job's audience accepts, so a report is bound to that UID and refused
(409) if the job under the name is another object now. A valid token minted for another job gets 403;
a missing or forged one 401. Plain HTTP inside the cluster network by default (the tokens are short-lived
and useless against the API server, and a NetworkPolicy in deploy/ admits only job pods); pass
--tls-cert/--tls-key for HTTPS.

Updates are coalesced: the latest report per job is kept in memory and written to the status at once
if the job's last write is at least a flush interval ago, else when it is (per job, leading edge): a
report at the runtime's pace (one per 5 s at most) shows in `kubectl get` within a round trip, and a
chatty trainer still costs one PATCH per interval, not one per step.

A failed write is tried again after a backoff of its own job's (`retry_delay`: the flush interval,
doubling with each failure in a row up to RETRY_CAP_SECONDS, shortened by a little jitter, or the
server's Retry-After if that is longer; never sooner than the flush interval); the first success resets it. (Retried at once, a job sent 355 PATCHes in 2 s into API Priority and
Fairness 429s.) While this replica may not write (leader.py's fencing: the Lease is lost or about to be),
nothing is written and nothing is tried: reports stay pending, and the loop sleeps until it may again.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from ..api.spec import KIND
from ..api.status import ProgressReport
from ..render.config import progress_audience
from ..render.rayjob import JOB_LABEL
from .k8s import PODS, RAYCLUSTER, RAYJOB, Kube
from .metrics import Metrics
from .progress_guard import Limits, ReviewLimiter, TTLCache, implausible

Obj = dict[str, Any]
log = logging.getLogger("finetune.progress")
AUDIENCE_PREFIX = "finetune.dev/progress/"
MAX_BODY = 64 * 1024
FLUSH_WORKERS = 8  # concurrent status patches (the API client pools 5 connections per core)
RETRY_CAP_SECONDS = 60.0  # the longest backoff (a Retry-After may ask for longer, up to RETRY_AFTER_MAX)
RETRY_AFTER_MAX_SECONDS = 300.0
RETRY_JITTER = 0.2  # a delay is shortened by up to this fraction, so jobs that failed together spread out
NOT_LEADER_POLL_SECONDS = 1.0  # how often a replica that may not write looks again (no request is made)


def retry_delay(failures: int, retry_after: float | None, jitter: float, base: float) -> float:
    """Seconds before the next write of a job whose last `failures` (>= 1) writes failed in a row.

    Exponential (`base` x 2^(failures-1), capped), shortened by `jitter` (0..1, from the random source)
    times RETRY_JITTER; the server's Retry-After wins when it asks for longer."""
    backoff = min(RETRY_CAP_SECONDS, base * 2.0 ** min(failures - 1, 32))
    backoff *= 1.0 - RETRY_JITTER * min(max(jitter, 0.0), 1.0)
    if retry_after is not None:
        backoff = max(backoff, min(retry_after, RETRY_AFTER_MAX_SECONDS))
    return backoff


def unverified_audiences(token: str) -> list[str]:
    """The `aud` claim of a JWT, *unverified*: only used to pick which audience to ask TokenReview about."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return []
    aud = claims.get("aud", [])
    return [aud] if isinstance(aud, str) else [a for a in aud if isinstance(a, str)]


@dataclass
class Verdict:
    code: int
    message: str
    cluster: str | None = None  # the `ray.io/cluster` label of the pod the token is bound to
    job_uid: str | None = None  # the UID of the FinetuneJob that pod belongs to (through its owners)


def _owner_uid(obj: Obj | None, kind: str) -> str | None:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return next((str(r["uid"]) for r in refs if r.get("kind") == kind and r.get("uid")), None)


def owning_job_uid(namespace: str, pod: Obj, get: Callable[[tuple[str, str, str], str, str], Obj | None]) -> str | None:
    """The UID of the FinetuneJob a Ray pod belongs to, following its owners (each checked by UID): Pod ->
    RayCluster -> RayJob -> FinetuneJob. None if a link is missing (the job's children are being deleted)."""
    cluster = (pod["metadata"].get("labels") or {}).get("ray.io/cluster")
    rc = get(RAYCLUSTER, namespace, cluster) if cluster else None
    if rc is None or rc["metadata"].get("uid") != _owner_uid(pod, "RayCluster"):
        return None
    rayjob_uid = _owner_uid(rc, "RayJob")
    rayjob_name = next((r.get("name") for r in rc["metadata"].get("ownerReferences") or []
                        if r.get("kind") == "RayJob"), None)
    rj = get(RAYJOB, namespace, str(rayjob_name)) if rayjob_uid and rayjob_name else None
    if rj is None or rj["metadata"].get("uid") != rayjob_uid:
        return None
    return _owner_uid(rj, KIND)


@dataclass
class _Pending:
    training: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    runtime_phase: str | None = None
    dirty: bool = False
    flushed_network: dict[str, Any] = field(default_factory=dict)  # what the last flush wrote
    uid: str | None = None  # the FinetuneJob the reports were accepted for
    received: float = float("-inf")  # monotonic time the latest report arrived
    # When the report written last arrived: the next write is due `flush_interval` after it. (Measured from
    # the write instead, every write's own latency would push the next one later: a trainer reporting once
    # per interval would see its reports wait longer and longer.)
    last_flush: float = float("-inf")
    failures: int = 0  # writes that failed in a row
    retry_at: float = float("-inf")  # monotonic: no write before this (the backoff after a failure)


def _merge(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    return {**a, **{k: v for k, v in (b or {}).items() if v is not None}}


async def read_body(request: web.Request, limit: int) -> bytes | None:
    """The whole body, or None if it is over `limit` bytes. (`content.read(n)` returns what has arrived
    so far, which may be a part of the body.)"""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None


class ProgressServer:
    def __init__(
        self,
        kube: Kube,
        metrics: Metrics,
        on_flushed: Callable[[str, str], None] = lambda ns, name: None,
        flush_interval: float = 5.0,
        auth_cache_seconds: float = 60.0,
        clock: Callable[[], str] | None = None,
        limits: Limits | None = None,
        current_cluster: Callable[[str, str], str | None] = lambda ns, name: None,
        current_uid: Callable[[str, str], str | None] = lambda ns, name: None,
        current_version: Callable[[str, str], str | None] = lambda ns, name: None,
        get_pod: Callable[[str, str], dict[str, Any] | None] | None = None,
        get_owner: Callable[[tuple[str, str, str], str, str], dict[str, Any] | None] | None = None,
        monotonic: Callable[[], float] | None = None,
        jitter: Callable[[], float] = random.random,
        leader_check: Callable[[], bool] | None = None,
    ):
        from .reconcile import utcnow

        self.kube = kube
        self.metrics = metrics
        self.on_flushed = on_flushed
        self.flush_interval = flush_interval
        # The job's current RayCluster (from the RayJob's status): a report from a pod of another one comes
        # from an earlier attempt (a retry or a suspend replaced the cluster) and must not overwrite status.
        self.current_cluster = current_cluster
        # The UID of the FinetuneJob the reconciler last saw under the name: a flush is written to that object
        # only (a job deleted and re-created under its name must not get the old one's progress).
        self.current_uid = current_uid
        # The FinetuneJob's resourceVersion as last seen (the watch cache): each progress write tests it,
        # so a write delayed past a leadership change (a paused leader) is refused by the API server.
        self.current_version = current_version
        self.conflicts = 0  # writes that found the job changed since the cache saw it (and were retried)
        # Reads the pod a token is bound to (the operator: from its watch cache; default: a GET).
        self.get_pod = get_pod or (lambda ns, name: self.kube.get(PODS, ns, name))
        # Reads the pod's RayCluster and RayJob, to find the FinetuneJob UID it belongs to (the operator: its cache).
        self.get_owner = get_owner or (lambda gvr, ns, name: self.kube.get(gvr, ns, name))
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.auth_cache_seconds = auth_cache_seconds
        self.clock = clock or utcnow
        # Injected in tests (a fake clock, a fixed jitter); looked up at each call otherwise.
        self._monotonic = monotonic or (lambda: time.monotonic())
        self._jitter = jitter
        self.write_failures = 0  # failed status writes (each followed by a backoff of its job's)
        # Whether this replica may write now (the runner: leader.py's fencing check); None: always.
        self.leader_check = leader_check
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.limits = limits or Limits(accepted_ttl=auth_cache_seconds)
        # Verdicts by token (bounded, expiring): accepted ones spare genuine pods a TokenReview per report,
        # rejected ones make a repeated forged token free. See progress_guard.py.
        self._auth_cache: TTLCache[Verdict] = TTLCache(self.limits.max_cached)
        self._rejected: TTLCache[Verdict] = TTLCache(self.limits.max_cached)
        self._limiter = ReviewLimiter(self.limits, self._monotonic)
        self._auth_lock = threading.Lock()
        # TokenReviews run on their own few threads: a flood can never take the threads the leader
        # election and the flusher run on (asyncio's default executor).
        self._auth_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="progress-auth")
        self.ready = False

    # ------------------------------------------------------------------------------------------ auth
    def authorize(self, token: str, namespace: str, name: str, client: str = "unknown") -> Verdict:
        key = hashlib.sha256(f"{namespace}/{name}/{token}".encode()).hexdigest()
        with self._auth_lock:
            hit = self._auth_cache.get(key) or self._rejected.get(key)
        if hit is not None:
            return hit
        why = implausible(token, time.time())
        if why is not None:
            verdict = Verdict(401, why)
            with self._auth_lock:
                self._rejected.put(key, verdict, self.limits.rejected_ttl)
            return verdict
        with self._auth_lock:
            allowed = self._limiter.allow(client)
        if not allowed:
            return Verdict(429, "too many unverified tokens; retry later")
        verdict = self._authorize(token, namespace, name)
        with self._auth_lock:
            if verdict.code == 200:
                self._auth_cache.put(key, verdict, self.limits.accepted_ttl)
            else:
                self._rejected.put(key, verdict, self.limits.rejected_ttl)
        return verdict

    def _authorize(self, token: str, namespace: str, name: str) -> Verdict:
        audience = progress_audience(namespace, name)
        self.metrics.token_reviews.inc()
        review = self.kube.token_review(token, [audience])
        if not review.get("authenticated"):
            others = [a for a in unverified_audiences(token) if a.startswith(AUDIENCE_PREFIX) and a != audience]
            if others:
                self.metrics.token_reviews.inc()
            if others and self.kube.token_review(token, others[:1]).get("authenticated"):
                return Verdict(403, f"token was issued for {others[0]}, not for job {namespace}/{name}")
            return Verdict(401, review.get("error") or "token not accepted for this job's audience")
        user = review.get("user") or {}
        parts = str(user.get("username", "")).split(":")
        if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or parts[2] != namespace:
            return Verdict(403, f"{user.get('username')} is not a service account of namespace {namespace}")
        extra = user.get("extra") or {}
        pod_name = (extra.get("authentication.kubernetes.io/pod-name") or [None])[0]
        pod_uid = (extra.get("authentication.kubernetes.io/pod-uid") or [None])[0]
        if not pod_name:
            return Verdict(403, "token is not bound to a pod")
        pod = self.get_pod(namespace, pod_name)
        if pod is None or (pod_uid and pod["metadata"].get("uid") != pod_uid):
            return Verdict(403, f"pod {pod_name} no longer exists")
        owner = (pod["metadata"].get("labels") or {}).get(JOB_LABEL)
        if owner != name:
            return Verdict(403, f"pod {pod_name} belongs to job {owner!r}, not {name!r}")
        job_uid = owning_job_uid(namespace, pod, self.get_owner)
        if job_uid is None:
            return Verdict(403, f"pod {pod_name} belongs to no FinetuneJob {namespace}/{name} any more "
                                "(its RayCluster or RayJob is gone)")
        return Verdict(200, "ok", cluster=(pod["metadata"].get("labels") or {}).get("ray.io/cluster"), job_uid=job_uid)

    # ----------------------------------------------------------------------------------------- HTTP
    async def handle_progress(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        if not self.ready:
            # A standby drops reports (only the leader flushes them): never answer 202 for those.
            return self._reply(503, "this replica is not the leader; retry (reports are routed to the leader)")
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            return self._reply(401, "missing bearer token")
        loop = asyncio.get_running_loop()
        verdict = await loop.run_in_executor(self._auth_pool, self.authorize, header[7:].strip(), ns, name,
                                             request.remote or "unknown")
        if verdict.code != 200:
            return self._reply(verdict.code, verdict.message)
        try:
            raw = await read_body(request, MAX_BODY)
            if raw is None:
                return self._reply(413, f"body over {MAX_BODY} bytes")
            report = ProgressReport.model_validate_json(raw)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            return self._reply(422, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
        current_uid = self.current_uid(ns, name)
        if verdict.job_uid and current_uid and verdict.job_uid != current_uid:
            return self._reply(409, f"report from a pod of a previous FinetuneJob {ns}/{name} (uid {verdict.job_uid}); "
                                    f"the job under that name now is uid {current_uid}: ignored")
        current = self.current_cluster(ns, name)
        if verdict.cluster and current and verdict.cluster != current:
            return self._reply(409, f"report from Ray cluster {verdict.cluster}, an earlier attempt of {ns}/{name}; "
                                    f"the job now runs on {current}: ignored")
        self.accept(ns, name, report, uid=verdict.job_uid)
        return self._reply(202, "accepted")

    def accept(self, namespace: str, name: str, report: ProgressReport, uid: str | None = None) -> None:
        """`uid`: the FinetuneJob the reporting pod belongs to (the verdict's); the reconciler's otherwise.
        The write is guarded by it (ObjectReplaced if the object under the name is another one)."""
        p = self.pending.setdefault((namespace, name), _Pending())
        uid = uid or self.current_uid(namespace, name)
        if uid and p.uid and uid != p.uid:  # a new object under the name: start afresh
            p = self.pending[(namespace, name)] = _Pending()
        p.uid = p.uid or uid
        training = report.training.wire() if report.training and report.rank == 0 else None
        network = report.network.wire() if report.network else None
        if training is not None:
            training["lastReportTime"] = self.clock()
        p.training = _merge(p.training, training)
        p.network = _merge(p.network, network)
        if report.phase and report.rank == 0:
            p.runtime_phase = report.phase  # kept: decides the outcome if the RayJob vanishes unobserved
        p.dirty = True
        p.received = self._monotonic()
        self.metrics.observe_progress(namespace, name, training, network)
        self._signal()

    def _signal(self) -> None:
        """Wake the flusher (from any thread)."""
        if self._wake is None or self._loop is None:
            return
        try:
            if asyncio.get_running_loop() is self._loop:
                self._wake.set()
                return
        except RuntimeError:
            pass
        self._loop.call_soon_threadsafe(self._wake.set)

    def _reply(self, code: int, message: str) -> web.Response:
        self.metrics.progress_reports.labels(str(code)).inc()
        headers = {"Retry-After": "1"} if code == 429 else None
        return web.json_response({"code": code, "message": message}, status=code, headers=headers)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        # Only the leader is ready, so the Service sends progress to the replica that acts on it.
        return web.Response(text="leader" if self.ready else "standby", status=200 if self.ready else 503)

    async def metrics_view(self, request: web.Request) -> web.Response:
        self.metrics.mirror_api_calls(self.kube)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/progress/{namespace}/{name}", self.handle_progress)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_view)
        return app

    # ---------------------------------------------------------------------------------------- flush
    def held_report(self, namespace: str, name: str) -> str | None:
        """When the latest report of the job that is not written yet arrived (None: nothing held): the stall
        window does not count time whose reports this process holds (a status write refused, say)."""
        p = self.pending.get((namespace, name))
        if p is None or not p.dirty:
            return None
        uid = self.current_uid(namespace, name)
        if uid and p.uid and uid != p.uid:
            return None
        return p.training.get("lastReportTime")

    def forget(self, namespace: str, name: str) -> None:
        self.pending.pop((namespace, name), None)

    def may_write(self) -> bool:
        """Whether this replica may write now (leader.py's fencing); no request is made. Each write still
        asks the client's own check as well (Kube._write)."""
        return self.leader_check is None or bool(self.leader_check())

    def _due(self, p: _Pending, now: float) -> bool:
        return p.dirty and now - p.last_flush >= self.flush_interval and now >= p.retry_at

    def flush_once(self, due_only: bool = False) -> int:
        """Write every job's latest progress into its status (`due_only`: only jobs whose last write is a
        flush interval ago and whose backoff after a failure has run out); returns how many jobs were patched.
        Nothing while this replica may not write.

        The patches go out FLUSH_WORKERS at a time: one after the other, 100 reporting jobs took one
        flush about 15 s on a loaded dev cluster (each patch a round trip), far beyond the interval."""
        if not self.may_write():
            return 0
        now = self._monotonic()
        dirty = [(key, p) for key, p in list(self.pending.items())
                 if p.dirty and (not due_only or self._due(p, now))]
        if not dirty:
            return 0
        if len(dirty) == 1:
            return int(self._flush_one(*dirty[0]))
        with ThreadPoolExecutor(max_workers=min(FLUSH_WORKERS, len(dirty)), thread_name_prefix="progress-flush") as pool:
            return sum(pool.map(lambda kp: self._flush_one(*kp), dirty))

    def _failed(self, key: tuple[str, str], p: _Pending, err: BaseException, retry_after: float | None = None) -> None:
        """A write of this job's failed: keep the report, and try again only after the job's backoff."""
        p.dirty = True
        p.failures += 1
        self.write_failures += 1
        delay = retry_delay(p.failures, retry_after, self._jitter(), self.flush_interval)
        p.retry_at = self._monotonic() + delay
        log.warning("progress for %s/%s not written (failure %d in a row; next try in %.1fs): %s",
                    *key, p.failures, delay, err)

    def _flush_one(self, key: tuple[str, str], p: _Pending) -> bool:
        from .k8s import ApiError, Conflict, NotLeader, ObjectReplaced

        ns, name = key
        p.dirty = False
        p.last_flush = p.received if p.received > float("-inf") else self._monotonic()
        patch: dict[str, Any] = {}
        if p.training:
            patch["training"] = dict(p.training)
            step, total = p.training.get("step"), p.training.get("totalSteps")
            if step is not None:
                patch["step"] = f"{step}/{total}" if total else str(step)
        if p.network:
            patch["network"] = dict(p.network)
        if p.runtime_phase:
            patch["runtimePhase"] = p.runtime_phase
        try:
            try:
                self.kube.patch_status(ns, name, patch, uid=p.uid,
                                       resource_version=self.current_version(ns, name) if p.uid else None)
            except Conflict as err:
                # Somebody wrote the job since the cache saw it (a reconcile's status write in flight, a new
                # leader): write again on the version just read. This retry asks the leader check again,
                # which a replica that was paused past its Lease no longer passes.
                self.conflicts += 1
                self.kube.patch_status(ns, name, patch, uid=p.uid,
                                       resource_version=err.current["metadata"].get("resourceVersion"))
        except NotLeader as err:  # deposed: the report stays unwritten; the loop stops trying (may_write)
            self._failed(key, p, err)
            return False
        except ApiError as err:
            if err.status == 404 or isinstance(err, ObjectReplaced):
                self.forget(ns, name)
                return False
            self._failed(key, p, err, err.retry_after)
            return False
        p.failures, p.retry_at = 0, float("-inf")
        if p.received > float("-inf"):
            self.metrics.progress_write_delay.observe(self._monotonic() - p.last_flush)
        # Only the network figures feed a condition (NetworkHealthy); step/loss do not, so a
        # reconcile after every flush would be wasted work at scale.
        if p.network != p.flushed_network:
            p.flushed_network = dict(p.network)
            self.on_flushed(ns, name)
        return True

    def _next_due(self, busy: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset()) -> float | None:
        """Seconds until the next dirty job may be written (0: now), None if nothing is dirty. Jobs in `busy`
        (a write of theirs is under way) are not counted."""
        now = self._monotonic()
        waits = [max(0.0, p.last_flush + self.flush_interval - now, p.retry_at - now)
                 for key, p in list(self.pending.items()) if p.dirty and key not in busy]
        return min(waits) if waits else None

    def dispatch_due(self, busy: set[tuple[str, str]]) -> list[tuple[tuple[str, str], _Pending]]:
        """The jobs whose write may start now (due, none of theirs under way); none while this replica may
        not write. They are marked busy."""
        if not self.may_write():
            return []
        now = self._monotonic()
        due = [(key, p) for key, p in list(self.pending.items()) if key not in busy and self._due(p, now)]
        busy.update(key for key, _ in due)
        return due

    async def flush_forever(self) -> None:
        """Write each job's progress as soon as it is allowed to (see the module doc), woken by reports.

        Each due job's write goes to a pool of FLUSH_WORKERS threads on its own, so a slow patch holds up
        only its own job. (Flushing in batches, every report that fell due during a batch waited for the
        batch's slowest patch: on a loaded API server at 1000 jobs that put the operator's share of the
        status latency in the seconds.) A job has at most one write under way."""
        loop = self._loop = asyncio.get_running_loop()
        wake = self._wake = asyncio.Event()
        pool = ThreadPoolExecutor(max_workers=FLUSH_WORKERS, thread_name_prefix="progress-flush")
        busy: set[tuple[str, str]] = set()

        def finished(key: tuple[str, str], p: _Pending, fut: asyncio.Future[bool]) -> None:  # on the loop
            busy.discard(key)
            if not fut.cancelled() and fut.exception() is not None:
                # Not an API answer (those _flush_one handles): a connection error, a timeout. Backs off too.
                self._failed(key, p, fut.exception() or RuntimeError("unknown"))
            wake.set()

        try:
            while True:
                wake.clear()  # before looking: a report or a finished write from here on wakes the wait below
                for key, p in self.dispatch_due(busy):
                    fut = loop.run_in_executor(pool, self._flush_one, key, p)
                    fut.add_done_callback(functools.partial(finished, key, p))
                if not self.may_write():
                    # Not the leader (or no longer surely): no write, no retry; look again a while later.
                    wait: float | None = NOT_LEADER_POLL_SECONDS
                else:
                    wait = self._next_due(busy)
                    if wait is not None and wait <= 0:
                        await asyncio.sleep(0)  # fell due just now: dispatched on the next pass
                        continue
                try:
                    await asyncio.wait_for(wake.wait(), timeout=wait if wait is not None else self.flush_interval)
                except TimeoutError:
                    pass
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
