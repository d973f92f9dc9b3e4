"""Training metrics: FLOPs per token, MFU, throughput, ETA, peak memory.

MFU (PaLM appendix B, as nanoGPT/torchtitan): `flops_per_token = 6*N + 12*L*H*Q*T` with N the
parameters that do a matmul per token: everything but the token-embedding table (a lookup), plus the LM
head, which with tied embeddings shares the table's weights but still multiplies by it (6·V·H; 13.6 % of
Qwen2.5-1.5B's FLOPs at 2048 tokens). L layers, H query heads, Q head dim, T sequence length. `MFU = flops_per_token * tokens_per_second / (peak_bf16 * gpus)` with the
peak per GPU from `finetune_operator.instance_types`. No MFU on CPU (no meaningful peak).
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    non_embedding_params: int
    layers: int
    heads: int
    head_dim: int

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.non_embedding_params, self.layers, self.heads, self.head_dim, seq_len)


def flops_per_token(n_params: int, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    return 6.0 * n_params + 12.0 * layers * heads * head_dim * seq_len


def mfu(flops_tok: float, tokens_per_second: float, peak_tflops_per_gpu: float, gpus: int) -> float | None:
    if peak_tflops_per_gpu <= 0 or gpus <= 0:
        return None
    return flops_tok * tokens_per_second / (peak_tflops_per_gpu * 1e12 * gpus)


def model_shape(model: Any) -> ModelShape:
    """Shape of a transformers causal LM (call before sharding: counts full parameter sizes)."""
    cfg = model.config
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb_weight = model.get_input_embeddings().weight
    emb = emb_weight.numel()
    head = model.get_output_embeddings()
    if head is not None and head.weight is emb_weight:  # tied: the head's matmul is not in `total`
        total += emb
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return ModelShape(total - emb, int(cfg.num_hidden_layers), heads, head_dim)


def shape_from_config(cfg: Any) -> ModelShape:
    """The same figures from a config alone (benchmarks), for standard Llama/Qwen2-style decoders."""
    h, i, L = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers)
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    q = int(getattr(cfg, "head_dim", None) or h // heads)
    attn = h * heads * q + 2 * h * kv * q + heads * q * h + (heads * q + 2 * kv * q)  # qkv bias (Qwen2)
    mlp = 3 * h * i
    norms = 2 * h
    n = L * (attn + mlp + norms) + h + h * int(cfg.vocab_size)  # the LM head, tied or not
    return ModelShape(n, L, heads, q)


def peak_memory_gib(on_gpu: bool) -> float:
    if on_gpu:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


class Throughput:
    """Step-time bookkeeping: tokens/s over a sliding window and an ETA from the recent step time."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self._times: list[tuple[float, int]] = []
        self._last = time.perf_counter()

    def reset_clock(self) -> None:
        self._last = time.perf_counter()

    def step(self, tokens: int) -> float:
        now = time.perf_counter()
        dt = now - self._last
        self._last = now
        self._times.append((dt, tokens))
        if len(self._times) > self.window:
            self._times.pop(0)
        return dt

    @property
    def step_time(self) -> float | None:
        if not self._times:
            return None
        return sum(t for t, _ in self._times) / len(self._times)

    @property
    def tokens_per_second(self) -> float | None:
        t = sum(t for t, _ in self._times)
        return sum(n for _, n in self._times) / t if t > 0 else None

    def eta(self, remaining_steps: int) -> float | None:
        st = self.step_time
        return None if st is None else st * max(0, remaining_steps)
