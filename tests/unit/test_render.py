"""The renderer: FinetuneJob -> ConfigMaps + RayJob, pure and correct for the instance type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.api.grammar import DNS1123_LABEL
from finetune_operator.api.validation import SpecError, parse_job
from finetune_operator.render.config import CONFIG_KEY, CONFIG_MOUNT, RenderConfig, progress_audience
from finetune_operator.render.rayjob import (
    CONFIG_ANNOTATION,
    is_shared,
    render_children,
    render_rayjob,
    render_runtime_config_map,
    runtime_config_map_name,
    suspension_patch,
    to_yaml,
)

from tests.builders import JobDoc
from tests.unit.rendering import CFG, EXAMPLES, FAKE_RUNTIME, render_example

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"



NO_PROGRESS = RenderConfig()
def rayjob_for(doc: dict[str, Any], cfg: RenderConfig = NO_PROGRESS) -> dict[str, Any]:
    return render_rayjob(parse_job(doc), FAKE_RUNTIME, cfg)


def workers(rj: dict[str, Any]) -> dict[str, Any]:
    (group,) = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group


def container(group: dict[str, Any]) -> dict[str, Any]:
    (c,) = group["template"]["spec"]["containers"]
    return c


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_golden(example: Path, request: pytest.FixtureRequest) -> None:
    doc = yaml.safe_load(example.read_text())
    doc["metadata"].update(namespace="ml", uid="00000000-0000-0000-0000-000000000001")
    out = to_yaml(render_example(doc))
    golden = GOLDEN / f"{example.stem}.yaml"
    if request.config.getoption("--update-golden"):
        golden.write_text(out)
    assert golden.exists(), f"no golden file for {example.name}: run pytest --update-golden and review the diff"
    assert out == golden.read_text(), f"{golden} is stale: run pytest --update-golden and review the diff"


def test_every_example_has_a_golden_file() -> None:
    assert {e.stem for e in EXAMPLES} == {g.stem for g in GOLDEN.glob("*.yaml")}


def test_deterministic() -> None:
    doc = JobDoc().obj()
    a = to_yaml(render_children(parse_job(doc), FAKE_RUNTIME, CFG))
    b = to_yaml(render_children(parse_job(JobDoc().obj()), dict(reversed(FAKE_RUNTIME.items())), CFG))
    assert a == b


def test_seed_setup_g6_12xlarge_with_efa() -> None:
    rj = rayjob_for(yaml.safe_load((ROOT / "examples" / "qwen2.5-1.5b-g6-efa.yaml").read_text()))
    w = workers(rj)
    assert w["replicas"] == w["minReplicas"] == w["maxReplicas"] == 2
    c = container(w)
    limits = c["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4"
    assert limits["vpc.amazonaws.com/efa"] == "1"
    assert limits["hugepages-2Mi"] == "5120Mi"
    assert (limits["cpu"], limits["memory"]) == ("40", "160Gi")
    assert c["resources"]["requests"] == limits
    assert w["rayStartParams"]["num-gpus"] == "4"
    e = env(c)
    assert e["FI_PROVIDER"] == "efa" and e["NCCL_NET_PLUGIN"] == "ofi" and e["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "FI_EFA_USE_DEVICE_RDMA" not in e  # g6 has no GPUDirect RDMA
    assert e["FINETUNE_REQUIRE_EFA"] == "1" and e["NCCL_NET"] == "Libfabric"  # NCCL itself refuses to fall back
    spec = w["template"]["spec"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "g6.12xlarge"}
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "vpc.amazonaws.com/efa"}
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    hc = container(head)
    assert "nvidia.com/gpu" not in hc["resources"]["limits"]
    assert env(hc)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert rj["spec"]["shutdownAfterJobFinishes"] is False  # deletionRules instead (see test_cleanup_rules)
    assert rj["spec"]["backoffLimit"] == 2
    assert "rayClusterSpec" in rj["spec"] and "clusterSelector" not in rj["spec"]


@pytest.mark.parametrize(
    ("instance", "gpus", "efa", "cpu", "memory"),
    [
        ("g6.12xlarge", "4", "1", "40", "160Gi"),
        ("g6.48xlarge", "8", "1", "160", "640Gi"),
        ("g5.48xlarge", "8", "1", "160", "640Gi"),
        ("p4d.24xlarge", "8", "4", "80", "960Gi"),
        ("p5.48xlarge", "8", "32", "160", "1706Gi"),
    ],
)
def test_instance_table(instance: str, gpus: str, efa: str, cpu: str, memory: str) -> None:
    doc = JobDoc().set("spec.cluster.instanceType", instance).set("spec.cluster.workers.gpusPerWorker", int(gpus))
    doc.set("spec.training.globalBatchSize", 64)
    c = container(workers(rayjob_for(doc.obj())))
    limits = c["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"], limits["cpu"], limits["memory"]) == (
        gpus,
        efa,
        cpu,
        memory,
    )
    rdma = env(c).get("FI_EFA_USE_DEVICE_RDMA")
    assert rdma == ("1" if instance.startswith("p") else None)
    assert "NCCL_NET" not in env(c)  # requireEFA off: NCCL may fall back, the probe reports it


def test_efa_off_has_no_efa_resources_or_env() -> None:
    c = container(workers(rayjob_for(JobDoc().set("spec.network.efa", False).obj())))
    limits = c["resources"]["limits"]
    assert "vpc.amazonaws.com/efa" not in limits and "hugepages-2Mi" not in limits
    e = env(c)
    assert "FI_PROVIDER" not in e and "NCCL_NET_PLUGIN" not in e and "NCCL_NET" not in e
    assert "securityContext" not in c


def test_spec_that_does_not_fit_is_rejected() -> None:
    with pytest.raises(SpecError) as err:
        rayjob_for(JobDoc().set("spec.cluster.workers.gpusPerWorker", 8).obj())
    assert "spec.cluster.workers.gpusPerWorker" in str(err.value)


def test_progress_channel_is_wired_with_a_job_specific_audience() -> None:
    doc = JobDoc(name="alpha").obj()
    doc["metadata"]["namespace"] = "team-a"
    rj = rayjob_for(doc, CFG)
    for group in (rj["spec"]["rayClusterSpec"]["headGroupSpec"], workers(rj)):
        spec = group["template"]["spec"]
        token = next(v for v in spec["volumes"] if v["name"] == "finetune-progress-token")
        sa = token["projected"]["sources"][0]["serviceAccountToken"]
        assert sa["audience"] == progress_audience("team-a", "alpha") == "finetune.dev/progress/team-a/alpha"
        e = env(container(group))
        assert e["FINETUNE_PROGRESS_URL"].endswith("/v1/progress/team-a/alpha")
        assert group["template"]["metadata"]["labels"]["finetune.dev/job"] == "alpha"


def test_hub_token_is_a_secret_reference_never_a_value() -> None:
    doc = JobDoc().set("spec.model.hubTokenSecretRef", {"name": "hf", "key": "token"}).obj()
    objs = render_children(parse_job(doc), FAKE_RUNTIME, CFG)
    c = container(workers(objs[-1]))
    hf = next(e for e in c["env"] if e["name"] == "HF_TOKEN")
    assert hf == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def test_pvc_sources_are_mounted_once_per_claim() -> None:
    doc = (
        JobDoc()
        .set("spec.model.source", "pvc://fsx/models/qwen")
        .set("spec.dataset.source", "pvc://fsx/data/train.jsonl")
        .set("spec.training.checkpoint.storageUri", "pvc://ckpt/runs")
        .obj()
    )
    spec = workers(rayjob_for(doc))["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["ckpt", "fsx"]
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {"/mnt/finetune/pvc/fsx", "/mnt/finetune/pvc/ckpt"} <= mounts


def test_pvc_volume_names_are_dns1123_labels_for_any_claim() -> None:
    # A claim is a DNS-1123 subdomain (dots, up to 253 characters); a volume name is a DNS-1123 label. Before
    # issue 30 `pvc://models.team-a/...` rendered the volume `pvc-models.team-a`, which the API server refuses
    # when KubeRay creates the pod (the RayJob itself is accepted): a job stuck after admission.
    long_claim = "c" * 70
    doc = (
        JobDoc()
        .set("spec.model.source", "pvc://models.team-a/qwen")
        .set("spec.dataset.source", "pvc://models-team-a/data.jsonl")
        .set("spec.training.checkpoint.storageUri", f"pvc://{long_claim}/runs")
        .obj()
    )
    spec = workers(rayjob_for(doc))["template"]["spec"]
    vols = {v["persistentVolumeClaim"]["claimName"]: v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    assert set(vols) == {"models.team-a", "models-team-a", long_claim}
    assert vols["models-team-a"] == "pvc-models-team-a"  # a label already: kept as it was
    assert len(set(vols.values())) == 3
    for name in vols.values():
        assert DNS1123_LABEL.check(name) is None, name
    mounts = {m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert set(vols.values()) <= mounts


def test_user_env_overrides_defaults_and_extras_are_kept() -> None:
    doc = (
        JobDoc()
        .set("spec.cluster.env", [{"name": "NCCL_SOCKET_IFNAME", "value": "ens5"}, {"name": "X", "value": "1"}])
        .set("spec.cluster.tolerations", [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}])
        .set("spec.cluster.nodeSelector", {"topology.kubernetes.io/zone": "us-west-2a"})
        .set("spec.cluster.priorityClassName", "training")
        .obj()
    )
    w = workers(rayjob_for(doc))
    names = [e["name"] for e in container(w)["env"]]
    assert names.count("NCCL_SOCKET_IFNAME") == 1
    assert env(container(w))["NCCL_SOCKET_IFNAME"] == "ens5"
    spec = w["template"]["spec"]
    assert spec["nodeSelector"]["topology.kubernetes.io/zone"] == "us-west-2a"
    assert any(t["key"] == "team" for t in spec["tolerations"])
    assert spec["priorityClassName"] == "training"


def test_children_are_labelled_and_owned() -> None:
    doc = JobDoc(name="owned").obj()
    doc["metadata"]["uid"] = "u-1"
    runtime, rayjob = render_children(parse_job(doc), FAKE_RUNTIME, CFG)
    for obj in (runtime, rayjob):
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "finetune-operator"
    # The runtime ConfigMap is shared and has no owners: the operator collects it (controller/runtime_configmaps.py).
    assert is_shared(runtime) and "ownerReferences" not in runtime["metadata"] and not is_shared(rayjob)
    (ref,) = rayjob["metadata"]["ownerReferences"]
    assert ref["uid"] == "u-1" and ref["kind"] == "FinetuneJob" and ref["controller"] is True
    digest = runtime["metadata"]["labels"]["finetune.dev/runtime"]
    # The RayJob (and, through KubeRay, its RayCluster) and every Ray pod name the runtime they mount.
    assert rayjob["metadata"]["labels"]["finetune.dev/job"] == "owned"
    assert rayjob["metadata"]["labels"]["finetune.dev/runtime"] == digest
    for group in (rayjob["spec"]["rayClusterSpec"]["headGroupSpec"], workers(rayjob)):
        assert group["template"]["metadata"]["labels"]["finetune.dev/runtime"] == digest


def test_the_head_pod_carries_the_resolved_job_and_mounts_it() -> None:
    """No ConfigMap of its own: the resolved job is an annotation of the head pod template (KubeRay copies
    template metadata onto the pod) and a downwardAPI volume shows it where the entrypoint (the Ray driver,
    on the head) reads it. Worker pods carry none of it."""
    rayjob = rayjob_for(JobDoc(name="cfg").obj())
    assert rayjob["spec"]["entrypoint"] == f"python3 -m finetune_training --config {CONFIG_MOUNT}/{CONFIG_KEY}"
    w = workers(rayjob)
    assert "annotations" not in w["template"]["metadata"]
    assert all(v["name"] != "finetune-config" for v in w["template"]["spec"]["volumes"])
    for group in (rayjob["spec"]["rayClusterSpec"]["headGroupSpec"],):
        job = yaml.safe_load(group["template"]["metadata"]["annotations"][CONFIG_ANNOTATION])
        reparsed = parse_job(job)
        assert reparsed.spec == parse_job(JobDoc(name="cfg").obj()).spec
        assert job["spec"]["training"]["fsdp"]["shardingStrategy"] == "hybrid"  # defaults are resolved
        assert "suspend" not in job["spec"]  # the operator's business: suspending leaves the pods' config alone
        vol = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == "finetune-config")
        assert vol == {"name": "finetune-config", "downwardAPI": {"items": [
            {"path": CONFIG_KEY, "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}}]}}
        assert {"name": "finetune-config", "mountPath": CONFIG_MOUNT, "readOnly": True} in container(group)["volumeMounts"]
    suspended = rayjob_for(JobDoc(name="cfg").set("spec.suspend", True).obj())
    assert suspended["spec"]["rayClusterSpec"] == rayjob["spec"]["rayClusterSpec"]


CLEANUP = [
    ("defaults", {}, {"SUCCEEDED": 0, "FAILED": 900, "Failed": 900}),
    ("ttl", {"spec.ttlSecondsAfterFinished": 60}, {"SUCCEEDED": 60, "FAILED": 900, "Failed": 900}),
    ("failure-ttl", {"spec.ttlSecondsAfterFailure": 0}, {"SUCCEEDED": 0, "FAILED": 0, "Failed": 0}),
    ("failure-never-shorter", {"spec.ttlSecondsAfterFinished": 3600, "spec.ttlSecondsAfterFailure": 60},
     {"SUCCEEDED": 3600, "FAILED": 3600, "Failed": 3600}),
]


@pytest.mark.parametrize(("sets", "ttls"), [c[1:] for c in CLEANUP], ids=[c[0] for c in CLEANUP])
def test_cleanup_rules_keep_a_failed_jobs_pods_longer(sets: dict[str, Any], ttls: dict[str, int]) -> None:
    doc = JobDoc()
    for k, v in sets.items():
        doc.set(k, v)
    spec = rayjob_for(doc.obj())["spec"]
    # KubeRay v1.6: deletionRules exclude shutdownAfterJobFinishes and the global TTL (utils/validation.go).
    assert spec["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in spec
    rules = spec["deletionStrategy"]["deletionRules"]
    got = {r["condition"].get("jobStatus") or r["condition"]["jobDeploymentStatus"]: r["condition"]["ttlSeconds"]
           for r in rules}
    assert got == ttls
    assert {r["policy"] for r in rules} == {"DeleteCluster"}


def test_suspended_job_uses_shutdown_after_finish() -> None:
    # KubeRay refuses to suspend a RayJob with shutdownAfterJobFinishes false.
    spec = rayjob_for(JobDoc().set("spec.suspend", True).set("spec.ttlSecondsAfterFinished", 30).obj())["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 30
    assert "deletionStrategy" not in spec


def test_the_operators_own_suspend_and_resume_patches_are_valid_for_kuberay() -> None:
    """A stall policy suspends (and, with Restart, resumes) the RayJob by a merge patch: that patch turns
    the rendered running spec into the rendered suspended one and back (suspend alone is ValidationFailed)."""
    job = parse_job(JobDoc().set("spec.ttlSecondsAfterFinished", 30).obj())
    running = render_rayjob(job, FAKE_RUNTIME, NO_PROGRESS)["spec"]
    held = render_rayjob(job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})}),
                         FAKE_RUNTIME, NO_PROGRESS)["spec"]

    def merge(spec: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        out = dict(spec)
        for k, v in patch["spec"].items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return out

    assert merge(running, suspension_patch(job.spec, True)) == held
    assert merge(held, suspension_patch(job.spec, False)) == running


def test_submitter_pod_is_small_labelled_and_uses_a_cpu_image() -> None:
    doc = JobDoc("sub").set("spec.cluster.tolerations", [{"key": "team", "operator": "Exists"}])
    doc.set("spec.cluster.head.nodeSelector", {"pool": "cpu"})
    sub = rayjob_for(doc.obj())["spec"]["submitterPodTemplate"]
    assert sub["metadata"]["labels"]["finetune.dev/job"] == "sub"
    assert sub["metadata"]["labels"]["app.kubernetes.io/component"] == "submitter"
    pod = sub["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["tolerations"] == [{"key": "team", "operator": "Exists"}] and pod["nodeSelector"] == {"pool": "cpu"}
    (c,) = pod["containers"]
    assert c["name"] == "ray-job-submitter" and "command" not in c  # KubeRay fills in `ray job submit`
    assert c["image"] == "docker.io/rayproject/ray:2.58.0-cpu"
    assert c["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    other = rayjob_for(doc.obj(), RenderConfig(submitter_image="registry.example/ray-slim:{rayVersion}"))
    assert other["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["image"] == "registry.example/ray-slim:2.58.0"


def test_head_has_memory_backed_dev_shm() -> None:
    head = rayjob_for(JobDoc().obj())["spec"]["rayClusterSpec"]["headGroupSpec"]
    spec = head["template"]["spec"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}  # a quarter of the 16Gi head
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(head)["volumeMounts"]


def test_runtime_config_map_is_content_addressed_immutable_and_shared() -> None:
    a = parse_job(JobDoc("a").set("metadata.namespace", "ml").set("metadata.uid", "uid-a").obj())
    b = parse_job(JobDoc("b").set("metadata.namespace", "ml").set("metadata.uid", "uid-b").obj())
    ra, rb = (render_runtime_config_map(j, FAKE_RUNTIME) for j in (a, b))
    assert ra["metadata"]["name"] == rb["metadata"]["name"] == runtime_config_map_name(FAKE_RUNTIME)
    assert ra["metadata"]["name"].startswith("finetune-runtime-") and ra["immutable"] is True
    assert ra["data"] == rb["data"]
    assert "finetune.dev/job" not in ra["metadata"]["labels"] and is_shared(ra)
    assert "ownerReferences" not in ra["metadata"]  # shared: collected by the operator, not by owners
    changed = {**FAKE_RUNTIME, "finetune_training/__init__.py": "# runtime v2\n"}
    assert runtime_config_map_name(changed) != runtime_config_map_name(FAKE_RUNTIME)
    vol = next(v for v in workers(rayjob_for(JobDoc().obj()))["template"]["spec"]["volumes"] if v["name"] == "finetune-runtime")
    assert vol["configMap"]["name"] == runtime_config_map_name(FAKE_RUNTIME)


def test_progress_ca_reaches_every_ray_container() -> None:
    cfg = RenderConfig(progress_url="https://op.svc:8080", progress_ca="-----BEGIN CERTIFICATE-----\nX\n")
    rj = rayjob_for(JobDoc().obj(), cfg)
    for group in (rj["spec"]["rayClusterSpec"]["headGroupSpec"], workers(rj)):
        assert env(container(group))["FINETUNE_PROGRESS_CA"].startswith("-----BEGIN CERTIFICATE-----")
    assert "FINETUNE_PROGRESS_CA" not in env(container(workers(rayjob_for(JobDoc().obj(), CFG))))
