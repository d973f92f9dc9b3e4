"""Known EC2 instance types: what one node offers a Ray worker pod.

Figures are the published EC2 specifications (vCPU, memory, GPUs, EFA interfaces, network) and the
GPU vendors' dense bf16 tensor peak (used for MFU). Allocatable is estimated with the EKS AMI formula
(kube-reserved CPU: 6% of the first core, 1% of the second, 0.5% of cores 3-4, 0.25% above;
kube-reserved memory 255Mi + 11Mi per pod at max-pods 110; eviction threshold 100Mi), and the default
worker requests leave one sixth of the node for daemonsets (aws-node, EFA/NVIDIA device plugins,
kube-proxy, log agents): the seed's g6.12xlarge pod asks 40 CPU / 160Gi of 48 / 192.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import quantity

MAX_PODS = 110
BUILT_IN = "built-in table"
# ConfigMaps with this label hold instance-type figures: the admission policy's parameters
# (deploy/instance-types.yaml) and any that a cluster adds for types the built-in table lacks.
PARAMS_LABEL = "finetune.dev/instance-types"
PARAMS_NAME = "finetune-instance-types"
# Keys of a params ConfigMap: "<instance type>.<figure>".
FIGURES = ("gpus", "efaInterfaces", "allocatableCPU", "allocatableMemory", "gpuModel")
GI = 1024  # MiB per GiB


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpu: int
    memory_gib: int
    gpus: int
    gpu_model: str
    gpu_memory_gib: int
    efa_interfaces: int
    network_gbps: int
    gpudirect_rdma: bool
    gpu_bf16_tflops: float  # dense bf16 tensor peak per GPU, for MFU
    # Where the figures come from ("built-in table", "ConfigMap ns/name", "node name"); exact
    # allocatable figures (from a ConfigMap or a node) replace the EKS estimate below.
    source: str = BUILT_IN
    alloc_cpu_millis: int | None = None
    alloc_memory_mib: int | None = None

    @property
    def allocatable_cpu_millis(self) -> int:
        if self.alloc_cpu_millis is not None:
            return self.alloc_cpu_millis
        reserved = 60.0 + (10.0 if self.vcpu > 1 else 0.0)
        reserved += 5.0 * max(0, min(self.vcpu, 4) - 2)
        reserved += 2.5 * max(0, self.vcpu - 4)
        return int(self.vcpu * 1000 - reserved)

    @property
    def allocatable_memory_mib(self) -> int:
        if self.alloc_memory_mib is not None:
            return self.alloc_memory_mib
        return self.memory_gib * GI - (255 + 11 * MAX_PODS) - 100

    @property
    def default_worker_cpu(self) -> int:
        return self.vcpu * 5 // 6

    @property
    def default_worker_memory_gib(self) -> int:
        return self.memory_gib * 5 // 6


_TYPES = [
    # 4 x NVIDIA L4 24 GB, no NVLink, no GPUDirect RDMA (traffic staged through host memory).
    InstanceType("g6.12xlarge", 48, 192, 4, "L4", 24, 1, 40, False, 121.0),
    InstanceType("g6.48xlarge", 192, 768, 8, "L4", 24, 1, 100, False, 121.0),
    # 8 x NVIDIA A10G 24 GB.
    InstanceType("g5.48xlarge", 192, 768, 8, "A10G", 24, 1, 100, False, 70.0),
    # 8 x NVIDIA A100 40 GB (NVSwitch), 4 EFA, GPUDirect RDMA.
    InstanceType("p4d.24xlarge", 96, 1152, 8, "A100", 40, 4, 400, True, 312.0),
    # 8 x NVIDIA H100 80 GB (NVSwitch), 32 EFA, GPUDirect RDMA.
    InstanceType("p5.48xlarge", 192, 2048, 8, "H100", 80, 32, 3200, True, 989.0),
    # CPU-only types for the Ray head and for CPU smoke runs.
    InstanceType("m5.2xlarge", 8, 32, 0, "", 0, 0, 10, False, 0.0),
    InstanceType("m5.4xlarge", 16, 64, 0, "", 0, 0, 10, False, 0.0),
    InstanceType("m7i.4xlarge", 16, 64, 0, "", 0, 0, 12, False, 0.0),
]

INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in _TYPES}


def lookup(name: str, table: Mapping[str, InstanceType] | None = None) -> InstanceType | None:
    return (INSTANCE_TYPES if table is None else table).get(name)


# ------------------------------------------------------------------------------------------------
# The table as admission-policy parameters (one source of figures for the API server and the operator)


def params_data(types: Mapping[str, InstanceType] | None = None) -> dict[str, str]:
    """ConfigMap `data` for the ValidatingAdmissionPolicy: string values (ConfigMap data is strings;
    the policy's CEL reads them with int() and quantity())."""
    data: dict[str, str] = {}
    for name, t in sorted((INSTANCE_TYPES if types is None else types).items()):
        data[f"{name}.gpus"] = str(t.gpus)
        data[f"{name}.efaInterfaces"] = str(t.efa_interfaces)
        data[f"{name}.allocatableCPU"] = f"{t.allocatable_cpu_millis}m"
        data[f"{name}.allocatableMemory"] = f"{t.allocatable_memory_mib}Mi"
        if t.gpu_model:
            data[f"{name}.gpuModel"] = t.gpu_model
    return data


def params_configmap(namespace: str = "finetune-system") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": PARAMS_NAME,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "finetune-operator", PARAMS_LABEL: "true"},
        },
        "data": params_data(),
    }


def _millis(value: str) -> int:
    return int(float(quantity.parse(value)) * 1000)


def _mib(value: str) -> int:
    return int(float(quantity.parse(value)) / 2**20)


def from_params(data: Mapping[str, str], source: str) -> dict[str, InstanceType]:
    """Instance types described by a params ConfigMap's data. Entries without a parseable `gpus`,
    `allocatableCPU` and `allocatableMemory` are skipped (the admission policy skips them too)."""
    out: dict[str, InstanceType] = {}
    names = {k.rsplit(".", 1)[0] for k in data if k.rsplit(".", 1)[-1] in FIGURES}
    for name in sorted(names):
        try:
            gpus = int(data[f"{name}.gpus"])
            efa = int(data.get(f"{name}.efaInterfaces", "0"))
            cpu = _millis(data[f"{name}.allocatableCPU"])
            mem = _mib(data[f"{name}.allocatableMemory"])
        except (KeyError, ValueError):
            continue
        base = INSTANCE_TYPES.get(name)
        model = data.get(f"{name}.gpuModel", base.gpu_model if base else "")
        out[name] = InstanceType(
            name, base.vcpu if base else -(-cpu // 1000), base.memory_gib if base else -(-mem // GI), gpus, model, base.gpu_memory_gib if base else 0, efa,
            base.network_gbps if base else 0, base.gpudirect_rdma if base else efa > 1,
            base.gpu_bf16_tflops if base else 0.0, source=source, alloc_cpu_millis=cpu, alloc_memory_mib=mem,
        )
    return out


def from_node(node: Mapping[str, Any]) -> InstanceType | None:
    """Figures of the node's instance type taken from the node itself (allocatable GPUs, EFA, CPU, memory)."""
    meta = node.get("metadata") or {}
    name = (meta.get("labels") or {}).get("node.kubernetes.io/instance-type")
    alloc = (node.get("status") or {}).get("allocatable") or {}
    if not name or "cpu" not in alloc or "memory" not in alloc:
        return None
    cap = (node.get("status") or {}).get("capacity") or alloc
    try:
        cpu, mem = _millis(str(alloc["cpu"])), _mib(str(alloc["memory"]))
        vcpu = -(-_millis(str(cap.get("cpu", alloc["cpu"]))) // 1000)
        mem_gib = -(-_mib(str(cap.get("memory", alloc["memory"]))) // GI)
        gpus = int(str(alloc.get("nvidia.com/gpu", "0")))
        efa = int(str(alloc.get("vpc.amazonaws.com/efa", "0")))
    except ValueError:
        return None
    return InstanceType(
        name, vcpu, mem_gib, gpus, "", 0, efa, 0, efa > 1, 0.0,
        source=f"node {meta.get('name', '?')}", alloc_cpu_millis=cpu, alloc_memory_mib=mem,
    )


def merged(*layers: Mapping[str, InstanceType]) -> dict[str, InstanceType]:
    """Later layers win: built-in < ConfigMaps (configuration) for a known name."""
    out: dict[str, InstanceType] = {}
    for layer in layers:
        out.update(layer)
    return out


def with_source(t: InstanceType, source: str) -> InstanceType:
    return replace(t, source=source)
