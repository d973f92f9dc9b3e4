"""The dev cluster is a real control plane: real scheduling, garbage collection, KubeRay, token auth."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_devcluster import DevCluster
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity

from .conftest import Kube, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GPU_TYPE = "g6.12xlarge"
CPU_TYPE = "m5.2xlarge"
RAY_IMAGE = "rayproject/ray:2.52.0-py311-gpu"
WORKER_RESOURCES = {
    "cpu": "40",
    "memory": "160Gi",
    "nvidia.com/gpu": "4",
    "vpc.amazonaws.com/efa": "1",
    "hugepages-2Mi": "5120Mi",
}


def raycluster(name: str, workers: int = 2) -> dict[str, Any]:
    """The seed's shape: a CPU-node head, one worker per g6.12xlarge holding all 4 GPUs and the EFA."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"num-gpus": "0"},
                "template": {
                    "spec": {
                        "nodeSelector": {"node.kubernetes.io/instance-type": CPU_TYPE},
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": RAY_IMAGE,
                                "resources": {
                                    "requests": {"cpu": "2", "memory": "8Gi"},
                                    "limits": {"cpu": "2", "memory": "8Gi"},
                                },
                            }
                        ],
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": {"num-gpus": "4"},
                    "template": {
                        "spec": {
                            "nodeSelector": {"node.kubernetes.io/instance-type": GPU_TYPE},
                            "tolerations": [
                                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "vpc.amazonaws.com/efa", "operator": "Exists", "effect": "NoSchedule"},
                            ],
                            "containers": [
                                {
                                    "name": "ray-worker",
                                    "image": RAY_IMAGE,
                                    "resources": {"requests": dict(WORKER_RESOURCES), "limits": dict(WORKER_RESOURCES)},
                                }
                            ],
                        }
                    },
                }
            ],
        },
    }


def create_raycluster(kube: Kube, namespace: str, body: dict[str, Any]) -> None:
    kube.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", body)


def pods(kube: Kube, namespace: str, cluster: str, node_type: str | None = None) -> list[client.V1Pod]:
    selector = f"ray.io/cluster={cluster}"
    if node_type:
        selector += f",ray.io/node-type={node_type}"
    return list(kube.core.list_namespaced_pod(namespace, label_selector=selector).items)


def running_ready(pod: client.V1Pod) -> bool:
    conds = {c.type: c.status for c in pod.status.conditions or []}
    return pod.status.phase == "Running" and conds.get("Ready") == "True"


def unschedulable_message(pod: client.V1Pod) -> str | None:
    for c in pod.status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return str(c.message)
    return None


def workers_running(kube: Kube, namespace: str, cluster: str, n: int) -> list[client.V1Pod] | None:
    ws = pods(kube, namespace, cluster, "worker")
    return ws if len(ws) == n and all(running_ready(p) for p in ws) else None


def node_of(kube: Kube, pod: client.V1Pod) -> client.V1Node:
    return kube.core.read_node(pod.spec.node_name)


def test_nodes_ready_with_eks_gpu_efa_shape(kube: Kube) -> None:
    nodes = {n.metadata.name: n for n in kube.core.list_node().items}
    assert set(nodes) == {"gpu-node-0", "gpu-node-1", "cpu-node-0"}
    for node in nodes.values():
        conds = {c.type: c.status for c in node.status.conditions}
        assert conds.get("Ready") == "True", node.metadata.name
    for name in ("gpu-node-0", "gpu-node-1"):
        node = nodes[name]
        labels = node.metadata.labels
        assert labels["node.kubernetes.io/instance-type"] == GPU_TYPE
        assert labels["topology.kubernetes.io/zone"] == "us-west-2a"
        assert labels["topology.kubernetes.io/region"] == "us-west-2"
        assert labels["eks.amazonaws.com/nodegroup"] == "gpu-efa"
        assert labels["kubernetes.io/arch"] == "amd64" and labels["type"] == "kwok"
        alloc = {k: parse_quantity(v) for k, v in node.status.allocatable.items()}
        assert alloc["nvidia.com/gpu"] == 4
        assert alloc["vpc.amazonaws.com/efa"] == 1
        assert alloc["hugepages-2Mi"] == parse_quantity("5120Mi")
        assert alloc["cpu"] == parse_quantity("47810m")
        assert alloc["memory"] == parse_quantity("189923Mi")  # 192Gi - kube-reserved - eviction - hugepages
        assert alloc["pods"] == 110
        capacity = {k: parse_quantity(v) for k, v in node.status.capacity.items()}
        assert capacity["cpu"] == 48 and capacity["memory"] == parse_quantity("192Gi")
        taints = {(t.key, t.value, t.effect) for t in node.spec.taints}
        assert taints == {("nvidia.com/gpu", "true", "NoSchedule"), ("vpc.amazonaws.com/efa", "true", "NoSchedule")}
    cpu = nodes["cpu-node-0"]
    assert cpu.metadata.labels["node.kubernetes.io/instance-type"] == CPU_TYPE
    assert not cpu.spec.taints
    assert "nvidia.com/gpu" not in cpu.status.allocatable


def test_raycluster_scheduling_capacity_and_garbage_collection(kube: Kube, namespace: str) -> None:
    # (a) KubeRay creates the pods; the scheduler spreads the 2 workers over the 2 GPU nodes.
    create_raycluster(kube, namespace, raycluster("first"))
    workers = wait_for("2 workers of 'first' Running", lambda: workers_running(kube, namespace, "first", 2), timeout=90)
    assert isinstance(workers, list)
    placed = {p.spec.node_name for p in workers}
    assert len(placed) == 2, f"workers share a node: {placed}"
    assert all(node_of(kube, p).metadata.labels["node.kubernetes.io/instance-type"] == GPU_TYPE for p in workers)
    head = wait_for(
        "head of 'first' Running",
        lambda: [p for p in pods(kube, namespace, "first", "head") if running_ready(p)],
        timeout=60,
    )
    assert isinstance(head, list)
    assert node_of(kube, head[0]).metadata.labels["node.kubernetes.io/instance-type"] == CPU_TYPE
    wait_for(
        "RayCluster 'first' state ready",
        lambda: (
            kube.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "first")
            .get("status", {})
            .get("state")
            == "ready"
        ),
        timeout=60,
    )

    # (b) A second identical cluster does not fit: its workers stay Pending, and the scheduler says why.
    create_raycluster(kube, namespace, raycluster("second"))

    def pending_reasons() -> list[str] | None:
        ws = pods(kube, namespace, "second", "worker")
        msgs = [unschedulable_message(p) for p in ws]
        return [m for m in msgs if m] if len(ws) == 2 and all(msgs) else None

    reasons = wait_for("workers of 'second' Unschedulable", pending_reasons, timeout=60)
    assert isinstance(reasons, list)
    for msg in reasons:
        assert "Insufficient nvidia.com/gpu" in msg or "Insufficient vpc.amazonaws.com/efa" in msg, msg
    assert all(p.status.phase == "Pending" for p in pods(kube, namespace, "second", "worker"))

    # (c) Deleting the first cluster garbage-collects its pods (ownerReferences + the GC controller) ...
    names = {p.metadata.name for p in pods(kube, namespace, "first")}
    assert len(names) == 3
    kube.custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "first")
    wait_for("pods of 'first' deleted", lambda: not pods(kube, namespace, "first"), timeout=90)
    # ... which frees the GPU nodes, so the scheduler places the waiting workers.
    wait_for("2 workers of 'second' Running", lambda: workers_running(kube, namespace, "second", 2), timeout=90)


def test_added_gpu_node_unblocks_pending_worker(
    kube: Kube, namespace: str, gpu_node: Any, control_plane: DevCluster
) -> None:
    create_raycluster(kube, namespace, raycluster("three", workers=3))

    def two_running_one_pending() -> bool:
        ws = pods(kube, namespace, "three", "worker")
        return len(ws) == 3 and sum(map(running_ready, ws)) == 2 and sum(1 for p in ws if unschedulable_message(p)) == 1

    wait_for("2 of 3 workers Running, 1 Unschedulable", two_running_one_pending, timeout=90)
    node = gpu_node()
    assert node == "gpu-node-2"
    workers = wait_for("3 workers Running", lambda: workers_running(kube, namespace, "three", 3), timeout=90)
    assert isinstance(workers, list)
    assert node in {p.spec.node_name for p in workers}


def test_token_request_with_job_audience_passes_token_review(kube: Kube, namespace: str) -> None:
    audience = f"finetune.dev/{namespace}/job-a"
    kube.core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="trainer"))
    )
    # A pod to bind the token to, as the kubelet does for a projected service-account token volume.
    pod = kube.core.create_namespaced_pod(
        namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name="worker-0"),
            spec=client.V1PodSpec(
                service_account_name="trainer",
                node_selector={"node.kubernetes.io/instance-type": CPU_TYPE},
                containers=[client.V1Container(name="c", image="busybox")],
            ),
        ),
    )
    token = kube.core.create_namespaced_service_account_token(
        "trainer",
        namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[audience],
                expiration_seconds=600,
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod", api_version="v1", name="worker-0", uid=pod.metadata.uid
                ),
            ),
        ),
    ).status.token

    def review(aud: list[str]) -> client.V1TokenReviewStatus:
        return kube.auth.create_token_review(
            client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=aud))
        ).status

    ok = review([audience])
    assert ok.authenticated, ok.error
    assert ok.audiences == [audience]
    assert ok.user.username == f"system:serviceaccount:{namespace}:trainer"
    assert ok.user.extra["authentication.kubernetes.io/pod-name"] == ["worker-0"]
    assert ok.user.extra["authentication.kubernetes.io/pod-uid"] == [pod.metadata.uid]

    wrong = review([f"finetune.dev/{namespace}/job-b"])
    assert not wrong.authenticated
    default_aud = review([])  # the apiserver's own audience: a job token must not work there
    assert not default_aud.authenticated

    # Deleting the bound pod invalidates the token.
    kube.core.delete_namespaced_pod("worker-0", namespace, grace_period_seconds=0)
    wait_for("token rejected after its pod is deleted", lambda: not review([audience]).authenticated, timeout=30)


def test_service_account_has_no_write_permissions_by_default(kube: Kube, namespace: str) -> None:
    """RBAC is on: a training pod's service account cannot patch anything unless granted."""
    review = client.AuthorizationV1Api(kube.api_client).create_subject_access_review(
        client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=f"system:serviceaccount:{namespace}:default",
                groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                resource_attributes=client.V1ResourceAttributes(
                    namespace=namespace, verb="patch", group="ray.io", resource="rayclusters"
                ),
            )
        )
    )
    assert review.status.allowed is False


def test_repo_crds_installed_and_examples_accepted(kube: Kube, namespace: str) -> None:
    crd_files = sorted((REPO / "crds").glob("*.yaml"))
    assert crd_files, "crds/ holds no CRD"
    installed = {c.metadata.name for c in kube.apiext.list_custom_resource_definition().items}
    for f in crd_files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                assert doc["metadata"]["name"] in installed
    assert {"rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io"} <= installed

    examples = []
    for f in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("apiVersion", "").startswith("finetune.dev/"):
                examples.append((f.name, doc))
    assert examples, "examples/ holds no FinetuneJob"
    allow_local_ray_image(kube)
    for fname, doc in examples:
        group, version = doc["apiVersion"].split("/")
        body = copy.deepcopy(doc)
        body["metadata"].pop("namespace", None)
        deadline = time.monotonic() + 30
        while True:
            try:
                kube.custom.create_namespaced_custom_object(group, version, namespace, "finetunejobs", body, dry_run="All")
                break
            except ApiException as e:
                # A policy parameter just changed reaches the admission plugin through an informer: retry.
                if "finetune-allowed-images" in str(e.body) and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                pytest.fail(f"examples/{fname} rejected by the apiserver: {e.body}")


def allow_local_ray_image(kube: Kube) -> None:
    """examples/local-cluster.yaml runs the Ray image built on this machine. Where another test module has
    installed deploy/'s admission policies, allow that image the way `make demo-cluster` does
    (finetune_devcluster.demo.adapt_deploy); the CRD's own rules are what this test checks."""
    try:
        cm = kube.core.read_namespaced_config_map("finetune-operator-policy", "finetune-system")
    except ApiException as e:
        if e.status == 404:
            return
        raise
    allowed = (cm.data or {}).get("allowedImages", "")
    if "localhost/finetune/ray:*" not in allowed.split():
        kube.core.patch_namespaced_config_map("finetune-operator-policy", "finetune-system",
                                              {"data": {"allowedImages": allowed + "localhost/finetune/ray:*\n"}})


def test_rendered_example_accepted_by_apiserver_with_kuberay_crds(kube: Kube, namespace: str) -> None:
    """What `finetune render` prints for the seed example passes the real apiserver's validation of KubeRay's
    CRDs (server-side dry run: nothing is created)."""
    example = REPO / "examples" / "qwen2.5-1.5b-g6-efa.yaml"
    assert example.is_file(), f"{example}: the seed example is missing"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune_operator.cli",
            "render",
            str(example),
            "--namespace",
            namespace,
            "--progress-url",
            "https://finetune-operator.finetune-system.svc:8443",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {o["kind"] for o in objs} >= {"RayJob"}
    for obj in objs:
        kind = obj["kind"]
        try:
            if kind == "RayJob":
                kube.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", obj, dry_run="All")
            elif kind == "ConfigMap":
                kube.core.create_namespaced_config_map(namespace, obj, dry_run="All")
            else:
                pytest.fail(f"no dry-run mapping for rendered kind {kind}")
        except ApiException as e:
            pytest.fail(f"rendered {kind} {obj['metadata']['name']} rejected: {e.body}")


def test_job_pods_complete_and_job_succeeds(kube: Kube, namespace: str) -> None:
    """The Job controller runs and kwok completes Job-owned pods (how a RayJob's submitter behaves here)."""
    kube.batch.create_namespaced_job(
        namespace,
        client.V1Job(
            metadata=client.V1ObjectMeta(name="once"),
            spec=client.V1JobSpec(
                backoff_limit=0,
                template=client.V1PodTemplateSpec(
                    spec=client.V1PodSpec(
                        restart_policy="Never",
                        containers=[client.V1Container(name="c", image="busybox", command=["true"])],
                    )
                ),
            ),
        ),
    )
    wait_for(
        "Job 'once' succeeded",
        lambda: (kube.batch.read_namespaced_job_status("once", namespace).status.succeeded or 0) == 1,
        timeout=60,
    )
