"""Loading the base model and tokenizer (hub id, local dir, `pvc://`, `s3://`), and exporting the result.

The hub token comes only from the `HF_TOKEN` environment variable (the renderer maps the Secret there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from finetune_operator.api.spec import DType, ModelSpec, Precision
from finetune_operator.api.storage import is_remote, resolve_in_pod


def default_cache_dir() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE_DIR") or Path.home() / ".cache" / "finetune")


def resolve_source(source: str, cache_dir: str | Path | None = None) -> tuple[str, bool]:
    """(what `from_pretrained` gets, whether it is a local directory).

    `pvc://claim/path` → its mount path; `s3://bucket/prefix` → downloaded to the cache; absolute or
    `./` paths as given; anything else is a hub id.
    """
    if is_remote(source):
        from .storage import download_prefix

        return str(download_prefix(source, Path(cache_dir or default_cache_dir()) / "s3")), True
    path = resolve_in_pod(source)
    if path.startswith(("/", "./", "../")) or Path(path).is_dir():
        if not Path(path).is_dir():
            raise FileNotFoundError(f"spec.model.source: {source!r} is not a directory ({path})")
        return path, True
    return path, False


def compute_dtype(precision: Precision, on_gpu: bool) -> Any:
    """The dtype forward/backward run in."""
    import torch

    if precision == Precision.fp32 or (precision == Precision.auto and not on_gpu):
        return torch.float32
    if not on_gpu:
        raise ValueError("spec.training.precision: bf16 needs GPUs (gpusPerWorker > 0); use auto or fp32 on CPU")
    return torch.bfloat16


def load_dtype(dtype: DType, precision: Precision, on_gpu: bool) -> Any:
    """The dtype weights are loaded (and kept, as FSDP's sharded master copy) in.

    `auto` keeps fp32 master weights; with bf16 compute FSDP casts them per layer (MixedPrecisionPolicy),
    which is what "auto follows precision" means for the math while the optimizer stays in fp32.
    An explicit dtype is honoured as given (e.g. bfloat16: pure-bf16 training, half the memory).
    """
    import torch

    compute_dtype(precision, on_gpu)  # validates the combination
    return {
        DType.auto: torch.float32,
        DType.float32: torch.float32,
        DType.bfloat16: torch.bfloat16,
        DType.float16: torch.float16,
    }[dtype]


def _dtype_kw(torch_dtype: Any) -> dict[str, Any]:
    """transformers >= 4.56 takes `dtype=`; older releases (possibly in the DLC image) `torch_dtype=`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": torch_dtype} if (major, minor) >= (4, 56) else {"torch_dtype": torch_dtype}


def _hub_kwargs(spec: ModelSpec, local: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if not local:
        if spec.revision:
            kw["revision"] = spec.revision
        token = os.environ.get("HF_TOKEN")
        if token:
            kw["token"] = token
    return kw


def load_tokenizer(spec: ModelSpec, cache_dir: str | Path | None = None) -> Any:
    from transformers import AutoTokenizer

    path, local = resolve_source(spec.source, cache_dir)
    tok = AutoTokenizer.from_pretrained(path, **_hub_kwargs(spec, local))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: ModelSpec, torch_dtype: Any, cache_dir: str | Path | None = None) -> Any:
    """`AutoModelForCausalLM.from_pretrained` on CPU in `torch_dtype` (FSDP moves shards to the GPU)."""
    from transformers import AutoModelForCausalLM

    path, local = resolve_source(spec.source, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, **_dtype_kw(torch_dtype), **_hub_kwargs(spec, local))
    model.config.use_cache = False
    return model


def export_hf(full_state_dict: dict[str, Any], config: Any, tokenizer: Any, out_dir: str | Path,
              dtype: Any) -> Path:
    """Write a Hugging Face model directory (safetensors + config + tokenizer) from a full state dict.

    The model is built on the meta device and the gathered tensors are assigned into it, so rank 0 holds
    one copy of the weights, not two.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **_dtype_kw(dtype))  # type: ignore[no-untyped-call]
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full_state_dict.items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.state_dict().items() if p.is_meta]
    if missing:
        raise RuntimeError(f"export: weights missing from the gathered state dict: {missing[:5]}")
    model.config.use_cache = True
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
