"""AdamW and the learning-rate schedule: linear warmup, then cosine / linear decay to 0, or constant."""

from __future__ import annotations

import math
from typing import Any

from finetune_operator.api.spec import Scheduler, TrainingSpec


def lr_factor(step: int, total_steps: int, warmup_ratio: float, kind: Scheduler) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    warmup = int(total_steps * warmup_ratio)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == Scheduler.constant:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if kind == Scheduler.linear:
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build(model: Any, spec: TrainingSpec, total_steps: int) -> tuple[Any, Any]:
    import torch

    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=spec.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, spec.warmup_ratio, spec.scheduler)
    )
    return optimizer, scheduler
