"""Sharded checkpoints (torch.distributed.checkpoint) and where they live.

Layout under the job's storage (spec.training.checkpoint.storageUri, `./.work/<job>` locally):

    <storage>/<run>/checkpoint-step-00000050/   one checkpoint, Ray Train's run directory
        .metadata                               DCP metadata (written by rank 0)
        __0_0.distcp, __1_0.distcp, ...         one shard per rank: model + optimizer state (DTensors)
        trainer_state.json                      step, epoch, data position, scheduler, world size, metrics
    <storage>/<run>/checkpoint_manager_snapshot.json   Ray's list of registered checkpoints
    <storage>/final/                            Hugging Face export (safetensors + config + tokenizer)

Each rank writes its shard to node-local staging and reports it with `ray.train.report(...,
checkpoint=...)`; Ray uploads and merges the ranks' files into one directory and keeps the newest
`keep`. A checkpoint is complete when `.metadata`, `trainer_state.json` and one shard per rank exist.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-step-{step:08d}"


def save(path: str | Path, model: Any, optimizer: Any, trainer_state: dict[str, Any], rank: int) -> Path:
    """Collective: every rank writes its shard of model + optimizer state; rank 0 the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out))
    if rank == 0:
        tmp = out / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        tmp.rename(out / STATE_FILE)
    return out


def load(path: str | Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Collective: restore model + optimizer shards in place; returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return read_state(path)


def read_state(path: str | Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / STATE_FILE).read_text()))


def is_complete(path: str | Path) -> bool:
    p = Path(path)
    if not (p / ".metadata").is_file() or not (p / STATE_FILE).is_file():
        return False
    try:
        world = int(read_state(p).get("world_size", 1))
    except (ValueError, OSError):
        return False
    return all((p / f"__{r}_0.distcp").is_file() for r in range(world))


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under a run directory (local or mounted), oldest first."""
    try:
        entries = list(Path(run_dir).iterdir())
    except OSError:
        return []
    found = []
    for e in entries:
        m = _NAME.match(e.name)
        if m and e.is_dir() and is_complete(e):
            found.append((int(m.group(1)), e))
    return sorted(found)


def latest(run_dir: str | Path) -> tuple[int, Path] | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def latest_uri(run_uri: str) -> tuple[int, str] | None:
    """Like `latest` for any storage URI (s3:// listed through pyarrow, checked by its files)."""
    from finetune_operator.api.storage import is_remote

    if not is_remote(run_uri):
        hit = latest(run_uri)
        return (hit[0], str(hit[1])) if hit else None
    import pyarrow.fs as pafs

    from .storage import filesystem

    fs, base = filesystem(run_uri)
    best: tuple[int, str] | None = None
    for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        m = _NAME.match(os.path.basename(info.path))
        if not m or info.type != pafs.FileType.Directory:
            continue
        names = {os.path.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(info.path))}
        if ".metadata" in names and STATE_FILE in names:
            with fs.open_input_stream(f"{info.path}/{STATE_FILE}") as f:
                world = int(json.loads(f.read()).get("world_size", 1))
            if all(f"__{r}_0.distcp" in names for r in range(world)):
                step = int(m.group(1))
                if best is None or step > best[0]:
                    best = (step, f"s3://{info.path}")
    return best
