"""The engine's prompt cache on SmolLM2 as `serve` runs it (its packed weights, the native kernel's integer products
in decode steps): a request sent again finds all of its prompt but the last token cached, and answers, token for
token and logprob for logprob, as it did with a cold cache, a forced tool call's arguments included."""

import json

import pytest
from models import smollm2_path

import minimlx
from minimlx.decode import SamplingSettings
from minimlx.decode.engine import Engine, Request
from minimlx.decode.grammar import Constraint

WEATHER = {  # the tool of docs/serve.md (no additionalProperties: a call may add properties), its city bounded
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}


@pytest.mark.slow
def test_a_request_sent_again_answers_as_it_did_cold():
    model, tokenizer = minimlx.load(smollm2_path())
    system = f"You call the tool get_weather with JSON arguments of this schema: {json.dumps(WEATHER)}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), False)
    settings = SamplingSettings(temperature=0, max_tokens=120, constraint=Constraint.json_schema(WEATHER), logprobs=0)
    engine = Engine(model, tokenizer, prompt_cache_size=8)  # as `minimlx serve` makes it
    answers = []
    for _ in range(3):
        generation = engine.submit(Request(list(prompt), settings))
        outputs = []
        while engine.busy:
            outputs += engine.step()
        answers.append((generation.cached_tokens, [(o.token, o.logprob) for o in outputs]))
    (cold_cached, cold), *warm = answers
    assert cold_cached == 0 and [cached for cached, _ in warm] == [len(prompt) - 1] * 2
    assert all(answer == cold for _, answer in warm)  # the logprobs too: the logits are the same to the last bit
    text = tokenizer.decode([token for token, _ in cold], skip_special_tokens=True)
    arguments = json.loads(text)
    assert arguments["city"] == "Paris" and arguments["unit"] in ("celsius", "fahrenheit")
