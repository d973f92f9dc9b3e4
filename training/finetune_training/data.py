"""Training data: read records, render them to token ids with a loss mask, pack, split.

Formats (spec.dataset.format):
- `text`: every token of `textField` is trained; an EOS token ends each record.
- `promptCompletion`: `promptField` tokens are masked (label -100), `completionField` + EOS trained.
- `chat`: `messagesField` (a list of {role, content}) rendered with the tokenizer's chat template; only
  assistant turns are trained. The mask comes from rendering prefixes: the tokens the template adds
  for message i are those of `render(messages[:i+1])` beyond `render(messages[:i], add_generation_prompt)`
  for assistant turns, so the "assistant" header itself is masked. A tokenizer without a template
  gets `FALLBACK_CHAT_TEMPLATE` (`<|role|>\\ncontent\\n`, EOS after assistant turns), which is also saved
  with the exported tokenizer so inference sees the same layout. A template that ends assistant turns
  without EOS or an end-of-turn token gets EOS appended to each assistant turn (input and label, one
  warning), or the fine-tuned model would never stop.

Packing (spec.training.packing, default on) concatenates records and cuts full sequences of
`sequenceLength` tokens (the last partial sequence is dropped unless it is the only one). Each packed
sequence carries per-record `position_ids` (0, 1, … restarting at every record and at every sequence
start), from which transformers builds a block-diagonal causal mask (SDPA/eager) or calls the varlen
flash-attention kernel: a record never attends to another one. The first label of every record is
ignored (it would be predicted from the previous record). Without packing each record is
truncated/padded to `sequenceLength` with an attention mask; records left with no trained token by the
truncation are counted (`stats`); `truncation_notice` says what the loop tells about them.

Every rank builds the same data deterministically (shuffle with spec.training.seed), so no data is
broadcast; the global step alone says where in the data a run is (see `batch_indices`).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_operator.api.spec import DatasetFormat, DatasetSpec
from finetune_operator.api.storage import is_remote, resolve_in_pod

from .errors import DeterministicError

IGNORE = -100
TRUNCATION_WARN_FRACTION = 0.02  # warn when more than this share of records lost every trained token
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
FALLBACK_CHAT_TEMPLATE = (  # newlines as expressions: transformers renders with trim_blocks
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


log = logging.getLogger("finetune.data")


class DataError(DeterministicError, ValueError):
    """A problem with spec.dataset a user can fix."""


# -------------------------------------------------------------------------------------------- reading


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        return rows
    text = path.read_text()
    if path.suffix == ".json":
        stripped = text.lstrip()
        if stripped.startswith("["):
            return list(json.loads(text))
        if stripped.startswith("{") and "\n{" not in stripped:
            doc = json.loads(text)
            for key in ("data", "records", "train"):
                if isinstance(doc.get(key), list):
                    return list(doc[key])
            return [doc]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return out


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        if not files:
            raise DataError(f"spec.dataset.source: no {'/'.join(FILE_SUFFIXES)} files under {path}")
        return files
    raise DataError(f"spec.dataset.source: {path} does not exist")


def read_records(spec: DatasetSpec, cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """All records of the dataset source, in a stable order (files sorted by path)."""
    source = resolve_in_pod(spec.source)
    if is_remote(source):
        from .modelio import default_cache_dir
        from .storage import download

        # One object is one file, a prefix every file under it (`storage.files_of`).
        local = download(source, Path(cache_dir or default_cache_dir()) / "s3", "spec.dataset.source")
        files = _local_files(local)
    elif source.startswith(("/", "./", "../")) or Path(source).exists():
        files = _local_files(Path(source))
    else:
        return _read_hub(spec)
    records: list[dict[str, Any]] = []
    for f in files:
        records.extend(_read_file(f))
    if not records:
        raise DataError(f"spec.dataset.source: {spec.source} holds no records")
    return records


def _read_hub(spec: DatasetSpec) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"spec.dataset.source: {spec.source!r} looks like a Hugging Face dataset id, but the `datasets` "
            "package is not installed in the training image; add it to spec.cluster.pip or point the source "
            "at .jsonl/.json/.parquet files (s3://, pvc:// or a path)"
        ) from None
    try:
        ds = datasets.load_dataset(spec.source, split=spec.split)
    except Exception as e:  # unknown id, hub unreachable, gated, no such split: one line, not datasets' traceback
        raise DataError(f"spec.dataset.source: could not load Hugging Face dataset {spec.source!r} "
                        f"(split {spec.split!r}): {type(e).__name__}: {e}") from None
    return [dict(r) for r in ds]


# -------------------------------------------------------------------------------------- tokenizing


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer: Any) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []


def _field(rec: dict[str, Any], name: str, n: int, spec_field: str) -> Any:
    if name not in rec:
        raise DataError(f"spec.dataset.{spec_field}: record {n} has no field {name!r} (fields: {sorted(rec)})")
    return rec[name]


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give the tokenizer the fallback template if it has none; True if the fallback was installed."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return True


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    if not messages and not generation_prompt:
        return []
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                        return_dict=False)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def turn_end_ids(tokenizer: Any) -> set[int]:
    """Token ids that end an assistant turn: EOS and the template's end-of-turn token (`<|im_end|>`, …)."""
    from .modelio import end_of_turn_id

    ids = {tokenizer.eos_token_id, end_of_turn_id(tokenizer)}
    return {int(i) for i in ids if i is not None}


_warned_no_turn_end: set[str] = set()


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], turn_ends: set[int] | None = None) -> Example:
    """Token ids and labels of one conversation; only assistant turns are trained.

    An assistant turn the template ends without EOS or an end-of-turn token gets EOS appended (input and
    label): trained on the template as is, the model would never learn to stop. Warned once per template.
    """
    ends = turn_ends if turn_ends is not None else turn_end_ids(tokenizer)
    rendered: list[int] = []  # the template's own rendering so far (without the EOS added here)
    ids: list[int] = []
    labels: list[int] = []
    for i, msg in enumerate(messages):
        assistant = msg.get("role") == "assistant"
        prefix = _chat_ids(tokenizer, messages[:i], generation_prompt=assistant)
        full = _chat_ids(tokenizer, messages[: i + 1], generation_prompt=False)
        if full[: len(rendered)] != rendered:
            raise DataError("spec.dataset.format chat: the chat template is not prefix-stable; cannot mask turns")
        if assistant:
            if full[: len(prefix)] != prefix:
                raise DataError("spec.dataset.format chat: the chat template's generation prompt is not a prefix")
            header, turn = prefix[len(rendered) :], full[len(prefix) :]
            ids.extend(header)
            labels.extend([IGNORE] * len(header))
            ids.extend(turn)
            labels.extend(turn)
            if not ends.intersection(turn) and tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
                labels.append(tokenizer.eos_token_id)
                template = str(getattr(tokenizer, "chat_template", ""))
                if template not in _warned_no_turn_end:
                    _warned_no_turn_end.add(template)
                    log.warning("the chat template ends assistant turns without EOS or an end-of-turn token; "
                                "appending EOS (%r) to each assistant turn so the model learns to stop",
                                tokenizer.eos_token)
        else:
            new = full[len(rendered) :]
            ids.extend(new)
            labels.extend([IGNORE] * len(new))
        rendered = full
    return Example(ids, labels)


def encode(records: list[dict[str, Any]], spec: DatasetSpec, tokenizer: Any) -> list[Example]:
    eos = tokenizer.eos_token_id
    out: list[Example] = []
    turn_ends: set[int] = set()
    if spec.format == DatasetFormat.chat:
        ensure_chat_template(tokenizer)
        turn_ends = turn_end_ids(tokenizer)
    for n, rec in enumerate(records):
        if spec.format == DatasetFormat.text:
            ids = _bos(tokenizer) + _encode(tokenizer, str(_field(rec, spec.text_field, n, "textField"))) + [eos]
            out.append(Example(ids, list(ids)))
        elif spec.format == DatasetFormat.prompt_completion:
            p = _bos(tokenizer) + _encode(tokenizer, str(_field(rec, spec.prompt_field, n, "promptField")))
            c = _encode(tokenizer, str(_field(rec, spec.completion_field, n, "completionField"))) + [eos]
            out.append(Example(p + c, [IGNORE] * len(p) + c))
        else:
            msgs = _field(rec, spec.messages_field, n, "messagesField")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
                raise DataError(f"spec.dataset.messagesField: record {n} is not a list of {{role, content}}")
            out.append(encode_chat(tokenizer, msgs, turn_ends))
    return out


# ----------------------------------------------------------------------------------- packing/split


@dataclass
class Sequences:
    """Fixed-length training sequences: `input_ids`, `labels` (-100 = no loss), and either an attention
    mask (padded records) or per-record position ids (packed records)."""

    input_ids: Any  # LongTensor [N, T]
    labels: Any  # LongTensor [N, T]
    attention_mask: Any | None = None  # LongTensor [N, T] when padded
    position_ids: Any | None = None  # LongTensor [N, T] when packed

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def pack(examples: list[Example], seq_len: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(input ids, labels, position ids) of full `seq_len` sequences cut from the concatenated records.

    Position ids restart at 0 at every record and at every sequence start (so a record cut across two
    sequences continues as a new document); each record's first label is ignored.
    """
    flat_ids: list[int] = []
    flat_labels: list[int] = []
    flat_pos: list[int] = []
    for ex in examples:
        if not ex.input_ids:
            continue
        flat_ids.extend(ex.input_ids)
        flat_labels.extend([IGNORE, *ex.labels[1:]])
        flat_pos.extend(range(len(ex.input_ids)))
    n = len(flat_ids) // seq_len
    ids = [flat_ids[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    labels = [flat_labels[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    pos = [flat_pos[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    if n == 0 and flat_ids:  # a dataset shorter than one sequence still yields one (padded) sequence
        pad = seq_len - len(flat_ids)
        ids = [flat_ids + [flat_ids[-1]] * pad]
        labels = [flat_labels + [IGNORE] * pad]
        pos = [flat_pos + [0] * pad]  # the padding is a document of its own, with no labels
    for row in pos:
        if row and row[0] != 0:  # a record continued from the previous sequence
            off = row[0]
            for j, p in enumerate(row):
                if p < off or (j and p == 0):
                    break
                row[j] = p - off
    return ids, labels, pos


def to_sequences(examples: list[Example], seq_len: int, packing: bool, pad_id: int) -> Sequences:
    import torch

    if packing:
        ids, labels, pos = pack(examples, seq_len)
        return Sequences(torch.tensor(ids, dtype=torch.long).reshape(-1, seq_len),
                         torch.tensor(labels, dtype=torch.long).reshape(-1, seq_len),
                         position_ids=torch.tensor(pos, dtype=torch.long).reshape(-1, seq_len))
    rows, lrows, mrows = [], [], []
    for ex in examples:
        i, lab = ex.input_ids[:seq_len], ex.labels[:seq_len]
        pad = seq_len - len(i)
        rows.append(i + [pad_id] * pad)
        lrows.append(lab + [IGNORE] * pad)
        mrows.append([1] * len(i) + [0] * pad)
    return Sequences(torch.tensor(rows, dtype=torch.long).reshape(-1, seq_len),
                     torch.tensor(lrows, dtype=torch.long).reshape(-1, seq_len),
                     torch.tensor(mrows, dtype=torch.long).reshape(-1, seq_len))


def untrained_after_truncation(examples: list[Example], seq_len: int) -> int:
    """Records with trained tokens of which none is left once cut to `seq_len` (unpacked data)."""
    def trained(labels: list[int]) -> bool:
        return any(lab != IGNORE for lab in labels[1:])  # label 0 is never predicted

    return sum(1 for ex in examples if trained(ex.labels) and not trained(ex.labels[:seq_len]))


def truncation_notice(stats: dict[str, int], seq_len: int) -> tuple[int, str] | None:
    """What to tell about records truncation left without a trained token: None when there are none
    (or the data was packed, which truncates nothing), else a `logging` level and the text.

    WARNING when their share of the training records exceeds `TRUNCATION_WARN_FRACTION` (they cost a
    forward/backward pass and train nothing; the text names the fix), INFO (the count alone) otherwise.
    """
    lost = stats.get("train_records_truncated_away", 0)
    if not lost:
        return None
    total = stats.get("train_records", 0)
    share = lost / max(1, total)
    text = (f"data: {lost} of {total} training records ({share:.1%}) have no trained token left after "
            f"truncation to sequenceLength {seq_len}")
    if share > TRUNCATION_WARN_FRACTION:
        return logging.WARNING, (f"WARNING: {text}, more than {TRUNCATION_WARN_FRACTION:.0%} "
                                 f"(raise training.sequenceLength or enable training.packing)")
    return logging.INFO, text


def split_records(records: list[dict[str, Any]], eval_fraction: float, seed: int,
                  max_samples: int | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Shuffle with the seed, keep `max_samples`, hold out `eval_fraction` (at least one record if > 0)."""
    recs = list(records)
    random.Random(seed).shuffle(recs)
    if max_samples:
        recs = recs[:max_samples]
    n_eval = 0
    if eval_fraction > 0 and len(recs) >= 2:
        n_eval = max(1, int(round(len(recs) * eval_fraction)))
    return recs[n_eval:], recs[:n_eval]


@dataclass
class PreparedData:
    train: Sequences
    eval: Sequences | None
    stats: dict[str, int] = field(default_factory=dict)


def prepare(spec: DatasetSpec, tokenizer: Any, seq_len: int, packing: bool, seed: int,
            cache_dir: str | Path | None = None) -> PreparedData:
    records = read_records(spec, cache_dir)
    train_recs, eval_recs = split_records(records, spec.eval_fraction, seed, spec.max_samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_ex = encode(train_recs, spec, tokenizer)
    train = to_sequences(train_ex, seq_len, packing, pad_id)
    ev = to_sequences(encode(eval_recs, spec, tokenizer), seq_len, packing, pad_id) if eval_recs else None
    if ev is not None and len(ev) == 0:
        ev = None
    stats = {
        "records": len(records),
        "train_records": len(train_recs),
        "eval_records": len(eval_recs),
        "train_sequences": len(train),
        "eval_sequences": len(ev) if ev is not None else 0,
        "train_target_tokens": int((train.labels != IGNORE).sum()),
    }
    if not packing:
        stats["train_records_truncated_away"] = untrained_after_truncation(train_ex, seq_len)
    return PreparedData(train, ev, stats)


# ------------------------------------------------------------------------------------ batch order


def check_enough_sequences(num_sequences: int, micro_batch_size: int, accumulation: int, world: int) -> None:
    """Fail when the training data holds fewer sequences than one global batch: the run would make 0
    optimizer steps and export the untouched base model as if it had trained."""
    global_batch = micro_batch_size * accumulation * world
    if num_sequences < global_batch:
        raise DataError(
            f"dataset too small: {num_sequences} training sequences, fewer than one global batch of "
            f"{global_batch} (training.microBatchSize {micro_batch_size} x gradient accumulation {accumulation} "
            f"x {world} data-parallel ranks); add data or lower training.globalBatchSize (with packing, a "
            "lower training.sequenceLength also makes more sequences)"
        )


def steps_per_epoch(num_sequences: int, global_batch_size: int) -> int:
    return num_sequences // global_batch_size


def step_sequences(step: int, num_sequences: int, global_batch_size: int, seed: int) -> list[int]:
    """The `global_batch_size` sequence indices of optimizer step `step` (0-based) over all ranks.

    Step `step` reads its slice of epoch `step // steps_per_epoch`, whose order is a permutation seeded
    by (seed, epoch). The step number alone fixes the data position, so a resumed run continues exactly
    where its checkpoint left off.
    """
    import torch

    spe = steps_per_epoch(num_sequences, global_batch_size)
    if spe == 0:
        raise DataError(
            f"dataset too small: {num_sequences} training sequences < globalBatchSize {global_batch_size} "
            "(add data, lower training.globalBatchSize or training.sequenceLength)"
        )
    epoch, in_epoch = divmod(step, spe)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_sequences, generator=g)
    return perm[in_epoch * global_batch_size : (in_epoch + 1) * global_batch_size].tolist()


def batch_indices(step: int, num_sequences: int, global_batch_size: int, rank: int, world: int,
                  micro_batch_size: int, seed: int) -> list[list[int]]:
    """Sequence indices for one optimizer step on one rank, as a list of micro-batches."""
    batch = step_sequences(step, num_sequences, global_batch_size, seed)
    per_rank = global_batch_size // world
    mine = batch[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
