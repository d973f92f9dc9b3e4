"""Sharded checkpoints (torch.distributed.checkpoint), where they live, and Ray's pointers to them.

Layout under the job's storage (spec.training.checkpoint.storageUri, `./.work/<job>` locally):

    <storage>/checkpoints/train/checkpoint-step-00000050/   one checkpoint (run name `train`)
        __0_0.distcp, __1_0.distcp, ...               one shard per rank: model + optimizer state (DTensors)
        .metadata                                     DCP metadata (rank 0, after every shard is written)
        trainer_state.json                            step, data position, scheduler, world size, metrics
    <storage>/train/                                  Ray Train's run directory (run name `train`)
        checkpoint-step-00000050/pointer.json         what Ray's checkpoint holds: {"step", "uri"}
        checkpoint_manager_snapshot.json              Ray's list of registered checkpoints
    <storage>/final/                                  Hugging Face export (safetensors + config + tokenizer)

Every rank writes its shard straight to shared storage (local path or PVC; for s3:// through node-local
staging and an upload); then all ranks call `ray.train.report`, rank 0 with a pointer checkpoint. Ray
keeps its own bookkeeping of pointers (and can lose one when a worker dies right after a report); the
runtime keeps the newest `keep` complete checkpoints itself and, on resume, takes the newest complete
checkpoint it can find through either route. A checkpoint is complete when `.metadata`,
`trainer_state.json` and one shard per rank exist.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DeterministicError

STATE_FILE = "trainer_state.json"
POINTER_FILE = "pointer.json"
CHECKPOINTS_DIR = "checkpoints"
_NAME = re.compile(r"^checkpoint-step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-step-{step:08d}"


def save(path: str | Path, model: Any, optimizer: Any, trainer_state: dict[str, Any], rank: int) -> Path:
    """Collective: every rank writes its shard of model + optimizer state; rank 0 the trainer state.

    `path` is local (or a mounted PVC); for S3 see `save_to`.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out))
    if rank == 0:
        tmp = out / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        tmp.rename(out / STATE_FILE)
    return out


def load(path: str | Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Collective: restore model + optimizer shards in place; returns the trainer state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return read_state(path)


def read_state(path: str | Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / STATE_FILE).read_text()))


def is_complete(path: str | Path) -> bool:
    return not missing_files(str(path))


def missing_files(uri: str) -> list[str]:
    """What a checkpoint directory (local path or s3://) lacks to be complete; [] when complete."""
    from finetune_operator.api.storage import is_remote

    if is_remote(uri):
        import pyarrow.fs as pafs

        from .storage import filesystem

        fs, base = filesystem(uri)
        try:
            names = {os.path.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(base))}
        except (OSError, FileNotFoundError):
            return ["the directory"]

        def read_world() -> int:
            with fs.open_input_stream(f"{base}/{STATE_FILE}") as f:
                return int(json.loads(f.read()).get("world_size", 1))
    else:
        p = Path(uri)
        if not p.is_dir():
            return ["the directory"]
        names = {e.name for e in p.iterdir()}

        def read_world() -> int:
            return int(read_state(p).get("world_size", 1))
    missing = [n for n in (".metadata", STATE_FILE) if n not in names]
    if STATE_FILE in names:
        try:
            world = read_world()
        except (ValueError, OSError):
            return [*missing, f"a readable {STATE_FILE}"]
        missing += [f"__{r}_0.distcp" for r in range(world) if f"__{r}_0.distcp" not in names]
    return missing


class ResumeError(DeterministicError, RuntimeError):
    """Ray restored a checkpoint but nothing usable is behind it: refusing to restart at step 0."""


@dataclass(frozen=True)
class ResumeChoice:
    step: int
    uri: str | None  # None: start at step 0
    why: str


def choose_resume(pointer: dict[str, Any] | None, checkpoints_uri: str,
                  agree: Callable[[Callable[[], ResumeChoice]], ResumeChoice] | None = None) -> ResumeChoice:
    """The checkpoint every rank resumes from: rank 0 chooses (`_choose`), the others take its choice.

    Ranks listing shared storage independently can disagree (NFS/EFS attribute and directory caches show
    one rank a checkpoint another does not see yet), and ranks loading different checkpoints is silent
    corruption. `agree` runs the choice once and hands it to every rank (default: `broadcast_from_rank0`;
    a single process just chooses). A ResumeError on rank 0 is raised on every rank.
    """
    return (agree or broadcast_from_rank0)(lambda: _choose(pointer, checkpoints_uri))


def broadcast_from_rank0(decide: Callable[[], ResumeChoice]) -> ResumeChoice:
    """`decide()` on rank 0 and its result on every rank (`broadcast_object_list`) when a process group of
    more than one rank is up; otherwise just `decide()`. Rank 0's exception reaches every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as e:  # sent on, so the other ranks raise instead of waiting in the broadcast
            error = e
            box[0] = ("error", f"{type(e).__name__}: {e}" if not isinstance(e, ResumeError) else str(e))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise ResumeError(value if value.startswith("cannot resume") else f"cannot resume: rank 0: {value}")
    assert isinstance(value, ResumeChoice)
    return value


def _choose(pointer: dict[str, Any] | None, checkpoints_uri: str) -> ResumeChoice:
    """Pick the checkpoint to resume from: the newer of Ray's (if its checkpoint is complete) and the
    newest complete one found by always scanning `checkpoints_uri`; `why` says which and why.

    Raises ResumeError when Ray handed over a checkpoint (so this run had progressed) but neither it nor
    the scan yields a complete checkpoint.
    """
    notes: list[str] = []
    candidates: list[tuple[int, str, str]] = []
    if pointer is not None:
        uri = str(pointer.get("uri"))
        gaps = missing_files(uri) if pointer.get("step") is not None else ["pointer.json"]
        if gaps:
            notes.append(f"Ray's checkpoint points to {uri}, which lacks {', '.join(gaps[:4])}")
        else:
            candidates.append((int(pointer["step"]), uri, "Ray's checkpoint"))
            notes.append(f"Ray's checkpoint: step {pointer['step']}")
    hit = latest_uri(checkpoints_uri)
    if hit is not None:
        candidates.append((hit[0], hit[1], "storage scan"))
        notes.append(f"storage scan of {checkpoints_uri}: step {hit[0]}")
    else:
        notes.append(f"no complete checkpoint in {checkpoints_uri}")
    if not candidates:
        if pointer is not None:
            raise ResumeError(f"cannot resume: {'; '.join(notes)}; refusing to restart at step 0 "
                              "(run with --fresh / delete the run's storage to start over)")
        return ResumeChoice(0, None, f"{'; '.join(notes)}: starting at step 0")
    step, uri, source = max(candidates)
    return ResumeChoice(step, uri, f"{'; '.join(notes)} -> step {step} from the {source} (newest complete)")


def load_from(uri: str, model: Any, optimizer: Any, local_rank: int, staging: str | Path) -> dict[str, Any]:
    """Collective `load` from a local/PVC path, or from s3:// through one download per node.

    For S3 local rank 0 copies the checkpoint to node-local staging while the node's other ranks wait;
    every rank reads from there; then local rank 0 deletes the copy (a barrier first, so nobody reads a
    deleted file).
    """
    import shutil

    import torch.distributed as dist
    from finetune_operator.api.storage import is_remote

    if not is_remote(uri):
        return load(uri, model, optimizer)
    from .storage import download

    root = Path(staging) / "resume"
    if local_rank == 0:
        local = download(uri, root, "resume checkpoint")
    dist.barrier()
    if local_rank != 0:
        local = download(uri, root, "resume checkpoint")  # already complete: returns the path, copies nothing
    try:
        return load(local, model, optimizer)
    finally:
        dist.barrier()
        if local_rank == 0:
            shutil.rmtree(root, ignore_errors=True)


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


def prune(run_uri: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoint directories (spec.training.checkpoint.keep).

    Done by the runtime rather than Ray's `num_to_keep`: Ray loses count across a worker-group restart
    and would keep an extra one. Only directories older than the newest `keep` are touched.
    """
    import pyarrow.fs as pafs

    from .storage import filesystem

    fs, base = filesystem(run_uri)
    found = []
    for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        m = _NAME.match(os.path.basename(info.path))
        if m and info.type == pafs.FileType.Directory:
            found.append((int(m.group(1)), info.path))
    removed = []
    for _, path in sorted(found)[:-keep] if keep > 0 else []:
        try:
            fs.delete_dir(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def save_to(uri: str, model: Any, optimizer: Any, trainer_state: dict[str, Any], rank: int,
            staging: str | Path) -> None:
    """`save` to a local/PVC path directly, or to s3:// via node-local staging (shards first, then rank 0
    uploads `.metadata` and the trainer state, so an S3 checkpoint is complete only once all are there)."""
    import shutil

    import torch.distributed as dist
    from finetune_operator.api.storage import is_remote

    if not is_remote(uri):
        save(uri, model, optimizer, trainer_state, rank)
        return
    import pyarrow.fs as pafs

    from .storage import filesystem

    local = Path(staging) / f"{Path(uri).name}-rank{rank}"
    shutil.rmtree(local, ignore_errors=True)
    save(local, model, optimizer, trainer_state, rank)
    fs, base = filesystem(uri)
    fs.create_dir(base, recursive=True)
    for f in local.glob("__*.distcp"):
        pafs.copy_files(str(f), f"{base}/{f.name}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)
    dist.barrier()
    if rank == 0:
        for name in (".metadata", STATE_FILE):
            pafs.copy_files(str(local / name), f"{base}/{name}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
    dist.barrier()
    shutil.rmtree(local, ignore_errors=True)


def write_pointer(directory: str | Path, step: int, uri: str) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / POINTER_FILE).write_text(json.dumps({"step": step, "uri": uri}))
    return d


def read_pointer(directory: str | Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((Path(directory) / POINTER_FILE).read_text()))
    except (OSError, ValueError):
        return None
