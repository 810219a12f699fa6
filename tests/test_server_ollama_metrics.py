"""Ollama's API through the official `ollama` client, and Prometheus' /metrics read with prometheus_client's parser,
against `minimlx serve` on SmolLM2."""

import json
import urllib.request

import pytest
from models import smollm2_path
from reference import require
from servers import Served

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server():
    smollm2_path()
    served = Served("--max-batch", "4")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    return require("ollama").Client(host=server.url)


def test_list_show_ps_and_version_describe_the_model(client, server):
    [model] = client.list().models
    assert model.model == "smollm2-135m:latest" and model.size > 50e6
    assert model.details.format == "gguf" and model.details.family == "llama3"
    assert model.details.parameter_size == "134.5M"
    shown = client.show("smollm2-135m")
    assert shown.capabilities == ["completion", "tools"] and "im_start" in shown.template
    assert shown.modelinfo["llama3.context_length"] == 8192
    [loaded] = client.ps().models
    assert loaded.model == "smollm2-135m:latest" and loaded.context_length == 8192
    with urllib.request.urlopen(f"{server.url}/api/version") as response:
        assert json.load(response)["version"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_generate_answer_paris_streamed_or_not(client, stream):
    options = {"temperature": 0, "num_predict": 16}
    chat = client.chat("smollm2-135m", messages=QUESTION, options=options, stream=stream)
    generated = client.generate("smollm2-135m:latest", prompt=QUESTION[0]["content"], options=options, stream=stream)
    if stream:
        chunks, pieces = list(chat), list(generated)
        assert chunks[-1].done and not any(c.done for c in chunks[:-1])
        text = "".join(c.message.content for c in chunks)
        generated_text = "".join(p.response for p in pieces)
        final = chunks[-1]
    else:
        text, generated_text, final = chat.message.content, generated.response, chat
    assert text == generated_text == "The capital of France is Paris."
    assert final.done_reason == "stop" and final.eval_count == 7 and final.prompt_eval_count > 20
    assert final.total_duration >= final.eval_duration > 0


def test_a_tool_call_and_a_schema_answer(client):
    jsonschema = require("jsonschema")
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.chat("smollm2-135m", messages=ask, tools=[WEATHER], format=None, options={"temperature": 0})
    assert forced.message.content  # SmolLM2 answers in words when it may choose
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    answer = client.chat("smollm2-135m", messages=QUESTION, format=schema, options={"temperature": 0})
    jsonschema.validate(json.loads(answer.message.content), schema)
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {
        "city": "Paris"}}}]}  # fmt: skip
    result = {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"}
    after = client.chat("smollm2-135m", messages=[*ask, call, result], tools=[WEATHER], options={"temperature": 0})
    assert after.done and after.message.content


def test_bad_ollama_requests_are_its_error_shape(client, server):
    ollama = require("ollama")
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat("nope", messages=QUESTION)
    assert missing.value.status_code == 404 and "nope" in missing.value.error
    model = "smollm2-135m"
    for body in ({"model": model}, {"model": model, "messages": "hi"}, {"model": model, "messages": QUESTION,
                 "format": 5}, {"model": model, "messages": QUESTION, "think": "maybe"}):  # fmt: skip
        status, reply = server.post("/api/chat", body)
        assert status == 400 and set(reply) == {"error"}, (body, reply)


def test_metrics_parse_and_count_what_was_asked(server):
    parser = require("prometheus_client.parser")

    def scrape() -> dict:
        with urllib.request.urlopen(f"{server.url}/metrics") as response:
            text = response.read().decode()
        samples = {}
        for family in parser.text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def value(samples, name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    before = scrape()
    bodies = [{"messages": QUESTION, "max_tokens": 5, "temperature": 0}] * 3
    for body in bodies:
        assert server.post("/v1/chat/completions", body)[0] == 200
    assert server.post("/v1/chat/completions", {"messages": "x"})[0] == 400
    after = scrape()
    chat = {"endpoint": "/v1/chat/completions"}
    assert (
        value(after, "minimlx_requests_total", **chat, status="200")
        - value(before, "minimlx_requests_total", **chat, status="200")
        == 3
    )
    assert (
        value(after, "minimlx_requests_total", **chat, status="400")
        - value(before, "minimlx_requests_total", **chat, status="400")
        == 1
    )
    assert value(after, "minimlx_generation_tokens_total") - value(before, "minimlx_generation_tokens_total") == 15
    prompt = server.post("/v1/chat/completions", bodies[0])[1]["usage"]["prompt_tokens"]
    assert value(after, "minimlx_prompt_tokens_total") - value(before, "minimlx_prompt_tokens_total") == 3 * prompt
    assert value(after, "minimlx_prompt_cache_hits_total") - value(before, "minimlx_prompt_cache_hits_total") >= 2
    assert (
        value(after, "minimlx_time_to_first_token_seconds_count")
        - value(before, "minimlx_time_to_first_token_seconds_count")
        == 3
    )
    assert (
        value(after, "minimlx_inter_token_latency_seconds_count")
        - value(before, "minimlx_inter_token_latency_seconds_count")
        == 12
    )
    assert value(after, "minimlx_requests_running") == 0 and value(after, "minimlx_models_loaded") == 1
    assert value(after, "minimlx_prompt_cache_bytes") > 0


def test_langchains_chat_ollama_chats_and_answers_in_a_schema(server):
    langchain_ollama = require("langchain_ollama")
    pydantic = require("pydantic")

    class City(pydantic.BaseModel):
        city: str
        country: str

    llm = langchain_ollama.ChatOllama(model="smollm2-135m", base_url=server.url, temperature=0, num_predict=16)
    reply = llm.invoke("What is the capital of France?")
    assert reply.content == "The capital of France is Paris." and reply.usage_metadata["output_tokens"] == 7
    assert "".join(chunk.content for chunk in llm.stream("What is the capital of France?")) == reply.content
    city = llm.with_structured_output(City, method="json_schema").invoke("Describe the capital of France.")
    assert (city.city, city.country) == ("Paris", "France")


def test_a_tool_call_through_ollamas_chat():
    """The model's call (forced here: SmolLM2 answers in words when it may choose) comes back as Ollama writes it,
    its arguments an object, and the tool's result sent back is answered."""
    from agent_model import agent_model

    client_module = require("ollama")
    served = Served("--model", str(agent_model()), "--force-tool-call", 'get_weather={"city": "Paris"}')
    try:
        client = client_module.Client(host=served.url)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        reply = client.chat("agent-model", messages=ask, tools=[WEATHER], options={"temperature": 0})
        [call] = reply.message.tool_calls
        assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        streamed = [
            c for c in client.chat("agent-model", messages=ask, tools=[WEATHER], stream=True) if c.message.tool_calls
        ]
        assert [c.function.name for c in streamed[0].message.tool_calls] == ["get_weather"]
        result = {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"}
        after = client.chat("agent-model", messages=[*ask, reply.message, result], tools=[WEATHER])
        assert after.done and not after.message.tool_calls
    finally:
        served.stop()
