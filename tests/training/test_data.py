"""Data: file formats, the three record formats and their loss masks, packing, eval split, batch order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from finetune_operator.api.spec import DatasetSpec
from finetune_training import data as D
from finetune_training.data import IGNORE

from .conftest import prompt_completion_records, write_jsonl


def spec(source: str | Path, **kw: Any) -> DatasetSpec:
    return DatasetSpec(source=str(source), **kw)


def trained_text(tok: Any, ex: D.Example) -> str:
    return tok.decode([i for i, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE])


def masked_text(tok: Any, ex: D.Example) -> str:
    return tok.decode([i for i, lab in zip(ex.input_ids, ex.labels, strict=True) if lab == IGNORE])


# ---------------------------------------------------------------------------------------- reading


@pytest.mark.parametrize("kind", ["jsonl", "json-array", "json-object", "parquet", "dir"])
def test_read_records_file_kinds(tmp_path: Path, kind: str) -> None:
    recs = [{"text": f"record {i}"} for i in range(5)]
    if kind == "jsonl":
        src = write_jsonl(tmp_path / "d.jsonl", recs)
    elif kind == "json-array":
        src = tmp_path / "d.json"
        src.write_text(json.dumps(recs))
    elif kind == "json-object":
        src = tmp_path / "d.json"
        src.write_text(json.dumps({"data": recs}))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        src = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(recs), src)
    else:
        write_jsonl(tmp_path / "dir" / "b.jsonl", recs[2:])
        write_jsonl(tmp_path / "dir" / "a.jsonl", recs[:2])
        (tmp_path / "dir" / "README.md").write_text("ignored")
        src = tmp_path / "dir"
    assert D.read_records(spec(src)) == recs


def test_hub_dataset_that_cannot_be_loaded_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our pins lack `datasets` (the DLC has it): each stack checks its own branch, both one DataError line."""
    import importlib.util

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: fail at once instead of retrying
    if importlib.util.find_spec("datasets") is None:
        expected = "`datasets` package is not installed"
    else:
        expected = "could not load Hugging Face dataset 'someorg/somedata'"
    with pytest.raises(D.DataError, match=expected) as e:
        D.read_records(spec("someorg/somedata"))
    assert "\n" not in str(e.value)


def test_missing_path_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(D.DataError, match="does not exist"):
        D.read_records(spec(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(D.DataError, match="bad.jsonl:2"):
        D.read_records(spec(bad))


# --------------------------------------------------------------------------------------- formats


def test_text_format_trains_every_token_and_ends_with_eos(tokenizer: Any) -> None:
    (ex,) = D.encode([{"body": "What is 12 plus 11?"}], spec("/x", format="text", text_field="body"), tokenizer)
    assert ex.labels == ex.input_ids
    assert ex.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ex.input_ids[:-1]) == "What is 12 plus 11?"


def test_prompt_completion_masks_the_prompt(tokenizer: Any) -> None:
    rec = {"q": "Question: What is 12 plus 11?\nAnswer: ", "a": "12 + 11 = 23"}
    (ex,) = D.encode([rec], spec("/x", format="promptCompletion", prompt_field="q", completion_field="a"),
                     tokenizer)
    assert masked_text(tokenizer, ex) == rec["q"]
    assert trained_text(tokenizer, ex) == rec["a"] + tokenizer.eos_token
    assert len(ex.input_ids) == len(ex.labels)


CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 12 plus 11?"},
    {"role": "assistant", "content": "12 + 11 = 23"},
    {"role": "user", "content": "And 30 plus 11?"},
    {"role": "assistant", "content": "30 + 11 = 41"},
]


def test_chat_trains_only_assistant_turns_with_the_tokenizers_template(tokenizer: Any) -> None:
    assert "im_start" in tokenizer.chat_template
    (ex,) = D.encode([{"messages": CHAT}], spec("/x", format="chat"), tokenizer)
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(ex.input_ids) == full
    trained = trained_text(tokenizer, ex)
    assert trained == "12 + 11 = 23<|im_end|>\n30 + 11 = 41<|im_end|>\n"
    masked = masked_text(tokenizer, ex)
    assert "<|im_start|>assistant\n" in masked and "What is 12 plus 11?" in masked
    assert "12 + 11 = 23" not in masked


def test_chat_fallback_template_when_the_tokenizer_has_none(tiny_model_dir: Path) -> None:
    from finetune_operator.api.spec import ModelSpec
    from finetune_training.modelio import load_tokenizer

    tok = load_tokenizer(ModelSpec(source=str(tiny_model_dir)))
    tok.chat_template = None
    (ex,) = D.encode([{"messages": CHAT[:3]}], spec("/x", format="chat"), tok)
    assert tok.chat_template == D.FALLBACK_CHAT_TEMPLATE
    assert tok.decode(ex.input_ids) == (
        "<|system|>\nYou add numbers.\n<|user|>\nWhat is 12 plus 11?\n<|assistant|>\n12 + 11 = 23<|endoftext|>\n"
    )
    assert trained_text(tok, ex) == "12 + 11 = 23<|endoftext|>\n"


NO_EOS_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def test_chat_template_without_eos_gets_eos_after_each_assistant_turn(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 26.5(2): trained on such a template as is, the model never learns to stop."""
    import logging

    from finetune_operator.api.spec import ModelSpec
    from finetune_training.modelio import load_tokenizer

    tok = load_tokenizer(ModelSpec(source=str(tiny_model_dir)))
    tok.chat_template = NO_EOS_TEMPLATE
    monkeypatch.setattr(D, "_warned_no_turn_end", set(), raising=False)  # warn afresh
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        ex, ex2 = D.encode([{"messages": CHAT}, {"messages": CHAT[:3]}], spec("/x", format="chat"), tok)
    assert tok.decode(ex.input_ids) == (
        "<|system|>\nYou add numbers.\n<|user|>\nWhat is 12 plus 11?\n<|assistant|>\n12 + 11 = 23\n<|endoftext|>"
        "<|user|>\nAnd 30 plus 11?\n<|assistant|>\n30 + 11 = 41\n<|endoftext|>")
    assert trained_text(tok, ex) == "12 + 11 = 23\n<|endoftext|>30 + 11 = 41\n<|endoftext|>"
    assert trained_text(tok, ex2) == "12 + 11 = 23\n<|endoftext|>"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without EOS or an end-of-turn token; appending EOS" in warnings[0], warnings


def test_missing_field_names_the_spec_field(tokenizer: Any) -> None:
    with pytest.raises(D.DataError, match=r"spec.dataset.completionField: record 0 has no field 'completion'"):
        D.encode([{"prompt": "x"}], spec("/x", format="promptCompletion"), tokenizer)


# ------------------------------------------------------------------------------- packing and split


def test_packing_cuts_full_sequences_with_per_record_positions() -> None:
    exs = [D.Example([1, 2, 3], [IGNORE, 2, 3]), D.Example([4, 5, 6, 7], [IGNORE, IGNORE, 6, 7]),
           D.Example([8, 9], [8, 9])]
    ids, labels, pos = D.pack(exs, 4)
    assert ids == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the trailing [9] is dropped
    # Each record's first label is ignored (it would be predicted from the previous record).
    assert labels == [[IGNORE, 2, 3, IGNORE], [IGNORE, 6, 7, IGNORE]]
    # Positions restart at every record, and at the start of a sequence (record 2 continued).
    assert pos == [[0, 1, 2, 0], [0, 1, 2, 0]]


def test_packing_a_dataset_shorter_than_one_sequence_pads_it() -> None:
    ids, labels, pos = D.pack([D.Example([1, 2], [1, 2])], 4)
    assert len(ids[0]) == 4 and labels == [[IGNORE, 2, IGNORE, IGNORE]] and pos == [[0, 1, 0, 0]]


def test_packed_record_sees_only_itself(tiny_model_dir: Path) -> None:
    """The runtime's packed inputs (flattened micro-batch, per-record position ids): the logits of a
    record inside a pack equal those of the record alone."""
    import torch
    from finetune_training.loop import Trainer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate((11, 17, 9, 23, 20))]
    seqs = D.to_sequences([D.Example(r, r) for r in records], 40, True, 0)
    assert len(seqs) == 2
    batch = Trainer._batch(type("T", (), {"device": torch.device("cpu")})(), seqs, [0, 1])  # type: ignore[arg-type]
    assert batch["input_ids"].shape == (1, 80) and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        # Record 3 (23 tokens) starts at offset 37 of the flat pack; it is cut at 40 and continues in row 2.
        alone = model(input_ids=torch.tensor([records[1]])).logits[0]
        assert torch.allclose(packed[11:28], alone, atol=1e-5), (packed[11:28] - alone).abs().max()
        alone = model(input_ids=torch.tensor([records[3][3:]])).logits[0]
        assert torch.allclose(packed[40:60], alone, atol=1e-5)


def test_no_packing_pads_each_record_with_attention_mask() -> None:
    seqs = D.to_sequences([D.Example([1, 2, 3], [IGNORE, 2, 3]), D.Example([4] * 9, [4] * 9)], 5, False, 0)
    assert seqs.input_ids.tolist() == [[1, 2, 3, 0, 0], [4] * 5]
    assert seqs.labels.tolist() == [[IGNORE, 2, 3, IGNORE, IGNORE], [4] * 5]
    assert seqs.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]


@pytest.mark.parametrize(
    ("n", "fraction", "max_samples", "train", "evals"),
    [(100, 0.05, None, 95, 5), (100, 0.0, None, 100, 0), (100, 0.1, 30, 27, 3), (3, 0.01, None, 2, 1)],
    ids=["5pct", "no-eval", "max-samples", "at-least-one"],
)
def test_eval_split(n: int, fraction: float, max_samples: int | None, train: int, evals: int) -> None:
    recs = [{"i": i} for i in range(n)]
    tr, ev = D.split_records(recs, fraction, seed=3, max_samples=max_samples)
    assert (len(tr), len(ev)) == (train, evals)
    assert not {r["i"] for r in tr} & {r["i"] for r in ev}
    assert D.split_records(recs, fraction, 3, max_samples) == (tr, ev)  # seeded: reproducible
    assert D.split_records(recs, fraction, 4, max_samples) != (tr, ev)


def test_prepare_end_to_end(tmp_path: Path, tokenizer: Any) -> None:
    src = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_records(60))
    pd = D.prepare(spec(src, format="promptCompletion", eval_fraction=0.1), tokenizer, 32, True, seed=1)
    assert pd.stats["train_records"] == 54 and pd.stats["eval_records"] == 6
    assert pd.train.input_ids.shape[1] == 32 and pd.eval is not None
    assert 0 < pd.stats["train_target_tokens"] < pd.train.input_ids.numel()
    assert pd.train.position_ids is not None and pd.train.attention_mask is None


def test_records_truncated_away_are_counted(tmp_path: Path, tokenizer: Any) -> None:
    recs = prompt_completion_records(20)
    for r in recs[:5]:
        r["prompt"] = "Question: " + "What is one plus one? " * 20  # the completion falls past 32 tokens
    src = write_jsonl(tmp_path / "pc.jsonl", recs)
    pd = D.prepare(spec(src, format="promptCompletion", eval_fraction=0.0), tokenizer, 32, False, seed=1)
    assert pd.stats["train_records_truncated_away"] == 5
    assert D.untrained_after_truncation([D.Example([1, 2, 3], [IGNORE, IGNORE, 3])], 2) == 1
    assert D.untrained_after_truncation([D.Example([1, 2, 3], [IGNORE, 2, 3])], 2) == 0


def test_truncation_notice_warns_above_the_threshold_and_names_the_fix() -> None:
    import logging

    assert D.TRUNCATION_WARN_FRACTION == 0.02
    notice = D.truncation_notice({"train_records": 100, "train_records_truncated_away": 3}, 48)
    assert notice is not None
    level, text = notice
    assert level == logging.WARNING
    assert text.startswith("WARNING: data: 3 of 100 training records (3.0%) have no trained token left")
    assert "sequenceLength 48" in text and "more than 2%" in text
    assert text.endswith("(raise training.sequenceLength or enable training.packing)")
    # Just above: 201 of 10000 (2.01 %) warns.
    above = D.truncation_notice({"train_records": 10000, "train_records_truncated_away": 201}, 64)
    assert above is not None and above[0] == logging.WARNING


def test_truncation_notice_at_or_below_the_threshold_only_counts() -> None:
    import logging

    for lost, total in ((2, 100), (1, 50), (1, 1000)):  # exactly 2 % and below: no warning
        notice = D.truncation_notice({"train_records": total, "train_records_truncated_away": lost}, 32)
        assert notice is not None, (lost, total)
        level, text = notice
        assert level == logging.INFO, (lost, total)
        assert text == (f"data: {lost} of {total} training records ({lost / total:.1%}) have no trained token "
                        f"left after truncation to sequenceLength 32")
        assert "WARNING" not in text and "raise training.sequenceLength" not in text


def test_truncation_notice_is_silent_when_nothing_is_lost_or_the_data_is_packed() -> None:
    assert D.truncation_notice({"train_records": 100, "train_records_truncated_away": 0}, 32) is None
    assert D.truncation_notice({"train_records": 100}, 32) is None  # packed: the key is absent
    assert D.truncation_notice({}, 32) is None


# ------------------------------------------------------------------------------------- batch order


def test_batch_indices_partition_each_step_and_reshuffle_each_epoch() -> None:
    n, g, world, mb = 20, 8, 2, 2
    step0 = [D.batch_indices(0, n, g, r, world, mb, seed=5) for r in range(world)]
    flat = [i for rank in step0 for micro in rank for i in micro]
    assert len(flat) == g == len(set(flat)) and all(len(m) == mb for r in step0 for m in r)
    assert D.batch_indices(0, n, g, 1, world, mb, seed=5) == step0[1]  # deterministic: resume-safe
    epoch0 = D.step_sequences(0, n, g, 5) + D.step_sequences(1, n, g, 5)
    assert len(set(epoch0)) == 16  # 2 steps per epoch, no repeats within an epoch
    assert D.step_sequences(2, n, g, 5) != D.step_sequences(0, n, g, 5)


def test_dataset_smaller_than_a_batch() -> None:
    with pytest.raises(D.DataError, match="dataset too small"):
        D.step_sequences(0, 3, 8, 0)
