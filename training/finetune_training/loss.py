"""The token loss without materialising `[tokens, vocab]` fp32 logits: shifted labels, chunked cross-entropy.

`targets` are the labels shifted left by one (`targets[t] = labels[t+1]`, the last position ignored), so
the logits are never sliced (a slice of a `[micro·T, vocab]` tensor is a copy). The LM head and the
cross-entropy run over chunks of `chunk_tokens(vocab)` positions, each under non-reentrant activation
checkpointing: at most one chunk's fp32 logits exist at a time, forward or backward (the chunk's matmul
is recomputed in backward: about a third of the LM head's FLOPs extra). The chunk is sized by the
vocabulary, so one chunk's fp32 logits stay within `CHUNK_LOGITS_BYTES` (512 positions for Qwen2's 152k
tokens): a fixed 4096 equalled a whole seed micro-batch (1 × 4096) and saved nothing.

The chunked path is a method attached to the model (`finetune_loss_sum`) and registered with FSDP2
(`register_fsdp_forward_method`), so the root's parameters (embeddings, final norm, LM head) are
gathered around it as around `forward`. Models whose `forward` does more than `lm_head(hidden)`
(logit scaling or soft-capping) fall back to the full logits, still with shifted labels.
"""

from __future__ import annotations

import types
from typing import Any

IGNORE = -100
CHUNK_LOGITS_BYTES = 512 << 20  # fp32 logits of one chunk: at most 0.5 GiB
MAX_CHUNK_TOKENS = 4096
METHOD = "finetune_loss_sum"
_LOGIT_TWEAKS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def shift_targets(labels: Any) -> Any:
    """`[..., T]` labels → next-token targets: `targets[..., t] = labels[..., t+1]`, the last one ignored."""
    import torch

    out = torch.full_like(labels, IGNORE)
    out[..., :-1] = labels[..., 1:]
    return out


def chunk_tokens(vocab_size: int) -> int:
    """Positions per loss chunk: the largest power of two whose `[chunk, vocab]` fp32 logits fit in
    `CHUNK_LOGITS_BYTES` (at least 16, at most `MAX_CHUNK_TOKENS`)."""
    fit = max(1, CHUNK_LOGITS_BYTES // (4 * max(1, vocab_size)))
    return max(16, min(MAX_CHUNK_TOKENS, 1 << (fit.bit_length() - 1)))


def _ce_chunk(hidden: Any, weight: Any, bias: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy_sum(hidden: Any, weight: Any, bias: Any, targets: Any,
                              chunk: int | None = None) -> Any:
    """Σ cross-entropy of `hidden [N, H] @ weight.T (+ bias)` against `targets [N]`, chunk by chunk
    (`chunk` positions; default `chunk_tokens` of the vocabulary, `weight`'s rows)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    chunk = chunk or chunk_tokens(int(weight.shape[0]))

    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    n = hidden.shape[0]
    for i in range(0, n, chunk):
        h, t = hidden[i : i + chunk], targets[i : i + chunk]
        if torch.is_grad_enabled():
            total = total + checkpoint(_ce_chunk, h, weight, bias, t, use_reentrant=False)
        else:
            total = total + _ce_chunk(h, weight, bias, t)
    return total


def supports_chunked(model: Any) -> bool:
    import torch.nn as nn

    cfg = model.config
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in _LOGIT_TWEAKS):
        return False
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return isinstance(getattr(model, "lm_head", None), nn.Linear) and isinstance(base, nn.Module)


def _loss_sum_method(self: Any, input_ids: Any, targets: Any, attention_mask: Any = None,
                     position_ids: Any = None, chunk: int | None = None) -> Any:
    base = getattr(self, getattr(self, "base_model_prefix", "model"))
    out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    head = self.lm_head
    return chunked_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                     targets.reshape(-1), chunk)


def install(model: Any) -> bool:
    """Attach the chunked loss method (before `fully_shard`); False when the model needs the fallback."""
    if not supports_chunked(model):
        return False
    setattr(model, METHOD, types.MethodType(_loss_sum_method, model))
    return True


def register_with_fsdp(model: Any) -> None:
    """After `fully_shard(model)`: make FSDP gather the root's parameters around the loss method."""
    if hasattr(model, METHOD):
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, METHOD)


def loss_sum(model: Any, input_ids: Any, targets: Any, attention_mask: Any = None, position_ids: Any = None,
             chunk: int | None = None) -> Any:
    """Summed token cross-entropy (fp32) of a batch against its shifted `targets`."""
    import torch.nn.functional as F

    fn = getattr(model, METHOD, None)
    if fn is not None:
        return fn(input_ids, targets, attention_mask=attention_mask, position_ids=position_ids, chunk=chunk)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
