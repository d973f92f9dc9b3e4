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
"""

from __future__ import annotations

import logging
from typing import Any

from finetune_operator.api.spec import FSDPSpec, ShardingStrategy

log = logging.getLogger("finetune.parallel")


def mesh_shape(strategy: ShardingStrategy, world: int, local_world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if strategy == ShardingStrategy.none:
        return (world, 1), ("replicate", "shard")
    if strategy == ShardingStrategy.hybrid:
        if local_world <= 0 or world % local_world:
            log.warning("hybrid sharding needs the same ranks on every node (%d ranks, %d local); using full",
                        world, local_world)
            return (world,), ("shard",)
        return (world // local_world, local_world), ("replicate", "shard")
    return (world,), ("shard",)


def build_mesh(strategy: ShardingStrategy, world: int, local_world: int, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

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
    """Activation checkpointing, then `fully_shard` on every decoder layer and on the root."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

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
    for i, layer in enumerate(layers):
        # The last layer is gathered again right away by the root's backward: keep it (torchtitan does).
        fully_shard(layer, reshard_after_forward=reshard and i < len(layers) - 1, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model
