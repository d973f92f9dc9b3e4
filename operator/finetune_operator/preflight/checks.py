"""`finetune preflight`: is this cluster ready for a first FinetuneJob? Pure checks over what was read
(`gather` in preflight/cli.py does the reading), each with the fix a user can run.

Checks: the FinetuneJob and KubeRay CRDs, the KubeRay operator's version, nodes of the instance type
advertising nvidia.com/gpu and vpc.amazonaws.com/efa (device plugins), hugepages-2Mi allocatable, their
taints against the tolerations worker pods get, one zone for EFA, an untainted node for the Ray head,
the operator's RBAC, and enough nodes for a job (controller/capacity.py's capacity check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..api import quantity
from ..api.spec import FinetuneJobSpec
from ..controller.capacity import check_capacity
from ..render.rayjob import EFA, GPU, HUGEPAGES, INSTANCE_LABEL

ZONE_LABEL = "topology.kubernetes.io/zone"
# What a worker pod tolerates (render/rayjob.py) when the job sets no extra tolerations.
WORKER_TOLERATIONS = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
                      {"key": EFA, "operator": "Exists", "effect": "NoSchedule"}]
MIN_KUBERAY = (1, 6)
ADDONS = "bash deploy/eks/install-addons.sh"


@dataclass(frozen=True)
class Check:
    status: str  # ok, warn, fail
    what: str
    detail: str
    fix: str = ""


@dataclass
class Facts:
    instance_type: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    crds: set[str] = field(default_factory=set)
    kuberay_images: list[str] = field(default_factory=list)
    # (verb, resource) -> allowed, for the operator's ServiceAccount
    operator_access: dict[tuple[str, str], bool] = field(default_factory=dict)
    operator_sa: str = "system:serviceaccount:finetune-system:finetune-operator"
    job: FinetuneJobSpec | None = None


def _alloc(node: dict[str, Any], resource: str) -> float:
    value = (node.get("status", {}).get("allocatable") or {}).get(resource)
    return float(quantity.parse(str(value))) if value is not None else 0.0


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value") == taint.get("value"):
            return True
    return False


def _blocking(node: dict[str, Any], tolerations: list[dict[str, Any]]) -> list[str]:
    return [f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in node.get("spec", {}).get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(t, tolerations)]


def _version(image: str) -> tuple[int, ...] | None:
    tag = image.rsplit(":", 1)[-1] if ":" in image.rsplit("/", 1)[-1] else ""
    try:
        return tuple(int(p) for p in tag.lstrip("v").split("-")[0].split(".")[:2])
    except ValueError:
        return None


def names(nodes: list[dict[str, Any]]) -> str:
    return ", ".join(n["metadata"]["name"] for n in nodes)


def evaluate(f: Facts) -> list[Check]:
    out: list[Check] = []
    add = out.append
    add(Check("ok", "FinetuneJob CRD", "finetunejobs.finetune.dev installed") if "finetunejobs.finetune.dev" in f.crds
        else Check("fail", "FinetuneJob CRD", "finetunejobs.finetune.dev not installed",
                   "helm install finetune-operator deploy/helm/finetune-operator -n finetune-system --create-namespace"))
    ray_crds = {"rayjobs.ray.io", "rayclusters.ray.io"}
    if ray_crds <= f.crds:
        add(Check("ok", "KubeRay CRDs", "rayjobs.ray.io and rayclusters.ray.io installed"))
    else:
        add(Check("fail", "KubeRay CRDs", f"missing {', '.join(sorted(ray_crds - f.crds))}", ADDONS))
    versions = [v for v in (_version(i) for i in f.kuberay_images) if v]
    if not f.kuberay_images:
        add(Check("fail", "KubeRay operator", "no Deployment runs a kuberay/operator image", ADDONS))
    elif not versions or max(versions) < MIN_KUBERAY:
        add(Check("fail", "KubeRay operator", f"{', '.join(f.kuberay_images)}: need >= v{MIN_KUBERAY[0]}.{MIN_KUBERAY[1]}",
                  ADDONS))
    else:
        add(Check("ok", "KubeRay operator", ", ".join(f.kuberay_images)))

    typed = [n for n in f.nodes if (n["metadata"].get("labels") or {}).get(INSTANCE_LABEL) == f.instance_type]
    itype = f.instance_type
    if not typed:
        add(Check("fail", f"{itype} nodes", f"no node labelled {INSTANCE_LABEL}={itype}",
                  "eksctl create nodegroup -f deploy/eks/cluster.yaml (or apply deploy/eks/karpenter.yaml)"))
    else:
        for resource, plugin in ((GPU, "NVIDIA device plugin"), (EFA, "EFA device plugin")):
            lacking = [n for n in typed if _alloc(n, resource) <= 0]
            add(Check("fail", f"{resource} allocatable", f"none on {names(lacking)}: is the {plugin} running there?", ADDONS)
                if lacking else Check("ok", f"{resource} allocatable", f"on all {len(typed)} {itype} node(s)"))
        need = 5120 * 2**20
        low = [n for n in typed if _alloc(n, HUGEPAGES) < need]
        add(Check("fail", "hugepages-2Mi allocatable", f"under 5120Mi on {names(low)}",
                  "sysctl vm.nr_hugepages=2560 before the kubelet starts (deploy/eks/cluster.yaml preBootstrapCommands)")
            if low else Check("ok", "hugepages-2Mi allocatable", f">= 5120Mi on all {len(typed)} {itype} node(s)"))
        user_tolerations = [t.wire() for t in f.job.cluster.tolerations] if f.job else []
        tolerations = WORKER_TOLERATIONS + user_tolerations
        blocked = {n["metadata"]["name"]: b for n in typed if (b := _blocking(n, tolerations))}
        if blocked:
            detail = "; ".join(f"{n}: {', '.join(b)}" for n, b in sorted(blocked.items()))
            add(Check("fail", "taints vs worker tolerations", f"workers do not tolerate {detail}",
                      "remove the taint, or add a matching toleration to spec.cluster.tolerations"))
        else:
            add(Check("ok", "taints vs worker tolerations", "worker pods tolerate every taint of the nodes"))
        zones = {(n["metadata"].get("labels") or {}).get(ZONE_LABEL, "?") for n in typed}
        add(Check("ok", "one zone for EFA", f"all in {zones.pop()}") if len(zones) == 1 else
            Check("warn", "one zone for EFA", f"{itype} nodes span zones {', '.join(sorted(zones))}; EFA does not cross zones",
                  "keep the GPU node group in one availability zone (deploy/eks/cluster.yaml)"))
    heads = [n for n in f.nodes if not _blocking(n, [t.wire() for t in f.job.cluster.tolerations] if f.job else [])
             and not n.get("spec", {}).get("unschedulable")]
    add(Check("ok", "node for the Ray head", f"{len(heads)} untainted node(s)") if heads else
        Check("fail", "node for the Ray head", "every node has a taint the Ray head does not tolerate",
              "add an untainted CPU node group (deploy/eks/cluster.yaml, node group cpu)"))
    denied = sorted(f"{verb} {res}" for (verb, res), ok in f.operator_access.items() if not ok)
    if f.operator_access:
        add(Check("fail", "operator RBAC", f"{f.operator_sa} may not: {', '.join(denied)}",
                  "helm upgrade --install finetune-operator deploy/helm/finetune-operator (or kubectl apply -k deploy/)")
            if denied else Check("ok", "operator RBAC", f"{f.operator_sa} has what the operator needs"))
    if f.job is not None:
        cap = check_capacity(f.job, f.nodes)
        add(Check("ok" if cap.fits else "warn", "capacity for the job", cap.message,
                  "" if cap.fits else "scale the GPU node group (or let Karpenter add nodes)"))
    return out


def render(checks: list[Check]) -> str:
    marks = {"ok": "[ok]  ", "warn": "[warn]", "fail": "[FAIL]"}
    lines = []
    for c in checks:
        lines.append(f"{marks[c.status]} {c.what}: {c.detail}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    failed = sum(c.status == "fail" for c in checks)
    lines.append(f"checklist: {failed} of {len(checks)} to fix" if failed else f"checklist: all {len(checks)} ok")
    return "\n".join(lines) + "\n"
