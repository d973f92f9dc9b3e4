"""Model loading through the real code, sharded checkpoint round trip, Hugging Face export reload.

FSDP2 runs here in a one-rank gloo process group (the 2-rank case is covered by test_e2e).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from finetune_operator.api.spec import DType, FSDPSpec, ModelSpec, Precision, TrainingSpec
from finetune_training import checkpoint as ckpt
from finetune_training import modelio, optim
from finetune_training.parallel import apply_fsdp, build_mesh, mesh_shape


def sharded(model_dir: Path, strategy: str = "full") -> tuple[Any, Any, Any]:
    import torch

    spec = TrainingSpec(learning_rate=1e-2, fsdp=FSDPSpec(sharding_strategy=strategy, activation_checkpointing=True))
    model = modelio.load_model(ModelSpec(source=str(model_dir)), torch.float32)
    mesh = build_mesh(spec.fsdp.sharding_strategy, 1, 1, "cpu")
    model = apply_fsdp(model, mesh, spec.fsdp, torch.float32, on_gpu=False)
    opt, sched = optim.build(model, spec, total_steps=10)
    return model, opt, sched


def train_steps(model: Any, opt: Any, sched: Any, n: int) -> None:
    import torch

    torch.manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def full_weights(model: Any) -> dict[str, Any]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------ loading


def test_load_from_local_dir_and_pvc_uri(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model = modelio.load_model(ModelSpec(source=str(tiny_model_dir)), torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.use_cache is False
    # pvc://claim/path resolves to the renderer's mount point
    import finetune_operator.api.storage as storage

    monkeypatch.setattr(storage, "PVC_MOUNT_ROOT", str(tiny_model_dir.parent))
    path, local = modelio.resolve_source(f"pvc://{tiny_model_dir.name}")
    assert (Path(path), local) == (tiny_model_dir, True)
    tok = modelio.load_tokenizer(ModelSpec(source=str(tiny_model_dir)))
    assert tok.pad_token is not None


def test_dtype_rules() -> None:
    import torch

    assert modelio.compute_dtype(Precision.auto, on_gpu=False) == torch.float32
    assert modelio.compute_dtype(Precision.auto, on_gpu=True) == torch.bfloat16
    assert modelio.load_dtype(DType.auto, Precision.auto, on_gpu=True) == torch.float32  # fp32 master weights
    assert modelio.load_dtype(DType.bfloat16, Precision.bf16, on_gpu=True) == torch.bfloat16
    with pytest.raises(ValueError, match="bf16 needs GPUs"):
        modelio.compute_dtype(Precision.bf16, on_gpu=False)
    assert "fp16" not in {p.value for p in Precision}  # needs loss scaling; not offered by the API


def test_missing_local_model_dir() -> None:
    with pytest.raises(FileNotFoundError, match="spec.model.source"):
        modelio.resolve_source("/nonexistent/model")


# ------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("strategy", ["full", "hybrid", "gradOp", "none"])
def test_mesh_shapes(strategy: str) -> None:
    from finetune_operator.api.spec import ShardingStrategy

    s = ShardingStrategy(strategy)
    shapes = {"full": (8,), "gradOp": (8,), "hybrid": (2, 4), "none": (8, 1)}
    assert mesh_shape(s, world=8, local_world=4)[0] == shapes[strategy]
    assert mesh_shape(ShardingStrategy.hybrid, world=2, local_world=2)[0] == (1, 2)  # local run: full
    assert mesh_shape(ShardingStrategy.hybrid, world=3, local_world=1)[0] == (3, 1)  # CPU pods: replicate


@pytest.mark.parametrize("strategy", ["full", "hybrid"])
def test_checkpoint_round_trip(process_group: None, tiny_model_dir: Path, tmp_path: Path, strategy: str) -> None:
    import torch

    model, opt, sched = sharded(tiny_model_dir, strategy)
    train_steps(model, opt, sched, 3)
    state = {"step": 3, "world_size": 1, "scheduler": sched.state_dict()}
    path = ckpt.save(tmp_path / ckpt.checkpoint_name(3), model, opt, state, rank=0)
    assert ckpt.is_complete(path) and ckpt.latest(tmp_path) == (3, path)
    before = full_weights(model)

    model2, opt2, sched2 = sharded(tiny_model_dir, strategy)
    assert not torch.equal(full_weights(model2)["model.norm.weight"], before["model.norm.weight"])
    loaded = ckpt.load(path, model2, opt2)
    sched2.load_state_dict(loaded["scheduler"])
    after = full_weights(model2)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert loaded["step"] == 3 and sched2.last_epoch == 3
    steps = {int(s["step"]) for s in opt2.state_dict()["state"].values()}
    assert steps == {3}
    # Same next step from both: the restored optimizer state is the real one.
    train_steps(model, opt, sched, 1)
    train_steps(model2, opt2, sched2, 1)
    assert all(torch.allclose(a, b) for a, b in zip(full_weights(model).values(), full_weights(model2).values(), strict=True))


def test_incomplete_checkpoints_are_ignored(tmp_path: Path) -> None:
    import json

    good = tmp_path / ckpt.checkpoint_name(4)
    bad = tmp_path / ckpt.checkpoint_name(6)
    for d in (good, bad):
        d.mkdir()
        (d / ".metadata").write_text("x")
        (d / ckpt.STATE_FILE).write_text(json.dumps({"step": 0, "world_size": 2}))
        (d / "__0_0.distcp").write_text("x")
    (good / "__1_0.distcp").write_text("x")
    assert ckpt.latest(tmp_path) == (4, good)
    assert ckpt.latest(tmp_path / "missing") is None


def test_hf_export_reloads_with_from_pretrained(process_group: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, opt, sched = sharded(tiny_model_dir)
    train_steps(model, opt, sched, 2)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tok = modelio.load_tokenizer(ModelSpec(source=str(tiny_model_dir)))
    out = modelio.export_hf(full, model.config, tok, tmp_path / "final", torch.float32)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    sd = reloaded.state_dict()
    for k, v in full.items():
        assert torch.equal(sd[k], v), k
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # still tied
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
    ids = torch.tensor([[1, 2, 3]])
    assert reloaded.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)
