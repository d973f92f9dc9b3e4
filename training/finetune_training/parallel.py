"""FSDP2 (`fully_shard`): device mesh per sharding strategy, per-decoder-layer wrapping, mixed precision.

Strategies (spec.training.fsdp.shardingStrategy) and the mesh they use:
- `full`: 1-D mesh over all ranks; parameters, gradients and optimizer state sharded (ZeRO-3).
- `gradOp`: the same mesh with `reshard_after_forward=False` (parameters stay gathered between forward
  and backward; ZeRO-2-like memory, less communication).
- `hybrid` (HSDP): 2-D mesh (replicate = nodes, shard = ranks per node): shard inside a node, all-reduce
  across nodes, so only gradient all-reduces cross the (scarce) inter-node network. One node gives a
  (1, n) mesh, i.e. `full`; one rank per node (CPU pods, gpusPerWorker 0) gives (nodes, 1), i.e. `none`.
  Locally (`finetune run`: 2 CPU ranks on one machine) it is therefore plain full sharding.
- `none`: 2-D mesh (ranks, 1): every rank holds everything, gradients all-reduced (DDP-like), but
  through the same FSDP2 code path (same state dicts, same checkpoints).

Mixed precision: bf16 compute with fp32 reductions on GPU (MixedPrecisionPolicy), fp32 on CPU with gloo.
The sharded master weights (and so AdamW's state) are always fp32: a model loaded in bf16
(`model.dtype: bfloat16`) is upcast layer by layer just before it is sharded, so small updates are not
rounded away (pure-bf16 AdamW at lr 2e-5 leaves most weights unchanged).

Gradient accumulation: `gradient_sync(model, strategy, last)` before each micro-batch's backward. With
`hybrid` the cross-node all-reduce runs only on the last micro-batch (the intra-node reduce-scatter still
runs every micro-batch, so gradients stay sharded); with `none` (replicated) no gradient communication
happens until the last micro-batch. `full`/`gradOp` reduce-scatter every micro-batch: deferring it
would keep full unsharded gradients on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from finetune_operator.api.spec import FSDPSpec, ShardingStrategy

from .errors import DeterministicError

log = logging.getLogger("finetune.parallel")


def mesh_shape(strategy: ShardingStrategy, world: int, local_world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if strategy == ShardingStrategy.none:
        return (world, 1), ("replicate", "shard")
    if strategy == ShardingStrategy.hybrid:
        if local_world <= 0 or world % local_world:
            raise UnevenShardingError(uneven_message([local_world], world))
        return (world // local_world, local_world), ("replicate", "shard")
    return (world,), ("shard",)


class UnevenShardingError(DeterministicError, ValueError):
    """hybrid sharding over nodes with different numbers of ranks (every rank raises it at once)."""


def uneven_message(local_worlds: list[int], world: int) -> str:
    return (f"training.fsdp.shardingStrategy: hybrid needs the same number of ranks on every node; "
            f"got ranks per node {sorted(set(local_worlds))} for {world} ranks (use full, or give every "
            "worker pod the same gpusPerWorker)")


def check_same_local_world(strategy: ShardingStrategy, world: int, local_world: int) -> None:
    """Collective (hybrid only): every rank must see the same ranks per node, else all fail at once.

    Without it ranks on different nodes would build different meshes and hang in their first collective.
    """
    if strategy != ShardingStrategy.hybrid or world <= 1:
        return
    import torch.distributed as dist

    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, local_world)
    if len(set(seen)) > 1 or world % local_world:
        raise UnevenShardingError(uneven_message([int(x) for x in seen], world))


def build_mesh(strategy: ShardingStrategy, world: int, local_world: int, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    check_same_local_world(strategy, world, local_world)
    shape, names = mesh_shape(strategy, world, local_world)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def decoder_layers(model: Any) -> list[Any]:
    """The repeated transformer blocks of a transformers causal LM (`model.model.layers` and kin)."""
    import torch.nn as nn

    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers", "layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, nn.ModuleList):
            return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def apply_fsdp(model: Any, mesh: Any, fsdp: FSDPSpec, compute_dtype: Any, on_gpu: bool) -> Any:
    """Activation checkpointing, then `fully_shard` on every decoder layer and on the root (fp32 shards)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from . import loss

    if fsdp.activation_checkpointing:
        # transformers 5 renamed it; the DLC image may carry 4.x.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw: dict[str, Any] = {"mesh": mesh}
    if compute_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if fsdp.cpu_offload:
        if on_gpu:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        else:
            log.info("fsdp.cpuOffload has no effect on CPU ranks; ignored")
    reshard = fsdp.sharding_strategy != ShardingStrategy.grad_op
    layers = decoder_layers(model)
    loss.install(model)
    for i, layer in enumerate(layers):
        layer.to(torch.float32)  # fp32 master weights whatever the load dtype (one layer at a time)
        # The last layer is gathered again right away by the root's backward: keep it (torchtitan does).
        fully_shard(layer, reshard_after_forward=reshard and i < len(layers) - 1, **kw)
    model.to(torch.float32)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    loss.register_with_fsdp(model)
    return model


def gradient_sync(model: Any, strategy: ShardingStrategy, last: bool) -> None:
    """Before a micro-batch's backward: communicate gradients across replicas only on the last one."""
    if strategy == ShardingStrategy.hybrid:
        model.set_requires_all_reduce(last)
    elif strategy == ShardingStrategy.none:
        model.set_requires_gradient_sync(last)
