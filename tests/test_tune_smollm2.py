"""A real fine-tuning run (acceptance 2): `minimlx lora` on SmolLM2-135M-Instruct over the chat data shipped in
examples/finetune/data (answers always in double square brackets) lowers the held-out loss by at least 20%, and the
adapted model then answers held-out questions in that format, which the base model never uses. The run is kept
short for the test (4 blocks, 12 updates of 4 chats, a high learning rate)."""

import json
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from models import greedy_ids

import minimlx
from minimlx.cli import main
from minimlx.tune import differentiable, load_adapter

DATA = Path(__file__).resolve().parents[1] / "examples" / "finetune" / "data"
BRACKETED = re.compile(r"^\[\[[^\[\]\n]+\]\]$")


@pytest.mark.slow
def test_lora_on_smollm2_learns_the_bracketed_answers(tmp_path):
    from models import smollm2_path

    smollm2_path()
    options = "--iters 12 --batch-size 4 --learning-rate 5e-3 --num-layers 4 --targets all-linear --rank 8"
    options += " --steps-per-eval 12 --val-batches 4 --max-seq-length 64 --seed 0"
    started = time.perf_counter()
    result = CliRunner().invoke(
        main,
        ["lora", "--model", "smollm2-135m", "--data", str(DATA), "--adapter-path", str(tmp_path), *options.split()],
    )
    seconds = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    validation = [float(line.rpartition(" ")[2]) for line in result.stdout.splitlines() if "validation loss" in line]
    assert len(validation) == 2 and validation[1] <= 0.8 * validation[0], result.stdout
    assert seconds < 15 * 60  # the bound; on 2 idle cores the run takes well under a minute

    model, tokenizer = minimlx.load("smollm2-135m", dtype="float32")
    differentiable(model)
    questions = [json.loads(line)["messages"][0]["content"] for line in (DATA / "valid.jsonl").read_text().splitlines()]
    base = tokenizer.decode(greedy_ids(model, tokenizer, questions[0], max_tokens=12), skip_special_tokens=True)
    assert not BRACKETED.match(base.strip())
    load_adapter(model, tmp_path)
    for question in questions[:3]:
        answer = tokenizer.decode(greedy_ids(model, tokenizer, question, max_tokens=12), skip_special_tokens=True)
        assert BRACKETED.match(answer.strip()), (question, answer)
