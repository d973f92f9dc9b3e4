"""MFU arithmetic, model shapes, and the learning-rate schedule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from finetune_operator.api.instance_types import lookup
from finetune_operator.api.spec import Scheduler
from finetune_training.metrics import Throughput, flops_per_token, mfu, model_shape, shape_from_config
from finetune_training.optim import lr_factor

QWEN25_15B = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                             num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def test_flops_per_token_formula() -> None:
    assert flops_per_token(1_000, 2, 4, 8, 16) == 6 * 1_000 + 12 * 2 * 4 * 8 * 16


def test_qwen25_15b_shape_and_mfu_on_g6() -> None:
    shape = shape_from_config(QWEN25_15B)
    # ~1.31 B non-embedding parameters, plus the LM head's matmul (151936 x 1536): tied to the embedding
    # table, but it still multiplies every token's hidden state by it.
    head = 151936 * 1536
    assert shape.non_embedding_params - head == pytest.approx(1.31e9, rel=0.01)
    fpt = shape.flops_per_token(2048)
    assert fpt == pytest.approx(6 * shape.non_embedding_params + 12 * 28 * 12 * 128 * 2048)
    without_head = fpt - 6 * head
    assert 1 - without_head / fpt == pytest.approx(0.136, abs=0.001)  # what leaving it out cost
    g6 = lookup("g6.12xlarge")
    assert g6 is not None
    # 8 L4s at 121 TFLOP/s; 10k tokens/s
    assert mfu(fpt, 10_000, g6.gpu_bf16_tflops, 8) == pytest.approx(fpt * 1e4 / (121e12 * 8))
    assert mfu(fpt, 10_000, 0.0, 2) is None  # CPU: no MFU


def test_model_shape_matches_config_formula(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.tie_word_embeddings
    assert model_shape(model) == shape_from_config(model.config)
    emb = model.get_input_embeddings().weight.numel()
    matmul = sum(p.numel() for p in model.parameters())  # parameters() lists the tied table once
    assert model_shape(model).non_embedding_params == matmul  # the tied head counts, the lookup does not
    assert emb > 0


@pytest.mark.parametrize(
    ("kind", "step", "expected"),
    [
        (Scheduler.cosine, 0, 1 / 11), (Scheduler.cosine, 9, 10 / 11), (Scheduler.cosine, 10, 1.0),
        (Scheduler.cosine, 55, 0.5), (Scheduler.cosine, 100, 0.0), (Scheduler.linear, 55, 0.5),
        (Scheduler.constant, 90, 1.0),
    ],
    ids=["warmup-start", "warmup-end", "peak", "cosine-mid", "cosine-end", "linear-mid", "constant"],
)
def test_lr_schedule(kind: Scheduler, step: int, expected: float) -> None:
    assert lr_factor(step, 100, 0.1, kind) == pytest.approx(expected)


def test_throughput_and_eta() -> None:
    t = Throughput(window=3)
    t._times = [(0.5, 1000), (0.5, 1000), (1.0, 1000)]
    assert t.tokens_per_second == pytest.approx(1500.0)
    assert t.eta(10) == pytest.approx(10 * 2 / 3)
