"""FinetuneJob -> child objects (the shared runtime ConfigMap and the KubeRay RayJob). Pure.

No clock, no randomness, no API calls: the same inputs give byte-identical output, so GitOps diffs and
the golden files stay quiet. The training code reaches the cluster without building an image: its
Python source travels in a runtime ConfigMap, mounted at RUNTIME_MOUNT in every Ray pod and put on
PYTHONPATH; the resolved FinetuneJob travels in the head pod's own annotation CONFIG_ANNOTATION, which a
downwardAPI volume shows to the entrypoint as a file (no ConfigMap of its own: two requests less per job).

The runtime ConfigMap is content-addressed (`finetune-runtime-<hash>`) and `immutable: true`: one per
namespace and runtime version, shared by every job that runs that version. It has no owners: the operator
deletes it once no job of the namespace needs it (controller/runtime_configmaps.py), so jobs do not each patch it.
Running trainers never see their code change under them: an operator upgrade renders a new name, and
pods keep the ConfigMap they mounted. Every Ray pod carries the runtime's digest as a label.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import yaml

from ..api import instance_types as it
from ..api import quantity
from ..api import spec as s
from ..api.quantity import fmt_gi
from ..api.storage import PVC_MOUNT_ROOT, parse_pvc
from ..api.validation import SpecError, fit_issues, worker_resources
from .config import (
    CONFIG_KEY,
    CONFIG_MOUNT,
    RUNTIME_MOUNT,
    TOKEN_EXPIRATION_SECONDS,
    TOKEN_FILE,
    TOKEN_MOUNT,
    WORKER_GROUP,
    RenderConfig,
    progress_audience,
)

Obj = dict[str, Any]

GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
HUGEPAGES = "hugepages-2Mi"
INSTANCE_LABEL = "node.kubernetes.io/instance-type"
JOB_LABEL = "finetune.dev/job"
RUNTIME_LABEL = "finetune.dev/runtime"
# The resolved FinetuneJob (YAML), on the head pod template; KubeRay copies template metadata onto the pod,
# and the downwardAPI volume `finetune-config` shows it to the entrypoint at CONFIG_MOUNT/CONFIG_KEY.
CONFIG_ANNOTATION = "finetune.dev/job-config"
HEAD_SHM_MAX_GIB = 8.0
SUBMITTER_CONTAINER = "ray-job-submitter"  # KubeRay fills in this container's command (K8sJobMode)
ENTRYPOINT = f"python3 -m finetune_training --config {CONFIG_MOUNT}/{CONFIG_KEY}"


def child_names(name: str) -> dict[str, str]:
    """Fixed child names (recorded in status by the reconcile that creates them)."""
    return {"rayJob": name}


def runtime_hash(runtime_files: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(runtime_files):
        h.update(path.encode() + b"\0" + runtime_files[path].encode() + b"\0")
    return h.hexdigest()[:12]


def runtime_config_map_name(runtime_files: Mapping[str, str]) -> str:
    return f"finetune-runtime-{runtime_hash(runtime_files)}"


def labels(job: s.FinetuneJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "finetunejob",
        "app.kubernetes.io/instance": job.metadata.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "finetune-operator",
        "app.kubernetes.io/part-of": "finetune-operator",
        JOB_LABEL: job.metadata.name,
    }


def _meta(job: s.FinetuneJob, name: str, component: str) -> Obj:
    meta: Obj = {"name": name, "labels": labels(job, component)}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    if job.metadata.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": s.API_VERSION,
                "kind": s.KIND,
                "name": job.metadata.name,
                "uid": job.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def job_document(job: s.FinetuneJob) -> str:
    """The resolved job (defaults filled in) that the training entrypoint reads (CONFIG_ANNOTATION)."""
    meta: Obj = {"name": job.metadata.name}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    spec = job.spec.wire()
    # Whether the job is suspended is the operator's business, not the trainer's: left out, so suspending
    # and resuming (also the operator's own, by a patch: suspension_patch) leave the pod templates as they are.
    spec.pop("suspend", None)
    doc = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": meta, "spec": spec}
    return str(yaml.safe_dump(doc, sort_keys=True, width=120))


def runtime_key(path: str) -> str:
    """ConfigMap keys cannot hold '/': finetune_training/data.py -> finetune_training__data.py."""
    return path.replace("/", "__")


def render_runtime_config_map(job: s.FinetuneJob, runtime_files: Mapping[str, str]) -> Obj:
    """Shared by every job of the namespace on this runtime version. No ownerReferences: the operator
    collects it once no job of the namespace uses it (controller/runtime_configmaps.py)."""
    digest = runtime_hash(runtime_files)
    meta: Obj = {
        "name": runtime_config_map_name(runtime_files),
        "labels": {
            "app.kubernetes.io/name": "finetune-runtime",
            "app.kubernetes.io/component": "runtime",
            "app.kubernetes.io/managed-by": "finetune-operator",
            "app.kubernetes.io/part-of": "finetune-operator",
            RUNTIME_LABEL: digest,
        },
    }
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "immutable": True,
        "data": {runtime_key(p): runtime_files[p] for p in sorted(runtime_files)},
    }


def is_shared(obj: Obj) -> bool:
    """Children shared between jobs (the runtime ConfigMap): created once, never changed. (A job's RayJob
    carries the runtime label too, beside its job label.)"""
    labels_ = obj["metadata"].get("labels") or {}
    return RUNTIME_LABEL in labels_ and JOB_LABEL not in labels_


# ------------------------------------------------------------------------------------------------ pods


def _pvc_claims(spec: s.FinetuneJobSpec) -> list[str]:
    uris = [spec.model.source, spec.dataset.source, spec.training.checkpoint.storage_uri]
    return sorted({p.claim for p in (parse_pvc(u) for u in uris) if p})


def pvc_volume_name(claim: str) -> str:
    """A volume name is a DNS-1123 label; a claim is a DNS-1123 subdomain (dots, up to 253 characters).
    Claims that are labels keep their readable name; others get a digest, so two never share a name."""
    vol = f"pvc-{claim}"
    if len(vol) <= 63 and "." not in vol:
        return vol
    digest = hashlib.sha256(claim.encode()).hexdigest()[:10]
    return f"pvc-{claim.replace('.', '-')[:48].rstrip('-')}-{digest}"


def _volumes(job: s.FinetuneJob, runtime_files: Mapping[str, str], cfg: RenderConfig,
             head: bool) -> tuple[list[Obj], list[Obj]]:
    volumes: list[Obj] = [
        {"name": "ray-logs", "emptyDir": {}},
        {
            "name": "finetune-runtime",
            "configMap": {
                "name": runtime_config_map_name(runtime_files),
                "items": [{"key": runtime_key(p), "path": p} for p in sorted(runtime_files)],
            },
        },
    ]
    mounts: list[Obj] = [
        {"name": "ray-logs", "mountPath": "/tmp/ray"},
        {"name": "finetune-runtime", "mountPath": RUNTIME_MOUNT, "readOnly": True},
    ]
    if head:  # the entrypoint (the Ray driver) runs on the head: the workers get the job from it
        volumes.append({"name": "finetune-config", "downwardAPI": {"items": [
            {"path": CONFIG_KEY, "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}}]}})
        mounts.append({"name": "finetune-config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    for claim in _pvc_claims(job.spec):
        vol = pvc_volume_name(claim)
        volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": vol, "mountPath": f"{PVC_MOUNT_ROOT}/{claim}"})
    if cfg.progress_url:
        volumes.append(
            {
                "name": "finetune-progress-token",
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "audience": progress_audience(job.metadata.namespace or "default", job.metadata.name),
                                "expirationSeconds": TOKEN_EXPIRATION_SECONDS,
                                "path": TOKEN_FILE,
                            }
                        }
                    ]
                },
            }
        )
        mounts.append({"name": "finetune-progress-token", "mountPath": TOKEN_MOUNT, "readOnly": True})
    return volumes, mounts


def _env(job: s.FinetuneJob, cfg: RenderConfig, *, worker: bool) -> list[Obj]:
    spec = job.spec
    env: list[Obj] = [
        {"name": "PYTHONPATH", "value": RUNTIME_MOUNT},
        {"name": "FINETUNE_JOB_NAME", "value": job.metadata.name},
        {"name": "FINETUNE_JOB_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "FINETUNE_INSTANCE_TYPE", "value": spec.cluster.instance_type},
        {"name": "FINETUNE_REQUIRE_EFA", "value": "1" if spec.network.require_efa else "0"},
        {"name": "NCCL_DEBUG", "value": spec.network.nccl_debug.value},
    ]
    if cfg.progress_url:
        ns = job.metadata.namespace or "default"
        env += [
            {"name": "FINETUNE_PROGRESS_URL", "value": f"{cfg.progress_url.rstrip('/')}/v1/progress/{ns}/{job.metadata.name}"},
            {"name": "FINETUNE_PROGRESS_TOKEN_FILE", "value": f"{TOKEN_MOUNT}/{TOKEN_FILE}"},
        ]
        if cfg.progress_ca:
            env.append({"name": "FINETUNE_PROGRESS_CA", "value": cfg.progress_ca})
    if spec.model.hub_token_secret_ref:
        ref = spec.model.hub_token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if worker and spec.cluster.workers.gpus_per_worker:
        # NCCL's init log goes to a per-process file the runtime's network probe parses (transport,
        # provider, plugin version); INIT+NET carry the aws-ofi-nccl and "Using network" lines.
        env += [
            {"name": "NCCL_DEBUG_FILE", "value": "/tmp/finetune-nccl.%h.%p.log"},
            {"name": "NCCL_DEBUG_SUBSYS", "value": "INIT,NET,ENV"},
        ]
    if worker and spec.network.efa:
        inst = it.lookup(spec.cluster.instance_type, cfg.instance_types)
        env += [
            {"name": "FI_PROVIDER", "value": "efa"},
            {"name": "NCCL_NET_PLUGIN", "value": "ofi"},
            {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
            # Ray and PyTorch data loaders fork; libfabric must know (else memory registration breaks).
            {"name": "FI_EFA_FORK_SAFE", "value": "1"},
        ]
        if spec.network.require_efa:
            # aws-ofi-nccl's network name: pinned, NCCL fails instead of falling back to sockets.
            env.append({"name": "NCCL_NET", "value": "Libfabric"})
        if inst is not None and inst.gpudirect_rdma:
            env.append({"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"})
    elif worker:
        env.append({"name": "NCCL_SOCKET_IFNAME", "value": "eth0"})
    # User env last; a user entry replaces ours of the same name (explicit beats default).
    user = {e.name: e.value for e in spec.cluster.env}
    env = [e for e in env if e["name"] not in user]
    env += [{"name": n, "value": v} for n, v in user.items()]
    return env


def _env_from(spec: s.FinetuneJobSpec) -> list[Obj]:
    out: list[Obj] = []
    for src in spec.cluster.env_from:
        item: Obj = {}
        if src.config_map_ref:
            item["configMapRef"] = {"name": src.config_map_ref}
        if src.secret_ref:
            item["secretRef"] = {"name": src.secret_ref}
        if src.prefix:
            item["prefix"] = src.prefix
        out.append(item)
    return out


def _pod_meta(job: s.FinetuneJob, component: str, runtime_files: Mapping[str, str], head: bool) -> Obj:
    """A Ray pod template's metadata: the job's labels and the runtime it mounts; on the head, where the
    entrypoint runs, also the resolved job it reads (not on every worker pod: 2-3 KB each)."""
    meta: Obj = {"labels": {**labels(job, component), RUNTIME_LABEL: runtime_hash(runtime_files)}}
    if head:
        meta["annotations"] = {CONFIG_ANNOTATION: job_document(job)}
    return meta


def _pod_common(spec: s.FinetuneJobSpec) -> Obj:
    pod: Obj = {}
    if spec.cluster.service_account_name:
        pod["serviceAccountName"] = spec.cluster.service_account_name
    if spec.cluster.priority_class_name:
        pod["priorityClassName"] = spec.cluster.priority_class_name
    return pod


def _head(job: s.FinetuneJob, runtime_files: Mapping[str, str], cfg: RenderConfig) -> Obj:
    spec = job.spec
    volumes, mounts = _volumes(job, runtime_files, cfg, head=True)
    # Ray's object store and PyTorch data loaders use /dev/shm; the container default is 64 MiB.
    shm_gib = min(quantity.gib(spec.cluster.head.memory) / 4, HEAD_SHM_MAX_GIB)
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": fmt_gi(shm_gib)}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    resources = {"cpu": spec.cluster.head.cpu, "memory": spec.cluster.head.memory}
    container: Obj = {
        "name": "ray-head",
        "image": spec.cluster.image,
        # GPU-less node with an nvidia default runtime: skip the NVML hook instead of failing.
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}] + _env(job, cfg, worker=False),
        "ports": [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
        ],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }
    if spec.cluster.env_from:
        container["envFrom"] = _env_from(spec)
    pod: Obj = {**_pod_common(spec), "containers": [container], "volumes": volumes}
    if spec.cluster.head.node_selector:
        pod["nodeSelector"] = dict(sorted(spec.cluster.head.node_selector.items()))
    if spec.cluster.tolerations:
        pod["tolerations"] = [t.wire() for t in spec.cluster.tolerations]
    return {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {"metadata": _pod_meta(job, "ray-head", runtime_files, head=True), "spec": pod},
    }


def _worker(job: s.FinetuneJob, runtime_files: Mapping[str, str], cfg: RenderConfig) -> Obj:
    spec = job.spec
    inst = it.lookup(spec.cluster.instance_type, cfg.instance_types)
    assert inst is not None  # fit_issues ran first
    res = worker_resources(spec, cfg.instance_types)
    assert res is not None
    cpu, mem_gib, _, shm_gib = res
    w = spec.cluster.workers
    resources: dict[str, str] = {"cpu": w.cpu or f"{cpu:g}", "memory": w.memory or fmt_gi(mem_gib)}
    if w.gpus_per_worker:
        resources[GPU] = str(w.gpus_per_worker)
    if spec.network.efa:
        efa = spec.cluster.efa_interfaces_per_worker
        resources[EFA] = str(inst.efa_interfaces if efa is None else efa)
        resources[HUGEPAGES] = w.hugepages2_mi
    volumes, mounts = _volumes(job, runtime_files, cfg, head=False)
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": w.shm_size or fmt_gi(shm_gib)}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.network.efa:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    container: Obj = {
        "name": "ray-worker",
        "image": spec.cluster.image,
        "env": _env(job, cfg, worker=True),
        "resources": {"requests": dict(sorted(resources.items())), "limits": dict(sorted(resources.items()))},
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }
    if spec.network.efa:
        # libfabric pins (registers) memory for EFA: needs IPC_LOCK for an unlimited memlock.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    if spec.cluster.env_from:
        container["envFrom"] = _env_from(spec)
    tolerations: list[Obj] = []
    if w.gpus_per_worker:
        tolerations.append({"key": GPU, "operator": "Exists", "effect": "NoSchedule"})
    if spec.network.efa:
        tolerations.append({"key": EFA, "operator": "Exists", "effect": "NoSchedule"})
    tolerations += [t.wire() for t in spec.cluster.tolerations]
    pod: Obj = {
        **_pod_common(spec),
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": dict(sorted({**spec.cluster.node_selector, INSTANCE_LABEL: inst.name}.items())),
    }
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.cluster.affinity:
        pod["affinity"] = spec.cluster.affinity
    return {
        "groupName": WORKER_GROUP,
        "replicas": w.replicas,
        "minReplicas": w.replicas,
        "maxReplicas": w.replicas,
        "rayStartParams": {"num-gpus": str(w.gpus_per_worker)},
        "template": {"metadata": _pod_meta(job, "ray-worker", runtime_files, head=False), "spec": pod},
    }


def _submitter(job: s.FinetuneJob, cfg: RenderConfig) -> Obj:
    """The pod that runs `ray job submit` (KubeRay K8sJobMode): small, on the head's nodes, with the
    job's labels, and a CPU image (KubeRay's default is the head's GPU image, pulled just to submit)."""
    spec = job.spec
    resources = {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
    container: Obj = {
        "name": SUBMITTER_CONTAINER,
        "image": cfg.submitter_image.replace("{rayVersion}", spec.cluster.ray_version),
        "resources": resources,
    }
    pod: Obj = {"restartPolicy": "Never", "containers": [container]}
    if spec.cluster.priority_class_name:
        pod["priorityClassName"] = spec.cluster.priority_class_name
    if spec.cluster.head.node_selector:
        pod["nodeSelector"] = dict(sorted(spec.cluster.head.node_selector.items()))
    if spec.cluster.tolerations:
        pod["tolerations"] = [t.wire() for t in spec.cluster.tolerations]
    return {"metadata": {"labels": labels(job, "submitter")}, "spec": pod}


def suspension_patch(spec: s.FinetuneJobSpec, suspend: bool) -> Obj:
    """A JSON merge patch for the RayJob's spec that suspends or resumes it on the operator's own initiative
    (a stall policy), with the cleanup fields KubeRay's validation demands for that state (see _cleanup):
    patching `suspend` alone onto a RayJob rendered with deletionRules makes KubeRay mark it ValidationFailed."""
    cleanup = _cleanup(spec.model_copy(update={"suspend": suspend}))
    return {"spec": {"suspend": suspend, "deletionStrategy": None, "ttlSecondsAfterFinished": None, **cleanup}}


def _cleanup(spec: s.FinetuneJobSpec) -> Obj:
    """When KubeRay deletes the Ray cluster. Success: after ttlSecondsAfterFinished. Failure: after
    ttlSecondsAfterFailure, so the pods' logs can still be read. KubeRay v1.6 expresses per-outcome TTLs
    only as deletionRules, which exclude shutdownAfterJobFinishes, while suspending needs it
    (utils/validation.go): a suspended job is rendered with shutdownAfterJobFinishes instead."""
    done = spec.ttl_seconds_after_finished or 0
    if spec.suspend:
        return {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": done}
    failed = max(done, spec.ttl_seconds_after_failure)
    rule = "DeleteCluster"
    return {
        "shutdownAfterJobFinishes": False,
        "deletionStrategy": {
            "deletionRules": [
                {"policy": rule, "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": done}},
                {"policy": rule, "condition": {"jobStatus": "FAILED", "ttlSeconds": failed}},
                # Failed deployments (deadline exceeded, retries exhausted, submitter failed) whose Ray
                # job never reached FAILED.
                {"policy": rule, "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": failed}},
            ]
        },
    }


def render_rayjob(job: s.FinetuneJob, runtime_files: Mapping[str, str], cfg: RenderConfig) -> Obj:
    spec = job.spec
    errors = fit_issues(spec, cfg.instance_types)
    if errors:
        raise SpecError(errors)
    rayjob_spec: Obj = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": "K8sJobMode",
        **_cleanup(spec),
        "backoffLimit": spec.backoff_limit,
        "suspend": spec.suspend,
        "submitterPodTemplate": _submitter(job, cfg),
        "rayClusterSpec": {
            "rayVersion": spec.cluster.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": _head(job, runtime_files, cfg),
            "workerGroupSpecs": [_worker(job, runtime_files, cfg)],
        },
    }
    if spec.active_deadline_seconds:
        rayjob_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    if spec.cluster.pip:
        rayjob_spec["runtimeEnvYAML"] = yaml.safe_dump({"pip": list(spec.cluster.pip)}, sort_keys=True)
    meta = _meta(job, child_names(job.metadata.name)["rayJob"], "rayjob")
    meta["labels"][RUNTIME_LABEL] = runtime_hash(runtime_files)  # KubeRay copies it onto the RayCluster
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": rayjob_spec}


def render_children(job: s.FinetuneJob, runtime_files: Mapping[str, str], cfg: RenderConfig) -> list[Obj]:
    """Everything the job needs, in apply order (the runtime ConfigMap before the RayJob that mounts it)."""
    rayjob = render_rayjob(job, runtime_files, cfg)
    return [render_runtime_config_map(job, runtime_files), rayjob]


def to_yaml(objs: list[Obj]) -> str:
    return str(yaml.safe_dump_all(objs, sort_keys=False, width=120))
