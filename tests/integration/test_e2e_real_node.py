"""The product path end to end, for real, on CPU: ``kubectl apply -f examples/local-cluster.yaml`` ->
the operator -> RayJob -> KubeRay -> real Ray head and worker pods on the dev cluster's real node (containerd,
runc, kubelet) -> KubeRay's submitter -> ``python3 -m finetune_training`` -> Ray Train workers -> FSDP over gloo
-> progress in the FinetuneJob's status -> phase Succeeded -> the exported model on the PersistentVolume.

Nothing is simulated on this path: the images are built on this machine (the Ray image carries the Ray
Train DLC's Python stack; the operator image is ``Dockerfile.operator`` built by buildah), the operator runs
in the cluster as a pod from ``deploy/`` (kustomize; RBAC, admission policies, Service), the training code
reaches the Ray pods through the runtime ConfigMap, the model and data through the ``pvc://`` claim, and
progress through the projected-token channel and the operator's Service. The steps are the ones
``make demo-cluster`` runs (``finetune_operator.devcluster.demo``).

Cost (2-core machine): see docs/dev-cluster.md ("End to end").
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.devcluster import DevCluster, DevClusterError, demo
from finetune_operator.devcluster import node as realnode
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from .conftest import wait_for

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
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    timings: dict[str, float] = {}
    workdir = tmp_path_factory.mktemp("e2e-real-node")
    cluster = DevCluster(workdir, nodes=1, die_with_parent=True, real_node=True)
    try:
        t0 = time.monotonic()
        cluster.up(timeout=600)
        timings["dev-cluster up --real-node"] = time.monotonic() - t0
        timings.update(demo.import_images(cluster))
        t0 = time.monotonic()
        demo.install_operator(cluster)
        timings["operator from deploy/ leading"] = time.monotonic() - t0
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        yield E2E(cluster, Path(cluster.kubeconfig), client.CoreV1Api(api), client.CustomObjectsApi(api), timings)
    finally:
        cluster.down()
        print("e2e timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))


@pytest.fixture
def ns(real: E2E) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    real.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def default_sa() -> bool:
        try:
            real.core.read_namespaced_service_account("default", name)
            return True
        except ApiException:
            return False

    wait_for("default ServiceAccount", default_sa, timeout=60)
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
