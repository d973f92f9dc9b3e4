"""deploy/eks/: the eksctl ClusterConfig against eksctl's own JSON schema (from eksctl's Go module, no
AWS), and the node groups against what our renderer asks of a node (labels, taints, huge pages).
The Karpenter manifests go through the API server with Karpenter's CRDs in
tests/integration/test_eks_manifests.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from finetune_devcluster.upstream_crds import module_dir
from finetune_devcluster.versions import EKSCTL_VERSION, KUBERAY_VERSION
from finetune_operator.api.validation import parse_job
from finetune_operator.render.rayjob import render_rayjob

ROOT = Path(__file__).resolve().parents[2]
EKS = ROOT / "deploy" / "eks"


@pytest.fixture(scope="module")
def eksctl_schema() -> dict[str, Any]:
    path = module_dir("github.com/weaveworks/eksctl", EKSCTL_VERSION) / "pkg/apis/eksctl.io/v1alpha5/assets/schema.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def cluster_config() -> dict[str, Any]:
    return yaml.safe_load((EKS / "cluster.yaml").read_text())  # type: ignore[no-any-return]


def errors(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    v = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in v.iter_errors(doc)]


def test_cluster_config_is_valid_for_eksctls_schema(eksctl_schema: dict[str, Any]) -> None:
    assert errors(eksctl_schema, cluster_config()) == []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda c: c["managedNodeGroups"][1].__setitem__("efaEnable", True), "efaEnable"),
        (lambda c: c["managedNodeGroups"][1].__setitem__("minSize", "zero"), "minSize"),
        (lambda c: c["managedNodeGroups"][1]["taints"][0].__setitem__("effects", "NoSchedule"), "effects"),
    ],
    ids=["unknown-field", "wrong-type", "unknown-taint-field"],
)
def test_eksctl_schema_rejects_bad_configs(eksctl_schema: dict[str, Any], mutate: Any, expected: str) -> None:
    cfg = cluster_config()
    mutate(cfg)
    assert any(expected in e for e in errors(eksctl_schema, cfg))


def _gpu_group() -> dict[str, Any]:
    return next(g for g in cluster_config()["managedNodeGroups"] if g["name"] == "gpu-efa")


def _seed_worker_pod() -> dict[str, Any]:
    from finetune_operator.render.config import RenderConfig

    doc = yaml.safe_load((ROOT / "examples" / "qwen2.5-1.5b-g6-efa.yaml").read_text())
    doc["metadata"]["namespace"] = "ml"
    rj = render_rayjob(parse_job(doc), {}, RenderConfig(progress_url="http://op:8080"))
    return rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]  # type: ignore[no-any-return]


def _tolerated(taint: dict[str, str], tolerations: list[dict[str, Any]]) -> bool:
    return any(t.get("key") == taint["key"] and t.get("effect", taint["effect"]) == taint["effect"]
               and (t.get("operator") == "Exists" or t.get("value") == taint.get("value")) for t in tolerations)


def test_gpu_node_group_is_what_the_seed_job_needs() -> None:
    group = _gpu_group()
    pod = _seed_worker_pod()
    assert group["instanceType"] == pod["nodeSelector"]["node.kubernetes.io/instance-type"]
    assert group["efaEnabled"] is True and len(group["availabilityZones"]) == 1
    assert group["desiredCapacity"] >= 2  # the seed's 2 workers, one per node
    for taint in group["taints"]:
        assert _tolerated(taint, pod.get("tolerations", [])), taint
    # Huge pages reserved per node cover what one worker requests.
    pages = int(re.search(r"vm.nr_hugepages=(\d+)", " ".join(group["preBootstrapCommands"])).group(1))  # type: ignore[union-attr]
    request = pod["containers"][0]["resources"]["requests"]["hugepages-2Mi"]
    assert request.endswith("Mi") and pages * 2 >= int(request[:-2])


def test_cpu_node_group_takes_pods_without_gpu_tolerations() -> None:
    cpu = next(g for g in cluster_config()["managedNodeGroups"] if g["name"] == "cpu")
    assert not cpu.get("taints")


def test_karpenter_node_pool_matches_the_managed_node_group() -> None:
    pool, node_class = list(yaml.safe_load_all((EKS / "karpenter.yaml").read_text()))
    group = _gpu_group()
    assert pool["spec"]["template"]["spec"]["taints"] == group["taints"]
    reqs = {r["key"]: r["values"] for r in pool["spec"]["template"]["spec"]["requirements"]}
    assert reqs["node.kubernetes.io/instance-type"] == [group["instanceType"]]
    assert reqs["topology.kubernetes.io/zone"] == group["availabilityZones"]
    assert "vm.nr_hugepages=2560" in node_class["spec"]["userData"]


def test_addons_pin_the_kuberay_version_we_test_against() -> None:
    script = (EKS / "install-addons.sh").read_text()
    assert f"KUBERAY_VERSION={KUBERAY_VERSION.lstrip('v')}\n" in script
