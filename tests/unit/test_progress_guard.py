"""The progress endpoint's flood defences (controller/progress_guard.py): bounded caches, token buckets,
the cheap plausibility filter. Pure, with a fake clock."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable

import pytest
from finetune_operator.controller.metrics import Metrics
from finetune_operator.controller.progress import ProgressServer
from finetune_operator.controller.progress_guard import Limits, ReviewLimiter, TokenBucket, TTLCache, implausible


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ttl_cache_expires_and_evicts_least_recently_used() -> None:
    clock = Clock()
    cache: TTLCache[int] = TTLCache(max_entries=2, clock=clock)
    cache.put("a", 1, ttl=10)
    cache.put("b", 2, ttl=10)
    assert cache.get("a") == 1  # a is now the most recently used
    cache.put("c", 3, ttl=10)
    assert (cache.get("a"), cache.get("b"), cache.get("c"), len(cache), cache.evictions) == (1, None, 3, 2, 1)
    clock.now = 11
    assert cache.get("a") is None and len(cache) == 1


def test_token_bucket_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.now = 0.5
    assert [bucket.take() for _ in range(2)] == [True, False]


def test_limiter_is_per_client_and_overall() -> None:
    clock = Clock()
    limiter = ReviewLimiter(Limits(reviews_per_second=1, reviews_burst=5, client_reviews_per_second=1,
                                   client_reviews_burst=2, max_clients=2), clock)
    assert [limiter.allow("flood") for _ in range(4)] == [True, True, False, False]
    assert [limiter.allow("pod") for _ in range(2)] == [True, True]  # another client has its own bucket
    assert limiter.allow("third") is True  # overall burst: 5 allowed in total
    assert limiter.allow("fourth") is False and len(limiter.clients) == 2  # bounded
    assert limiter.refused == 3


def _jwt(claims: dict[str, object]) -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{body}.c2ln"


PLAUSIBLE = [
    ("garbage", "not-a-token", "not a JWT"),
    ("two-parts", "a.b", "not a JWT"),
    ("bad-base64-json", "a.!!!.c", "not a JWT"),
    ("expired", _jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10}), "token expired"),
    ("api-server-audience", _jwt({"aud": ["https://kubernetes.default.svc"], "exp": 10**12}), "no finetune.dev/progress"),
    ("plausible", _jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10**12}), None),
]


@pytest.mark.parametrize(("token", "why"), [p[1:] for p in PLAUSIBLE], ids=[p[0] for p in PLAUSIBLE])
def test_implausible_tokens_never_reach_the_api_server(token: str, why: str | None) -> None:
    got = implausible(token, now=1000.0)
    assert (got is None) if why is None else (got is not None and why in got)


class StubKube:
    """Stands in for the API server in these unit tests only (the real TokenReview path is covered by
    tests/integration/test_operator.py): counts TokenReviews, rejects every token, records status patches."""

    def __init__(self) -> None:
        self.reviews = 0
        self.patches: list[tuple[str, str, dict[str, object]]] = []
        self.uids: list[str | None] = []

    def token_review(self, token: str, audiences: list[str]) -> dict[str, object]:
        self.reviews += 1
        return {"authenticated": False, "error": "invalid bearer token"}

    def patch_status(self, ns: str, name: str, patch: dict[str, object], uid: str | None = None,
                     has_status: bool = True, resource_version: str | None = None) -> dict[str, object]:
        self.patches.append((ns, name, patch))
        self.uids.append(uid)
        return {}


def _server(kube: StubKube, flushed: list[str] | None = None, **limits: float) -> ProgressServer:
    sink = flushed if flushed is not None else []
    return ProgressServer(kube, Metrics(), on_flushed=lambda ns, n: sink.append(n),  # type: ignore[arg-type]
                          limits=Limits(**limits))


def test_a_repeated_forged_token_costs_one_token_review_and_garbage_costs_none() -> None:
    kube = StubKube()
    server = _server(kube)
    forged = _jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10**12})
    codes = [server.authorize(forged, "ns", "a", "10.0.0.9").code for _ in range(50)]
    assert set(codes) == {401} and kube.reviews == 1
    assert server.authorize("garbage", "ns", "a", "10.0.0.9").code == 401 and kube.reviews == 1


def test_fresh_forged_tokens_are_rate_limited_per_client() -> None:
    kube = StubKube()
    server = _server(kube, client_reviews_per_second=0.001, client_reviews_burst=3)
    codes = [server.authorize(_jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10**12, "n": i}),
                              "ns", "a", "10.0.0.9").code for i in range(10)]
    assert codes == [401] * 3 + [429] * 7 and kube.reviews == 3
    # Another client (a genuine pod) still gets its token looked at.
    server.authorize(_jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10**12, "n": "pod"}), "ns", "a", "10.0.0.7")
    assert kube.reviews == 4


def test_a_flood_from_many_sources_leaves_a_quiet_source_its_reviews() -> None:
    # Eight sources flood with fresh forged tokens (each within, then over, its own budget: together far
    # over the overall one); a genuine pod's token, reviewed once and re-verified when its verdict
    # expires, must still be reviewed, not answered 429.
    kube, clock = StubKube(), Clock()
    server = ProgressServer(kube, Metrics(), monotonic=clock,  # type: ignore[arg-type]
                            limits=Limits(reviews_per_second=10, reviews_burst=20, client_reviews_per_second=2,
                                          client_reviews_burst=5, quiet_seconds=10))
    floods = [f"10.1.0.{i}" for i in range(8)]

    def flood(n: int) -> list[int]:
        return [server.authorize(_jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10**12, "n": f"{src}-{n}-{i}"}),
                                 "ns", "a", src).code for src in floods for i in range(10)]

    genuine = [server.authorize(_jwt({"aud": ["finetune.dev/progress/ns/b"], "exp": 10**12, "n": "pod"}), "ns", "b",
                                "10.2.0.7").code]
    for second in range(1, 61):
        clock.now = float(second)
        codes = flood(second)
        assert codes.count(429) >= 60  # every flooding source is held to its own budget (and the overall one)
        if second % 15 == 0:  # the pod's re-verification (a new token, as after its verdict expired)
            genuine.append(server.authorize(_jwt({"aud": ["finetune.dev/progress/ns/b"], "exp": 10**12,
                                                  "n": f"pod-{second}"}), "ns", "b", "10.2.0.7").code)
    assert genuine == [401] * 5  # reviewed every time (StubKube rejects every token): never 429
    assert kube.reviews <= 20 + 60 * 10  # the overall cap holds: burst + rate x seconds


def test_reconcile_after_a_flush_only_when_the_network_changed() -> None:
    from finetune_operator.api.status import ProgressReport

    kube, flushed = StubKube(), []
    server = _server(kube, flushed)
    report = ProgressReport.model_validate({"rank": 0, "training": {"step": 1}, "network": {"transport": "efa", "healthy": True}})
    server.accept("ns", "a", report)
    server.flush_once()
    for step in (2, 3):
        server.accept("ns", "a", ProgressReport.model_validate({"rank": 0, "training": {"step": step}}))
        server.flush_once()
    assert len(kube.patches) == 3 and flushed == ["a"]  # three status writes, one reconcile
    server.accept("ns", "a", ProgressReport.model_validate({"network": {"transport": "socket", "healthy": False}}))
    server.flush_once()
    assert flushed == ["a", "a"]


def test_progress_is_flushed_to_the_object_it_was_reported_for() -> None:
    from finetune_operator.api.status import ProgressReport

    kube = StubKube()
    current = {"uid": "uid-old"}
    server = ProgressServer(kube, Metrics(), current_uid=lambda ns, n: current["uid"])  # type: ignore[arg-type]
    server.accept("ns", "a", ProgressReport.model_validate({"rank": 0, "training": {"step": 7, "loss": 2.5}}))
    server.flush_once()
    assert kube.uids == ["uid-old"]  # the write is UID-guarded (k8s.Kube.patch_status)
    # `kubectl delete && kubectl apply`: the reconciler now sees another object under the name. Progress
    # accepted for the old one is not carried over to the new one.
    current["uid"] = "uid-new"
    server.accept("ns", "a", ProgressReport.model_validate({"rank": 0, "training": {"step": 1}}))
    server.flush_once()
    assert kube.uids == ["uid-old", "uid-new"]
    assert kube.patches[-1][2]["training"] == {"step": 1, "lastReportTime": kube.patches[-1][2]["training"]["lastReportTime"]}


class SlowKube(StubKube):
    """Status patches take a while (a round trip to a loaded API server); job `bad` gets a 500."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lock, self.active, self.most = threading.Lock(), 0, 0

    def patch_status(self, ns: str, name: str, patch: dict[str, object], uid: str | None = None,
                     has_status: bool = True, resource_version: str | None = None) -> dict[str, object]:
        import time

        from finetune_operator.controller.k8s import ApiError

        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.05)
        with self.lock:
            self.active -= 1
        if name == "bad":
            raise ApiError(500, "etcd timeout", f"patch {ns}/{name}/status")
        return super().patch_status(ns, name, patch)


def test_a_flush_patches_jobs_side_by_side_and_keeps_a_failed_one_dirty() -> None:
    from finetune_operator.api.status import ProgressReport

    kube = SlowKube()
    server = ProgressServer(kube, Metrics())  # type: ignore[arg-type]
    names = [f"j{i}" for i in range(20)] + ["bad"]
    for n in names:
        server.accept("ns", n, ProgressReport.model_validate({"rank": 0, "training": {"step": 7}}))
    assert server.flush_once() == 20
    assert sorted(n for _, n, _ in kube.patches) == sorted(names[:-1])
    assert all(p["step"] == "7" for _, _, p in kube.patches)
    assert kube.most > 1  # one after the other, 100 jobs took a flush ~15 s on a loaded dev cluster
    assert server.flush_once() == 0 and len(kube.patches) == 20  # only `bad` was still dirty, and failed again


def test_progress_is_written_on_the_leading_edge_and_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report for a job written longer than the interval ago is due at once; quicker ones wait for the
    interval, counted from when the last written report *arrived*: a write's own latency must not push
    the next one later (a trainer reporting once per interval would otherwise wait longer each time)."""
    from finetune_operator.api.status import ProgressReport
    from finetune_operator.controller import progress as progress_mod

    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    kube = StubKube()
    server = _server(kube)  # flush_interval 5 s

    def report(step: int) -> None:
        server.accept("ns", "a", ProgressReport.model_validate({"rank": 0, "training": {"step": step}}))

    report(1)
    assert server.flush_once(due_only=True) == 1  # first report: written at once
    for t, step in ((1.0, 2), (2.0, 3), (4.9, 4)):  # quicker than the interval: coalesced, not written
        clock.now = t
        report(step)
        assert server.flush_once(due_only=True) == 0
    assert server._next_due() == pytest.approx(0.1)
    clock.now = 5.0
    assert server.flush_once(due_only=True) == 1 and kube.patches[-1][2]["training"]["step"] == 4  # type: ignore[index]
    # At the interval's pace, each write late by 0.3 s (a busy API server): every report is still due on
    # arrival, the lateness does not add up.
    for n in range(1, 6):
        clock.now = 4.9 + 5.0 * n  # arrives 5 s after the one written before it
        report(10 + n)
        clock.now += 0.3  # the flusher gets to it late
        assert server.flush_once(due_only=True) == 1, n
    assert len(kube.patches) == 7
    # Each write's delay from its report's arrival is on /metrics: the five late ones 0.3 s, step 4 (arrived
    # at 4.9, written at 5.0) 0.1 s, the first 0 s.
    reg = server.metrics.registry
    assert reg.get_sample_value("finetune_progress_write_delay_seconds_count") == 7
    assert reg.get_sample_value("finetune_progress_write_delay_seconds_sum") == pytest.approx(5 * 0.3 + 0.1)
    assert reg.get_sample_value("finetune_progress_write_delay_seconds_bucket", {"le": "0.25"}) == 2


class OneHangingJob(StubKube):
    """Job `slow`'s status patch hangs (a loaded API server) until the test releases it; the others' return
    at once. `written` is the order the patches completed in."""

    def __init__(self) -> None:
        super().__init__()
        self.hanging = threading.Event()
        self.release = threading.Event()
        self.written: list[str] = []

    def patch_status(self, ns: str, name: str, patch: dict[str, object], uid: str | None = None,
                     has_status: bool = True, resource_version: str | None = None) -> dict[str, object]:
        if name == "slow":
            self.hanging.set()
            self.release.wait(60)
        self.written.append(name)
        return super().patch_status(ns, name, patch)


def test_a_slow_status_write_holds_up_only_its_own_job() -> None:
    """flush_forever hands each due job's write to the pool on its own: reports that fall due while one
    job's patch hangs are written while it still hangs (in batches they waited for the batch's slowest
    patch). Order, not time: the slow patch is released only once the others were written, or after a
    30 s guard -- then the others came after it and the test fails."""
    import asyncio

    from finetune_operator.api.status import ProgressReport

    kube = OneHangingJob()
    server = ProgressServer(kube, Metrics(), flush_interval=5.0)  # type: ignore[arg-type]
    fast = [f"fast{n}" for n in range(5)]

    def report(name: str) -> None:
        server.accept("ns", name, ProgressReport.model_validate({"rank": 0, "training": {"step": 1}}))

    async def until(check: Callable[[], bool]) -> None:
        for _ in range(3000):  # a guard against a hang (30 s), not a timing assertion
            if check():
                return
            await asyncio.sleep(0.01)

    async def run() -> list[str]:
        flusher = asyncio.create_task(server.flush_forever())
        report("slow")
        await until(kube.hanging.is_set)  # its write is under way, and hangs
        for n in fast:
            report(n)
        await until(lambda: set(fast) <= set(kube.written))
        while_hanging = list(kube.written)
        kube.release.set()
        await until(lambda: "slow" in kube.written)
        flusher.cancel()
        return while_hanging

    while_hanging = asyncio.run(run())
    assert kube.hanging.is_set()
    assert sorted(while_hanging) == fast, (while_hanging, kube.written)  # all written while `slow` hung
    assert kube.written[-1] == "slow", kube.written


# ------------------------------------------------------------------ reports are bound to the job's UID
def _owned(kind: str, name: str, uid: str, owner_kind: str, owner_name: str, owner_uid: str,
           **labels: str) -> dict[str, object]:
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": labels,
                                       "ownerReferences": [{"kind": owner_kind, "name": owner_name, "uid": owner_uid}]}}


class Incarnations(StubKube):
    """Job ns/a deleted and created again under its name: the old one's pod `old-w` is still there (its
    RayCluster and RayJob too, or already gone), the new one's pod `new-w` runs. Every token is genuine."""

    def __init__(self, old_children: bool = True) -> None:
        super().__init__()
        rayjob = "a-rayjob"
        self.objects: dict[tuple[str, str], dict[str, object]] = {
            ("pods", "new-w"): _owned("Pod", "new-w", "pod-new", "RayCluster", "a-new", "rc-new",
                                      **{"finetune.dev/job": "a", "ray.io/cluster": "a-new"}),
            ("rayclusters", "a-new"): _owned("RayCluster", "a-new", "rc-new", "RayJob", rayjob, "rj-new"),
            ("rayjobs", rayjob): _owned("RayJob", rayjob, "rj-new", "FinetuneJob", "a", "uid-new"),
            ("pods", "old-w"): _owned("Pod", "old-w", "pod-old", "RayCluster", "a-old", "rc-old",
                                      **{"finetune.dev/job": "a", "ray.io/cluster": "a-old"}),
        }
        if old_children:  # the old RayJob's name is taken by the new one: only its RayCluster can remain
            self.objects[("rayclusters", "a-old")] = _owned("RayCluster", "a-old", "rc-old", "RayJob", rayjob, "rj-old")

    def token_review(self, token: str, audiences: list[str]) -> dict[str, object]:
        self.reviews += 1
        pod = token.split(".")[2]  # these test tokens name their pod in the signature part
        return {"authenticated": True, "user": {"username": "system:serviceaccount:ns:default", "extra": {
            "authentication.kubernetes.io/pod-name": [pod], "authentication.kubernetes.io/pod-uid": [f"pod-{pod[:3]}"]}}}

    def get(self, gvr: tuple[str, str, str], ns: str, name: str) -> dict[str, object] | None:
        return self.objects.get((gvr[2], name))


class Request:
    """What ProgressServer.handle_progress reads of an aiohttp request."""

    def __init__(self, token: str, body: bytes) -> None:
        self.match_info = {"namespace": "ns", "name": "a"}
        self.headers = {"Authorization": f"Bearer {token}"}
        self.remote = "10.0.0.5"
        self._body = body

        class Content:
            async def read(_self, n: int) -> bytes:
                out, self._body = self._body[:n], self._body[n:]
                return out

        self.content = Content()


def _post(server: ProgressServer, pod: str) -> tuple[int, str]:
    import asyncio

    token = _jwt({"aud": ["finetune.dev/progress/ns/a"], "exp": 10**12}).rsplit(".", 1)[0] + f".{pod}"
    body = json.dumps({"rank": 0, "training": {"step": 3}}).encode()
    resp = asyncio.run(server.handle_progress(Request(token, body)))  # type: ignore[arg-type]
    return resp.status, json.loads(resp.body)["message"]  # type: ignore[union-attr,arg-type]


@pytest.mark.parametrize("old_rayjob, old_raycluster, code, says", [
    (True, True, 409, "report from a pod of a previous FinetuneJob ns/a (uid uid-old); the job under that name now is uid uid-new"),
    (False, True, 403, "pod old-w belongs to no FinetuneJob ns/a any more"),
    (False, False, 403, "pod old-w belongs to no FinetuneJob ns/a any more"),
], ids=["old-rayjob-still-there", "old-raycluster-left", "old-children-gone"])
def test_a_pod_of_a_deleted_job_cannot_report_into_its_same_name_successor(old_rayjob: bool, old_raycluster: bool,
                                                                           code: int, says: str) -> None:
    kube = Incarnations(old_raycluster)
    if old_rayjob:  # the new job waits for it (WaitingForPreviousChild): it has no pods yet
        kube.objects[("rayjobs", "a-rayjob")] = _owned("RayJob", "a-rayjob", "rj-old", "FinetuneJob", "a", "uid-old")
    server = ProgressServer(kube, Metrics(), current_uid=lambda ns, n: "uid-new")  # type: ignore[arg-type]
    server.ready = True
    status, message = _post(server, "old-w")
    assert status == code and message.startswith(says), message
    assert ("ns", "a") not in server.pending
    if not old_rayjob:
        assert _post(server, "new-w") == (202, "accepted")
        server.flush_once()
        assert kube.uids == ["uid-new"]


def test_a_report_is_bound_to_its_pods_job_even_before_the_reconciler_knows_the_job() -> None:
    """Just after a restart the reconciler has not seen the job yet: the write is guarded by the UID the
    pod's owners name, so the old job's progress can never land on the new object."""
    kube = Incarnations()
    kube.objects[("rayjobs", "a-rayjob")] = _owned("RayJob", "a-rayjob", "rj-old", "FinetuneJob", "a", "uid-old")
    server = ProgressServer(kube, Metrics())  # type: ignore[arg-type]
    server.ready = True
    assert _post(server, "old-w")[0] == 202
    server.flush_once()
    assert kube.uids == ["uid-old"]  # Kube.patch_status refuses it (ObjectReplaced) if ns/a is another object


@pytest.mark.parametrize("owners, fences", [
    ([], False),
    ([{"kind": "FinetuneJob", "name": "a", "uid": "uid-old"}], False),  # a previous job's under the name
    ([{"kind": "FinetuneJob", "name": "a", "uid": "uid-1"}], True),
], ids=["unowned", "previous-job", "own"])
def test_only_the_jobs_own_rayjob_names_its_current_cluster(owners: list[dict[str, str]], fences: bool) -> None:
    """The cluster a RayJob names fences off reports from every other cluster (ProgressServer.current_cluster):
    a RayJob merely labelled with the job must not shut out the real pods' reports."""
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.config import RenderConfig

    rec = Reconciler(None, RenderConfig(), {})  # type: ignore[arg-type]
    rec.uids[("ns", "a")] = "uid-1"
    rec.ray_clusters[("ns", "a")] = "a-real"
    rayjob = {"metadata": {"name": "a-copy", "uid": "rj-x", "ownerReferences": owners},
              "status": {"rayClusterName": "a-copy-xyz"}}
    rec.observe_rayjob("ns", "a", rayjob)
    assert rec.ray_clusters[("ns", "a")] == ("a-copy-xyz" if fences else "a-real")


def test_a_reconcile_records_the_cluster_of_the_jobs_own_rayjob() -> None:
    """Just after a restart the RayJob's watch event may come before the job's first reconcile (its UID not
    known yet: the event is not trusted); the reconcile, which knows the RayJob is the job's own, records it."""
    from finetune_operator.controller.k8s import FTJ
    from finetune_operator.controller.reconcile import Reconciler
    from finetune_operator.render.config import RenderConfig

    from tests.builders import JobDoc
    from tests.unit.api_server import ApiServer

    kube = ApiServer()
    rec = Reconciler(kube, RenderConfig(), {}, clock=lambda: "2026-12-05T10:00:00Z")  # type: ignore[arg-type]
    kube._put(FTJ, JobDoc("a").obj())
    rec.reconcile("ns", "a")  # creates the RayJob
    kube.objects[("rayjobs", "a")]["status"] = {"jobDeploymentStatus": "Initializing", "rayClusterName": "a-xyz"}
    rec.observe_rayjob("ns", "a", kube.objects[("rayjobs", "a")])
    rec.forget("ns", "a")  # a restarted operator: nothing known
    rec.observe_rayjob("ns", "a", kube.objects[("rayjobs", "a")])
    assert ("ns", "a") not in rec.ray_clusters
    rec.reconcile("ns", "a")
    assert rec.ray_clusters[("ns", "a")] == "a-xyz"
