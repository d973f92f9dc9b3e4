"""Environment variables that the renderer (render/rayjob.py `_env`, `_head`) and KubeRay (v1.6.1,
ray-operator/controllers/ray/common/pod.go `setContainerEnvVars`) set in the Ray containers, and whether
`spec.cluster.env` may override each.

A user's `spec.cluster.env` entry replaces the renderer's entry of the same name. Where that breaks the
job (the runtime's code is not found, the network probe reads nothing, requireEFA's pin is undone) or
leaks a secret into the spec, it is rejected at admission with the field path. KubeRay appends some of its
variables after ours, so a user's value of those is silently ignored (the later entry wins): rejected too,
as a field with no effect. The rest may be overridden, with a warning from `finetune validate`.

`spec.cluster.envFrom` cannot be checked at admission (the keys live in the ConfigMap or Secret); the same
table applies to it, documented in docs/api.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Verdict(str, Enum):
    rejected = "rejected"
    rejected_with_require_efa = "rejected with network.requireEFA; warning with network.efa"
    warning_with_efa = "warning with network.efa"
    warning = "warning"


@dataclass(frozen=True)
class Reserved:
    name: str
    set_by: str
    verdict: Verdict
    why: str


OPERATOR = "the operator (all Ray containers)"
WORKERS = "the operator (GPU workers)"
EFA_WORKERS = "the operator (workers, network.efa)"
KUBERAY = "KubeRay"

RESERVED: tuple[Reserved, ...] = (
    Reserved("PYTHONPATH", OPERATOR, Verdict.rejected,
             "the training runtime is mounted from its ConfigMap and found through it"),
    Reserved("FINETUNE_JOB_NAME", OPERATOR, Verdict.rejected, "the runtime reports progress for this job"),
    Reserved("FINETUNE_JOB_NAMESPACE", OPERATOR, Verdict.rejected, "the runtime reports progress for this job"),
    Reserved("FINETUNE_INSTANCE_TYPE", OPERATOR, Verdict.rejected, "set from spec.cluster.instanceType"),
    Reserved("FINETUNE_REQUIRE_EFA", OPERATOR, Verdict.rejected, "set from spec.network.requireEFA"),
    Reserved("FINETUNE_PROGRESS_URL", OPERATOR, Verdict.rejected, "the operator's progress endpoint for this job"),
    Reserved("FINETUNE_PROGRESS_TOKEN_FILE", OPERATOR, Verdict.rejected,
             "the projected ServiceAccount token the progress endpoint checks"),
    Reserved("FINETUNE_PROGRESS_CA", OPERATOR, Verdict.rejected, "the CA of the operator's progress endpoint"),
    Reserved("HF_TOKEN", OPERATOR, Verdict.rejected,
             "a literal token would sit in plain text in the spec; use spec.model.hubTokenSecretRef"),
    Reserved("NCCL_DEBUG", OPERATOR, Verdict.rejected, "set from spec.network.ncclDebug"),
    Reserved("NCCL_DEBUG_FILE", WORKERS, Verdict.rejected,
             "the runtime's network probe reads NCCL's log from this file"),
    Reserved("NCCL_DEBUG_SUBSYS", WORKERS, Verdict.rejected,
             "the runtime's network probe needs the INIT and NET lines"),
    Reserved("NVIDIA_VISIBLE_DEVICES", "the operator (head: void) and the GPU device plugin (workers)",
             Verdict.rejected, "the device plugin assigns each worker its GPUs"),
    Reserved("FI_PROVIDER", EFA_WORKERS, Verdict.rejected_with_require_efa,
             "requireEFA pins libfabric to efa; otherwise NCCL may fall back to sockets (status.network shows it)"),
    Reserved("NCCL_NET_PLUGIN", EFA_WORKERS, Verdict.rejected_with_require_efa,
             "requireEFA pins the aws-ofi-nccl plugin"),
    Reserved("NCCL_NET", "the operator (workers, network.requireEFA)", Verdict.rejected_with_require_efa,
             "requireEFA pins NCCL's network to Libfabric, so NCCL fails instead of falling back to sockets"),
    Reserved("FI_EFA_FORK_SAFE", EFA_WORKERS, Verdict.warning_with_efa,
             "Ray and PyTorch data loaders fork; without it EFA memory registration breaks"),
    Reserved("FI_EFA_USE_DEVICE_RDMA", "the operator (workers of GPUDirect RDMA types, network.efa)",
             Verdict.warning_with_efa, "GPUDirect RDMA on the types that have it"),
    Reserved("NCCL_SOCKET_IFNAME", "the operator (workers)", Verdict.warning,
             "NCCL's bootstrap and socket traffic use the pod's eth0"),
    Reserved("RAY_ADDRESS", KUBERAY, Verdict.rejected,
             "KubeRay sets it only when absent: another value points the pods at another Ray head"),
    Reserved("RAY_PORT", KUBERAY, Verdict.rejected,
             "KubeRay sets it only when absent: another value breaks joining the head's GCS"),
    Reserved("RAY_IP", KUBERAY, Verdict.rejected, "KubeRay appends its own (workers): a user's value is ignored"),
    Reserved("FQ_RAY_IP", KUBERAY, Verdict.rejected, "KubeRay appends its own (workers): a user's value is ignored"),
    Reserved("RAY_CLUSTER_NAME", KUBERAY, Verdict.rejected, "KubeRay appends its own: a user's value is ignored"),
    Reserved("RAY_CLUSTER_NAMESPACE", KUBERAY, Verdict.rejected, "KubeRay appends its own: a user's value is ignored"),
    Reserved("RAY_CLOUD_INSTANCE_ID", KUBERAY, Verdict.rejected, "KubeRay appends its own: a user's value is ignored"),
    Reserved("RAY_NODE_TYPE_NAME", KUBERAY, Verdict.rejected, "KubeRay appends its own: a user's value is ignored"),
    Reserved("KUBERAY_GEN_RAY_START_CMD", KUBERAY, Verdict.rejected,
             "KubeRay appends its own: a user's value is ignored"),
    Reserved("RAY_USAGE_STATS_EXTRA_TAGS", KUBERAY, Verdict.rejected,
             "KubeRay appends its own (head): a user's value is ignored"),
)

BY_NAME = {r.name: r for r in RESERVED}
ALWAYS_REJECTED = tuple(r.name for r in RESERVED if r.verdict is Verdict.rejected)
PINNED_BY_REQUIRE_EFA = tuple(r.name for r in RESERVED if r.verdict is Verdict.rejected_with_require_efa)


def rejection(name: str) -> str:
    r = BY_NAME[name]
    return f"{name} is set by {r.set_by} and may not be overridden: {r.why}"


def _cel_list(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def _cel_reasons() -> str:
    return "{" + ", ".join(f"'{n}': \"{rejection(n)}\"" for n in ALWAYS_REJECTED) + "}"


# On each spec.cluster.env[] item: the API server reports spec.cluster.env[i].name.
ITEM_VALIDATIONS: list[dict[str, Any]] = [{
    "rule": f"!(self.name in {_cel_list(ALWAYS_REJECTED)})",
    "messageExpression": f"{_cel_reasons()}[self.name]",
    "fieldPath": ".name",
    "reason": "FieldValueForbidden",
}]

REQUIRE_EFA_MESSAGE = (
    f"{', '.join(PINNED_BY_REQUIRE_EFA)} are pinned by network.requireEFA: true and may not be overridden "
    "(set requireEFA: false to tune them, at the risk of NCCL falling back to sockets)"
)

# On the spec: depends on spec.network.
SPEC_VALIDATIONS: list[dict[str, Any]] = [{
    "rule": ("!self.network.requireEFA || !has(self.cluster.env) || "
             f"!self.cluster.env.exists(e, e.name in {_cel_list(PINNED_BY_REQUIRE_EFA)})"),
    "message": f"cluster.env: {REQUIRE_EFA_MESSAGE}",
    "fieldPath": ".cluster.env",
}]


def warning(name: str, efa: bool) -> str | None:
    """The warning `finetune validate` gives for an allowed override, None when there is nothing to say."""
    r = BY_NAME.get(name)
    if r is None or r.verdict is Verdict.rejected:
        return None
    if r.verdict is not Verdict.warning and not efa:
        return None
    if r.verdict is Verdict.rejected_with_require_efa:
        return (f"{name} overrides the EFA settings of network.efa: NCCL may fall back to TCP sockets "
                "(status.network.transport shows what it used; network.requireEFA: true forbids this)")
    return f"{name} replaces the value set by {r.set_by}: {r.why}"
