"""`finetune preflight`'s checks (preflight/checks.py), table-style over built cluster facts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from finetune_operator.preflight.checks import Facts, evaluate, render

TAINTS = [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
          {"key": "vpc.amazonaws.com/efa", "value": "true", "effect": "NoSchedule"}]


def node(name: str, itype: str = "g6.12xlarge", gpu: str = "4", efa: str = "1", huge: str = "5120Mi",
         taints: list[dict[str, str]] | None = None, zone: str = "us-west-2a") -> dict[str, Any]:
    alloc = {"cpu": "47810m", "memory": "189923Mi", "hugepages-2Mi": huge}
    if gpu:
        alloc["nvidia.com/gpu"] = gpu
    if efa:
        alloc["vpc.amazonaws.com/efa"] = efa
    return {"metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": itype,
                                                  "topology.kubernetes.io/zone": zone}},
            "spec": {"taints": TAINTS if taints is None else taints},
            "status": {"allocatable": alloc, "conditions": [{"type": "Ready", "status": "True"}]}}


def good() -> Facts:
    return Facts(
        instance_type="g6.12xlarge",
        nodes=[node("gpu-0"), node("gpu-1"), node("cpu-0", itype="m5.2xlarge", gpu="", efa="", huge="0", taints=[])],
        crds={"finetunejobs.finetune.dev", "rayjobs.ray.io", "rayclusters.ray.io"},
        kuberay_images=["quay.io/kuberay/operator:v1.6.1"],
        operator_access={("create", "ray.io/rayjobs"): True},
    )


def breaks(change: Callable[[Facts], None]) -> Facts:
    f = good()
    change(f)
    return f


CASES: list[tuple[str, Callable[[Facts], None], str, str]] = [
    ("no-crd", lambda f: f.crds.discard("finetunejobs.finetune.dev"), "FinetuneJob CRD", "helm install"),
    ("no-kuberay", lambda f: f.kuberay_images.clear(), "KubeRay operator", "install-addons.sh"),
    ("old-kuberay", lambda f: f.kuberay_images.__setitem__(0, "quay.io/kuberay/operator:v1.4.0"), "KubeRay operator",
     "install-addons.sh"),
    ("no-gpu-plugin", lambda f: f.nodes[0]["status"]["allocatable"].pop("nvidia.com/gpu"), "nvidia.com/gpu allocatable",
     "install-addons.sh"),
    ("no-efa-plugin", lambda f: f.nodes[1]["status"]["allocatable"].pop("vpc.amazonaws.com/efa"),
     "vpc.amazonaws.com/efa allocatable", "install-addons.sh"),
    ("no-hugepages", lambda f: f.nodes[0]["status"]["allocatable"].__setitem__("hugepages-2Mi", "0"),
     "hugepages-2Mi allocatable", "nr_hugepages"),
    ("extra-taint", lambda f: f.nodes[0]["spec"].__setitem__("taints", [*TAINTS, {"key": "team", "value": "a",
                                                                                     "effect": "NoSchedule"}]),
     "taints vs worker tolerations", "spec.cluster.tolerations"),
    ("no-gpu-nodes", lambda f: f.__setattr__("instance_type", "p5.48xlarge"), "p5.48xlarge nodes", "eksctl"),
    ("no-head-node", lambda f: f.nodes.pop(), "node for the Ray head", "cpu"),
    ("rbac", lambda f: f.operator_access.__setitem__(("create", "ray.io/rayjobs"), False), "operator RBAC", "helm"),
]


def test_a_ready_cluster_passes_everything() -> None:
    checks = evaluate(good())
    assert [c for c in checks if c.status != "ok"] == []
    assert render(checks).endswith(f"checklist: all {len(checks)} ok\n")


@pytest.mark.parametrize(("change", "what", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_problem_fails_its_check_with_a_fix(change: Callable[[Facts], None], what: str, fix: str) -> None:
    checks = evaluate(breaks(change))
    failed = [c for c in checks if c.status == "fail"]
    assert [c.what for c in failed] == [what]
    assert fix in failed[0].fix
    assert "checklist: 1 of" in render(checks)


def test_nodes_in_two_zones_warn() -> None:
    f = good()
    f.nodes[1]["metadata"]["labels"]["topology.kubernetes.io/zone"] = "us-west-2b"
    (warn,) = [c for c in evaluate(f) if c.status != "ok"]
    assert warn.status == "warn" and "us-west-2a, us-west-2b" in warn.detail
