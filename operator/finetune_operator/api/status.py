"""`FinetuneJob` status, and the progress message training processes send to the operator.

The status schema is declared in the CRD in full (a structural schema prunes undeclared fields), even
though the operator fills it over time. The progress message is the one documented wire format between
the training runtime and the operator's progress endpoint (`POST /v1/progress/{namespace}/{name}`).
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from . import instance_types as it
from .base import StatusModel


class Phase(str, Enum):
    pending = "Pending"
    provisioning = "Provisioning"
    running = "Running"
    suspended = "Suspended"
    succeeded = "Succeeded"
    failed = "Failed"


class Condition(StatusModel):
    """A Kubernetes API convention condition."""

    type: str = Field(description="Condition type, PascalCase (e.g. Ready, CapacityAvailable, NetworkHealthy).")
    status: str = Field(description="True, False or Unknown.", pattern=r"^(True|False|Unknown)$")
    reason: str = Field(default="", description="Machine-readable CamelCase reason.")
    message: str = Field(default="", description="Human-readable explanation a user can act on.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )


class TrainingProgress(StatusModel):
    """Progress as reported by rank 0 of the training processes."""

    step: int | None = Field(default=None, description="Optimizer steps completed.")
    total_steps: int | None = Field(default=None, description="Optimizer steps planned.")
    epoch: float | None = Field(default=None, description="Fractional epoch.")
    loss: float | None = Field(default=None, description="Training loss (mean over the last logging window).")
    eval_loss: float | None = Field(default=None, description="Loss on the held-out split at the last evaluation.")
    learning_rate: float | None = Field(default=None, description="Current learning rate.")
    grad_norm: float | None = Field(default=None, description="Global gradient norm before clipping.")
    tokens_per_second: float | None = Field(default=None, description="Training throughput over all ranks.")
    mfu: float | None = Field(default=None, description="Model FLOPs utilisation (0..1) against the GPUs' bf16 peak.")
    peak_memory_gib: float | None = Field(default=None, description="Peak accelerator (or host) memory per rank.")
    eta_seconds: float | None = Field(default=None, description="Estimated seconds to the last step.")
    last_report_time: str | None = Field(default=None, description="When the training processes last reported.")
    last_checkpoint: str | None = Field(default=None, description="URI of the newest checkpoint.")
    last_checkpoint_step: int | None = Field(default=None, description="Step of the newest checkpoint.")


class NetworkHealth(StatusModel):
    """Outcome of the NCCL/EFA probe the training runtime runs at start."""

    transport: str | None = Field(
        default=None, description="What carries inter-node collectives: efa, socket, gloo, intra-node (one node: NVLink/P2P/SHM, nothing crossed the network), unknown."
    )
    provider: str | None = Field(default=None, description="libfabric provider NCCL selected (efa, tcp, ...).")
    plugin_version: str | None = Field(default=None, description="aws-ofi-nccl plugin version, if loaded.")
    nccl_version: str | None = Field(default=None, description="NCCL version.")
    efa_devices: int | None = Field(default=None, description="EFA devices visible in the worker pod.")
    bus_bandwidth_g_bps: float | None = Field(
        default=None, alias="busBandwidthGBps", description="All-reduce bus bandwidth from the start-up probe (GB/s)."
    )
    healthy: bool | None = Field(default=None, description="False when EFA was expected but not used, or errors were seen.")
    message: str | None = Field(default=None, description="What the probe saw, in words.")


class InstanceFigures(StatusModel):
    """The instance-type figures a job was judged and rendered against, recorded once before its RayJob is
    created: later reconciles render from these, so a figures ConfigMap changed or the nodes of the type
    removed (Karpenter) never re-judge a job that runs or has finished."""

    name: str = Field(description="Instance type (spec.cluster.instanceType).")
    source: str = Field(description="Where the figures came from: built-in table, ConfigMap ns/name, or node name.")
    vcpu: int = Field(description="vCPUs of one node.")
    memory_gib: int = Field(alias="memoryGiB", description="Memory of one node, GiB.")
    gpus: int = Field(description="GPUs of one node.")
    gpu_model: str = Field(default="", description="GPU model, if known.")
    gpu_memory_gib: int = Field(default=0, alias="gpuMemoryGiB", description="Memory of one GPU, GiB (0: unknown).")
    efa_interfaces: int = Field(description="EFA interfaces of one node.")
    network_gbps: int = Field(default=0, description="Network bandwidth of one node, Gbit/s (0: unknown).")
    gpudirect_rdma: bool = Field(default=False, alias="gpudirectRDMA", description="GPUDirect RDMA over EFA.")
    gpu_bf16_tflops: float = Field(default=0.0, alias="gpuBf16TFLOPS", description="Dense bf16 peak of one GPU (MFU).")
    allocatable_cpu_millis: int = Field(alias="allocatableCPUMillis", description="Allocatable CPU of one node, millicores.")
    allocatable_memory_mib: int = Field(alias="allocatableMemoryMiB", description="Allocatable memory of one node, MiB.")

    @classmethod
    def of(cls, t: it.InstanceType) -> InstanceFigures:
        return cls.model_validate({
            "name": t.name, "source": t.source, "vcpu": t.vcpu, "memoryGiB": t.memory_gib, "gpus": t.gpus,
            "gpuModel": t.gpu_model, "gpuMemoryGiB": t.gpu_memory_gib, "efaInterfaces": t.efa_interfaces,
            "networkGbps": t.network_gbps, "gpudirectRDMA": t.gpudirect_rdma, "gpuBf16TFLOPS": t.gpu_bf16_tflops,
            "allocatableCPUMillis": t.allocatable_cpu_millis, "allocatableMemoryMiB": t.allocatable_memory_mib})

    def instance_type(self) -> it.InstanceType:
        return it.InstanceType(self.name, self.vcpu, self.memory_gib, self.gpus, self.gpu_model, self.gpu_memory_gib,
                               self.efa_interfaces, self.network_gbps, self.gpudirect_rdma, self.gpu_bf16_tflops,
                               source=self.source, alloc_cpu_millis=self.allocatable_cpu_millis,
                               alloc_memory_mib=self.allocatable_memory_mib)


class FinetuneJobStatus(StatusModel):
    """Observed state, written by the operator: phase, conditions, children, progress, network health."""

    phase: Phase | None = Field(default=None, description="Pending, Provisioning, Running, Suspended, Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list, description="Kubernetes-style conditions.")
    observed_generation: int | None = Field(default=None, description="Last metadata.generation acted on.")
    ray_job_name: str | None = Field(default=None, description="Name of the child RayJob.")
    ray_job_uid: str | None = Field(
        default=None, alias="rayJobUID",
        description="UID of the RayJob this job created. A recorded RayJob that disappears is never re-created: "
                    "the job's outcome is decided from what was last known.",
    )
    ray_cluster_name: str | None = Field(default=None, description="Name of the RayCluster KubeRay created for the job.")
    config_map_name: str | None = Field(default=None, description="Not written any more (the resolved job config is the Ray head pod's annotation finetune.dev/job-config); kept so that statuses written by earlier operator versions stay valid.")
    job_id: str | None = Field(default=None, description="Ray job submission id.")
    dashboard_url: str | None = Field(default=None, alias="dashboardURL", description="Ray dashboard address.")
    start_time: str | None = Field(
        default=None, description="When the job first started (its first attempt; activeDeadlineSeconds counts from it).")
    completion_time: str | None = Field(default=None, description="When the job finished.")
    attempt: int | None = Field(default=None, description="Attempt number (1 + retries so far).")
    step: str | None = Field(
        default=None, description="Training step as `n/total` (for the Step printer column)."
    )
    message: str | None = Field(default=None, description="Short human summary of the current state.")
    training: TrainingProgress | None = Field(default=None, description="Training progress reported by the job.")
    network: NetworkHealth | None = Field(default=None, description="Network health reported by the job.")
    runtime_phase: str | None = Field(
        default=None, description="Last phase the training runtime reported: Starting, Training, Exporting, Done, Failed."
    )
    stall_restarts: int | None = Field(
        default=None, description="Ray clusters replaced after a stall (spec.stallPolicy.action Restart)."
    )
    stall_restart_pending: bool | None = Field(
        default=None, description="A stall restart is under way: the RayJob is suspended and is resumed once its Ray cluster is gone."
    )
    instance: InstanceFigures | None = Field(
        default=None,
        description="The instance-type figures the job was judged and rendered against, fixed once its RayJob exists "
                    "(the allow-list and the figures are judged only before that).",
    )


class ProgressReport(StatusModel):
    """What a training process POSTs to the operator. All fields optional: send what changed."""

    attempt: int | None = Field(default=None, description="Attempt the sender belongs to.")
    rank: int = Field(default=0, description="Sending rank (the operator only acts on rank 0's reports).")
    training: TrainingProgress | None = Field(default=None, description="Training progress.")
    network: NetworkHealth | None = Field(default=None, description="Network probe outcome.")
    phase: str | None = Field(default=None, description="Runtime phase: Starting, Training, Exporting, Done, Failed.")
    message: str | None = Field(default=None, description="Free text (e.g. a fail-fast reason).", max_length=2048)
