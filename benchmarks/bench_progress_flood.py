"""The progress endpoint under a flood of forged tokens, on the local control plane.

Installs deploy/ (RBAC, admission policies), runs the operator as its ServiceAccount with leader
election, creates N FinetuneJobs, mints each one's pod-bound job-audience token (what the kubelet
mounts), then for S seconds sends R forged requests/s (plausible JWTs naming real jobs, each one new)
while every job reports once a second from another address. Prints what came back, how many
TokenReviews the operator asked for, and whether it kept its Lease.

    .venv/bin/python benchmarks/bench_progress_flood.py --jobs 20 --rate 1000 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune_devcluster import DevCluster
from kubernetes import client, config

from tests.builders import example
from tests.integration.flood import flood, lease_sampler
from tests.integration.operator_fixtures import OperatorProcess, pod_token, service_account_kubeconfig

LEASE_NS = "finetune-system"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def reviews(op: OperatorProcess) -> float:
    m = re.search(r"^finetune_progress_token_reviews_total ([0-9.e+]+)$", op.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--rate", type=float, default=1000.0, help="forged requests per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-flood-"))
    cluster = DevCluster(work / "cluster", nodes=2, die_with_parent=True)
    cluster.up()
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    coordination = client.CoordinationV1Api(api)
    ns = "flood"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    (work / "op").mkdir()
    sa = service_account_kubeconfig(Path(cluster.kubeconfig), work / "sa-kubeconfig")
    op = OperatorProcess(sa, work / "op", lease_namespace=LEASE_NS)
    op.start()
    try:
        doc = example("qwen2.5-1.5b-g6-efa.yaml")
        names = [f"job-{i:02d}" for i in range(args.jobs)]
        for n in names:
            custom.create_namespaced_custom_object("finetune.dev", "v1alpha1", ns, "finetunejobs", dict(doc, metadata={"name": n}))
        jobs = []
        deadline = time.monotonic() + 300
        for n in names:
            while True:  # any pod of the job (head or worker) carries the job label and a token
                pods = core.list_namespaced_pod(ns, label_selector=f"finetune.dev/job={n}").items
                if pods or time.monotonic() > deadline:
                    break
                time.sleep(1)
            if not pods:
                print(f"no pod for {n} after 300 s; see {cluster.logs_dir}")
                return 1
            pod = pods[0]
            jobs.append((ns, n, pod_token(core, ns, pod, f"finetune.dev/progress/{ns}/{n}", 3600)))
        samples: list[tuple[float, str, str]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=lease_sampler, args=(
            lambda: coordination.read_namespaced_lease("finetune-operator-leader", LEASE_NS), stop, samples))
        before = reviews(op)
        sampler.start()
        result = asyncio.run(flood(op.url, jobs, args.rate, args.seconds))
        stop.set()
        sampler.join()
        made = reviews(op) - before
        print(f"\n{args.jobs} jobs reporting every 1 s; forged {args.rate:.0f}/s asked for {args.seconds:.0f} s "
              f"(took {result.seconds:.1f} s)")
        print(f"forged:  sent {result.forged_sent} ({result.forged_sent / result.seconds:.0f}/s achieved), "
              f"answers {dict(result.forged)}, latency p50 {statistics.median(result.forged_latency):.3f} s "
              f"p99 {pct(result.forged_latency, 0.99):.3f} s")
        print(f"genuine: sent {result.genuine_sent}, answers {dict(result.genuine)}, "
              f"latency p50 {statistics.median(result.genuine_latency):.3f} s p99 {pct(result.genuine_latency, 0.99):.3f} s")
        print(f"TokenReviews asked for: {made:.0f} (without the defences: about {result.forged_sent + len(jobs)})")
        holders = {h for _, h, _ in samples}
        renewals = len({r for _, _, r in samples})
        print(f"Lease holder(s) during the flood: {sorted(holders)}; distinct renewTimes sampled: {renewals}; "
              f"operator alive: {op.proc is not None and op.proc.poll() is None}, /readyz {op.readyz()}")
        time.sleep(3)  # one flush interval (1 s) and then some
        landed = 0
        for _, n, _ in jobs:
            st = custom.get_namespaced_custom_object("finetune.dev", "v1alpha1", ns, "finetunejobs", n).get("status") or {}
            landed += int((st.get("training") or {}).get("step") == result.last_step.get(f"{ns}/{n}"))
        print(f"jobs whose status shows their last genuine step: {landed}/{len(jobs)}")
    finally:
        op.stop()
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
