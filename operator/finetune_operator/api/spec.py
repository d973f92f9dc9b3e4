"""`FinetuneJob` spec (finetune.dev/v1alpha1): the single source of truth for the CRD schema,
`finetune validate`, the renderer and the training runtime.

Every field has a description (it becomes `kubectl explain`). Cross-field rules are written twice on
purpose: as CEL `x-kubernetes-validations` (enforced by the API server on kubectl apply / Argo CD sync)
and as pydantic validators (enforced by `finetune validate`, `finetune run` and the operator). The test
suite checks both against the same table of bad specs.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, Field, model_validator

from . import env_policy
from . import grammar as g
from .base import SpecModel

GROUP = "finetune.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "FinetuneJob"
PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]

DEFAULT_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.0"
DEFAULT_RAY_VERSION = "2.58.0"
DEFAULT_INSTANCE_TYPE = "g6.12xlarge"

_DNS1035 = DNS1035 = g.anchored(g.DNS1035_LABEL_FMT)
_PVC = f"pvc://{g.DNS1123_SUBDOMAIN_FMT}(/.*)?"
_SOURCE = rf"^(s3://[^/]+(/.*)?|{_PVC}|/.*|\./.*|[A-Za-z0-9][-\w.]*(/[-\w.]+)?)$"
_STORAGE = rf"^(s3://[^/]+(/.*)?|{_PVC}|/.*|\./.*)$"
# The claim of a pvc:// URI names a PersistentVolumeClaim: a DNS-1123 subdomain, at most 253 characters.
_CLAIM_FITS: dict[str, Any] = {"x-kubernetes-validations": [{
    "rule": "!self.startsWith('pvc://') || self.substring(6).split('/')[0].size() <= 253",
    "message": "the claim of a pvc:// URI names a PersistentVolumeClaim: at most 253 characters"}]}


def _claim_fits(uri: str) -> str:
    if uri.startswith("pvc://") and len(uri[6:].split("/")[0]) > g.DNS1123_SUBDOMAIN_MAX:
        raise ValueError("the claim of a pvc:// URI names a PersistentVolumeClaim: at most 253 characters")
    return uri


# The pattern sits before the validator: as a Field argument beside an AfterValidator it is enforced but
# left out of the JSON schema (and so out of the CRD).
SourceUri = Annotated[str, Field(max_length=1024, pattern=_SOURCE), AfterValidator(_claim_fits)]
StorageUri = Annotated[str, Field(max_length=1024, pattern=_STORAGE), AfterValidator(_claim_fits)]

Str = Annotated[str, Field(max_length=253)]
LongStr = Annotated[str, Field(max_length=4096)]


def _immutable_message(what: str) -> str:
    # What the user sees in `kubectl apply` and in a failed Argo CD sync (docs/gitops.md).
    return (f"{what} is immutable after creation: rename the job to train a new one, or delete and re-create it "
            "to re-run it (Argo CD: sync option Replace=true,Force=true)")


def _immutable(what: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": _immutable_message(what)}]}


# --------------------------------------------------------------------------------------------------
# model


class DType(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class SecretKeyRef(SpecModel):
    name: g.DNSSubdomain = Field(description="Name of a Secret in the FinetuneJob's namespace.")
    key: g.ConfigMapKey = Field(default="token", description="Key inside the Secret.")


class ModelSpec(SpecModel):
    """The base model to fine-tune."""

    model_config = SpecModel.model_config | {"json_schema_extra": _immutable("spec.model")}

    source: SourceUri = Field(
        description=(
            "Where the base model comes from: a Hugging Face hub id (`Qwen/Qwen2.5-1.5B`), an S3 URI "
            "(`s3://bucket/prefix`), a PersistentVolumeClaim path (`pvc://claim/path`, mounted into every "
            "Ray pod), or an absolute path visible inside the pods (or on this machine for `finetune run`)."
        ),
        json_schema_extra=_CLAIM_FITS,
    )
    revision: str | None = Field(
        default=None,
        description="Hub revision (branch, tag or commit) to pin; ignored for S3/PVC/path sources.",
        max_length=253,
    )
    dtype: DType = Field(
        default=DType.auto,
        description=(
            "Dtype the weights are loaded in. Training always keeps float32 master weights and optimizer "
            "state (bf16 weights round small updates away); spec.training.precision chooses the compute "
            "dtype (bf16 mixed precision on GPU). `auto` (recommended) and `float32` load float32; "
            "`bfloat16` loads bf16 (half the host memory while loading). `float16` is rejected (fp16 "
            "training needs loss scaling)."
        ),
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow model repositories to run their own Python code. Off by default: a security risk.",
    )
    hub_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret holding a Hugging Face token for gated/private models. Exposed to the pods as the "
            "HF_TOKEN environment variable via secretKeyRef; never copied into status, logs or rendered values."
        ),
    )


# --------------------------------------------------------------------------------------------------
# dataset


class DatasetFormat(str, Enum):
    text = "text"
    prompt_completion = "promptCompletion"
    chat = "chat"


class DatasetSpec(SpecModel):
    """The training data."""

    model_config = SpecModel.model_config | {"json_schema_extra": _immutable("spec.dataset")}

    source: SourceUri = Field(
        description=(
            "A Hugging Face dataset id, or a `.jsonl`/`.json`/`.parquet` file or directory given as an S3 "
            "URI, `pvc://claim/path` or absolute path."
        ),
        json_schema_extra=_CLAIM_FITS,
    )
    split: str = Field(default="train", description="Split to read (hub datasets).", max_length=63)
    format: DatasetFormat = Field(
        default=DatasetFormat.text,
        description=(
            "Record layout: `text` (one text field, all tokens trained), `promptCompletion` (prompt tokens "
            "masked out of the loss), `chat` (a list of {role, content} messages rendered with the "
            "tokenizer's chat template; only assistant turns are trained)."
        ),
    )
    text_field: str = Field(default="text", description="Field holding the text (format text).", max_length=63)
    prompt_field: str = Field(
        default="prompt", description="Field holding the prompt (format promptCompletion).", max_length=63
    )
    completion_field: str = Field(
        default="completion", description="Field holding the completion (format promptCompletion).", max_length=63
    )
    messages_field: str = Field(
        default="messages", description="Field holding the message list (format chat).", max_length=63
    )
    max_samples: int | None = Field(
        default=None, ge=1, le=g.INT32_MAX, description="Use at most this many records (after shuffling with the seed)."
    )
    eval_fraction: float = Field(
        default=0.05,
        ge=0.0,
        lt=0.5,
        description="Fraction of records held out for evaluation (0 disables evaluation).",
    )


# --------------------------------------------------------------------------------------------------
# training


class Scheduler(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Precision(str, Enum):
    # No fp16: it needs loss scaling, which the runtime does not do; bf16 is the GPU default.
    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class ShardingStrategy(str, Enum):
    full = "full"
    hybrid = "hybrid"
    grad_op = "gradOp"
    none = "none"


class FSDPSpec(SpecModel):
    """PyTorch FSDP2 (`fully_shard`) settings, applied per decoder layer."""

    sharding_strategy: ShardingStrategy = Field(
        default=ShardingStrategy.hybrid,
        description=(
            "`full`: shard parameters, gradients and optimizer state over all ranks. `hybrid`: shard within "
            "a node, replicate across nodes (HSDP; the right default where cross-node bandwidth is scarce, "
            "e.g. g6 without GPUDirect RDMA). `gradOp`: keep parameters after forward (ZeRO-2 like). `none`: "
            "replicate everything (DDP-like)."
        ),
    )
    activation_checkpointing: bool = Field(
        default=True, description="Recompute decoder-layer activations in backward to save memory."
    )
    cpu_offload: bool = Field(default=False, description="Keep sharded parameters and optimizer state in host memory.")


class CheckpointSpec(SpecModel):
    """Sharded checkpoints (torch.distributed.checkpoint) and the final Hugging Face export."""

    interval_steps: int = Field(default=100, ge=1, le=g.INT32_MAX, description="Save a checkpoint every this many optimizer steps.")
    storage_uri: StorageUri | None = Field(
        default=None,
        description=(
            "Shared storage for checkpoints and the exported model: `s3://bucket/prefix`, `pvc://claim/path`, "
            "or an absolute path every pod can write. Required when more than one worker pod is used. "
            "`finetune run` defaults to ./.work/<job name>."
        ),
        json_schema_extra=_CLAIM_FITS,
    )
    keep: int = Field(default=2, ge=1, le=100, description="How many recent checkpoints to keep.")


class Resume(str, Enum):
    auto = "auto"
    never = "never"


class TrainingSpec(SpecModel):
    """Optimization hyper-parameters and distributed-training settings."""

    model_config = SpecModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "self.globalBatchSize % self.microBatchSize == 0",
                    "message": "globalBatchSize must be a multiple of microBatchSize",
                    "fieldPath": ".globalBatchSize",
                },
                {
                    "rule": "self == oldSelf",
                    "message": _immutable_message("spec.training"),
                },
            ]
        }
    }

    epochs: int = Field(default=1, ge=1, le=1000, description="Passes over the training split (ignored if maxSteps is set).")
    max_steps: int | None = Field(default=None, ge=1, le=g.INT32_MAX, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(default=2e-5, gt=0.0, le=1.0, description="Peak AdamW learning rate.")
    scheduler: Scheduler = Field(default=Scheduler.cosine, description="Learning-rate decay after warmup.")
    warmup_ratio: float = Field(
        default=0.03, ge=0.0, lt=1.0, description="Fraction of total steps spent in linear warmup."
    )
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    global_batch_size: int = Field(
        default=32,
        ge=1,
        le=2**20,
        description=(
            "Sequences per optimizer step over all data-parallel ranks. Must be a multiple of "
            "microBatchSize x data-parallel ranks; the quotient is the gradient-accumulation count."
        ),
    )
    micro_batch_size: int = Field(default=1, ge=1, le=2**16, description="Sequences per rank per forward/backward pass.")
    sequence_length: int = Field(default=2048, ge=16, le=131072, description="Tokens per training sequence.")
    packing: bool = Field(
        default=True, description="Concatenate examples and cut them into full sequences (no padding waste)."
    )
    max_grad_norm: float = Field(default=1.0, ge=0.0, le=1e6, description="Gradient clipping by global norm (0 disables).")
    seed: int = Field(default=42, ge=0, le=g.UINT32_MAX, description="Seed for data shuffling, eval split and initialisation.")
    precision: Precision = Field(
        default=Precision.auto,
        description=(
            "Compute precision. `auto`: bf16 mixed precision on GPU (bf16 compute, fp32 master weights and "
            "optimizer state), fp32 on CPU. `bf16` needs GPUs."
        ),
    )
    eval_interval_steps: int = Field(
        default=100, ge=1, le=g.INT32_MAX, description="Evaluate on the held-out split every this many steps (and at the end)."
    )
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec, description="FSDP sharding and memory settings.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing and export.")
    resume: Resume = Field(
        default=Resume.auto,
        description="`auto`: continue from the latest checkpoint in storage if one exists; `never`: start at step 0.",
    )

    @model_validator(mode="after")
    def _batch(self) -> TrainingSpec:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"globalBatchSize: must be a multiple of microBatchSize "
                f"(got {self.global_batch_size} and {self.micro_batch_size})"
            )
        return self


# --------------------------------------------------------------------------------------------------
# cluster


class WorkersSpec(SpecModel):
    """The GPU worker group: one Ray worker pod per node."""

    replicas: int = Field(default=2, ge=1, le=512, description="Worker pods (= nodes, one pod per node).")
    gpus_per_worker: int = Field(
        default=4,
        ge=0,
        le=16,
        description=(
            "GPUs each worker pod requests; one Ray Train worker (rank) per GPU. 0 runs one CPU rank per pod "
            "(smoke tests). Must not exceed the instance type's GPUs."
        ),
    )
    cpu: g.Quantity | None = Field(
        default=None,
        description="CPU request/limit per worker pod. Default: five sixths of the instance's vCPUs.",
    )
    memory: g.Quantity | None = Field(
        default=None,
        description="Memory request/limit per worker pod. Default: five sixths of the instance's memory.",
    )
    shm_size: g.Quantity | None = Field(
        default=None,
        description="Size of the memory-backed /dev/shm volume. Default: a quarter of the worker memory, at most 64Gi.",
    )
    hugepages2_mi: g.Quantity = Field(
        default="5120Mi",
        alias="hugepages2Mi",
        description="hugepages-2Mi requested per worker pod when EFA is on (libfabric registers memory in them).",
    )


class HeadSpec(SpecModel):
    """The Ray head pod (GCS, dashboard, job driver). It gets no GPUs."""

    cpu: g.Quantity = Field(default="4", description="CPU request/limit of the head pod.")
    memory: g.Quantity = Field(default="16Gi", description="Memory request/limit of the head pod.")
    node_selector: g.NodeSelector = Field(
        default_factory=dict,
        description="nodeSelector for the head pod (by default it lands on any untainted node).",
    )


class EnvVar(SpecModel):
    model_config = SpecModel.model_config | {
        "json_schema_extra": {"x-kubernetes-validations": list(env_policy.ITEM_VALIDATIONS)}
    }

    name: g.EnvVarName = Field(description="Environment variable name.")
    value: str = Field(default="", description="Literal value.", max_length=32768)

    @model_validator(mode="after")
    def _not_reserved(self) -> EnvVar:
        if self.name in env_policy.ALWAYS_REJECTED:
            raise ValueError(f"name: {env_policy.rejection(self.name)}")
        return self


class EnvFromSource(SpecModel):
    config_map_ref: g.DNSSubdomain | None = Field(
        default=None, description="Name of a ConfigMap whose keys become environment variables."
    )
    secret_ref: g.DNSSubdomain | None = Field(
        default=None, description="Name of a Secret whose keys become environment variables."
    )
    prefix: g.EnvVarName | None = Field(default=None, description="Prefix added to every key.")

    model_config = SpecModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.configMapRef) != has(self.secretRef)",
                    "message": "set exactly one of configMapRef or secretRef",
                }
            ]
        }
    }

    @model_validator(mode="after")
    def _one(self) -> EnvFromSource:
        if (self.config_map_ref is None) == (self.secret_ref is None):
            raise ValueError("configMapRef: set exactly one of configMapRef or secretRef")
        return self


_OBJ = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class TolerationOperator(str, Enum):
    equal = "Equal"
    exists = "Exists"


class TaintEffect(str, Enum):
    no_schedule = "NoSchedule"
    prefer_no_schedule = "PreferNoSchedule"
    no_execute = "NoExecute"


_EMPTY_KEY = "an empty key tolerates every taint: it needs operator Exists"
_EXISTS_VALUE = "must be empty with operator Exists"
_SECONDS_EFFECT = "only with effect NoExecute"


class Toleration(SpecModel):
    """core/v1 Toleration, checked as the API server checks a pod's (validateTolerations)."""

    model_config = SpecModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {"rule": "!has(self.key) || self.key == '' || " + g.LABEL_KEY.cel("self.key"),
                 "message": g.LABEL_KEY.rule, "fieldPath": ".key"},
                {"rule": "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
                 "message": _EMPTY_KEY, "fieldPath": ".operator"},
                {"rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
                 "message": _EXISTS_VALUE, "fieldPath": ".value"},
                {"rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                 "message": _SECONDS_EFFECT, "fieldPath": ".tolerationSeconds"},
            ]
        }
    }

    key: str | None = Field(
        default=None, description="Taint key (a label key); empty with operator Exists tolerates every taint.",
        max_length=g.LABEL_KEY.max_length,
    )
    operator: TolerationOperator | None = Field(default=None, description="Equal (the default) or Exists.")
    value: g.LabelValue | None = Field(default=None, description="Taint value (operator Equal).")
    effect: TaintEffect | None = Field(default=None, description="Taint effect to match; empty matches all.")
    toleration_seconds: int | None = Field(
        # int64 in the pod spec; negative counts as 0 there. Bounded to int32 seconds (68 years): a JSON
        # maximum of 2^63-1 is not an exact integer to the API server's schema check.
        default=None, ge=0, le=g.INT32_MAX,
        description="With effect NoExecute: how long the pod stays bound after the taint appears.",
    )

    @model_validator(mode="after")
    def _rules(self) -> Toleration:
        if self.key:
            message = g.LABEL_KEY.check(self.key)
            if message is not None:
                raise ValueError(f"key: {message}")
        elif self.operator is not TolerationOperator.exists:
            raise ValueError(f"operator: {_EMPTY_KEY}")
        if self.operator is TolerationOperator.exists and self.value:
            raise ValueError(f"value: {_EXISTS_VALUE}")
        if self.toleration_seconds is not None and self.effect is not TaintEffect.no_execute:
            raise ValueError(f"tolerationSeconds: {_SECONDS_EFFECT}")
        return self


# The resolved job travels in one annotation of the Ray head pod (render/rayjob.py CONFIG_ANNOTATION), and a
# pod's annotations may hold 256 KiB in all (apimachinery TotalAnnotationSizeLimitB): KubeRay could not create
# the head pod of a bigger job. The env list is the one large field with a bound the API server can sum.
ENV_BYTES_MAX = 128 * 1024
JOB_DOCUMENT_BYTES_MAX = 192 * 1024
_ENV_TOO_BIG = (f"names and values add up to more than {ENV_BYTES_MAX} bytes (the resolved job travels in one "
                "annotation of the Ray head pod, and a pod's annotations hold at most 256 KiB); put large values "
                "in a ConfigMap or Secret and use envFrom")


def _document_size(wire: dict[str, Any]) -> int:
    """Bytes of the spec as the renderer writes it (YAML); JSON first, as YAML is slow to write and a job far
    under the limit as JSON is far under it as YAML too (the margin covers YAML's indentation)."""
    rough = len(json.dumps(wire, separators=(",", ":")))
    if rough < JOB_DOCUMENT_BYTES_MAX // 2:
        return rough
    return len(yaml.safe_dump(wire, sort_keys=True, width=120).encode())


class ClusterSpec(SpecModel):
    """The Ray cluster the job runs on (rendered into the RayJob's rayClusterSpec)."""

    model_config = SpecModel.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        *_immutable("spec.cluster")["x-kubernetes-validations"],
        {"rule": f"!has(self.env) || self.env.map(e, size(e.name) + (has(e.value) ? size(e.value) : 0)).sum() "
                 f"<= {ENV_BYTES_MAX}",
         "message": _ENV_TOO_BIG, "fieldPath": ".env"},
    ]}}

    @model_validator(mode="after")
    def _env_size(self) -> ClusterSpec:
        if sum(len(e.name) + len(e.value) for e in self.env) > ENV_BYTES_MAX:
            raise ValueError(f"env: {_ENV_TOO_BIG}")
        return self

    image: g.Image = Field(
        default=DEFAULT_IMAGE,
        description="Container image for head and workers. Default: the AWS Ray Train DLC, used as published.",
    )
    ray_version: str = Field(
        default=DEFAULT_RAY_VERSION, description="Ray version inside the image.", max_length=32,
        pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$",
    )
    instance_type: g.NodeLabelValue = Field(
        default=DEFAULT_INSTANCE_TYPE,
        description=(
            "EC2 instance type of the worker node group (matched with node.kubernetes.io/instance-type). "
            "Known: g6.12xlarge, g6.48xlarge, g5.48xlarge, p4d.24xlarge, p5.48xlarge, m5.2xlarge, m5.4xlarge, "
            "m7i.4xlarge."
        ),
    )
    workers: WorkersSpec = Field(default_factory=WorkersSpec, description="Worker pods and their resources.")
    efa_interfaces_per_worker: int | None = Field(
        default=None,
        ge=0,
        le=32,
        description="EFA interfaces requested per worker pod. Default: all of the instance's interfaces.",
    )
    head: HeadSpec = Field(default_factory=HeadSpec, description="The Ray head pod.")
    node_selector: g.NodeSelector = Field(
        default_factory=dict, description="Extra nodeSelector terms for the worker pods."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Extra tolerations for all Ray pods (GPU and EFA taints are tolerated already).",
        max_length=32,
    )
    affinity: dict[str, Any] | None = Field(
        default=None, description="Affinity for the worker pods (core/v1 Affinity).", json_schema_extra=_OBJ,  # type: ignore[arg-type]
    )
    priority_class_name: g.DNSSubdomain | None = Field(default=None, description="PriorityClass for all Ray pods.")
    service_account_name: g.DNSSubdomain | None = Field(
        default=None, description="ServiceAccount the Ray pods run as (e.g. one with an IRSA role for S3)."
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra environment variables for all Ray containers.", max_length=128
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        description="ConfigMaps/Secrets whose keys become environment variables (e.g. the seed's env file).",
        max_length=16,
    )
    pip: list[Str] = Field(
        default_factory=list,
        description="Extra pip requirements installed through the Ray runtime environment (none by default).",
        max_length=64,
    )


# --------------------------------------------------------------------------------------------------
# network


class NCCLDebug(str, Enum):
    off = "OFF"
    version = "VERSION"
    warn = "WARN"
    info = "INFO"
    trace = "TRACE"


class NetworkSpec(SpecModel):
    """Inter-node collectives: EFA through the aws-ofi-nccl plugin, or plain TCP sockets."""

    model_config = SpecModel.model_config | {"json_schema_extra": _immutable("spec.network")}

    efa: bool = Field(
        default=True,
        description="Request EFA interfaces and hugepages, and configure libfabric/NCCL for EFA (FI_PROVIDER=efa).",
    )
    nccl_debug: NCCLDebug = Field(
        default=NCCLDebug.info,
        description="NCCL_DEBUG level. INFO is needed for the transport probe to see which network NCCL chose.",
    )
    require_efa: bool = Field(
        default=False,
        alias="requireEFA",
        description=(
            "Fail the job at start if NCCL does not select the EFA provider (instead of silently falling back "
            "to TCP sockets). Needs efa: true."
        ),
    )

    @model_validator(mode="after")
    def _require(self) -> NetworkSpec:
        if self.require_efa and not self.efa:
            raise ValueError("requireEFA: needs efa: true (EFA cannot be required when it is off)")
        return self


# --------------------------------------------------------------------------------------------------
# the whole spec


def _dp_ranks_cel() -> str:
    w = "self.cluster.workers"
    return f"({w}.gpusPerWorker > 0 ? {w}.replicas * {w}.gpusPerWorker : {w}.replicas)"


class StallAction(str, Enum):
    report = "Report"
    fail = "Fail"
    restart = "Restart"


class StallPolicy(SpecModel):
    """Hang detection: a running job whose training stops reporting progress is `Stalled`."""

    timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=7 * 24 * 3600,
        description=(
            "Stalled after this many seconds without a progress report while running. Default: 10 x the "
            "observed step time, at least 900 s."
        ),
    )
    action: StallAction = Field(
        default=StallAction.report,
        description=(
            "Report: a Stalled condition, a Warning Event and the finetune_job_stalled metric. Fail: also fail "
            "the job and suspend its RayJob (the Ray cluster and its GPUs are released). Restart: replace the "
            "Ray cluster (suspend and resume the RayJob) so the training resumes from its last checkpoint, at "
            "most maxRestarts times, then fail as with Fail."
        ),
    )
    max_restarts: int = Field(
        default=3, ge=0, le=100,
        description="With action Restart: restarts after a stall before the job fails as stalled (status.stallRestarts counts them).",
    )


class FinetuneJobSpec(SpecModel):
    """Desired state of a fine-tuning run."""

    model_config = SpecModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": (
                        "self.training.globalBatchSize % (self.training.microBatchSize * "
                        f"{_dp_ranks_cel()}) == 0"
                    ),
                    "message": (
                        "training.globalBatchSize must be a multiple of training.microBatchSize x data-parallel "
                        "ranks (cluster.workers.replicas x cluster.workers.gpusPerWorker)"
                    ),
                    "fieldPath": ".training.globalBatchSize",
                },
                {
                    "rule": "self.cluster.workers.replicas <= 1 || has(self.training.checkpoint.storageUri)",
                    "message": (
                        "training.checkpoint.storageUri is required when cluster.workers.replicas > 1 "
                        "(Ray Train needs shared storage for multi-node checkpoints)"
                    ),
                    "fieldPath": ".training.checkpoint",
                },
                {
                    "rule": "self.training.precision != 'bf16' || self.cluster.workers.gpusPerWorker > 0",
                    "message": "training.precision bf16 needs GPUs (cluster.workers.gpusPerWorker > 0); use auto or fp32",
                    "fieldPath": ".training.precision",
                },
                {
                    "rule": "self.model.dtype != 'float16'",
                    "message": "model.dtype: float16 is not supported (fp16 training needs loss scaling); use auto (fp32 master weights, bf16 compute) or bfloat16",
                    "fieldPath": ".model.dtype",
                },
                {
                    "rule": "!self.network.requireEFA || self.network.efa",
                    "message": "network.requireEFA needs network.efa: true",
                    "fieldPath": ".network.requireEFA",
                },
                *env_policy.SPEC_VALIDATIONS,
            ]
        }
    }

    model: ModelSpec = Field(description="The base model.")
    dataset: DatasetSpec = Field(description="The training data.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Hyper-parameters, FSDP, checkpoints.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="The Ray cluster on KubeRay.")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="EFA/NCCL settings.")
    suspend: bool = Field(
        default=False,
        description="Suspend the job: the Ray cluster is deleted, and recreated from the last checkpoint on resume.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, le=g.INT32_MAX, description="Fail the job this long after it first started: over all its attempts "
        "(retries, stall restarts), time suspended included.",
    )
    backoff_limit: int = Field(
        default=0, ge=0, le=100, description="Retries of the whole job (each on a fresh Ray cluster, resuming)."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        le=g.INT32_MAX,
        description="Delete the Ray cluster this long after the job finishes (default: deleted right away).",
    )
    ttl_seconds_after_failure: int = Field(
        default=900,
        ge=0,
        le=7 * 86400,
        description=(
            "Keep the Ray pods of a failed job this long (so their logs can be read) before the Ray cluster is "
            "deleted; never shorter than ttlSecondsAfterFinished. 0 deletes them as soon as the job fails."
        ),
    )
    stall_policy: StallPolicy = Field(
        default_factory=StallPolicy, description="Hang detection: when a running job counts as stalled, and what then."
    )

    @property
    def data_parallel_ranks(self) -> int:
        w = self.cluster.workers
        return w.replicas * w.gpus_per_worker if w.gpus_per_worker > 0 else w.replicas

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_ranks)

    @model_validator(mode="after")
    def _cross_field(self) -> FinetuneJobSpec:
        per_step = self.training.micro_batch_size * self.data_parallel_ranks
        if self.training.global_batch_size % per_step:
            raise ValueError(
                f"training.globalBatchSize: must be a multiple of training.microBatchSize x data-parallel "
                f"ranks ({self.training.micro_batch_size} x {self.data_parallel_ranks} = {per_step}), "
                f"got {self.training.global_batch_size}"
            )
        if self.model.dtype == DType.float16:
            raise ValueError(
                "model.dtype: float16 is not supported (fp16 training needs loss scaling); use auto (fp32 master weights, bf16 compute) or bfloat16"
            )
        if self.training.precision == Precision.bf16 and self.cluster.workers.gpus_per_worker == 0:
            raise ValueError(
                "training.precision: bf16 needs GPUs (cluster.workers.gpusPerWorker > 0); use auto or fp32"
            )
        if self.network.require_efa:
            for i, e in enumerate(self.cluster.env):
                if e.name in env_policy.PINNED_BY_REQUIRE_EFA:
                    raise ValueError(f"cluster.env[{i}].name: {env_policy.REQUIRE_EFA_MESSAGE}")
        size = _document_size(self.wire())
        if size > JOB_DOCUMENT_BYTES_MAX:
            # Only here, not in the CRD: affinity is free-form, so the API server cannot size it.
            raise ValueError(
                f"the resolved job is {size} bytes as YAML, over {JOB_DOCUMENT_BYTES_MAX}: it travels in one "
                "annotation of the Ray head pod, and a pod's annotations hold at most 256 KiB (largest parts: "
                "cluster.env, cluster.affinity, cluster.pip)"
            )
        if self.cluster.workers.replicas > 1 and not self.training.checkpoint.storage_uri:
            raise ValueError(
                "training.checkpoint.storageUri: required when cluster.workers.replicas > 1 "
                "(Ray Train needs shared storage for multi-node checkpoints)"
            )
        return self


class ObjectMeta(SpecModel):
    model_config = SpecModel.model_config | {"extra": "allow"}

    name: str = Field(
        description="Name of the FinetuneJob (DNS-1035 label, at most 47 characters: KubeRay's RayJob name limit).",
        max_length=47,
        pattern=_DNS1035,
    )
    namespace: g.DNSLabel | None = Field(default=None, description="Namespace.")
    # The API server checks metadata of every object itself; these make `finetune validate` agree with it.
    labels: g.Labels = Field(default_factory=dict, description="Labels.")
    annotations: g.Annotations = Field(default_factory=dict, description="Annotations.")
    uid: str | None = Field(default=None, description="Server-assigned UID.")
    generation: int | None = Field(default=None, description="Server-assigned generation.")


class FinetuneJob(SpecModel):
    """A whole FinetuneJob document as read from YAML or the API server (status is not parsed here)."""

    model_config = SpecModel.model_config | {"extra": "ignore"}

    api_version: str = Field(default=API_VERSION, description="finetune.dev/v1alpha1")
    kind: str = Field(default=KIND, description="FinetuneJob")
    metadata: ObjectMeta = Field(description="Object metadata.")
    spec: FinetuneJobSpec = Field(description="Desired state.")

    @model_validator(mode="after")
    def _kind(self) -> FinetuneJob:
        if self.api_version != API_VERSION:
            raise ValueError(f"apiVersion: must be {API_VERSION}, got {self.api_version!r}")
        if self.kind != KIND:
            raise ValueError(f"kind: must be {KIND}, got {self.kind!r}")
        return self

