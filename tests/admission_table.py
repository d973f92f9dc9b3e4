"""One table of FinetuneJobs for admission (issue 30): each valid, or invalid with the field path that
both `finetune validate` and the API server (CRD schema and CEL, server-side dry run) must name.

Checked by tests/unit/test_admission_table.py (the Python path) and tests/integration/test_admission.py
(the real API server with the generated CRD installed): the verdicts must agree, and the path must appear
in both messages. Every spec starts from the seed example (so deploy/'s admission policies, when installed,
have nothing to say about the valid rows: allowed image prefix, default ServiceAccount, a fitting size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.builders import JobDoc

IMAGE = "public.ecr.aws/deep-learning-containers/ray"  # deploy/policy.yaml allows ray:*
DIGEST = "sha256:" + "0123456789abcdef" * 4


@dataclass(frozen=True)
class Row:
    id: str
    sets: dict[str, Any]  # dotted path from the document root -> value
    path: str | None  # None: valid; else the field path both sides must name
    old_accepted: bool = True  # the code before issue 30 let it through (the class this row closes)
    drops: tuple[str, ...] = field(default=())

    def doc(self) -> dict[str, Any]:
        built = JobDoc.example("adm")
        for path in self.drops:
            built.drop(path)
        for path, value in self.sets.items():
            built.set(path, value)
        return built.obj()


def _env(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "value": "x"} for n in names]


ROWS: list[Row] = [
    # ---------------------------------------------------------------- valid
    Row("valid-seed", {}, None),
    Row("valid-image-tag-and-digest", {"spec.cluster.image": f"{IMAGE}:train-ml-cuda-v1.0@{DIGEST}"}, None),
    Row("valid-node-selectors", {
        "spec.cluster.nodeSelector": {"topology.kubernetes.io/zone": "us-east-1a", "example.com/pool": ""},
        "spec.cluster.head.nodeSelector": {"kubernetes.io/os": "linux"}}, None),
    Row("valid-names", {"spec.cluster.priorityClassName": "team-a.high",
                        "spec.cluster.envFrom": [{"secretRef": "hf.token-env", "prefix": "HF_"},
                                                 {"configMapRef": "settings"}],
                        "spec.model.hubTokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN.v1"}}, None),
    Row("valid-pvc-claim-with-dots", {"spec.model.source": "pvc://models.team-a/qwen"}, None),
    Row("valid-quantities", {"spec.cluster.head.cpu": "3500m", "spec.cluster.head.memory": "12e9",
                             "spec.cluster.workers.shmSize": "8Gi"}, None),
    Row("valid-int-maxima", {"spec.activeDeadlineSeconds": 2**31 - 1, "spec.ttlSecondsAfterFinished": 2**31 - 1,
                             "spec.training.seed": 2**32 - 1}, None),
    Row("valid-env-overrides-with-warnings", {"spec.network.requireEFA": False,
                                              "spec.cluster.env": _env("NCCL_SOCKET_IFNAME", "NCCL_NET", "MY_FLAG")},
        None),
    Row("valid-tolerations", {"spec.cluster.tolerations": [
        {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
        {"operator": "Exists"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 300}]}, None),
    Row("valid-metadata", {"metadata.labels": {"team": "ml", "example.com/cost-center": "a-1"},
                           "metadata.annotations": {"example.com/note": "free text, spaces and all"}}, None),
    # ---------------------------------------------------------------- images (distribution/reference)
    Row("image-empty", {"spec.cluster.image": ""}, "spec.cluster.image"),
    Row("image-uppercase-path", {"spec.cluster.image": "public.ecr.aws/Deep-Learning-Containers/ray:1"},
        "spec.cluster.image"),
    Row("image-space-in-tag", {"spec.cluster.image": f"{IMAGE}:train ml"}, "spec.cluster.image"),
    Row("image-short-digest", {"spec.cluster.image": f"{IMAGE}:v1@sha256:abc"}, "spec.cluster.image"),
    Row("image-unknown-digest-algorithm", {"spec.cluster.image": f"{IMAGE}@md5:{'0' * 32}"}, "spec.cluster.image"),
    Row("image-tag-too-long", {"spec.cluster.image": f"{IMAGE}:{'t' * 129}"}, "spec.cluster.image"),
    Row("image-double-separator", {"spec.cluster.image": f"{IMAGE}..x:1"}, "spec.cluster.image"),
    Row("image-name-too-long", {"spec.cluster.image": f"{IMAGE}/{'a' * 250}:1"}, "spec.cluster.image"),
    Row("image-bare-identifier", {"spec.cluster.image": "0123456789abcdef" * 4}, "spec.cluster.image"),
    # ---------------------------------------------------------------- object names (DNS-1123)
    Row("service-account-underscore", {"spec.cluster.serviceAccountName": "team_sa"},
        "spec.cluster.serviceAccountName"),
    Row("priority-class-double-dot", {"spec.cluster.priorityClassName": "high..prio"},
        "spec.cluster.priorityClassName"),
    Row("configmap-ref-space", {"spec.cluster.envFrom": [{"configMapRef": "my config"}]},
        "spec.cluster.envFrom[0].configMapRef"),
    Row("secret-ref-leading-dash", {"spec.cluster.envFrom": [{"secretRef": "-secret"}]},
        "spec.cluster.envFrom[0].secretRef"),
    Row("envfrom-prefix-digit", {"spec.cluster.envFrom": [{"configMapRef": "settings", "prefix": "1X_"}]},
        "spec.cluster.envFrom[0].prefix"),
    Row("hub-token-secret-uppercase", {"spec.model.hubTokenSecretRef": {"name": "HF"}},
        "spec.model.hubTokenSecretRef.name", old_accepted=False),
    Row("hub-token-secret-double-dot", {"spec.model.hubTokenSecretRef": {"name": "hf..token"}},
        "spec.model.hubTokenSecretRef.name"),
    Row("hub-token-key-dotdot", {"spec.model.hubTokenSecretRef": {"name": "hf", "key": "..token"}},
        "spec.model.hubTokenSecretRef.key"),
    Row("pvc-claim-double-dot", {"spec.model.source": "pvc://models..a/qwen"}, "spec.model.source"),
    Row("storage-uri-http", {"spec.training.checkpoint.storageUri": "http://example.com/ckpt"},
        "spec.training.checkpoint.storageUri", old_accepted=False),
    Row("dataset-source-http", {"spec.dataset.source": "http://example.com/data.jsonl"}, "spec.dataset.source",
        old_accepted=False),
    Row("pvc-claim-too-long", {"spec.training.checkpoint.storageUri": f"pvc://{'a' * 254}/ckpt"},
        "spec.training.checkpoint.storageUri"),
    # ---------------------------------------------------------------- labels (nodeSelector, instance type)
    Row("node-selector-key-space", {"spec.cluster.nodeSelector": {"pool name": "a"}}, "spec.cluster.nodeSelector"),
    Row("node-selector-value-space", {"spec.cluster.nodeSelector": {"pool": "a b"}}, "spec.cluster.nodeSelector"),
    Row("node-selector-value-too-long", {"spec.cluster.nodeSelector": {"pool": "a" * 64}},
        "spec.cluster.nodeSelector"),
    Row("head-node-selector-key-name-too-long", {"spec.cluster.head.nodeSelector": {f"example.com/{'n' * 64}": "a"}},
        "spec.cluster.head.nodeSelector"),
    Row("instance-type-space", {"spec.cluster.instanceType": "g6 12xlarge"}, "spec.cluster.instanceType"),
    Row("metadata-label-value-space", {"metadata.labels": {"team": "ml platform"}}, "metadata.labels"),
    Row("metadata-annotation-key", {"metadata.annotations": {"bad key!": "x"}}, "metadata.annotations"),
    # ---------------------------------------------------------------- tolerations (validateTolerations)
    Row("toleration-key-space", {"spec.cluster.tolerations": [{"key": "dedicated team", "operator": "Exists"}]},
        "spec.cluster.tolerations[0].key"),
    Row("toleration-empty-key-equal", {"spec.cluster.tolerations": [{"operator": "Equal", "value": "x"}]},
        "spec.cluster.tolerations[0].operator"),
    Row("toleration-exists-with-value", {"spec.cluster.tolerations": [
        {"key": "team", "operator": "Exists", "value": "ml"}]}, "spec.cluster.tolerations[0].value"),
    Row("toleration-bad-effect", {"spec.cluster.tolerations": [{"key": "team", "effect": "NoScheduel"}]},
        "spec.cluster.tolerations[0].effect"),
    Row("toleration-seconds-without-noexecute", {"spec.cluster.tolerations": [
        {"key": "team", "value": "ml", "effect": "NoSchedule", "tolerationSeconds": 30}]},
        "spec.cluster.tolerations[0].tolerationSeconds"),
    Row("toleration-value-space", {"spec.cluster.tolerations": [{"key": "team", "value": "ml team"}]},
        "spec.cluster.tolerations[0].value"),
    # ---------------------------------------------------------------- quantities
    Row("quantity-two-dots", {"spec.cluster.workers.memory": "1.5.0Gi"}, "spec.cluster.workers.memory"),
    Row("quantity-dangling-exponent", {"spec.cluster.head.cpu": "1e"}, "spec.cluster.head.cpu"),
    Row("quantity-no-digits", {"spec.cluster.workers.shmSize": ".Gi"}, "spec.cluster.workers.shmSize"),
    Row("quantity-over-int64", {"spec.cluster.head.memory": "1E100"}, "spec.cluster.head.memory"),
    Row("quantity-doubled-suffix", {"spec.cluster.workers.hugepages2Mi": "5GiMi"}, "spec.cluster.workers.hugepages2Mi"),
    # ---------------------------------------------------------------- integers (int32 in the RayJob, seeds)
    Row("deadline-over-int32", {"spec.activeDeadlineSeconds": 2**31}, "spec.activeDeadlineSeconds"),
    Row("ttl-finished-over-int32", {"spec.ttlSecondsAfterFinished": 2**31}, "spec.ttlSecondsAfterFinished"),
    Row("seed-over-uint32", {"spec.training.seed": 2**32}, "spec.training.seed"),
    Row("max-steps-over-int32", {"spec.training.maxSteps": 2**31}, "spec.training.maxSteps"),
    Row("max-samples-over-int32", {"spec.dataset.maxSamples": 2**31}, "spec.dataset.maxSamples"),
    Row("checkpoint-interval-over-int32", {"spec.training.checkpoint.intervalSteps": 2**31},
        "spec.training.checkpoint.intervalSteps"),
    Row("eval-interval-over-int32", {"spec.training.evalIntervalSteps": 2**31}, "spec.training.evalIntervalSteps"),
    Row("micro-batch-absurd", {"spec.training.microBatchSize": 2**17, "spec.training.globalBatchSize": 2**20},
        "spec.training.microBatchSize"),
    Row("max-grad-norm-absurd", {"spec.training.maxGradNorm": 1e9}, "spec.training.maxGradNorm"),
    # ---------------------------------------------------------------- environment variables
    Row("env-pythonpath", {"spec.cluster.env": _env("PYTHONPATH")}, "spec.cluster.env[0].name"),
    Row("env-ray-address", {"spec.cluster.env": _env("MY_FLAG", "RAY_ADDRESS")}, "spec.cluster.env[1].name"),
    Row("env-hf-token-literal", {"spec.cluster.env": _env("HF_TOKEN")}, "spec.cluster.env[0].name"),
    Row("env-nccl-debug", {"spec.cluster.env": _env("NCCL_DEBUG")}, "spec.cluster.env[0].name"),
    Row("env-over-the-annotation-budget", {"spec.cluster.env": [{"name": f"V{i}", "value": "x" * 4000}
                                                                for i in range(40)]}, "spec.cluster.env"),
    Row("env-pinned-by-require-efa", {"spec.network.requireEFA": True, "spec.cluster.env": _env("NCCL_NET")},
        "spec.cluster.env"),
]

VALID = [r for r in ROWS if r.path is None]
INVALID = [r for r in ROWS if r.path is not None]
