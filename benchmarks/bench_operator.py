"""Operator latency, cost and idle write volume on the local control plane (real apiserver + KubeRay).

Installs deploy/ (RBAC, admission policies) and runs the operator as its ServiceAccount, with the
apiserver writing an audit log of that ServiceAccount's requests. Creates N FinetuneJobs (the seed
example under different names) and measures, in one run:
  - ours:    FinetuneJob create call  -> RayJob seen by a watch      (finetune-operator)
  - KubeRay: RayJob seen              -> its RayCluster seen by a watch (KubeRay v1.6.1)
  - API requests per job, from the apiserver's audit log (not the operator's own counters): all of the
    operator's requests while the jobs were created and settled, divided by N, and, for the jobs that
    reached Running (as many as the `--nodes` GPU nodes hold), the requests naming the job or its children
    until it was Running, plus its share of the requests naming no job (lists, Events, TokenReviews)
  - the operator's RSS with N jobs, and etcd bytes per job (current values under the run's namespace,
    read from etcd itself, by resource)
then counts API writes during an idle window: the operator's own write counter (from /metrics) and,
independently, the resourceVersions of every FinetuneJob/RayJob/ConfigMap of the run (unchanged
resourceVersion = nobody wrote it); and last, `--reporting` jobs post progress every `--report-every`
seconds (default 5, the runtime's own pace) with pod-bound tokens, and a watch times each POST until a
read of the FinetuneJob shows that step or a later one.

    .venv/bin/python benchmarks/bench_operator.py --jobs 1000 --idle 60 --reporting 100
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune_devcluster import DevCluster
from kubernetes import client, config, watch

from tests.builders import example
from tests.integration.conftest import RayDashboardStandIn
from tests.integration.operator_fixtures import OperatorProcess, pod_token, service_account_kubeconfig

OPERATOR_USER = "system:serviceaccount:finetune-system:finetune-operator"
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
# An Event's name is generated: its body (involvedObject) says which job it is about.
- level: Request
  users: ["{OPERATOR_USER}"]
  resources: [{{group: "", resources: ["events"]}}]
- level: Metadata
  users: ["{OPERATOR_USER}"]
- level: None
"""


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def watcher(api: client.ApiClient, plural: str, ns: str, seen: dict[str, float], owners: dict[str, str],
            stop: threading.Event) -> None:
    custom = client.CustomObjectsApi(api)
    w = watch.Watch()
    while not stop.is_set():
        try:
            for ev in w.stream(custom.list_namespaced_custom_object, "ray.io", "v1", ns, plural, timeout_seconds=5):
                meta = ev["object"]["metadata"]
                seen.setdefault(meta["name"], time.monotonic())
                for ref in meta.get("ownerReferences") or []:
                    owners.setdefault(meta["name"], ref["name"])
                if stop.is_set():
                    break
        except Exception as e:  # a dropped watch is restarted; the benchmark goes on
            print(f"{plural} watch restarted: {e}")


def ftj_watcher(api: client.ApiClient, ns: str, running: dict[str, float], steps: dict[tuple[str, int], float],
                stop: threading.Event) -> None:
    """Wall-clock time each job was first seen Running; monotonic time each (job, step) was first seen."""
    custom = client.CustomObjectsApi(api)
    w = watch.Watch()
    while not stop.is_set():
        try:
            for ev in w.stream(custom.list_namespaced_custom_object, "finetune.dev", "v1alpha1", ns, "finetunejobs",
                               timeout_seconds=5):
                obj, now = ev["object"], time.monotonic()
                st = obj.get("status") or {}
                name = obj["metadata"]["name"]
                if st.get("phase") == "Running":
                    running.setdefault(name, time.time())
                step = (st.get("training") or {}).get("step")
                if isinstance(step, int):
                    steps.setdefault((name, step), now)
                if stop.is_set():
                    break
        except Exception as e:  # a dropped watch is restarted; the benchmark goes on
            print(f"finetunejobs watch restarted: {e}")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def etcd_bytes(etcd_url: str, ns: str) -> dict[str, int]:
    """Bytes of the current values stored in etcd under `ns`, by resource (key /registry/<res>/<ns>/<name>)."""
    def b64(x: str) -> str:
        return base64.b64encode(x.encode()).decode()

    out: dict[str, int] = {}
    body = json.dumps({"key": b64("/registry/"), "range_end": b64("/registry0")}).encode()
    req = urllib.request.Request(f"{etcd_url}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        kvs = json.loads(r.read()).get("kvs") or []
    for kv in kvs:
        parts = base64.b64decode(kv["key"]).decode().split("/")
        if ns in parts[2:-1]:
            res = "/".join(parts[2:parts.index(ns, 2)])
            out[res] = out.get(res, 0) + len(base64.b64decode(kv.get("value", "")))
    return out


def audit_events(path: Path, since: float, until: float) -> list[dict[str, Any]]:
    events = []
    with path.open() as f:
        for line in f:
            ev = json.loads(line)
            t = datetime.fromisoformat(ev["requestReceivedTimestamp"]).timestamp()
            if since <= t <= until and ev.get("user", {}).get("username") == OPERATOR_USER:
                ev["_t"] = t
                events.append(ev)
    return events


def job_of(ev: dict[str, Any], names: set[str]) -> str | None:
    name = (ev.get("objectRef") or {}).get("name") or ""
    if not name and (ev.get("objectRef") or {}).get("resource") == "events":
        name = ((ev.get("requestObject") or {}).get("involvedObject") or {}).get("name") or ""
    if name in names:
        return str(name)
    base = name.rsplit("-", 1)[0]  # <job>-config, <job>-head-xxxxx, ... (job names here have no suffix clash)
    while base and base not in names and "-" in base:
        base = base.rsplit("-", 1)[0]
    return base if base in names else None


def kind_of(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef") or {}
    return f"{ev['verb']} {ref.get('resource', '?')}{'/' + ref['subresource'] if ref.get('subresource') else ''}"


async def report_progress(base_url: str, jobs: list[tuple[str, str, str]], seconds: float,
                          posted: dict[tuple[str, int], float], codes: dict[int, int], every: float = 5.0) -> None:
    """Each job posts every `every` seconds (the runtime's pace: training/finetune_training/progress.py
    posts at most once per 5 s), the jobs spread over the first interval as independent trainers are, from a
    loopback address of its own (pods have addresses of their own; the endpoint rate-limits TokenReviews
    per client address)."""
    deadline = time.monotonic() + seconds

    async def one(i: int, ns: str, name: str, token: str) -> None:
        connector = aiohttp.TCPConnector(limit=1, local_addr=(f"127.1.{i // 250}.{i % 250 + 1}", 0))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=connector) as session:
            step = 0
            await asyncio.sleep(every * i / max(1, len(jobs)))
            while time.monotonic() < deadline:
                step += 1
                started = time.monotonic()
                async with session.post(f"{base_url}/v1/progress/{ns}/{name}",
                                        json={"rank": 0, "training": {"step": step, "totalSteps": 100000, "loss": 1.0}},
                                        headers={"Authorization": f"Bearer {token}"}) as resp:
                    await resp.read()
                codes[resp.status] = codes.get(resp.status, 0) + 1
                if resp.status == 202:
                    posted[(name, step)] = started
                await asyncio.sleep(max(0.0, every - (time.monotonic() - started)))

    await asyncio.gather(*(one(i, *j) for i, j in enumerate(jobs)))


def histogram(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (inf included) from a /metrics text."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = re.match(rf'{name}_bucket\{{le="([^"]+)"\}} ([0-9.e+]+)', line)
        if m:
            out[float(m.group(1))] = float(m.group(2))
    return out


def bucket_quantile(cumulative: dict[float, float], q: float) -> float:
    """The smallest bucket bound that holds at least a fraction q of the observations."""
    total = cumulative.get(float("inf"), 0.0)
    for le in sorted(cumulative):
        if cumulative[le] >= q * total:
            return le
    return float("inf")


def writes_from_metrics(text: str, leases: bool = True) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r'finetune_api_writes_total\{kind="([^"]+)",verb="([^"]+)"\} ([0-9.e+]+)', line)
        if m and (leases or m.group(1) != "Lease"):
            out[f"{m.group(2)} {m.group(1)}"] = float(m.group(3))
    return out


STATUSES: dict[str, dict[str, Any]] = {}


def resource_versions(api: client.ApiClient, ns: str) -> dict[str, str]:
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    rv = {}
    for o in custom.list_namespaced_custom_object("finetune.dev", "v1alpha1", ns, "finetunejobs")["items"]:
        rv[f"finetunejobs/{o['metadata']['name']}"] = o["metadata"]["resourceVersion"]
        STATUSES.setdefault(o["metadata"]["name"], {})[o["metadata"]["resourceVersion"]] = o.get("status") or {}
    # KubeRay writes RayJob status all the time; only a spec write (ours) bumps the generation.
    for o in custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]:
        rv[f"rayjobs/{o['metadata']['name']}#generation"] = str(o["metadata"].get("generation"))
    for cm in core.list_namespaced_config_map(ns, label_selector="finetune.dev/job").items:
        rv[f"configmaps/{cm.metadata.name}"] = cm.metadata.resource_version
    return rv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=20, help="GPU nodes (g6.12xlarge); each Running job takes 2")
    ap.add_argument("--idle", type=float, default=60.0, help="idle window in seconds")
    ap.add_argument("--settle", type=float, default=20.0, help="quiet seconds before the idle window starts")
    ap.add_argument("--reporting", type=int, default=100, help="jobs posting progress for the status latency")
    ap.add_argument("--report-seconds", type=float, default=30.0)
    ap.add_argument("--trace-memory", action="store_true",
                    help="run the operator under tracemalloc and print where its memory is once settled (slower)")
    ap.add_argument("--flush-interval", type=float, default=5.0, help="the operator's --flush-interval (its default: 5)")
    ap.add_argument("--report-every", type=float, default=5.0,
                    help="seconds between one job's progress POSTs (the runtime posts at most every 5 s)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    (work / "audit-policy.yaml").write_text(AUDIT_POLICY)
    audit_log = work / "audit.log"
    cluster = DevCluster(work / "cluster", nodes=args.nodes, die_with_parent=True, apiserver_args=[
        f"--audit-policy-file={work / 'audit-policy.yaml'}", f"--audit-log-path={audit_log}"])
    t0 = time.monotonic()
    cluster.up()
    print(f"dev cluster up in {time.monotonic() - t0:.1f}s (logs: {cluster.logs_dir})")
    # kwok pods run no Ray: the stand-in answers for the Ray dashboard (jobStatus RUNNING once KubeRay's
    # submitter exists), as in the integration tests, so that jobs reach Running. Its requests are the
    # admin's, not the operator's ServiceAccount's: the audit counts below do not include them.
    RayDashboardStandIn(Path(cluster.kubeconfig)).__enter__()
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = "bench"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    (work / "op").mkdir()
    sa = service_account_kubeconfig(Path(cluster.kubeconfig), work / "sa-kubeconfig")
    # The operator as deployed: the Deployment's flush and resync intervals (the test fixture's are shorter)
    # and the image's malloc setting (Dockerfile.operator).
    env = {"MALLOC_ARENA_MAX": "2", **({"PYTHONTRACEMALLOC": "12"} if args.trace_memory else {})}
    op = OperatorProcess(sa, work / "op", lease_namespace="finetune-system", extra_env=env,
                         extra_args=["--flush-interval", str(args.flush_interval), "--resync-interval", "120"])
    op.start()
    stop = threading.Event()
    rj_seen: dict[str, float] = {}
    rc_seen: dict[str, float] = {}
    rc_owner: dict[str, str] = {}
    running: dict[str, float] = {}
    steps_seen: dict[tuple[str, int], float] = {}
    threads = [threading.Thread(target=watcher, args=(api, "rayjobs", ns, rj_seen, {}, stop), daemon=True),
               threading.Thread(target=watcher, args=(api, "rayclusters", ns, rc_seen, rc_owner, stop), daemon=True),
               threading.Thread(target=ftj_watcher, args=(api, ns, running, steps_seen, stop), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(2)
    assert op.proc is not None
    rss_idle = rss_mib(op.proc.pid)
    rss_peak = [rss_idle]

    def sample_rss() -> None:
        while not stop.is_set() and op.proc is not None:
            try:
                rss_peak[0] = max(rss_peak[0], rss_mib(op.proc.pid))
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=sample_rss, daemon=True).start()
    created: dict[str, float] = {}
    created_wall: dict[str, float] = {}
    doc = example("qwen2.5-1.5b-g6-efa.yaml")
    try:
        run_start = time.time() - 1
        for i in range(args.jobs):
            name = f"bench-{i:04d}"
            d = dict(doc, metadata={"name": name})
            created[name], created_wall[name] = time.monotonic(), time.time()
            custom.create_namespaced_custom_object("finetune.dev", "v1alpha1", ns, "finetunejobs", d)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and (len(rj_seen) < args.jobs or len(rc_seen) < args.jobs):
            time.sleep(0.5)
        ours = [rj_seen[n] - created[n] for n in created if n in rj_seen]
        kuberay = [rc_seen[c] - rj_seen[o] for c, o in rc_owner.items() if o in rj_seen]
        print(f"\n{args.jobs} FinetuneJobs created in {max(created.values()) - min(created.values()):.1f}s")
        print(f"{'step':<42} {'n':>4} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
        for label, vals in (("finetune-operator: FTJ create -> RayJob", ours),
                            ("KubeRay: RayJob -> RayCluster", kuberay)):
            if vals:
                print(f"{label:<42} {len(vals):>4} {statistics.median(vals):>8.3f} {pct(vals, 0.99):>8.3f} {max(vals):>8.3f}")
        if ours and kuberay:
            print(f"ratio of medians (ours / KubeRay): {statistics.median(ours) / statistics.median(kuberay):.2f}; "
                  f"of p99s: {pct(ours, 0.99) / pct(kuberay, 0.99):.2f}")

        # Idle: wait until the operator has stopped writing, and KubeRay has stopped creating pods, for
        # `settle` seconds, then measure. (Lease renewals every 10 s are leader election, reported
        # separately, not a sign of activity.) Without the pod count, a 1000-job run settled while KubeRay
        # was still creating Ray pods, and the status latency measured that load.
        def activity() -> tuple[Any, int]:
            return (writes_from_metrics(op.metrics(), leases=False),
                    len(core.list_namespaced_pod(ns, label_selector="finetune.dev/job").items))
        last, quiet_since = activity(), time.monotonic()
        settle_start = quiet_since
        while time.monotonic() - quiet_since < args.settle:
            time.sleep(2)
            now = activity()
            if now != last:
                last, quiet_since = now, time.monotonic()
        print(f"\nsettled: no operator writes and no new Ray pods ({last[1]}) for {args.settle:.0f}s "
              f"(after {time.monotonic() - settle_start:.0f}s)")
        settled = time.time()
        assert op.proc is not None
        print(f"operator RSS with {args.jobs} jobs: {rss_mib(op.proc.pid):.0f} MiB (before the first job: "
              f"{rss_idle:.0f} MiB; highest while they were created and settled: {rss_peak[0]:.0f} MiB)")
        if args.trace_memory:
            logs = sorted((work / "op").glob("operator-*.log"))
            mark = logs[-1].stat().st_size
            os.kill(op.proc.pid, signal.SIGUSR2)
            time.sleep(10)
            with logs[-1].open() as f:
                f.seek(mark)
                print(f.read()[-12000:])
        per_res = etcd_bytes(f"http://127.0.0.1:{cluster.port('etcd')}", ns)
        ours_res = ("finetune.dev/finetunejobs", "ray.io/rayjobs", "configmaps", "events")
        print(f"etcd bytes per job: {sum(per_res.values()) / args.jobs:.0f} in all, "
              f"{sum(v for k, v in per_res.items() if k in ours_res) / args.jobs:.0f} in FinetuneJob + RayJob + "
              f"ConfigMaps + Events; by resource: "
              f"{ {k: round(v / args.jobs) for k, v in sorted(per_res.items(), key=lambda kv: -kv[1])} }")

        events = [e for e in audit_events(audit_log, run_start, settled)
                  if (e.get("objectRef") or {}).get("resource") != "leases"]
        not_watch = [e for e in events if e["verb"] != "watch"]
        by_kind: dict[str, int] = {}
        for e in not_watch:
            by_kind[kind_of(e)] = by_kind.get(kind_of(e), 0) + 1
        print(f"operator API requests (audit log, Leases and watches left out) from the first create until settled: "
              f"{len(not_watch)} = {len(not_watch) / args.jobs:.2f} per job; "
              f"{ {k: v for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])} }; watch requests: "
              f"{len(events) - len(not_watch)}")
        names = set(created)
        unattributed = sum(1 for e in not_watch if job_of(e, names) is None)
        per_job: list[float] = []
        kinds: dict[str, int] = {}
        for n, t_run in running.items():
            mine = [e for e in not_watch if job_of(e, names) == n and e["_t"] <= t_run]
            for e in mine:
                kinds[kind_of(e)] = kinds.get(kind_of(e), 0) + 1
            per_job.append(len(mine) + unattributed / args.jobs)
        if per_job:
            print(f"API requests to reach Running ({len(per_job)} jobs Running on {args.nodes} nodes): median "
                  f"{statistics.median(per_job):.2f}, max {max(per_job):.2f} per job (naming the job or its children, "
                  f"plus {unattributed / args.jobs:.2f} per job naming none); naming the job, in all: "
                  f"{ {k: v for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])} }")
        else:
            print("API requests to reach Running: no job reached Running")

        # The metric windows are exactly `idle` long; the resourceVersion lists (3000 objects, seconds under
        # load) are taken outside them (inside, a 60 s window read 8 Lease renewals where the audit had 6).
        before_rv = resource_versions(api, ns)
        before_w = writes_from_metrics(op.metrics())
        time.sleep(args.idle)
        after_w = writes_from_metrics(op.metrics())
        after_rv = resource_versions(api, ns)
        delta = {k: after_w.get(k, 0) - before_w.get(k, 0) for k in set(after_w) | set(before_w)}
        non_lease = {k: v for k, v in delta.items() if v and not k.endswith("Lease")}
        lease = {k: v for k, v in delta.items() if v and k.endswith("Lease")}
        changed = [k for k in before_rv if after_rv.get(k) != before_rv[k]]
        print(f"\nidle {args.idle:.0f}s: operator writes to jobs/children/status/events = {int(sum(non_lease.values()))} "
              f"{non_lease or ''}")
        print(f"idle {args.idle:.0f}s: leader-election Lease renewals = {int(sum(lease.values()))}")
        print(f"idle {args.idle:.0f}s: objects whose resourceVersion changed = {len(changed)} of {len(before_rv)}"
              f" (FTJ resourceVersion, ConfigMap resourceVersion, RayJob generation) {changed[:5]}")
        for key in changed[:3]:  # what changed, so a write during the idle window can be explained
            name = key.split("/", 1)[1]
            if name not in STATUSES:
                continue
            old, new = STATUSES[name][before_rv[key]], STATUSES[name][after_rv[key]]
            diff = {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "conditions"}
            conds = [(c["type"], c["status"], c["reason"], c["message"][:160]) for c in new.get("conditions", [])
                     if c not in old.get("conditions", [])]
            print(f"  {name}: {diff} changed conditions: {conds}")

        if args.reporting:
            reporters = []
            for n in sorted(created)[:args.reporting]:
                pods = core.list_namespaced_pod(ns, label_selector=f"finetune.dev/job={n}").items
                if not pods:
                    continue
                pod = pods[0]
                reporters.append((ns, n, pod_token(core, ns, pod, f"finetune.dev/progress/{ns}/{n}", 3600)))
            posted: dict[tuple[str, int], float] = {}
            codes: dict[int, int] = {}
            delay_before = histogram(op.metrics(), "finetune_progress_write_delay_seconds")
            asyncio.run(report_progress(op.url, reporters, args.report_seconds, posted, codes, args.report_every))
            time.sleep(max(5.0, args.report_every))
            delay_after = histogram(op.metrics(), "finetune_progress_write_delay_seconds")
            delay = {le: n - delay_before.get(le, 0.0) for le, n in delay_after.items()}
            lat = [steps_seen[k] - t for k, t in posted.items() if k in steps_seen]
            # Freshness: for every POST, until a read shows that step or a later one (a step overtaken by the
            # next before it was written counts with the time the later one showed).
            seen_by_job: dict[str, list[tuple[int, float]]] = {}
            for (n, st), t_seen in steps_seen.items():
                seen_by_job.setdefault(n, []).append((st, t_seen))
            fresh = []
            for (n, st), t in posted.items():
                later = [t_seen for s2, t_seen in seen_by_job.get(n, []) if s2 >= st]
                if later:
                    fresh.append(min(later) - t)
            shown_last = sum(1 for _, n, _ in reporters if (n, max(s for m, s in posted if m == n)) in steps_seen) \
                if posted else 0
            print(f"\nstatus latency, progress POST -> FinetuneJob read shows it, {len(reporters)} jobs each reporting "
                  f"every {args.report_every:g} s for {args.report_seconds:.0f} s: answers {codes}; "
                  f"last step shown for {shown_last}/{len(reporters)} jobs")
            if fresh:
                print(f"  that step or a later one, all {len(fresh)} of {len(posted)} POSTs: p50 {statistics.median(fresh):.3f} s"
                      f"  p99 {pct(fresh, 0.99):.3f} s  max {max(fresh):.3f} s")
            if lat:
                print(f"  that very step ({len(lat)} of {len(posted)} shown): p50 {statistics.median(lat):.3f} s  "
                      f"p99 {pct(lat, 0.99):.3f} s  max {max(lat):.3f} s")
            if delay.get(float("inf")):
                print(f"  the operator's share (report arrival -> status write answered, its histogram): "
                      f"{delay[float('inf')]:.0f} writes, p50 <= {bucket_quantile(delay, 0.5):g} s, "
                      f"p99 <= {bucket_quantile(delay, 0.99):g} s")
    finally:
        stop.set()
        op.stop()
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
