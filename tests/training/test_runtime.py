"""One rank (gloo) through the runtime's own code: precision rules and fp32 master weights, the chunked
loss, the non-finite stop, the truncation warning, the export's generation config, and the resume choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from finetune_operator.api.spec import DType, FinetuneJob, FSDPSpec, ModelSpec, Precision, TrainingSpec
from finetune_training import checkpoint as ckpt
from finetune_training import modelio, optim
from finetune_training.parallel import apply_fsdp, build_mesh

from .conftest import export_ready_trainer, job_doc, prompt_completion_records, records_with_long_prompts, write_jsonl

# ------------------------------------------------------------------------------------------ precision


def test_float16_is_rejected_with_a_clear_message(tiny_model_dir: Path, tmp_path: Path) -> None:
    doc = job_doc(tiny_model_dir, tmp_path / "d.jsonl", tmp_path / "s")
    doc["spec"]["model"]["dtype"] = "float16"
    with pytest.raises(ValueError, match=r"model.dtype: float16 is not supported \(fp16 training needs loss scaling\)"):
        FinetuneJob.model_validate(doc)
    with pytest.raises(ValueError, match="spec.model.dtype: float16 is not supported"):
        modelio.load_dtype(DType.float16, Precision.auto, on_gpu=True)


def changed_fraction(model_dir: Path, dtype: Any, *, fsdp: bool, steps: int = 10) -> dict[str, float]:
    """Share of weights that moved after `steps` AdamW steps at lr 2e-5 (the seed example's rate)."""
    import torch

    spec = TrainingSpec(learning_rate=2e-5, warmup_ratio=0.0, scheduler="constant",
                        fsdp=FSDPSpec(sharding_strategy="full", activation_checkpointing=False))
    model = modelio.load_model(ModelSpec(source=str(model_dir)), dtype)
    if fsdp:  # the runtime's path
        model = apply_fsdp(model, build_mesh(spec.fsdp.sharding_strategy, 1, 1, "cpu"), spec.fsdp, torch.float32, False)
    before = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    opt, _ = optim.build(model, spec, steps)
    torch.manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(5, 200, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for n, p in model.named_parameters():
        after = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = float((after.detach() != before[n]).float().mean())
    dtypes = {str(p.dtype) for p in model.parameters()}
    return {"all": sum(out.values()) / len(out), "norms": min(v for n, v in out.items() if "norm" in n),
            "param_dtype": dtypes.pop() if len(dtypes) == 1 else str(dtypes)}  # type: ignore[dict-item]


def test_bfloat16_load_keeps_fp32_master_weights_so_small_updates_land(process_group: None, tiny_model_dir: Path) -> None:
    import torch

    assert modelio.load_dtype(DType.bfloat16, Precision.auto, on_gpu=True) == torch.bfloat16  # the load only
    pure = changed_fraction(tiny_model_dir, torch.bfloat16, fsdp=False)  # what pure-bf16 training did
    ours = changed_fraction(tiny_model_dir, torch.bfloat16, fsdp=True)
    print(f"share of weights changed after 10 steps at lr 2e-5: pure bf16 {pure['all']:.3f} (norms "
          f"{pure['norms']:.3f}); bf16 load + fp32 master {ours['all']:.3f} (norms {ours['norms']:.3f})")
    assert ours["param_dtype"] == "torch.float32"
    assert ours["all"] > 0.99 and ours["norms"] > 0.99
    assert pure["all"] < 0.6 and pure["norms"] == 0.0  # the defect this guards against


# ------------------------------------------------------------------------------------------------ loss


def test_chunked_loss_equals_the_full_logits_loss(process_group: None, tiny_model_dir: Path) -> None:
    import torch
    import torch.nn.functional as F
    from finetune_training.data import IGNORE
    from finetune_training.loss import loss_sum, shift_targets

    fsdp = FSDPSpec(sharding_strategy="full", activation_checkpointing=True)
    models = []
    for _ in range(2):
        m = modelio.load_model(ModelSpec(source=str(tiny_model_dir)), torch.float32)
        models.append(apply_fsdp(m, build_mesh(fsdp.sharding_strategy, 1, 1, "cpu"), fsdp, torch.float32, False))
    assert hasattr(models[0], "finetune_loss_sum")
    torch.manual_seed(1)
    ids = torch.randint(5, 200, (3, 24))
    labels = ids.clone()
    labels[:, :5] = IGNORE
    # Reference: the previous formulation (slice the logits, compare with labels[:, 1:]).
    logits = models[0](input_ids=ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                          ignore_index=IGNORE, reduction="sum")
    got = loss_sum(models[1], ids, shift_targets(labels), chunk=7)  # uneven chunks on purpose
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (got, ref)
    ref.backward()
    got.backward()
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
        assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6), (n, (ga - gb).abs().max())


@pytest.mark.parametrize(("vocab", "chunk"), [
    (151_936, 512),  # Qwen2/2.5: 512 x 152k x 4 B = 0.29 GiB (1024 would be 0.58 GiB)
    (128_256, 1024),  # Llama 3: 0.49 GiB
    (32_000, 4096),  # Llama 2 / Mistral: capped at MAX_CHUNK_TOKENS
    (300, 4096),  # the tiny test model
    (16_000_000, 16),  # absurd vocabularies still get a usable chunk
], ids=["qwen2", "llama3", "llama2", "tiny", "floor"])
def test_loss_chunk_is_sized_by_the_vocabulary(vocab: int, chunk: int) -> None:
    from finetune_training.loss import CHUNK_LOGITS_BYTES, chunk_tokens

    assert chunk_tokens(vocab) == chunk
    assert chunk * vocab * 4 <= CHUNK_LOGITS_BYTES or chunk == 16


def test_default_chunks_follow_the_vocabulary_and_sum_to_the_plain_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 32-position budget for V=300 the default chunking makes 3 chunks of 72 positions (the fixed
    4096 made one), and the sum and gradients equal the plain cross-entropy."""
    import torch
    import torch.nn.functional as F
    from finetune_training import loss
    from finetune_training.data import IGNORE

    monkeypatch.setattr(loss, "CHUNK_LOGITS_BYTES", 32 * 300 * 4, raising=False)
    calls: list[int] = []
    real = loss._ce_chunk
    monkeypatch.setattr(loss, "_ce_chunk", lambda h, *a: (calls.append(h.shape[0]), real(h, *a))[1])
    torch.manual_seed(0)
    hidden = torch.randn(72, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (72,))
    targets[::5] = IGNORE
    got = loss.chunked_cross_entropy_sum(hidden, weight, None, targets)
    assert calls == [32, 32, 8], calls
    (gh, gw) = torch.autograd.grad(got, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE, reduction="sum")
    (rh, rw) = torch.autograd.grad(ref, (hidden, weight))
    assert torch.allclose(got, ref, rtol=1e-5), (got, ref)
    assert torch.allclose(gh, rh, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


# ----------------------------------------------------------------------------------- non-finite stop


def test_non_finite_loss_stops_the_job_before_any_checkpoint_or_export(process_group: None, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    import torch
    from finetune_training.environment import RuntimeEnv
    from finetune_training.loop import LoopConfig, NonFiniteError, Trainer
    from transformers import AutoModelForCausalLM

    # A real overflow: a base model with one infinite weight (as a broken conversion would leave it).
    broken = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    broken.save_pretrained(tmp_path / "broken")
    modelio.load_tokenizer(ModelSpec(source=str(tiny_model_dir))).save_pretrained(tmp_path / "broken")
    data = write_jsonl(tmp_path / "d.jsonl", prompt_completion_records(60))
    doc = job_doc(tmp_path / "broken", data, tmp_path / "store", globalBatchSize=2, microBatchSize=1, maxSteps=6)
    doc["spec"]["cluster"]["workers"]["replicas"] = 1
    job = FinetuneJob.model_validate(doc)
    store = str(tmp_path / "store")
    cfg = LoopConfig(job=doc, storage=store, storage_uri=store, run_name="train")
    trainer = Trainer(job, cfg, rank=0, world=1, local_rank=0, local_world=1, device=torch.device("cpu"), env=RuntimeEnv())
    trainer.setup()
    reports: list[Any] = []
    with pytest.raises(NonFiniteError, match=r"step \d: loss .* is not finite; stopped before the optimizer step"):
        trainer.run(lambda *a: reports.append(a))
    trainer.close()
    assert trainer.step == 0 and reports == []
    assert not (tmp_path / "store" / "final").exists()
    assert ckpt.latest(tmp_path / "store" / "checkpoints" / "train") is None


# ------------------------------------------------------------------------------------ truncation warning


def test_setup_warns_when_truncation_leaves_records_untrained(process_group: None, tiny_model_dir: Path,
                                                             tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Trainer.setup tells it on every channel: rank 0's stdout (the job log), the log, and a progress
    message (what `finetune run` prints); with a long enough sequenceLength it says nothing."""
    import logging

    import torch
    from finetune_operator.api.status import ProgressReport
    from finetune_training.environment import RuntimeEnv
    from finetune_training.loop import LoopConfig, Trainer

    data = write_jsonl(tmp_path / "d.jsonl", records_with_long_prompts(40, long=10))
    for seq_len, warns in ((24, True), (64, False)):
        doc = job_doc(tiny_model_dir, data, tmp_path / "store", sequenceLength=seq_len, packing=False,
                      globalBatchSize=2, microBatchSize=1, maxSteps=1)
        doc["spec"]["cluster"]["workers"]["replicas"] = 1
        job = FinetuneJob.model_validate(doc)
        cfg = LoopConfig(job=doc, storage=str(tmp_path / "store"), storage_uri=str(tmp_path / "store"),
                         run_name="train")
        trainer = Trainer(job, cfg, rank=0, world=1, local_rank=0, local_world=1, device=torch.device("cpu"),
                          env=RuntimeEnv())
        reports: list[ProgressReport] = []
        trainer.progress.publish = reports.append  # type: ignore[method-assign]
        capfd.readouterr()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="finetune.train"):
            trainer.setup()
        trainer.close()
        stdout = capfd.readouterr().out
        messages = [r.message for r in reports if r.message]
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if warns:
            text = (f"WARNING: data: 8 of 36 training records (22.2%) have no trained token left after truncation "
                    f"to sequenceLength {seq_len}, more than 2% (raise training.sequenceLength or enable "
                    f"training.packing)")
            lines = stdout.splitlines()
            data_line = next(i for i, line in enumerate(lines) if " data: {" in line)
            assert lines[data_line + 1] == f"{RuntimeEnv().log_prefix()} {text}", stdout  # right after data:
            assert messages == [text] and reports[0].phase == "Starting", reports
            assert warnings == [text.removeprefix("WARNING: ")], warnings
        else:
            assert "'train_records_truncated_away': 0" in stdout, stdout
            assert "no trained token" not in stdout and messages == [] and warnings == [], (stdout, messages)


# -------------------------------------------------------------------------------------------- export


def test_export_keeps_the_generation_config_and_chat_generation_stops(process_group: None, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    import torch
    from finetune_training.data import encode_chat
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = ModelSpec(source=str(tiny_model_dir))
    tok = modelio.load_tokenizer(spec)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert modelio.end_of_turn_id(tok) == end and end != tok.eos_token_id
    # Teach the tiny model one chat turn (plain torch, a few seconds), then export it like the runtime.
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    ex = encode_chat(tok, msgs)
    model = modelio.load_model(spec, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = torch.tensor([ex.input_ids]), torch.tensor([ex.labels])
    torch.manual_seed(0)
    for _ in range(60):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    base = modelio.load_generation_config(spec)
    base.temperature, base.top_p, base.do_sample = 0.7, 0.8, True  # the base model's sampling settings
    out = modelio.export_hf(model.state_dict(), model.config, tok, tmp_path / "final", torch.float32, base)
    gen = GenerationConfig.from_pretrained(out)
    assert gen.use_cache is True and (gen.temperature, gen.top_p, gen.do_sample) == (0.7, 0.8, True)
    assert set(gen.eos_token_id) == {tok.eos_token_id, end}
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    new = reloaded.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
    assert tok.decode(new[:-1]) == "5" and new[-1] == end, tok.decode(new)  # stopped at <|im_end|>


def test_export_replaces_the_previous_one_only_when_complete(process_group: None, tiny_model_dir: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26.5(6): the export used to delete the previous one first; a failed export left nothing."""
    store = tmp_path / "store"
    final = store / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"previous": true}')
    (final / "stale.bin").write_bytes(b"old")
    trainer = export_ready_trainer(tiny_model_dir, str(store))
    real = modelio.export_hf

    def fails_half_way(*args: Any) -> Any:
        Path(args[3]).mkdir(parents=True, exist_ok=True)
        (Path(args[3]) / "model.safetensors").write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(modelio, "export_hf", fails_half_way)
    with pytest.raises(OSError, match="No space left"):
        trainer.export()
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "stale.bin"]  # the previous export, intact
    assert json.loads((final / "config.json").read_text()) == {"previous": True}
    monkeypatch.setattr(modelio, "export_hf", real)
    trainer.export()
    trainer.close()
    names = sorted(p.name for p in final.iterdir())
    assert "model.safetensors" in names and "stale.bin" not in names, names
    assert [p.name for p in store.iterdir()] == ["final"]  # no temporary sibling left


# -------------------------------------------------------------------------------------------- resume


def fake_checkpoint(root: Path, step: int, world: int = 2, shards: int = 2) -> Path:
    d = root / ckpt.checkpoint_name(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    (d / ckpt.STATE_FILE).write_text(json.dumps({"step": step, "world_size": world}))
    for r in range(shards):
        (d / f"__{r}_0.distcp").write_text("x")
    return d


def test_resume_choice_checks_the_pointed_checkpoint_and_always_scans(tmp_path: Path) -> None:
    run = tmp_path / "checkpoints" / "train"
    fresh = ckpt.choose_resume(None, str(run))
    assert (fresh.step, fresh.uri) == (0, None) and "no complete checkpoint" in fresh.why
    # Ray points at a checkpoint that lost a shard: the scan's older complete one is taken, and said so.
    c4 = fake_checkpoint(run, 4)
    c6 = fake_checkpoint(run, 6, shards=1)
    c = ckpt.choose_resume({"step": 6, "uri": str(c6)}, str(run))
    assert (c.step, c.uri) == (4, str(c4))
    assert "lacks __1_0.distcp" in c.why and "step 4 from the storage scan" in c.why
    # Ray's pointer is older than what storage holds (registered late): the newer wins.
    c8 = fake_checkpoint(run, 8)
    c = ckpt.choose_resume({"step": 4, "uri": str(c4)}, str(run))
    assert (c.step, c.uri) == (8, str(c8)) and "Ray's checkpoint: step 4" in c.why
    # Ray restored a checkpoint, but nothing usable exists: an error, never a silent step 0.
    with pytest.raises(ckpt.ResumeError, match="refusing to restart at step 0"):
        ckpt.choose_resume({"step": 9, "uri": str(tmp_path / "gone")}, str(tmp_path / "empty"))


def test_resume_choice_runs_once_through_the_agreement(tmp_path: Path) -> None:
    """The choice is made by whoever `agree` lets decide (rank 0) and that result is every rank's."""
    run = tmp_path / "checkpoints" / "train"
    fake_checkpoint(run, 4)
    decided: list[ckpt.ResumeChoice] = []

    def rank0_says_step_2(decide: Any) -> ckpt.ResumeChoice:  # stands in for broadcast_object_list
        decided.append(decide())  # rank 0 would see step 4 here; a peer receives what rank 0 sent
        return ckpt.ResumeChoice(2, str(run / ckpt.checkpoint_name(2)), "rank 0's choice")

    c = ckpt.choose_resume(None, str(run), agree=rank0_says_step_2)
    assert (c.step, c.why) == (2, "rank 0's choice") and [d.step for d in decided] == [4]


# ------------------------------------------------------------------------------------- cpuOffload


def test_cpu_offload_on_gpu_gets_a_gloo_backend_next_to_nccl(tiny_model_dir: Path, tmp_path: Path) -> None:
    from finetune_training.launcher import process_group_backend

    doc = job_doc(tiny_model_dir, tmp_path / "d.jsonl", tmp_path / "s")
    assert process_group_backend(FinetuneJob.model_validate(doc)) == "gloo"
    doc["spec"]["cluster"] = {"instanceType": "g6.12xlarge", "workers": {"replicas": 1, "gpusPerWorker": 4}}
    assert process_group_backend(FinetuneJob.model_validate(doc)) == "nccl"
    doc["spec"]["training"]["fsdp"]["cpuOffload"] = True
    assert process_group_backend(FinetuneJob.model_validate(doc)) == "cpu:gloo,cuda:nccl"


def test_packed_records_on_gpu_ask_for_the_varlen_flash_attention_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 11.2: with packing on GPU in bf16 the runtime asks transformers for flash_attention_2 (its varlen
    kernel takes the per-record position ids as boundaries) when flash-attn is installed, as in the Ray Train
    DLC. flash-attn needs CUDA, so here an empty module stands in for the installed package; the choice is
    what is tested (the kernel itself runs in benchmarks/gpu_check.sh)."""
    import sys
    import types

    import torch
    from finetune_training.modelio import attention_implementation

    assert attention_implementation(True, False, torch.float32) is None  # CPU: SDPA, block-diagonal mask
    assert attention_implementation(True, True, torch.float32) is None  # fp32: flash-attn has no fp32 kernel
    assert attention_implementation(False, True, torch.bfloat16) is None  # no packing: nothing to gain
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed (import raises ImportError)
    assert attention_implementation(True, True, torch.bfloat16) is None
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert attention_implementation(True, True, torch.bfloat16) == "flash_attention_2"


# ------------------------------------------------------------------------------------ too little data


def test_fewer_sequences_than_one_global_batch_fails_in_setup(process_group: None, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    """Issue 26.5(1): 0 optimizer steps used to export the untouched base model and report done."""
    import torch
    from finetune_training.data import DataError
    from finetune_training.environment import RuntimeEnv
    from finetune_training.loop import LoopConfig, Trainer

    data = write_jsonl(tmp_path / "d.jsonl", prompt_completion_records(4))  # 3 train + 1 eval records
    doc = job_doc(tiny_model_dir, data, tmp_path / "store", packing=False, globalBatchSize=4, microBatchSize=2,
                  epochs=1, maxSteps=None)
    doc["spec"]["cluster"]["workers"]["replicas"] = 1
    job = FinetuneJob.model_validate(doc)
    cfg = LoopConfig(job=doc, storage=str(tmp_path / "store"), storage_uri=str(tmp_path / "store"), run_name="train")
    trainer = Trainer(job, cfg, rank=0, world=1, local_rank=0, local_world=1, device=torch.device("cpu"),
                      env=RuntimeEnv())
    with pytest.raises(DataError, match=r"dataset too small: 3 training sequences, fewer than one global batch of 4 "
                                        r"\(training.microBatchSize 2 x gradient accumulation 2 x 1 data-parallel "
                                        r"ranks\); add data or lower training.globalBatchSize"):
        trainer.setup()
    trainer.close()
    assert not (tmp_path / "store" / "final").exists()
