"""The environment the renderer sets in the Ray pods, read in one place.

Variables (all optional unless said otherwise):

- `FINETUNE_JOB_NAMESPACE`, `FINETUNE_JOB_NAME`: the FinetuneJob this run belongs to (logs, progress).
- `FINETUNE_ATTEMPT`: attempt number (1 + job retries so far), echoed in progress reports.
- `FINETUNE_PROGRESS_URL`: where rank 0 POSTs `ProgressReport` JSON (the operator's progress endpoint).
  Unset: no HTTP progress (the local CLI sets it to its own in-process server).
- `FINETUNE_PROGRESS_TOKEN_FILE`: file holding a bearer token (a projected service-account token); read
  again before every POST because the kubelet rotates it.
- `FINETUNE_PROGRESS_INTERVAL`: minimum seconds between two POSTs (default 5; the local CLI uses 0.5).
- `FINETUNE_REQUIRE_EFA`: "1" to fail at start when NCCL does not use EFA (overrides spec.network.requireEFA
  when set).
- `FINETUNE_INSTANCE_TYPE`: EC2 instance type of the worker nodes (GPU peak for MFU); defaults to
  spec.cluster.instanceType.
- `FINETUNE_CACHE_DIR`: where `s3://` models are downloaded (default ~/.cache/finetune).
- `FINETUNE_STAGING_DIR`: node-local scratch for checkpoint shards before Ray uploads them (default: tmp).
- `HF_TOKEN`: Hugging Face token for gated/private hub models (from a Secret; never logged).
- `NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`, `NCCL_DEBUG_FILE`, `FI_PROVIDER`, `NCCL_NET_PLUGIN`, `NCCL_SOCKET_IFNAME`:
  passed through to NCCL/libfabric. If `NCCL_DEBUG_FILE` is unset the runtime points it at a per-process
  file so the network probe can read NCCL's init log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class RuntimeEnv:
    namespace: str | None = None
    job_name: str | None = None
    attempt: int | None = None
    progress_url: str | None = None
    progress_token_file: str | None = None
    progress_interval: float = 5.0
    require_efa: bool | None = None
    instance_type: str | None = None
    cache_dir: str | None = None
    staging_dir: str | None = None

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> RuntimeEnv:
        e = dict(os.environ if env is None else env)
        attempt = e.get("FINETUNE_ATTEMPT")
        interval = e.get("FINETUNE_PROGRESS_INTERVAL")
        return cls(
            namespace=e.get("FINETUNE_JOB_NAMESPACE") or None,
            job_name=e.get("FINETUNE_JOB_NAME") or None,
            attempt=int(attempt) if attempt and attempt.isdigit() else None,
            progress_url=e.get("FINETUNE_PROGRESS_URL") or None,
            progress_token_file=e.get("FINETUNE_PROGRESS_TOKEN_FILE") or None,
            progress_interval=float(interval) if interval else 5.0,
            require_efa=_flag(e.get("FINETUNE_REQUIRE_EFA")),
            instance_type=e.get("FINETUNE_INSTANCE_TYPE") or None,
            cache_dir=e.get("FINETUNE_CACHE_DIR") or None,
            staging_dir=e.get("FINETUNE_STAGING_DIR") or None,
        )

    def log_prefix(self) -> str:
        if self.job_name:
            return f"[{self.namespace or 'default'}/{self.job_name}]"
        return "[finetune]"
