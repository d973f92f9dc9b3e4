"""A tiny Qwen2-architecture model and byte-level BPE tokenizer, built from scratch (no hub).

Used to make `examples/models/tiny-qwen2/` (see `examples/make_tiny_model.py`) and by the tests. The
weights are random: the model is a stand-in "base model" small enough to fine-tune on two CPU cores in
a minute, with the real Qwen2 code path in transformers (same config class, same decoder layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# ChatML, as Qwen2 uses; only assistant turns end with <|im_end|> that the model must learn to emit.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer on `texts`; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(vocab_size: int, *, hidden: int = 96, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 256, max_positions: int = 512, seed: int = 0) -> Any:
    """A randomly initialised Qwen2ForCausalLM with tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw: dict[str, Any] = {"rope_theta": 10000.0}  # transformers 5 folds it into rope_parameters; 4.x takes it directly
    config = Qwen2Config(
        **kw,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def write_tiny_model(out_dir: str | Path, texts: Iterable[str], *, vocab_size: int = 512, **model_kw: int) -> Path:
    """Train the tokenizer on `texts`, build the model, `save_pretrained` both into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size)
    model = build_model(len(tokenizer), **model_kw)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
