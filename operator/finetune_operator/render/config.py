"""Operator-wide settings the renderer needs (passed in, never read from the environment here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..api.instance_types import InstanceType

FIELD_MANAGER = "finetune-operator"
RUNTIME_MOUNT = "/opt/finetune/src"
CONFIG_MOUNT = "/opt/finetune/config"
CONFIG_KEY = "job.yaml"
TOKEN_MOUNT = "/var/run/secrets/finetune.dev"
TOKEN_FILE = "token"
TOKEN_EXPIRATION_SECONDS = 3600
WORKER_GROUP = "gpu-workers"
# The pod that runs `ray job submit` only talks HTTP to the head: a CPU image of the same Ray version
# instead of the multi-GB GPU training image ({rayVersion} is replaced). --submitter-image overrides it.
DEFAULT_SUBMITTER_IMAGE = "docker.io/rayproject/ray:{rayVersion}-cpu"


def progress_audience(namespace: str, name: str) -> str:
    """Audience of the projected token a job's pods present to the progress endpoint: one per job,
    so a token minted for one job is useless for another (and for the API server itself)."""
    return f"finetune.dev/progress/{namespace}/{name}"


@dataclass(frozen=True)
class RenderConfig:
    # Base URL of the operator's progress endpoint as seen from the pods, e.g.
    # "http://finetune-operator.finetune-system.svc:8080". None: no progress channel rendered.
    progress_url: str | None = None
    operator_version: str = "0.1.0"
    # Instance-type figures (built-in table, extended by ConfigMaps / the cluster's nodes); None: built-in.
    instance_types: Mapping[str, InstanceType] | None = None
    submitter_image: str = DEFAULT_SUBMITTER_IMAGE
    # PEM of the CA that signed the progress endpoint's certificate (https progress URL), given to the
    # pods as FINETUNE_PROGRESS_CA; None: the system trust store (or plain http).
    progress_ca: str | None = None
