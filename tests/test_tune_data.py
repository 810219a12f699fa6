"""minimlx.tune.data: records of every format to token ids and loss masks, the folders they come in (JSONL as
mlx-lm reads them, a Hugging Face datasets folder), cuts, packing, batches, and bad records named by line."""

import numpy as np
import pytest
from tuning import chat, word_tokenizer, write_jsonl

from minimlx.errors import DataError
from minimlx.tune.data import Batches, Encoder, Example, Record, encode, pack, read_splits


def trained_words(tokenizer, example):
    """The words whose prediction counts in the loss."""
    return [tokenizer.decode([i]) for i, trained in zip(example.ids, example.trained) if trained]


def test_chat_trains_on_assistant_turns_with_their_end():
    tokenizer = word_tokenizer()
    messages = [
        {"role": "system", "content": "w3"},
        {"role": "user", "content": "w4 w5"},
        {"role": "assistant", "content": "w6 w7"},
        {"role": "user", "content": "w8"},
        {"role": "assistant", "content": "w9"},
    ]
    example = Encoder(tokenizer)(Record({"messages": messages}, "x"))
    assert tokenizer.decode(example.ids) == "w0 w3 w2 w0 w4 w5 w2 w0 w6 w7 w2 w0 w8 w2 w0 w9 w2"
    assert trained_words(tokenizer, example) == ["w6", "w7", "w2", "w9", "w2"]
    unmasked = Encoder(tokenizer, mask_prompt=False)(Record({"messages": messages}, "x"))
    assert unmasked.ids == example.ids and all(unmasked.trained)


def test_tools_reach_the_template_and_are_not_trained():
    tokenizer = word_tokenizer()
    record = {**chat("w4", "w5"), "tools": [{"name": "w10"}, {"name": "w11"}]}
    example = Encoder(tokenizer)(Record(record, "x"))
    words = tokenizer.decode(example.ids).split()
    assert "w10" in words and "w11" in words  # described in a system turn: minimlx's way for a template like this one
    assert words[-7:] == "w2 w0 w4 w2 w0 w5 w2".split()
    assert trained_words(tokenizer, example) == ["w5", "w2"]


def test_prompt_completion_and_text():
    tokenizer = word_tokenizer()
    pair = Encoder(tokenizer)(Record({"prompt": "w4 w5", "completion": "w6"}, "x"))
    assert tokenizer.decode(pair.ids) == "w0 w4 w5 w2 w0 w6 w2" and trained_words(tokenizer, pair) == ["w6", "w2"]
    plain = Encoder(word_tokenizer(template=None))(Record({"prompt": "w4 w5", "completion": "w6"}, "x"))
    assert tokenizer.decode(plain.ids) == "w4 w5 w6 w1" and trained_words(tokenizer, plain) == ["w6", "w1"]
    text = Encoder(tokenizer)(Record({"text": "w4 w5"}, "x"))
    assert tokenizer.decode(text.ids) == "w4 w5 w1" and all(text.trained)  # the end token teaches where text stops


def test_max_seq_length_cuts_and_counts():
    tokenizer = word_tokenizer()
    records = [Record(chat("w4", "w5 " * n), f"line {n}") for n in (1, 10, 20)]
    examples, cut = encode(records, Encoder(tokenizer), 12)
    assert [len(e.ids) for e in examples] == [6, 12, 12]
    assert (cut.count, cut.total, cut.longest) == (2, 3, 25)
    assert "2 of 3 examples were longer" in str(cut)
    with pytest.raises(DataError, match="line 9: no token of it is trained on within --max-seq-length 4"):
        encode([Record(chat("w4 w4 w4 w4", "w5"), "line 9")], Encoder(tokenizer), 4)


def test_packing_fills_rows_in_order():
    examples = [Example(list(range(n)), [True] * n) for n in (3, 4, 2, 5, 1)]
    rows = pack(examples, 7)
    assert [len(r.ids) for r in rows] == [7, 7, 1]
    assert rows[0].ids == [0, 1, 2, 0, 1, 2, 3] and rows[1].ids == [0, 1, 0, 1, 2, 3, 4]


def test_batches_depend_only_on_seed_and_step():
    rows = [Example([n] * (n + 2), [False] + [True] * (n + 1)) for n in range(12)]  # row n: n + 2 tokens of id n
    batches = Batches(rows, 3, "train")
    assert len(batches) == 4

    def rows_of(step, seed):
        return tuple(np.array(batches.at(step, seed).ids)[:, 0].tolist())

    order = [rows_of(step, 1) for step in range(8)]
    assert order == [rows_of(step, 1) for step in range(8)]  # a resumed run meets the same batches
    assert sorted(order[:4]) == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)]  # similar lengths together, once each
    assert sorted(order[4:]) == sorted(order[:4]) and order[4:] != order[:4]  # each epoch shuffled anew
    assert order != [rows_of(step, 2) for step in range(8)]
    batch = batches.at(0, seed=1)
    assert batch.ids.shape[1] % 8 == 1  # a multiple of 8 predicted positions
    assert batch.tokens == sum(len(rows[i].ids) - 1 for i in order[0])
    assert np.array(batch.mask).sum() == batch.tokens  # padding never counts
    with pytest.raises(DataError, match="the train split has 2 rows, fewer than --batch-size 3"):
        Batches(rows[:2], 3, "train")
    assert len(Batches(rows[:5], 3, "valid", whole=True)) == 2  # evaluation keeps the rows left over


def test_jsonl_folder_as_mlx_lm_reads_it(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat("w4", "w5"), "", {"text": "w6"}])
    write_jsonl(tmp_path / "valid.jsonl", [{"prompt": "w4", "completion": "w5"}])
    splits = read_splits(tmp_path)
    assert [r.fields for r in splits["train"]] == [chat("w4", "w5"), {"text": "w6"}]
    assert [r.where for r in splits["train"]] == ["train.jsonl line 1", "train.jsonl line 3"]
    assert len(splits["valid"]) == 1 and splits["test"] == []


def test_datasets_folder_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    called = {**chat("w4", "w5"), "tools": [{"name": "w10"}]}
    called["messages"][1]["tool_calls"] = [{"type": "function", "function": {"name": "w10", "arguments": "{}"}}]
    train = [called, chat("w6", "w7")]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "validation": datasets.Dataset.from_list([chat("w8", "w9")])}
    ).save_to_disk(str(tmp_path / "dict"))
    splits = read_splits(tmp_path / "dict")
    assert [r.fields for r in splits["train"]] == train  # the fields Arrow filled in for the other rows dropped
    assert [r.fields for r in splits["valid"]] == [chat("w8", "w9")] and splits["test"] == []
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "one"))
    assert [r.fields for r in read_splits(tmp_path / "one")["train"]] == train


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', r"train.jsonl line 2 is not valid JSON \(.*\); fix or remove the line"),
        ("[1, 2]", "train.jsonl line 2 is not a JSON object"),
        ('{"question": "w4"}', "train.jsonl line 2 has none of the fields minimlx trains on"),
        ('{"messages": [{"role": "user", "content": "w4"}]}', "train.jsonl line 2: the conversation has no assistant"),
        ('{"prompt": "w4", "completion": 5}', "train.jsonl line 2: prompt and completion must be strings"),
    ],
)
def test_bad_records_are_named_by_line(tmp_path, line, message):
    write_jsonl(tmp_path / "train.jsonl", [chat("w4", "w5"), line])
    with pytest.raises(DataError, match=message):
        for record in read_splits(tmp_path)["train"]:
            Encoder(word_tokenizer())(record)


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match="the data folder .*nowhere does not exist; pass --data a folder"):
        read_splits(tmp_path / "nowhere")
