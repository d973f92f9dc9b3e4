"""Simulated EKS nodes: Node objects that kwok keeps Ready and whose pods it marks Running.

Shapes follow what an EKS managed node group reports for the instance type:

- capacity is the EC2 specification (vCPU, GiB, GPUs, EFA interfaces);
- allocatable subtracts what the EKS AMI reserves: kube-reserved CPU (6% of the first core, 1% of the
  second, 0.5% of cores 3-4, 0.25% above), kube-reserved memory 255Mi + 11Mi per pod (max-pods 110),
  the 100Mi hard-eviction threshold, and the 2 MiB huge pages preallocated for EFA (libfabric);
  g6.12xlarge: cpu 48 -> 47810m, memory 192Gi -> 189923Mi (~185.5Gi);
- ``hugepages-2Mi: 5120Mi`` on EFA nodes: the figure the EKS EFA examples request per pod;
- ``ephemeral-storage``: a 200Gi root volume, allocatable 90% (the 10% nodefs eviction threshold).

GPU/EFA nodes carry the taints a GPU/EFA node group is given (``nvidia.com/gpu=true:NoSchedule``,
``vpc.amazonaws.com/efa=true:NoSchedule``), so only pods tolerating both land there; the CPU node (for the
Ray head and submitter pods) has none. All nodes share one region and zone, as EFA requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune_operator.api import instance_types as it

REGION = "us-west-2"
ZONE = "us-west-2a"
MAX_PODS = it.MAX_PODS
HUGEPAGES_2MI_MIB = 5120
EPHEMERAL_STORAGE_GIB = 200
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINTS = [
    {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
    {"key": "vpc.amazonaws.com/efa", "value": "true", "effect": "NoSchedule"},
]


@dataclass(frozen=True)
class Shape:
    """A node of one instance type, from the operator's own table (one source of figures)."""

    spec: it.InstanceType

    @property
    def instance_type(self) -> str:
        return self.spec.name

    @property
    def gpus(self) -> int:
        return self.spec.gpus

    @property
    def efa(self) -> int:
        return self.spec.efa_interfaces

    @property
    def hugepages_mib(self) -> int:
        return HUGEPAGES_2MI_MIB if self.efa else 0

    @property
    def allocatable_cpu_millis(self) -> int:
        return self.spec.allocatable_cpu_millis

    @property
    def allocatable_memory_mib(self) -> int:
        # Huge pages are carved out of the node's memory.
        return self.spec.allocatable_memory_mib - self.hugepages_mib

    def capacity(self) -> dict[str, str]:
        out = {
            "cpu": str(self.spec.vcpu),
            "memory": f"{self.spec.memory_gib}Gi",
            "pods": str(MAX_PODS),
            "ephemeral-storage": f"{EPHEMERAL_STORAGE_GIB}Gi",
            "hugepages-1Gi": "0",
            "hugepages-2Mi": f"{self.hugepages_mib}Mi",
        }
        if self.gpus:
            out["nvidia.com/gpu"] = str(self.gpus)
        if self.efa:
            out["vpc.amazonaws.com/efa"] = str(self.efa)
        return out

    def allocatable(self) -> dict[str, str]:
        out = self.capacity()
        out["cpu"] = f"{self.allocatable_cpu_millis}m"
        out["memory"] = f"{self.allocatable_memory_mib}Mi"
        out["ephemeral-storage"] = f"{EPHEMERAL_STORAGE_GIB * 1024 * 9 // 10}Mi"
        return out


SHAPES: dict[str, Shape] = {name: Shape(t) for name, t in it.INSTANCE_TYPES.items()}


def node_manifest(
    name: str, instance_type: str, nodegroup: str, index: int, kubelet_version: str = "v1.37.2"
) -> dict[str, Any]:
    """A Node as an EKS managed node group would register it, with status filled in for kwok."""
    try:
        shape = SHAPES[instance_type]
    except KeyError:
        raise ValueError(f"unknown instance type {instance_type!r}; known: {sorted(SHAPES)}") from None
    ip = f"10.0.{1 if shape.gpus else 2}.{10 + index}"
    labels = {
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "kubernetes.io/hostname": name,
        "node.kubernetes.io/instance-type": instance_type,
        "beta.kubernetes.io/instance-type": instance_type,
        "topology.kubernetes.io/region": REGION,
        "topology.kubernetes.io/zone": ZONE,
        "eks.amazonaws.com/nodegroup": nodegroup,
        "eks.amazonaws.com/capacityType": "ON_DEMAND",
        "type": "kwok",
    }
    if shape.gpus:
        labels["nvidia.com/gpu.present"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {
            "providerID": f"aws:///{ZONE}/i-{index:017x}",
            "taints": list(GPU_TAINTS) if shape.gpus else [],
        },
        "status": {
            "capacity": shape.capacity(),
            "allocatable": shape.allocatable(),
            "addresses": [
                {"type": "InternalIP", "address": ip},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "osImage": "Amazon Linux 2023 (simulated by kwok)",
                "kernelVersion": "6.1.0",
                "kubeletVersion": kubelet_version,
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "kwok",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }
