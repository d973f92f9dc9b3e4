"""Known EC2 instance types: what one node offers a Ray worker pod.

Figures are the published EC2 specifications (vCPU, memory, GPUs, EFA interfaces, network) and the
GPU vendors' dense bf16 tensor peak (used for MFU). Allocatable is estimated with the EKS AMI formula
(kube-reserved CPU: 6% of the first core, 1% of the second, 0.5% of cores 3-4, 0.25% above;
kube-reserved memory 255Mi + 11Mi per pod at max-pods 110; eviction threshold 100Mi), and the default
worker requests leave one sixth of the node for daemonsets (aws-node, EFA/NVIDIA device plugins,
kube-proxy, log agents): the seed's g6.12xlarge pod asks 40 CPU / 160Gi of 48 / 192.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PODS = 110
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

    @property
    def allocatable_cpu_millis(self) -> int:
        reserved = 60.0 + (10.0 if self.vcpu > 1 else 0.0)
        reserved += 5.0 * max(0, min(self.vcpu, 4) - 2)
        reserved += 2.5 * max(0, self.vcpu - 4)
        return int(self.vcpu * 1000 - reserved)

    @property
    def allocatable_memory_mib(self) -> int:
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


def lookup(name: str) -> InstanceType | None:
    return INSTANCE_TYPES.get(name)
