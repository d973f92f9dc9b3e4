"""Operator-wide settings the renderer needs (passed in, never read from the environment here)."""

from __future__ import annotations

from dataclasses import dataclass

FIELD_MANAGER = "finetune-operator"
RUNTIME_MOUNT = "/opt/finetune/src"
CONFIG_MOUNT = "/opt/finetune/config"
CONFIG_KEY = "job.yaml"
TOKEN_MOUNT = "/var/run/secrets/finetune.dev"
TOKEN_FILE = "token"
TOKEN_EXPIRATION_SECONDS = 3600
WORKER_GROUP = "gpu-workers"


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
