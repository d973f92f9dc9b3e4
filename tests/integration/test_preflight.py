"""`finetune preflight` against the dev cluster (kwok nodes shaped like EKS g6.12xlarge with the GPU/EFA
device plugins' resources, huge pages and taints), in a good configuration and broken ones."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.integration.conftest import Kube
from tests.integration.operator_fixtures import ROOT, service_account_kubeconfig

KUBERAY_NS = "kuberay-system"


def preflight(kube: Kube, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", "preflight", "--kubeconfig",
                           str(kube.kubeconfig), *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)


def _kuberay_deployment(image: str) -> client.V1Deployment:
    # The dev cluster runs KubeRay as a local process; a real install is a Deployment like this one
    # (kwok only marks its pod Running).
    labels = {"app.kubernetes.io/name": "kuberay-operator"}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name="kuberay-operator", labels=labels),
        spec=client.V1DeploymentSpec(
            replicas=1, selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels), spec=client.V1PodSpec(
                containers=[client.V1Container(name="kuberay-operator", image=image)]))))


@pytest.fixture
def ready_cluster(kube: Kube, control_plane: object, tmp_path: Path) -> Iterator[None]:
    service_account_kubeconfig(Path(kube.kubeconfig), tmp_path / "sa-kubeconfig")  # applies deploy/rbac.yaml
    subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "create", "namespace", KUBERAY_NS],
                   capture_output=True, check=False)
    kube.apps.create_namespaced_deployment(KUBERAY_NS, _kuberay_deployment("quay.io/kuberay/operator:v1.6.1"))
    yield
    kube.apps.delete_namespaced_deployment("kuberay-operator", KUBERAY_NS)


def test_good_cluster_passes(kube: Kube, ready_cluster: None) -> None:
    res = preflight(kube, "--job", str(ROOT / "examples" / "qwen2.5-1.5b-g6-efa.yaml"))
    assert res.returncode == 0, res.stdout + res.stderr
    for line in ("[ok]   KubeRay operator: quay.io/kuberay/operator:v1.6.1",
                 "[ok]   nvidia.com/gpu allocatable", "[ok]   vpc.amazonaws.com/efa allocatable",
                 "[ok]   hugepages-2Mi allocatable", "[ok]   taints vs worker tolerations", "[ok]   operator RBAC",
                 "[ok]   capacity for the job"):
        assert line in res.stdout, res.stdout
    assert res.stdout.rstrip().splitlines()[-1].startswith("checklist: all")


def test_old_kuberay_and_untolerated_taint_and_missing_rbac_fail(kube: Kube, ready_cluster: None, tmp_path: Path) -> None:
    kube.apps.patch_namespaced_deployment("kuberay-operator", KUBERAY_NS, {"spec": {"template": {"spec": {
        "containers": [{"name": "kuberay-operator", "image": "quay.io/kuberay/operator:v1.3.2"}]}}}})
    node = kube.core.read_node("gpu-node-0")
    taints = [t.to_dict() for t in node.spec.taints]
    kube.core.patch_node("gpu-node-0", {"spec": {"taints": [*taints, {"key": "team", "value": "a", "effect": "NoSchedule"}]}})
    kube.rbac.delete_cluster_role_binding("finetune-operator")
    try:
        res = preflight(kube)
        assert res.returncode == 1, res.stdout + res.stderr
        out = res.stdout
        assert "[FAIL] KubeRay operator: quay.io/kuberay/operator:v1.3.2: need >= v1.6" in out
        assert "[FAIL] taints vs worker tolerations: workers do not tolerate gpu-node-0: team=a:NoSchedule" in out
        assert "[FAIL] operator RBAC: system:serviceaccount:finetune-system:finetune-operator may not:" in out
        assert "fix: remove the taint, or add a matching toleration to spec.cluster.tolerations" in out
    finally:
        kube.core.patch_node("gpu-node-0", {"spec": {"taints": taints}})
        service_account_kubeconfig(Path(kube.kubeconfig), tmp_path / "restore")  # re-applies the binding


def test_wrong_instance_type_and_unreachable_cluster(kube: Kube, tmp_path: Path) -> None:
    res = preflight(kube, "--instance-type", "p5.48xlarge")
    assert res.returncode == 1 and "[FAIL] p5.48xlarge nodes: no node labelled" in res.stdout
    bad = tmp_path / "kubeconfig"
    bad.write_text(Path(kube.kubeconfig).read_text().replace("https://127.0.0.1:", "https://127.0.0.1:1"))
    res = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "preflight", "--kubeconfig", str(bad)],
                         capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.startswith("preflight: cannot reach the cluster")
    assert "Traceback" not in res.stderr
