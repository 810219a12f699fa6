"""The agents' API of `minimlx serve`, as clients use it: the official `openai` client on SmolLM2.

Tool calls through SmolLM2's own template and through llama.cpp's templates of Qwen3, Llama 3.3, Mistral Nemo,
gpt-oss and DeepSeek V3.1 (`--chat-template`): a named or required tool choice gives one call whose arguments
validate against the tool's schema, streamed or not, and a tool result sent back is answered. JSON-schema answers
validate at temperature 0.8; token logprobs equal a recomputation from the model's logits; a grammar that forces
thinking arrives as reasoning_content; any model name is answered unless --served-model-name is given.
"""

import json

import mlx.core as mx
import pytest
from llamacpp import llamacpp_template
from models import smollm2_path
from reference import require
from schemas import SCHEMAS  # the engine's tests of the same 11 schemas, here through the server
from servers import QUESTION, Served

pytestmark = pytest.mark.slow  # SmolLM2 behind a `minimlx serve` process

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATES = [
    None,  # SmolLM2's own, which knows no tools: the generic JSON format
    "Qwen-Qwen3-0.6B",
    "meta-llama-Llama-3.3-70B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "openai-gpt-oss-120b",
    "deepseek-ai-DeepSeek-V3.1",
]


@pytest.fixture(scope="module", params=TEMPLATES, ids=lambda name: name or "smollm2")
def templated_server(request, tmp_path_factory):
    smollm2_path()
    args = ["--max-batch", "2"]
    if request.param is not None:
        path = tmp_path_factory.mktemp("template") / f"{request.param}.jinja"
        path.write_text(llamacpp_template(request.param))
        args += ["--chat-template", str(path)]
    server = Served(*args)
    yield server
    server.stop()


def arguments_of(call, tool) -> dict:
    jsonschema = require("jsonschema")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_validates_streamed_or_not(templated_server, choice):
    client = templated_server.client()
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    tools = [WEATHER, TIME] if choice == "named" else [WEATHER]
    ask = dict(model="anything", messages=ASK, tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=120)
    reply = client.chat.completions.create(**ask, parallel_tool_calls=False)
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    [call] = choice_.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    arguments = arguments_of(call, WEATHER)
    streamed = {}
    for chunk in client.chat.completions.create(**ask, parallel_tool_calls=False, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert list(streamed) == [0] and streamed[0]["name"] == "get_weather"
    assert json.loads(streamed[0]["arguments"]) == arguments

    result = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    # Under a foreign template SmolLM2 may end its turn at once (Mistral's); its end of turn banned, it answers,
    # which shows the template rendered the tool result; tool_choice "none" asks for text, not another call.
    answer = client.chat.completions.create(
        model="x",
        messages=result,
        tools=tools,
        tool_choice="none",
        temperature=0,
        max_tokens=30,
        logit_bias={"2": -100},
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.fixture(scope="module")
def server():
    smollm2_path()
    served = Served("--max-batch", "4")
    yield served
    served.stop()


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_answers_validate_at_temperature_0_8(server, schema):
    jsonschema = require("jsonschema")
    reply = server.client().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give me an example."}],
        response_format={"type": "json_schema", "json_schema": {"name": "example", "schema": schema}},
        temperature=0.8,
        seed=7,
        max_tokens=400,
        n=2,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize(
    "format_",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "hiccup"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}},
        {"type": "json_object", "schema": {"type": 123}},
        {"type": "sound"},
    ],
)
def test_an_invalid_schema_is_a_400(server, format_):
    code, reply = server.post("/v1/chat/completions", {"messages": QUESTION, "response_format": format_})
    assert code == 400 and reply["error"]["param"] == "response_format", reply


@pytest.fixture(scope="module")
def smollm2():
    import minimlx

    return minimlx.load("smollm2-135m")


def test_logprobs_equal_the_models_log_softmax(smollm2):
    """With --exact, logprobs equal log_softmax of one plain forward pass over the prompt and the answer. (With the
    default integer products a decode step's logits also depend, at the level of the 8-bit rounding, on how the
    cached tokens before it were computed, which the server's prompt cache decides.)"""
    model, tokenizer = smollm2
    served = Served("--exact")
    try:
        reply = served.client().chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0.7, seed=3, max_tokens=12, logprobs=True, top_logprobs=5
        )
    finally:
        served.stop()
    tokens = reply.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == reply.choices[0].message.content
    prompt = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    ids = [tokenizer.encode(t.token, add_special_tokens=False) for t in tokens]
    assert all(len(i) == 1 for i in ids)  # each token's text is that token alone
    ids = [i[0] for i in ids]
    logits = model(mx.array([prompt + ids]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    for token, row, i in zip(tokens, expected, ids):
        assert abs(token.logprob - row[i]) < 1e-4
        assert len(token.top_logprobs) == 5
        tops = [t.logprob for t in token.top_logprobs]
        assert tops == sorted(tops, reverse=True) and abs(tops[0] - max(row)) < 1e-4
        assert token.bytes == list(token.token.encode())


def test_a_grammar_forcing_thought_splits_reasoning_from_content(tmp_path_factory):
    smollm2_path()
    path = tmp_path_factory.mktemp("qwen3") / "qwen3.jinja"
    path.write_text(llamacpp_template("Qwen-Qwen3-0.6B"))
    served = Served("--chat-template", str(path))
    try:
        grammar = 'start: "<think>" /[a-z ]{5,40}/ "</think>" /[A-Za-z ]{5,40}/'
        body = {"messages": QUESTION, "lark_grammar": grammar, "temperature": 0, "max_tokens": 60}
        code, whole = served.post("/v1/chat/completions", body)
        assert code == 200, whole
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"]
        assert "<think>" not in message["content"] + message["reasoning_content"]
        streamed = {"reasoning_content": "", "content": ""}
        client = served.client()
        for chunk in client.chat.completions.create(
            model="x",
            messages=QUESTION,
            temperature=0,
            max_tokens=60,
            stream=True,
            extra_body={"lark_grammar": grammar},
        ):
            delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
            for key in streamed:
                streamed[key] += delta.get(key) or ""
        assert streamed == {key: message[key] for key in streamed}
    finally:
        served.stop()


def test_a_served_model_name_is_the_only_one_answered():
    smollm2_path()
    served = Served("--served-model-name", "local-model")
    try:
        client = served.client()
        assert [m.id for m in client.models.list()] == ["local-model"]
        reply = client.chat.completions.create(model="local-model", messages=QUESTION, max_tokens=3)
        assert reply.model == "local-model"
        code, error = served.post("/v1/chat/completions", {"model": "gpt-4o", "messages": QUESTION})
        assert code == 404 and error["error"]["code"] == "model_not_found"
    finally:
        served.stop()


def test_any_model_name_is_answered_by_the_loaded_model(server):
    reply = server.client().chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=3)
    assert reply.model == "smollm2-135m" and reply.choices[0].message.content
