"""Instance-type figures from one source (built-in table -> admission ConfigMap -> operator), the
allow-list, and `finetune validate` saying where its figures came from. Pure; the API server's side of
the same rules is tested in tests/integration/test_admission.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.api import instance_types as it
from finetune_operator.api.crd import NAME_RULES
from finetune_operator.api.policy import AllowList, policy_issues
from finetune_operator.api.validation import check, fit_issues, parse_job
from finetune_operator.render.config import RenderConfig
from finetune_operator.render.rayjob import render_children

from tests.builders import JobDoc

ROOT = Path(__file__).resolve().parents[2]


def finetune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)


def test_committed_instance_types_configmap_has_not_drifted() -> None:
    out = finetune("crd", "--instance-types")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (ROOT / "deploy" / "instance-types.yaml").read_text(), "run `make crd`"


def test_params_round_trip_to_the_same_figures_and_render() -> None:
    table = it.from_params(it.params_data(), "ConfigMap finetune-system/finetune-instance-types")
    assert set(table) == set(it.INSTANCE_TYPES)
    for name, t in it.INSTANCE_TYPES.items():
        got = table[name]
        assert (got.gpus, got.efa_interfaces, got.allocatable_cpu_millis, got.allocatable_memory_mib) == (
            t.gpus, t.efa_interfaces, t.allocatable_cpu_millis, t.allocatable_memory_mib), name
        assert (got.default_worker_cpu, got.default_worker_memory_gib, got.gpudirect_rdma) == (
            t.default_worker_cpu, t.default_worker_memory_gib, t.gpudirect_rdma), name
        assert got.source.startswith("ConfigMap")
    # The operator renders the same children from the ConfigMap's figures as from the built-in ones.
    job = parse_job(JobDoc().set("metadata.namespace", "ns").obj())
    files = {"finetune_training/__init__.py": ""}
    assert render_children(job, files, RenderConfig(instance_types=table)) == render_children(job, files, RenderConfig())


def _node(itype: str, **alloc: str) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "labels": {"node.kubernetes.io/instance-type": itype}},
            "status": {"capacity": {"cpu": "48", "memory": "192Gi"}, "allocatable": alloc}}


def test_figures_from_a_node() -> None:
    t = it.from_node(_node("g6e.12xlarge", cpu="47810m", memory="189923Mi", **{"nvidia.com/gpu": "4",
                                                                           "vpc.amazonaws.com/efa": "1"}))
    assert t is not None
    assert (t.name, t.gpus, t.efa_interfaces, t.allocatable_cpu_millis, t.allocatable_memory_mib) == (
        "g6e.12xlarge", 4, 1, 47810, 189923)
    assert (t.vcpu, t.memory_gib, t.source) == (48, 192, "node n1")
    assert it.from_node(_node("x", cpu="4")) is None  # no memory figure: not usable


FIT = [
    ("too-many-gpus", {"spec.cluster.workers.gpusPerWorker": 8, "spec.training.globalBatchSize": 64},
     "spec.cluster.workers.gpusPerWorker", "8 GPUs per worker do not fit g6e.12xlarge (4 GPUs; figures from node n1)"),
    ("too-many-efa", {"spec.cluster.efaInterfacesPerWorker": 2}, "spec.cluster.efaInterfacesPerWorker",
     "2 EFA interfaces do not fit g6e.12xlarge (1)"),
    ("memory", {"spec.cluster.workers.memory": "190Gi"}, "spec.cluster.workers.memory", "exceeds g6e.12xlarge's allocatable"),
]


@pytest.mark.parametrize(("sets", "path", "fragment"), [f[1:] for f in FIT], ids=[f[0] for f in FIT])
def test_fit_against_node_figures(sets: dict[str, Any], path: str, fragment: str) -> None:
    node = it.from_node(_node("g6e.12xlarge", cpu="47810m", memory="189923Mi",
                              **{"nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "1"}))
    assert node is not None
    table = {**it.INSTANCE_TYPES, "g6e.12xlarge": node}
    doc = JobDoc().set("spec.cluster.instanceType", "g6e.12xlarge")
    for k, v in sets.items():
        doc.set(k, v)
    job, issues = check(doc.obj(), table)
    assert job is None
    assert any(i.path == path and fragment in i.message for i in issues), [str(i) for i in issues]
    ok, _ = check(JobDoc().set("spec.cluster.instanceType", "g6e.12xlarge").obj(), table)
    assert ok is not None


def test_unknown_instance_type_is_a_warning_for_validate_and_an_error_for_the_operator() -> None:
    doc = JobDoc().set("spec.cluster.instanceType", "g6e.12xlarge").obj()
    job, issues = check(doc)
    assert job is not None
    assert [i.severity for i in issues] == ["warning"] and "not in the built-in table" in issues[0].message
    errors = fit_issues(job.spec)
    assert len(errors) == 1 and "unknown instance type 'g6e.12xlarge'" in errors[0].message
    assert "finetune.dev/instance-types=true" in errors[0].message


def test_validate_names_the_source_of_its_figures(tmp_path: Path) -> None:
    seed = ROOT / "examples" / "qwen2.5-1.5b-g6-efa.yaml"
    out = finetune("validate", str(seed))
    assert out.returncode == 0 and "g6.12xlarge figures: built-in table" in out.stdout, out
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "extra"},
                                     "data": {"g6e.12xlarge.gpus": "4", "g6e.12xlarge.efaInterfaces": "1",
                                              "g6e.12xlarge.allocatableCPU": "47810m",
                                              "g6e.12xlarge.allocatableMemory": "380000Mi"}}))
    job = tmp_path / "g6e.yaml"
    job.write_text(yaml.safe_dump(JobDoc("g6e").set("spec.cluster.instanceType", "g6e.12xlarge").obj()))
    out = finetune("validate", str(job))
    assert out.returncode == 0 and "not in the built-in table" in out.stderr and "figures: none here" in out.stdout
    out = finetune("validate", "--instance-types", str(extra), str(job))
    assert out.returncode == 0, out.stderr
    assert f"g6e.12xlarge figures: {extra} (ConfigMap extra)" in out.stdout
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(JobDoc("big").set("spec.cluster.instanceType", "g6e.12xlarge")
                                  .set("spec.cluster.workers.gpusPerWorker", 8).set("spec.training.globalBatchSize", 64).obj()))
    out = finetune("validate", "--instance-types", str(extra), str(big))
    assert out.returncode == 1
    assert "spec.cluster.workers.gpusPerWorker: 8 GPUs per worker do not fit g6e.12xlarge (4 GPUs; figures from" in out.stderr
    out = finetune("render", "--no-runtime", "--instance-types", str(extra), str(job))
    assert out.returncode == 0, out.stderr
    rayjob = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "RayJob"][0]
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["nodeSelector"]["node.kubernetes.io/instance-type"] == "g6e.12xlarge"
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"


POLICY = AllowList(images=("public.ecr.aws/deep-learning-containers/ray:*", "registry.example/ray:2.58.0"),
                   service_accounts=("default", "s3-*"), source="ConfigMap p")
ALLOW = [
    ("default-image", {}, []),
    ("exact-image", {"spec.cluster.image": "registry.example/ray:2.58.0"}, []),
    ("other-tag", {"spec.cluster.image": "registry.example/ray:latest"}, ["spec.cluster.image"]),
    ("evil-image", {"spec.cluster.image": "evil.example/miner:1"}, ["spec.cluster.image"]),
    ("prefix-sa", {"spec.cluster.serviceAccountName": "s3-reader"}, []),
    ("admin-sa", {"spec.cluster.serviceAccountName": "cluster-admin"}, ["spec.cluster.serviceAccountName"]),
]


@pytest.mark.parametrize(("sets", "paths"), [a[1:] for a in ALLOW], ids=[a[0] for a in ALLOW])
def test_allow_list(sets: dict[str, Any], paths: list[str]) -> None:
    doc = JobDoc()
    for k, v in sets.items():
        doc.set(k, v)
    issues = policy_issues(parse_job(doc.obj()).spec, POLICY)
    assert [i.path for i in issues] == paths
    assert all("ConfigMap p" in i.message for i in issues)


def test_allow_list_from_configmap_data() -> None:
    data = yaml.safe_load((ROOT / "deploy" / "policy.yaml").read_text())["data"]
    allow = AllowList.from_data(data, "x")
    assert allow.images == ("public.ecr.aws/deep-learning-containers/ray:*",)
    assert allow.service_accounts == ("default",)
    assert AllowList.from_data({}, "x").images == ("*",)  # a missing key allows all


NAMES = [("dotted", "qwen2.5-ft", False), ("digit-first", "2qwen", False), ("upper", "Qwen", False),
         ("trailing-dash", "qwen-", False), ("ok", "qwen25-ft", True), ("too-long", "a" * 48, False), ("47", "a" * 47, True)]


@pytest.mark.parametrize(("name", "ok"), [n[1:] for n in NAMES], ids=[n[0] for n in NAMES])
def test_name_rule_matches_the_model(name: str, ok: bool) -> None:
    import re

    cel_regex = NAME_RULES[0]["rule"].split("'")[1]
    assert (bool(re.fullmatch(cel_regex, name)) and len(name) <= 47) == ok
    job, _ = check(JobDoc(name).obj())
    assert (job is not None) == ok


def _kustomize(path: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_deploy_overlays_build() -> None:
    base = _kustomize("deploy")
    kinds = [(d["kind"], d["metadata"]["name"]) for d in base]
    assert ("ClusterRoleBinding", "finetune-operator-children") in kinds
    assert sum(k == "ValidatingAdmissionPolicy" for k, _ in kinds) == 3
    assert ("ConfigMap", "finetune-instance-types") in kinds and ("ConfigMap", "finetune-operator-policy") in kinds
    scoped = _kustomize("examples/namespaced-operator")
    assert ("ClusterRoleBinding", "finetune-operator-children") not in [(d["kind"], d["metadata"]["name"]) for d in scoped]
    assert any(d["kind"] == "RoleBinding" and d["roleRef"]["name"] == "finetune-operator-children" for d in scoped)
    assert "--namespace=ml-team" in _operator_args(scoped)
    tls = _operator_args(_kustomize("examples/tls-operator"))
    assert [a for a in tls if a.startswith("--progress-url=")] == ["--progress-url=https://finetune-operator.finetune-system.svc:8080"]
    assert {"--tls-cert=/etc/finetune/tls/tls.crt", "--tls-key=/etc/finetune/tls/tls.key",
            "--progress-ca=/etc/finetune/tls/ca.crt"} <= set(tls)

