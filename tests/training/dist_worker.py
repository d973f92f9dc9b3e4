"""One rank of the 2-rank gloo checks in test_distributed.py (run as a script, one process per rank).

    python tests/training/dist_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR

Real FSDP2 over gloo on CPU, the runtime's own functions. Each check writes its figures into
OUT_DIR/rank<R>.json; the test asserts on them.
"""

from __future__ import annotations

import json
import resource
import sys
import traceback
from pathlib import Path
from typing import Any


def full(model: Any) -> dict[str, Any]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def check_load_once(model_dir: str, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 loads, rank 1 builds on meta; after sharding + broadcast the weights equal a plain load."""
    import torch
    from finetune_operator.api.spec import FSDPSpec, ModelSpec, ShardingStrategy
    from finetune_training import modelio
    from finetune_training.parallel import apply_fsdp, build_mesh

    spec = ModelSpec(source=model_dir)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, sd = modelio.load_for_sharding(spec, torch.float32, None, rank, world)
    on_meta = next(model.parameters()).is_meta
    fsdp = FSDPSpec(sharding_strategy=ShardingStrategy.full, activation_checkpointing=False)
    mesh = build_mesh(fsdp.sharding_strategy, world, world, "cpu")
    model = apply_fsdp(model, mesh, fsdp, torch.float32, on_gpu=False)
    modelio.fill_sharded(model, sd, torch.device("cpu"), rank, world)
    del sd
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = full(model)
    plain = modelio.load_model(spec, torch.float32)
    want = plain.state_dict()
    same = sorted(k for k in want if k in got and torch.equal(got[k], want[k]))
    buffers_same = all(torch.equal(b, dict(plain.named_buffers())[n]) for n, b in model.named_buffers())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        logits_equal = torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6)
    return {"on_meta": on_meta, "keys": sorted(want), "same": same, "buffers_same": buffers_same,
            "logits_equal": logits_equal, "maxrss_load_kib": rss1 - rss0}


def check_gradient_sync(model_dir: str, rank: int, world: int, strategy: str) -> dict[str, Any]:
    """Two micro-batches: grads with the deferred cross-replica sync equal grads synced every time."""
    import torch
    import torch.distributed as dist
    from finetune_operator.api.spec import FSDPSpec, ModelSpec, ShardingStrategy
    from finetune_training import modelio
    from finetune_training.loss import loss_sum, shift_targets
    from finetune_training.parallel import apply_fsdp, build_mesh, gradient_sync

    s = ShardingStrategy(strategy)
    fsdp = FSDPSpec(sharding_strategy=s, activation_checkpointing=False)
    counted = {"n": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*a: Any, **kw: Any) -> Any:  # instrumentation only: the real call is made
        counted["n"] += 1
        return real_all_reduce(*a, **kw)

    grads: dict[str, dict[str, Any]] = {}
    calls: dict[str, int] = {}
    for mode in ("every", "deferred"):
        torch.manual_seed(0)
        model = modelio.load_model(ModelSpec(source=model_dir), torch.float32)
        mesh = build_mesh(s, world, 1, "cpu")  # one rank per "node": hybrid = (2, 1), replicate across
        model = apply_fsdp(model, mesh, fsdp, torch.float32, on_gpu=False)
        g = torch.Generator().manual_seed(100 + rank)
        micro = [torch.randint(5, 200, (2, 12), generator=g) for _ in range(2)]
        counted["n"] = 0
        dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
        try:
            for i, ids in enumerate(micro):
                if mode == "deferred":
                    gradient_sync(model, s, last=i == len(micro) - 1)
                (loss_sum(model, ids, shift_targets(ids)) / 100.0).backward()
        finally:
            dist.all_reduce = real_all_reduce  # type: ignore[assignment]
        calls[mode] = counted["n"]
        grads[mode] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                       for n, p in model.named_parameters()}
    diff = max(float((grads["every"][n] - grads["deferred"][n]).abs().max()) for n in grads["every"])
    scale = max(float(v.abs().max()) for v in grads["every"].values())
    return {"max_abs_diff": diff, "max_abs_grad": scale, "all_reduce_calls": calls}


def check_uneven_hybrid(rank: int, world: int) -> dict[str, Any]:
    from finetune_operator.api.spec import ShardingStrategy
    from finetune_training.parallel import build_mesh

    try:
        build_mesh(ShardingStrategy.hybrid, world, 1 if rank == 0 else 2, "cpu")  # nodes with 1 and 2 ranks
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def check_resume_agreement(rank: int, out: Path) -> dict[str, Any]:
    """Each rank sees its own listing of the checkpoints (as NFS/EFS caches can show them): rank 1 sees a
    step 6 that rank 0 does not. Both must resume from rank 0's choice; rank 0's ResumeError reaches both."""
    from finetune_training import checkpoint as ckpt

    view = out / f"view-rank{rank}"
    for step in (4, 6) if rank == 1 else (4,):
        d = view / ckpt.checkpoint_name(step)
        d.mkdir(parents=True, exist_ok=True)
        (d / ".metadata").write_text("x")
        (d / ckpt.STATE_FILE).write_text(json.dumps({"step": step, "world_size": 1}))
        (d / "__0_0.distcp").write_text("x")
    choice = ckpt.choose_resume(None, str(view))
    error = None
    try:  # Ray restored a checkpoint; rank 0 finds nothing usable, rank 1 would take its step 6
        ckpt.choose_resume({"step": 9, "uri": str(out / "gone")}, str(view if rank == 1 else out / "empty"))
    except ckpt.ResumeError as e:
        error = str(e)
    return {"step": choice.step, "uri": choice.uri, "error": error}


def check_s3_resume(model_dir: str, rank: int, world: int, out: Path) -> dict[str, Any]:
    """Save to the session's S3 server (FINETUNE_TEST_S3_URI, AWS_* inherited), resume: one download per
    node, removed afterwards."""
    import os

    import torch
    from finetune_operator.api.spec import FSDPSpec, ModelSpec, ShardingStrategy, TrainingSpec
    from finetune_training import checkpoint as ckpt
    from finetune_training import modelio, optim, storage
    from finetune_training.parallel import apply_fsdp, build_mesh

    copies: list[bool] = []
    real_download = storage.download

    def recording_download(uri: str, root: Any, field: str = "storage") -> Any:  # did this call copy?
        copies.append(not (Path(root) / uri.removeprefix("s3://") / ".complete").exists())
        return real_download(uri, root, field)

    storage.download = recording_download  # type: ignore[assignment]
    fsdp = FSDPSpec(sharding_strategy=ShardingStrategy.full, activation_checkpointing=False)
    tspec = TrainingSpec(learning_rate=1e-2, fsdp=fsdp)

    def build() -> tuple[Any, Any]:
        model = modelio.load_model(ModelSpec(source=model_dir), torch.float32)
        model = apply_fsdp(model, build_mesh(fsdp.sharding_strategy, world, world, "cpu"), fsdp, torch.float32, False)
        return model, optim.build(model, tspec, 10)[0]

    model, opt = build()
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    uri = f"{os.environ['FINETUNE_TEST_S3_URI']}/checkpoint-step-00000001"
    staging = out / "staging-node"  # both ranks on one node share the node-local staging directory
    ckpt.save_to(uri, model, opt, {"step": 1, "world_size": world}, rank, out / f"save-{rank}")
    model2, opt2 = build()
    state = ckpt.load_from(uri, model2, opt2, local_rank=rank, staging=staging)
    same = all(torch.equal(a, b) for a, b in zip(full(model).values(), full(model2).values(), strict=True))
    import torch.distributed as dist

    dist.barrier()
    return {"copies": copies, "same": same, "step": state["step"],
            "staging_left": sorted(str(p.relative_to(staging)) for p in staging.rglob("*")) if staging.exists() else []}


def main() -> None:
    rank, world, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    checks = {
        "load_once": lambda: check_load_once(model_dir, rank, world),
        "sync_hybrid": lambda: check_gradient_sync(model_dir, rank, world, "hybrid"),
        "sync_none": lambda: check_gradient_sync(model_dir, rank, world, "none"),
        "uneven_hybrid": lambda: check_uneven_hybrid(rank, world),
        "resume_agreement": lambda: check_resume_agreement(rank, out),
        "s3_resume": lambda: check_s3_resume(model_dir, rank, world, out),
    }
    for name, fn in checks.items():
        try:
            result[name] = fn()
        except Exception:
            result[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
