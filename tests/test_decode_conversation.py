"""Long conversations: a chat that outgrows the context drops its oldest turns; memory grows only by the cache."""

import subprocess
import sys

import pytest
from models import chat_model

import minimlx
from minimlx.decode import Conversation


@pytest.mark.slow
def test_a_chat_that_fills_the_context_drops_its_oldest_turns(tmp_path):
    folder = chat_model(tmp_path, context=64)
    turns = "".join(f"w{i} w{i + 1} w{i + 2} w{i + 3}\n" for i in range(2, 14))
    result = subprocess.run(
        [sys.executable, "-m", "minimlx", "chat", "--model", str(folder), "--max-tokens", "8", "--temp", "0"],
        input=turns,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 12  # an answer line for every turn
    notes = result.stderr.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith(
        "warning: the conversation no longer fits the model's context of 64"
    ), result.stderr


@pytest.mark.slow
def test_memory_grows_only_by_the_cache(tmp_path):
    """From the 10th turn to the 100th, MLX holds no more than the conversation's cache; from the 20th call of
    `generate` to the 200th, no more at all (in a fresh process, where no other test's engine allocates)."""
    from memory_peaks import conversation_memory, in_fresh_process

    after_ten, after_hundred, after_twenty, after_two_hundred = in_fresh_process(
        conversation_memory, str(chat_model(tmp_path, context=4096))
    )
    assert abs(after_hundred - after_ten) < 256 * 1024, (after_hundred, after_ten)
    assert abs(after_two_hundred - after_twenty) < 256 * 1024, (after_two_hundred, after_twenty)


def test_a_windowed_cache_that_cannot_go_back_starts_over(tmp_path):
    """Gemma 2 with a 4-token window: cutting the conversation back to tokens the window dropped restarts the
    cache (keep returns 0), and the next turn answers as a fresh conversation with the same history does."""
    model, tokenizer = minimlx.load(chat_model(tmp_path, 256, "Gemma2Config", head_dim=8, sliding_window=4), "float32")
    conversation = Conversation(model, tokenizer)
    list(conversation.say("w2 w3 w4 w5", max_tokens=4))
    cached = len(conversation.cached_ids)
    assert conversation.keep(cached) == cached and conversation.keep(cached - 2) == 0
    assert [c.offset for c in conversation.cache] == [0, 0] and conversation.cached_ids == []
    answer = "".join(r.text for r in conversation.say("w6 w7", max_tokens=4))
    fresh = Conversation(model, tokenizer)
    fresh.messages = conversation.messages[:2]
    assert answer == "".join(r.text for r in fresh.say("w6 w7", max_tokens=4))
