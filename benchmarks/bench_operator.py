"""Operator latency and idle write volume on the local control plane (real apiserver + KubeRay).

Creates N FinetuneJobs (the seed example under different names) and measures, in one run:
  - ours:    FinetuneJob create call  -> RayJob seen by a watch      (finetune-operator)
  - KubeRay: RayJob seen              -> its RayCluster seen by a watch (KubeRay v1.6.1)
then counts API writes during an idle window: the operator's own write counter (from /metrics) and,
independently, the resourceVersions of every FinetuneJob/RayJob/ConfigMap of the run (unchanged
resourceVersion = nobody wrote it).

    .venv/bin/python benchmarks/bench_operator.py --jobs 100 --idle 60
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune_operator.devcluster import DevCluster
from kubernetes import client, config, watch

from tests.integration.operator_fixtures import OperatorProcess, example


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def watcher(api: client.ApiClient, plural: str, ns: str, seen: dict[str, float], owners: dict[str, str],
            stop: threading.Event) -> None:
    custom = client.CustomObjectsApi(api)
    w = watch.Watch()
    while not stop.is_set():
        for ev in w.stream(custom.list_namespaced_custom_object, "ray.io", "v1", ns, plural, timeout_seconds=5):
            meta = ev["object"]["metadata"]
            seen.setdefault(meta["name"], time.monotonic())
            for ref in meta.get("ownerReferences") or []:
                owners.setdefault(meta["name"], ref["name"])
            if stop.is_set():
                break


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
    ap.add_argument("--idle", type=float, default=60.0, help="idle window in seconds")
    ap.add_argument("--settle", type=float, default=20.0, help="quiet seconds before the idle window starts")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    cluster = DevCluster(work / "cluster", nodes=2, die_with_parent=True)
    t0 = time.monotonic()
    cluster.up()
    print(f"dev cluster up in {time.monotonic() - t0:.1f}s (logs: {cluster.logs_dir})")
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = "bench"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    (work / "op").mkdir()
    op = OperatorProcess(Path(cluster.kubeconfig), work / "op")
    op.start()
    stop = threading.Event()
    rj_seen: dict[str, float] = {}
    rc_seen: dict[str, float] = {}
    rc_owner: dict[str, str] = {}
    threads = [threading.Thread(target=watcher, args=(api, "rayjobs", ns, rj_seen, {}, stop), daemon=True),
               threading.Thread(target=watcher, args=(api, "rayclusters", ns, rc_seen, rc_owner, stop), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(2)
    created: dict[str, float] = {}
    doc = example("qwen2.5-1.5b-g6-efa.yaml")
    try:
        for i in range(args.jobs):
            name = f"bench-{i:03d}"
            d = dict(doc, metadata={"name": name})
            created[name] = time.monotonic()
            custom.create_namespaced_custom_object("finetune.dev", "v1alpha1", ns, "finetunejobs", d)
        deadline = time.monotonic() + 600
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
            print(f"ratio of medians (ours / KubeRay): {statistics.median(ours) / statistics.median(kuberay):.2f}")

        # Idle: wait until the operator has stopped writing for `settle` seconds, then measure.
        # (Lease renewals every 10 s are leader election, reported separately, not a sign of activity.)
        last, quiet_since = writes_from_metrics(op.metrics(), leases=False), time.monotonic()
        settle_start = quiet_since
        while time.monotonic() - quiet_since < args.settle:
            time.sleep(2)
            now = writes_from_metrics(op.metrics(), leases=False)
            if now != last:
                last, quiet_since = now, time.monotonic()
        print(f"\nsettled: no operator writes for {args.settle:.0f}s (after {time.monotonic() - settle_start:.0f}s)")
        before_w, before_rv = writes_from_metrics(op.metrics()), resource_versions(api, ns)
        time.sleep(args.idle)
        after_w, after_rv = writes_from_metrics(op.metrics()), resource_versions(api, ns)
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
            old, new = STATUSES[name][before_rv[key]], STATUSES[name][after_rv[key]]
            diff = {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "conditions"}
            conds = [(c["type"], c["status"], c["reason"], c["message"][:160]) for c in new.get("conditions", [])
                     if c not in old.get("conditions", [])]
            print(f"  {name}: {diff} changed conditions: {conds}")
    finally:
        stop.set()
        op.stop()
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
