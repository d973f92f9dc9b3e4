"""The product path end to end, for real, on CPU: ``kubectl apply -f examples/local-cluster.yaml`` ->
the operator -> RayJob -> KubeRay -> real Ray head and worker pods on the dev cluster's real node (containerd,
runc, kubelet) -> KubeRay's submitter -> ``python3 -m finetune_training`` -> Ray Train workers -> FSDP over gloo
-> progress in the FinetuneJob's status -> phase Succeeded -> the exported model on the PersistentVolume.

Nothing is simulated on this path: the images are built on this machine (the Ray image carries the Ray
Train DLC's Python stack; the operator image is ``Dockerfile.operator`` built by buildah), the operator runs
in the cluster as production runs it, installed by real helm from the chart in ``deploy/helm`` with its
defaults (two replicas on the pod network, one leading by Lease; RollingUpdate; in-cluster config through the
``kubernetes`` Service; RBAC, admission policies, Service; values ``demo.chart_values`` set only the local
images and the node; ``make demo-cluster`` installs the same objects with kustomize from
``deploy/``, and tests/deploy/test_helm_chart.py proves chart and kustomize render the same), the training code
reaches the Ray pods through the runtime ConfigMap, the model and data through the ``pvc://`` claim, and
progress through the projected-token channel and the operator's Service. The steps are the ones
``make demo-cluster`` runs (``finetune_devcluster.demo``).

Cost (2-core machine): see docs/dev-cluster.md ("End to end").
"""

from __future__ import annotations

import math
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_devcluster import DevCluster, DevClusterError, demo, realnode
from finetune_operator.render.rayjob import JOB_LABEL
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from .conftest import RealNodeCluster, create_namespace, wait_for

pytestmark = [pytest.mark.real_node, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = demo.EXAMPLE
G, V, P = "finetune.dev", "v1alpha1", "finetunejobs"


@dataclass
class E2E:
    cluster: DevCluster
    kubeconfig: Path
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    timings: dict[str, float]


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    return demo.kubectl(kubeconfig, *args, stdin=stdin)


@pytest.fixture(scope="module")
def real(real_node_cluster: RealNodeCluster, helm: Path) -> Iterator[E2E]:
    timings: dict[str, float] = {}
    cluster = real_node_cluster.cluster
    try:
        timings.update(demo.import_images(cluster))
        t0 = time.monotonic()
        demo.install_operator(cluster, helm=helm)
        timings["operator from the Helm chart leading"] = time.monotonic() - t0
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        yield E2E(cluster, Path(cluster.kubeconfig), client.CoreV1Api(api), client.CustomObjectsApi(api), timings)
    finally:
        print("e2e timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))


@pytest.fixture
def ns(real: E2E) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    create_namespace(real.core, name)
    yield name
    real.core.delete_namespace(name)


def diagnose(real: E2E, ns: str) -> str:
    """What to look at when the job does not succeed: pods, the RayJob's status, the last log lines."""
    out = [kubectl(real.kubeconfig, "get", "pods,rayjobs,rayclusters,ftj", "-n", ns, "-o", "wide")]
    try:
        out.append(kubectl(real.kubeconfig, "get", "rayjobs", "-n", ns, "-o", "jsonpath={.items[*].status}"))
    except DevClusterError as e:
        out.append(str(e))
    for pod in real.core.list_namespaced_pod(ns).items:
        for c in pod.spec.containers:
            try:
                log = real.core.read_namespaced_pod_log(pod.metadata.name, ns, container=c.name, tail_lines=40)
            except ApiException as e:
                log = f"(no logs: {e.reason})"
            out.append(f"--- {pod.metadata.name}/{c.name} ({pod.status.phase}):\n{log}")
    try:
        out.append("--- operator:\n" + kubectl(real.kubeconfig, "-n", demo.OPERATOR_NAMESPACE, "logs",
                                                 f"deployment/{demo.OPERATOR_NAME}", "--tail=60"))
    except DevClusterError as e:
        out.append(str(e))
    out.append(f"component logs: {real.cluster.logs_dir}")
    return "\n".join(out)


@pytest.mark.timeout(3600)
def test_local_cluster_example_trains_for_real_and_exports_a_loadable_model(real: E2E, ns: str) -> None:
    host = demo.prepare_claim(real.cluster, ns)
    doc = yaml.safe_load(EXAMPLE.read_text())
    name = doc["metadata"]["name"]
    total = int(doc["spec"]["training"]["maxSteps"])
    start = time.monotonic()
    kubectl(real.kubeconfig, "apply", "-n", ns, "-f", str(EXAMPLE))

    losses: dict[int, float] = {}  # step -> loss, as the status showed them while training
    pod_nodes: dict[str, str] = {}  # Ray pods and the node they ran on
    first_step_at: list[float] = []

    def finished() -> str | None:
        ftj: dict[str, Any] = real.custom.get_namespaced_custom_object(G, V, ns, P, name)
        status = ftj.get("status") or {}
        tr = status.get("training") or {}
        if tr.get("step") is not None and tr.get("loss") is not None:
            losses.setdefault(int(tr["step"]), float(tr["loss"]))
            if not first_step_at:
                first_step_at.append(time.monotonic() - start)
        for pod in real.core.list_namespaced_pod(ns, label_selector="ray.io/cluster").items:
            if pod.spec.node_name:
                pod_nodes[pod.metadata.name] = pod.spec.node_name
        phase = status.get("phase")
        if phase == "Failed":
            pytest.fail(f"FinetuneJob failed: {status.get('message')}\n{diagnose(real, ns)}")
        return phase if phase == "Succeeded" else None

    try:
        wait_for(f"FinetuneJob {name} Succeeded", finished, timeout=1800, interval=2)
    except pytest.fail.Exception:
        print(diagnose(real, ns))
        raise
    elapsed = time.monotonic() - start
    real.timings["apply -> Succeeded"] = elapsed
    if first_step_at:
        real.timings["apply -> first progress"] = first_step_at[0]

    ftj = real.custom.get_namespaced_custom_object(G, V, ns, P, name)
    status = ftj["status"]
    tr = status["training"]
    # Progress reached the status through the pods' channel: all steps, a finite loss that went down.
    assert status["step"] == f"{total}/{total}", status
    assert tr["step"] == tr["totalSteps"] == total, tr
    assert math.isfinite(tr["loss"]) and tr["loss"] > 0, tr
    early = min(losses)
    assert early < total, f"no progress seen before the last step: {losses}"
    assert tr["loss"] < losses[early], f"loss did not go down: step {early} {losses[early]} -> {tr['loss']}"
    # CPU workers talk gloo; the network probe said so.
    assert status["network"]["transport"] == "gloo", status.get("network")
    assert any(c["type"] == "NetworkHealthy" for c in status.get("conditions", [])), status.get("conditions")
    # The Ray head and both workers really ran on the real node.
    assert len(pod_nodes) >= 3 and set(pod_nodes.values()) == {realnode.NODE_NAME}, pod_nodes

    # The export is on the PV (written by rank 0 inside a worker pod) and loads with from_pretrained.
    final = host / "runs" / "local-cluster" / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file(), sorted(final.parent.rglob("*"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok("12+30=", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert torch.isfinite(logits).all()
    base = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "models" / "tiny-qwen2")
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed, "the exported weights equal the base model's: nothing was trained"


# ---------------------------------------------------------------- faults on the real node (issue 8, 2-4)


def apply_variant(real: E2E, ns: str, name: str, max_steps: int) -> dict[str, Any]:
    """examples/local-cluster.yaml under another name, with its own checkpoint directory and more steps
    (~0.75 s each here), so that the test can act between two checkpoints."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"]["maxSteps"] = max_steps
    doc["spec"]["training"]["checkpoint"]["storageUri"] = f"pvc://{demo.CLAIM}/runs/{name}"
    kubectl(real.kubeconfig, "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc))
    return doc


def ftj_status(real: E2E, ns: str, name: str) -> dict[str, Any]:
    ftj: dict[str, Any] = real.custom.get_namespaced_custom_object(G, V, ns, P, name)
    status: dict[str, Any] = ftj.get("status") or {}
    if status.get("phase") == "Failed":
        pytest.fail(f"FinetuneJob {name} failed: {status.get('message')}\n{diagnose(real, ns)}")
    return status


def checkpoint_step(real: E2E, ns: str, name: str) -> int:
    return int((ftj_status(real, ns, name).get("training") or {}).get("lastCheckpointStep") or 0)


def job_log(real: E2E, ns: str) -> str:
    """What the Ray job printed so far: KubeRay's submitter pod follows the driver's log, which carries the
    Ray Train workers' output (rank 0 says `resuming from step N`)."""
    out = []
    for pod in real.core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=submitter").items:
        try:
            out.append(real.core.read_namespaced_pod_log(pod.metadata.name, ns))
        except ApiException:
            pass
    return "\n".join(out)


def resumed_steps(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"resuming from step (\d+)", log)]


def node_containers(real: E2E, ns: str) -> list[str]:
    """The node's containerd containers of the pods in namespace ``ns`` (CRI labels them with it)."""
    out = real.cluster.node.ctr(realnode.node_binaries(), "containers", "ls", "-q",
                                f"labels.\"io.kubernetes.pod.namespace\"=={ns}")
    return out.stdout.split()


@pytest.mark.timeout(3600)
def test_a_killed_worker_and_a_suspend_resume_from_the_last_checkpoint_then_a_delete_leaves_nothing(
        real: E2E, ns: str) -> None:
    """Issue 8, points 2, 4 and 3, on one job: SIGKILL a worker container after the first checkpoint (kubelet
    restarts it, Ray Train restarts its worker group from that checkpoint), then suspend after a later
    checkpoint (the Ray cluster is released) and resume (a new Ray cluster continues from it); then delete
    the job while it runs: nothing of it is left."""
    demo.prepare_claim(real.cluster, ns)
    name, total = "local-faults", 400  # never reached: the job is deleted mid-run (step 4)
    apply_variant(real, ns, name, total)

    # 1. A worker container is killed (SIGKILL to its task in containerd) once a checkpoint exists.
    wait_for("the first checkpoint", lambda: checkpoint_step(real, ns, name) >= 10, timeout=1200, interval=1)
    # The victim must host a training worker: Ray may place one on the head and the other on whichever
    # worker pod was up first, leaving a late one idle (a CI run killed such an idle pod, training never
    # noticed, and the test waited for a resume that could not come). Ray prefixes a training worker's
    # output on another node with that node's IP.
    # Ray Train's controller lists its group (`- (ip=..., pid=...) world_rank=...`) before the first step; a
    # worker's own output carries the `ip=` prefix only once it has printed something, which may reach the
    # driver's log after the first checkpoint was seen (a cold CI-like run read the log too early: no IPs).
    def hosting() -> list[Any]:
        log = job_log(real, ns)
        ips = set(re.findall(r"RayTrainWorker pid=\d+, ip=([0-9.]+)", log))
        ips |= set(re.findall(r"\(ip=([0-9.]+), pid=\d+\) world_rank=", log))
        return [p for p in real.core.list_namespaced_pod(ns, label_selector="ray.io/node-type=worker").items
                if p.status.pod_ip in ips]

    workers = wait_for("a worker pod that hosts a training worker", hosting, timeout=60, interval=2)
    assert isinstance(workers, list) and workers, diagnose(real, ns)
    victim = workers[0]
    cid = victim.status.container_statuses[0].container_id.split("://", 1)[1]
    real.cluster.node.ctr(realnode.node_binaries(), "tasks", "kill", "--signal", "SIGKILL", cid)
    ckpt_at_kill = checkpoint_step(real, ns, name)

    def restarted() -> str:
        """kubelet restarted the container in place (restartPolicy Always), or KubeRay replaced the pod."""
        try:
            pod = real.core.read_namespaced_pod(victim.metadata.name, ns)
        except ApiException as e:
            return "pod replaced" if e.status == 404 else ""
        if pod.metadata.uid != victim.metadata.uid:
            return "pod replaced"
        return "container restarted" if any((c.restart_count or 0) >= 1 for c in pod.status.container_statuses or []) else ""

    how = wait_for(f"the killed worker {victim.metadata.name} comes back", restarted, timeout=300, interval=1)
    print(f"worker kill at checkpoint step {ckpt_at_kill}: {how}")
    first = wait_for("rank 0 resuming after the kill", lambda: resumed_steps(job_log(real, ns)), timeout=900, interval=2)
    assert isinstance(first, list)
    assert first[0] >= 10 and first[0] >= ckpt_at_kill, (first, ckpt_at_kill)  # not from step 0

    # 2. Suspend once a checkpoint after that resume exists: the Ray cluster and its pods go away.
    wait_for("a checkpoint after the resume",
             lambda: checkpoint_step(real, ns, name) >= first[0] + 10, timeout=900, interval=1)
    real.custom.patch_namespaced_custom_object(G, V, ns, P, name, {"spec": {"suspend": True}})
    wait_for("phase Suspended", lambda: ftj_status(real, ns, name).get("phase") == "Suspended", timeout=300, interval=1)
    wait_for("Ray pods gone while suspended",
             lambda: not real.core.list_namespaced_pod(ns, label_selector="ray.io/cluster").items, timeout=300, interval=2)
    saved = checkpoint_step(real, ns, name)
    assert 0 < saved < total, saved
    assert ftj_status(real, ns, name).get("phase") == "Suspended"

    # 3. Resume: a new Ray cluster continues from the checkpoint kept on the PV and trains on.
    real.custom.patch_namespaced_custom_object(G, V, ns, P, name, {"spec": {"suspend": False}})
    again = wait_for("rank 0 resuming after the suspend",
                     lambda: [s for s in resumed_steps(job_log(real, ns)) if s >= saved], timeout=900, interval=2)
    assert isinstance(again, list) and again[0] >= saved, (again, saved)  # the newest checkpoint on the PV
    wait_for("the resumed run reporting steps after the checkpoint",
             lambda: int((ftj_status(real, ns, name).get("training") or {}).get("step") or 0) > again[0],
             timeout=600, interval=1)
    assert ftj_status(real, ns, name).get("phase") == "Running"

    # 4. Issue 8, point 3, on the same job (one real-node job less in the suite; the other end-to-end jobs
    # run to Succeeded): `kubectl delete ftj` mid-run removes every child and the node's containers.
    assert_delete_leaves_nothing_behind(real, ns, name)


def assert_delete_leaves_nothing_behind(real: E2E, ns: str, name: str) -> None:
    """`kubectl delete ftj` of a running job removes every child (RayJob, RayCluster, pods, Services,
    ConfigMaps, the submitter Job) and the node's containers."""
    assert node_containers(real, ns), "the job's containers should be running on the node"
    demo.kubectl(real.kubeconfig, "delete", "-n", ns, "ftj", name, "--wait=true", "--timeout=300s", timeout=330)

    def leftovers() -> dict[str, list[str]]:
        sel = f"{JOB_LABEL}={name}"
        found = {
            "rayjobs": [o["metadata"]["name"] for o in real.custom.list_namespaced_custom_object(
                "ray.io", "v1", ns, "rayjobs")["items"]],
            "rayclusters": [o["metadata"]["name"] for o in real.custom.list_namespaced_custom_object(
                "ray.io", "v1", ns, "rayclusters")["items"]],
            "pods": [p.metadata.name for p in real.core.list_namespaced_pod(ns).items],
            "services": [s.metadata.name for s in real.core.list_namespaced_service(ns).items],
            # The shared runtime ConfigMap (the operator collects it once no job of the namespace needs it).
            "configmaps": [c.metadata.name for c in real.core.list_namespaced_config_map(ns).items
                           if c.metadata.name != "kube-root-ca.crt"],
            "jobs": [j.metadata.name for j in client.BatchV1Api(real.core.api_client).list_namespaced_job(
                ns, label_selector=sel).items],
            "containers": node_containers(real, ns),
        }
        return {k: v for k, v in found.items() if v}

    deadline = time.monotonic() + 300
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not left, f"left behind after the delete: {left}"


def operator_pods(real: E2E) -> list[Any]:
    return [p for p in real.core.list_namespaced_pod(demo.OPERATOR_NAMESPACE,
                                                     label_selector="app.kubernetes.io/name=finetune-operator").items
            if not p.metadata.deletion_timestamp]


@dataclass
class RolloutSample:
    step: int  # the FinetuneJob's status.training.step
    pods: frozenset[str]  # the operator's pods not terminating
    available: int  # the Deployment's status.availableReplicas
    holder: str  # the Lease's holderIdentity (the pod name)


def metric(text: str, series: str, **labels: str) -> float | None:
    """The value of one series in a Prometheus text exposition, None if absent."""
    for line in text.splitlines():
        if line.startswith(series + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(2400)
def test_a_rolling_update_of_the_operator_mid_training_keeps_the_job_reporting(real: E2E, ns: str, helm: Path) -> None:
    """`helm upgrade` of the operator while a job trains (issues 9.5 and 13), with production's Deployment as
    the chart makes it by default: two replicas on the pod network (one leads by Lease and carries the
    Service's leader label, the other stands by, Ready), in-cluster config through the `kubernetes` Service,
    and the RollingUpdate strategy (maxSurge 1, maxUnavailable 0). The update surges a third pod and never
    has fewer than two available, `kubectl rollout status` succeeds, a new pod leads; the job's progress
    reaches its status during the rollout and, once the old pods are gone, through the new leader, until
    it ends Succeeded with every step. tests/integration/test_lifecycle.py covers the Lease handover itself."""
    demo.prepare_claim(real.cluster, ns)
    name, total = "local-upgrade", 400  # 0.24-0.75 s a step; the rollout took 15-30 s (~130 steps)
    api = config.new_client_from_config(config_file=str(real.kubeconfig))  # the sampler thread's own client
    apps, leases, custom = client.AppsV1Api(api), client.CoordinationV1Api(api), client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)

    def step() -> int:
        return int((ftj_status(real, ns, name).get("training") or {}).get("step") or 0)

    apply_variant(real, ns, name, total)
    wait_for("training under way", lambda: step() >= 3, timeout=1200, interval=1)
    old = {p.metadata.name for p in operator_pods(real)}
    assert len(old) == 2, old
    assert demo.leader_pod(real.kubeconfig) in old

    samples: list[RolloutSample] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                ftj = custom.get_namespaced_custom_object(G, V, ns, P, name)
                dep = apps.read_namespaced_deployment(demo.OPERATOR_NAME, demo.OPERATOR_NAMESPACE)
                lease = leases.read_namespaced_lease("finetune-operator-leader", demo.OPERATOR_NAMESPACE)
                pods = frozenset(p.metadata.name for p in core.list_namespaced_pod(
                    demo.OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=finetune-operator").items
                    if not p.metadata.deletion_timestamp)
            except Exception as e:  # a failed sample is retried; the assertions below judge
                print(f"rollout sample failed: {e}")
                done.wait(0.5)
                continue
            samples.append(RolloutSample(int(((ftj.get("status") or {}).get("training") or {}).get("step") or 0),
                                         pods, dep.status.available_replicas or 0, lease.spec.holder_identity or ""))
            done.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    sampler.start()
    try:  # a new pod template (an annotation); install_operator waits for `kubectl rollout status`
        leader = demo.install_operator(real.cluster, helm=helm,
                                       values={"podAnnotations": {"finetune.dev/upgrade": uuid.uuid4().hex[:8]}})
    finally:
        done.set()
        sampler.join()
    real.timings["helm upgrade -> rollout complete, a new pod leading"] = time.monotonic() - t0
    new = {p.metadata.name for p in operator_pods(real)}
    assert len(new) == 2 and not new & old, (old, new)
    assert leader in new
    pod = real.core.read_namespaced_pod(leader, demo.OPERATOR_NAMESPACE)
    assert (pod.metadata.labels or {}).get("finetune.dev/operator-leader") == "true"
    assert samples, "no sample taken during the rollout"
    # Surged: a third pod came before an old one went; never fewer than two available.
    assert max(len(s.pods) for s in samples) == 3, [sorted(s.pods) for s in samples]
    assert min(s.available for s in samples) >= 2, [s.available for s in samples]
    # The job kept reporting while the operator rolled.
    assert samples[-1].step > samples[0].step, [s.step for s in samples]
    holders = [h for i, h in enumerate(s.holder for s in samples) if i == 0 or h != samples[i - 1].holder]
    print(f"rolling update in {time.monotonic() - t0:.0f}s, {len(samples)} samples: steps {samples[0].step} -> "
          f"{samples[-1].step} ({len({s.step for s in samples})} distinct), at most {max(len(s.pods) for s in samples)} "
          f"pods, at least {min(s.available for s in samples)} available, Lease holders {holders}, "
          f"pods {sorted(old)} -> {sorted(new)}")

    wait_for("the old operator pods gone", lambda: not old & {p.metadata.name for p in real.core.list_namespaced_pod(
        demo.OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=finetune-operator").items},
        timeout=300, interval=1)
    step_old_gone = step()
    try:
        wait_for(f"{name} Succeeded", lambda: ftj_status(real, ns, name).get("phase") == "Succeeded",
                 timeout=1200, interval=2)
    except pytest.fail.Exception:
        print(diagnose(real, ns))
        raise
    st = ftj_status(real, ns, name)
    # Every step reached the status; the ones after step_old_gone only through the new pods.
    assert st["step"] == f"{total}/{total}", st.get("step")
    assert step_old_gone < total, f"the job had finished before the old operator pods were gone ({step_old_gone})"
    # The new leader itself took reports (its /v1/progress counter) and knows the job finished. (A finished
    # job's progress series are freed, issue 23: only its phase series stays, for the FinetuneJobFailed alert.)
    lease = leases.read_namespaced_lease("finetune-operator-leader", demo.OPERATOR_NAMESPACE)
    assert lease.spec.holder_identity in new, (lease.spec.holder_identity, new)
    ip = real.core.read_namespaced_pod(lease.spec.holder_identity, demo.OPERATOR_NAMESPACE).status.pod_ip
    with urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=10) as r:
        exposition = r.read().decode()
    assert (metric(exposition, "finetune_progress_reports_total", code="202") or 0) > 0, exposition[:2000]
    assert metric(exposition, "finetune_job_phase", namespace=ns, name=name, phase="Succeeded") == 1
    assert metric(exposition, "finetune_job_step", namespace=ns, name=name) is None  # freed once finished
    print(f"after the rollout: step {step_old_gone} when the old pods were gone -> {total}/{total} through "
          f"{lease.spec.holder_identity}")
