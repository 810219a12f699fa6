"""Training data as people have it, turned into token ids with a loss mask.

A `--data` folder holds `train.jsonl`, `valid.jsonl` and `test.jsonl` (as mlx-lm reads them), or is a Hugging Face
`datasets` folder written by `save_to_disk` (its Arrow files read with pyarrow). Each record is one of
- `{"messages": [...], "tools": [...]}`: a chat, rendered through the model's chat template; the loss covers the
  assistant turns (their end-of-turn marker included) unless the prompt is not masked;
- `{"prompt": ..., "completion": ...}`: a user turn and the assistant's answer (the prompt and the completion
  one after the other where the model has no chat template), the loss on the answer;
- `{"text": ...}`: plain text, every token trained.
A bad record is named by its file and line, as a `DataError`.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import DataError, InvalidSettingError

SPLITS = {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}
"""Each split minimlx reads, and the names a Hugging Face dataset saves it under."""

FORMATS = '{"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}'


@dataclass
class Record:
    """One record of a data file, and where it came from (for error messages)."""

    fields: dict
    where: str  # "train.jsonl line 7", "train row 7"


@dataclass
class Example:
    """A tokenized record: `ids`, and `trained[i]` whether predicting `ids[i]` counts in the loss."""

    ids: list[int]
    trained: list[bool]


def read_jsonl(path: Path) -> list[Record]:
    """The records of a JSONL file (blank lines skipped); a line that is not a JSON object is named."""
    records = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {number} is not valid JSON ({e.msg}); fix or remove the line") from None
            if not isinstance(fields, dict):
                raise DataError(f"{path} line {number} is not a JSON object; write each record as {FORMATS}")
            records.append(Record(fields, where))
    return records


def read_arrow(folder: Path, split: str) -> list[Record]:
    """The rows of one split of a `datasets` folder (`save_to_disk`): its Arrow stream files, in order."""
    try:
        import pyarrow as pa
    except ImportError:
        message = f"{folder} is a Hugging Face datasets folder; reading it needs pyarrow (pip install pyarrow)"
        raise DataError(message) from None
    state = json.loads((folder / "state.json").read_text())
    rows = []
    for entry in state.get("_data_files", []):
        with pa.memory_map(str(folder / entry["filename"])) as file:
            rows.extend(pa.ipc.open_stream(file).read_all().to_pylist())
    return [Record(without_nulls(row), f"{split} row {number}") for number, row in enumerate(rows, 1)]


def without_nulls(value):
    """A row as its record was written: Arrow gives every struct all the fields any row has, as None where absent."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def read_splits(data: str | Path) -> dict[str, list[Record]]:
    """train/valid/test records of a `--data` folder (a split that is not there is empty)."""
    folder = Path(data)
    if not folder.is_dir():
        raise DataError(
            f"the data folder {folder} does not exist; pass --data a folder holding train.jsonl and valid.jsonl"
        )
    if (folder / "dataset_dict.json").is_file():  # a DatasetDict: one folder per split
        saved = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        return {
            split: next((read_arrow(folder / name, split) for name in names if name in saved), [])
            for split, names in SPLITS.items()
        }
    if (folder / "state.json").is_file():  # one Dataset: the training split
        return {"train": read_arrow(folder, "train"), "valid": [], "test": []}
    return {
        split: read_jsonl(folder / f"{split}.jsonl") if (folder / f"{split}.jsonl").is_file() else []
        for split in SPLITS
    }


class Encoder:
    """Records -> `Example`s through a tokenizer (its chat template for chats and prompt/completion pairs).

    `mask_prompt`: the loss covers only what the assistant writes (default); False trains on every token."""

    def __init__(self, tokenizer, mask_prompt: bool = True):
        self.tokenizer, self.mask_prompt = tokenizer, mask_prompt

    def __call__(self, record: Record) -> Example:
        fields = record.fields
        if "messages" in fields:
            return self.segments(self.chat(fields["messages"], fields.get("tools"), record.where))
        if "prompt" in fields and "completion" in fields:
            prompt, completion = fields["prompt"], fields["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise DataError(f"{record.where}: prompt and completion must be strings")
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            if self.tokenizer.chat_template is not None:
                return self.segments(self.chat(messages, fields.get("tools"), record.where))
            return self.segments([(prompt, False), (completion, True)], special=True, end=True)
        if "text" in fields:
            if not isinstance(fields["text"], str):
                raise DataError(f"{record.where}: text must be a string")
            return self.segments([(fields["text"], True)], special=True, end=True)
        raise DataError(f"{record.where} has none of the fields minimlx trains on; write each record as {FORMATS}")

    def chat(self, messages, tools, where: str) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is an assistant turn) pieces. A turn spans from where the
        template's prompt for it ends to where the conversation up to it ends (its end-of-turn marker included)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError(f'{where}: messages must be a list of objects such as {{"role": "user", "content": ...}}')
        answers = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
        if not answers:
            raise DataError(f"{where}: the conversation has no assistant turn, so nothing to train on; add one")
        render = self.tokenizer.apply_chat_template
        try:
            full = render(messages, add_generation_prompt=False, tools=tools, continue_final_message=False)
            spans = []
            for i in answers:
                start = len(prefix := render(messages[:i], add_generation_prompt=True, tools=tools))
                upto = render(messages[: i + 1], add_generation_prompt=False, tools=tools, continue_final_message=False)
                end = len(upto) if full.startswith(upto) else len(full)
                if full.startswith(prefix) and (not spans or start >= spans[-1][1]):
                    spans.append((start, end))
        except InvalidSettingError as e:
            raise DataError(f"{where}: {e}") from None
        if not spans:
            raise DataError(
                f"{where}: the chat template does not render this conversation's earlier turns as the start of the "
                "whole one, so its assistant turns cannot be found; pass --no-mask-prompt to train on every token"
            )
        pieces, at = [], 0
        for start, end in spans:
            pieces += [(full[at:start], False), (full[start:end], True)]
            at = end
        return [*pieces, (full[at:], False)]

    def segments(self, pieces: list[tuple[str, bool]], special: bool = False, end: bool = False) -> Example:
        """Token ids of the pieces, each encoded on its own as generation meets them (the prompt, then the answer):
        the first with the tokenizer's special tokens when `special` (plain text, as generation encodes it), the
        end-of-sequence token last when `end` (it teaches where an answer stops)."""
        ids, trained = [], []
        for number, (text, is_answer) in enumerate(pieces):
            piece = self.tokenizer.encode(text, add_special_tokens=special and number == 0) if text else []
            ids += piece
            trained += [is_answer or not self.mask_prompt] * len(piece)
        eos = end_token(self.tokenizer)
        if end and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            trained.append(True)
        return Example(ids, trained)


def end_token(tokenizer) -> int | None:
    """The id that ends a text: the tokenizer's end-of-sequence token, else the lowest of its end ids."""
    if tokenizer.eos_token is not None:
        return tokenizer.encode(tokenizer.eos_token, add_special_tokens=False)[0]
    return min(tokenizer.eos_token_ids, default=None)


@dataclass
class Cut:
    """What `--max-seq-length` cut: how many examples were longer, of how many, and the longest."""

    count: int
    total: int
    longest: int

    def __str__(self) -> str:
        return f"{self.count} of {self.total} examples were longer than the limit and were cut (the longest: " + (
            f"{self.longest} tokens); raise --max-seq-length to keep them whole"
        )


def encode(records: list[Record], encoder: Encoder, max_length: int) -> tuple[list[Example], Cut]:
    """The records' examples, each cut to `max_length` tokens, and a count of those cut. An example whose loss
    mask is empty after the cut is named (it would teach nothing)."""
    examples, longest, count = [], 0, 0
    for record in records:
        example = encoder(record)
        longest = max(longest, len(example.ids))
        if len(example.ids) > max_length:
            count += 1
            example = Example(example.ids[:max_length], example.trained[:max_length])
        if not any(example.trained[1:]):
            raise DataError(
                f"{record.where}: no token of it is trained on within --max-seq-length {max_length}; "
                "shorten its prompt or raise --max-seq-length"
            )
        examples.append(example)
    return examples, Cut(count, len(records), longest)


def pack(examples: list[Example], max_length: int) -> list[Example]:
    """Short examples concatenated, in order, into rows of at most `max_length` tokens (fewer, fuller rows: less
    padding). A row's later examples attend to its earlier ones, as packed training commonly allows."""
    rows, row = [], Example([], [])
    for example in examples:
        if row.ids and len(row.ids) + len(example.ids) > max_length:
            rows.append(row)
            row = Example([], [])
        row = Example(row.ids + example.ids, row.trained + example.trained)
    return rows + [row] if row.ids else rows


class Batches:
    """Rows in batches of `size`, rows of similar length together (less padding). Training batches come in an order
    that depends only on the seed and the step, so that a resumed run meets the batches an uninterrupted one would;
    every epoch has its own shuffle of the batches."""

    def __init__(self, rows: list[Example], size: int, split: str, whole: bool = False):
        if len(rows) < size and not whole:
            raise DataError(f"the {split} split has {len(rows)} rows, fewer than --batch-size {size}; lower it")
        by_length = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
        last = len(rows) if whole else len(rows) - size + 1  # training drops the rows left over; evaluation keeps them
        self.rows, self.groups = rows, [by_length[i : i + size] for i in range(0, last, size)]

    def __len__(self) -> int:
        return len(self.groups)

    def at(self, step: int, seed: int) -> "Batch":
        """The batch of training step `step` (counted from 0)."""
        return self.batch(self.group_at(step, seed))

    def group_at(self, step: int, seed: int) -> list[int]:
        epoch, index = divmod(step, len(self.groups))
        order = np.random.default_rng([seed, epoch]).permutation(len(self.groups))
        return self.groups[order[index]]

    def shape_at(self, step: int, seed: int) -> tuple[int, int]:
        """The (rows, positions) of the batch of step `step`, without making it."""
        group = self.group_at(step, seed)
        return len(group), padded(max(len(self.rows[i].ids) for i in group))

    def in_order(self, count: int | None = None):
        """The first `count` batches (all when None) in a fixed order: validation's."""
        for group in self.groups[:count]:
            yield self.batch(group)

    def batch(self, group: list[int]) -> "Batch":
        rows = [self.rows[i] for i in group]
        length = padded(max(len(row.ids) for row in rows))
        ids, mask = np.zeros((len(rows), length), np.int32), np.zeros((len(rows), length), bool)
        for i, row in enumerate(rows):
            ids[i, : len(row.ids)], mask[i, : len(row.ids)] = row.ids, row.trained
        return Batch(mx.array(ids), mx.array(mask), sum(len(row.ids) - 1 for row in rows))


PAD_TO = 8
"""Batches are padded to a multiple of this many predicted positions (fewer distinct shapes for compiled steps)."""


def padded(length: int) -> int:
    """The positions of a batch whose longest row has `length` tokens."""
    return 1 + -(-(length - 1) // PAD_TO) * PAD_TO


@dataclass
class Batch:
    """`ids` (batch, positions), `mask` True where predicting that token counts in the loss (position 0 never does:
    nothing comes before it), and how many tokens the batch reads (padding not counted)."""

    ids: mx.array
    mask: mx.array
    tokens: int
