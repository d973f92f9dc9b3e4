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

    `pvc://claim/path` → its mount path; `s3://bucket/prefix` → every object under it downloaded to the cache; absolute or
    `./` paths as given; anything else is a hub id.
    """
    if is_remote(source):
        from .storage import StorageError, download

        local = download(source, Path(cache_dir or default_cache_dir()) / "s3", "spec.model.source")
        if not local.is_dir():
            raise StorageError(f"spec.model.source: {source}: is one object; a model source is a prefix holding "
                               "config.json and the weights")
        return str(local), True
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
    """The dtype weights are loaded in (on rank 0, before sharding).

    Whatever it is, the sharded master weights and AdamW's state are fp32 (`parallel.apply_fsdp` upcasts
    each layer as it shards it): bf16 master weights round most small updates away. `auto`/`float32`
    load fp32; `bfloat16` loads bf16 (half the host memory while loading); bf16 compute on GPU comes from
    FSDP's mixed precision (spec.training.precision).
    """
    import torch

    compute_dtype(precision, on_gpu)  # validates the combination
    if dtype == DType.bfloat16:
        return torch.bfloat16
    if dtype in (DType.auto, DType.float32):
        return torch.float32
    raise ValueError(f"spec.model.dtype: {dtype.value} is not supported (fp16 needs loss scaling); "
                     "use auto or bfloat16")


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


def attention_implementation(packing: bool, on_gpu: bool, compute: Any) -> str | None:
    """The attention kernel to ask transformers for. Packed sequences on GPU in bf16/fp16 with
    flash-attention installed (the Ray Train DLC ships flash-attn 2.8.3): `flash_attention_2`, whose varlen
    kernel takes the per-record position ids as sequence boundaries (no [T, T] mask, no attention across
    records). Otherwise None: the model's default (SDPA; with packing, the block-diagonal mask transformers
    builds from the position ids)."""
    import torch

    if not (packing and on_gpu and compute in (torch.bfloat16, torch.float16)):
        return None
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return None
    return "flash_attention_2"


def _attn_kw(attn: str | None) -> dict[str, Any]:
    return {"attn_implementation": attn} if attn else {}


def load_model(spec: ModelSpec, torch_dtype: Any, cache_dir: str | Path | None = None, attn: str | None = None) -> Any:
    """`AutoModelForCausalLM.from_pretrained` on CPU in `torch_dtype` (FSDP moves shards to the GPU)."""
    from transformers import AutoModelForCausalLM

    path, local = resolve_source(spec.source, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, **_dtype_kw(torch_dtype), **_hub_kwargs(spec, local),
                                                 **_attn_kw(attn))
    model.config.use_cache = False
    return model


def load_for_sharding(spec: ModelSpec, torch_dtype: Any, cache_dir: str | Path | None, rank: int,
                      world: int, attn: str | None = None) -> tuple[Any, dict[str, Any] | None]:
    """(model, full state dict): rank 0 loads the weights; with world > 1 the other ranks build the same
    model on the meta device from the config alone (no weights in host memory) and get their shards from
    rank 0 in `fill_sharded` after `fully_shard`. The state dict is rank 0's (None elsewhere)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if world <= 1 or rank == 0:
        model = load_model(spec, torch_dtype, cache_dir, attn)
        return model, (dict(model.state_dict()) if world > 1 else None)
    path, local = resolve_source(spec.source, cache_dir)
    config = AutoConfig.from_pretrained(path, **_hub_kwargs(spec, local))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, trust_remote_code=spec.trust_remote_code, **_dtype_kw(torch_dtype), **_attn_kw(attn))
    model.config.use_cache = False
    return model, None


def fill_sharded(model: Any, full_sd: dict[str, Any] | None, device: Any, rank: int, world: int,
                 cpu_offload: bool = False) -> None:
    """Collective, after `fully_shard`: materialise the meta ranks' shards and broadcast rank 0's weights
    (each rank keeps its shard), then rank 0's buffers (e.g. rotary `inv_freq`, not in the state dict)."""
    if world <= 1:
        return
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if rank != 0:
        target = "cpu" if cpu_offload else device
        model.to_empty(device=target)
    sd: dict[str, Any] = full_sd if (rank == 0 and full_sd is not None) else {}
    set_model_state_dict(model, sd,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for _, buf in model.named_buffers():
        # Through the training device on every rank (rank 0's copy may sit elsewhere than a meta rank's
        # with cpuOffload), so all ranks use the same backend for the same broadcast.
        dev_buf = buf.to(device)
        dist.broadcast(dev_buf, src=0)
        if dev_buf is not buf:
            buf.copy_(dev_buf)
    if rank != 0 and hasattr(model, "tie_weights"):
        model.tie_weights()


def load_generation_config(spec: ModelSpec, cache_dir: str | Path | None = None) -> Any:
    """The base model's generation config (its `generation_config.json`, else derived from config.json)."""
    from transformers import AutoConfig, GenerationConfig

    path, local = resolve_source(spec.source, cache_dir)
    try:
        return GenerationConfig.from_pretrained(path, **_hub_kwargs(spec, local))
    except (OSError, ValueError):
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, **_hub_kwargs(spec, local)))


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template puts after an assistant message (`<|im_end|>`, `<|eot_id|>`)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        user = {"role": "user", "content": "1"}
        prefix = tokenizer.apply_chat_template([user], tokenize=True, add_generation_prompt=True, return_dict=False)
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": "2"}], tokenize=True,
                                             add_generation_prompt=False, return_dict=False)
    except Exception:
        return None
    if isinstance(prefix, dict) or hasattr(prefix, "keys"):
        prefix, full = prefix["input_ids"], full["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for tid in list(full)[len(prefix) :]:
        if tid in special:
            return int(tid)
    return None


def export_generation_config(base: Any, tokenizer: Any) -> Any:
    """The base generation config with `use_cache=True` and the end-of-turn token among the eos ids."""
    import copy

    from transformers import GenerationConfig

    gen = copy.deepcopy(base) if base is not None else GenerationConfig()  # type: ignore[no-untyped-call]
    eos = gen.eos_token_id
    ids: list[int] = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    for extra in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)):
        if extra is not None and extra not in ids:
            ids.append(int(extra))
    gen.eos_token_id = ids[0] if len(ids) == 1 else (ids or None)
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    gen.use_cache = True
    return gen


def export_hf(full_state_dict: dict[str, Any], config: Any, tokenizer: Any, out_dir: str | Path,
              dtype: Any, base_generation_config: Any = None) -> Path:
    """Write a Hugging Face model directory (safetensors + config + tokenizer) from a full state dict.

    The model is built on the meta device and the gathered tensors are assigned into it, so rank 0 holds
    one copy of the weights, not two. The generation config is the base model's (`use_cache=True`, the
    chat template's end-of-turn token added to the eos ids, so chat generation stops).
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
    model.generation_config = export_generation_config(base_generation_config, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
