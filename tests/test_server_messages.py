"""Anthropic's Messages API: request bodies read into Turns, scripted answers rendered as messages and events (no
model), errors in Anthropic's shape, then the official `anthropic` client against a real `minimlx serve`."""

import asyncio

import pytest
from pydantic import TypeAdapter
from scripted_answer import THOUGHT_ANSWER_AND_CALL, ScriptedAnswer, call, collect, end, text

from minimlx.server.fields import APIError
from minimlx.server.messages import Reply, error_body, read_turn, sampling
from minimlx.server.turns import Usage

anthropic_types = pytest.importorskip("anthropic.types")
USAGE = Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=4)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


# ---- the request ----


def test_system_text_blocks_and_sampling_fields():
    body = {
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["\n", "END"],
        "metadata": {"user_id": "u"},
    }
    turn = read_turn(body)
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert (turn.tools, turn.tool_choice, turn.template_kwargs) == (None, "auto", {})
    assert sampling(body) == {"max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": ["\n", "END"]}
    assert sampling({"max_tokens": 1})["stop"] == []


def test_tool_use_thinking_and_tool_results_become_chat_messages():
    turn = read_turn(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Ask the tool.", "signature": "x"},
                        {"type": "redacted_thinking", "data": "..."},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                         "content": [{"type": "text", "text": "City "}, {"type": "text", "text": "not found"}]},
                        {"type": "text", "text": "Here are the results."},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 50},
        }
    )  # fmt: skip
    calls = [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]
    assert turn.messages == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Ask the tool.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "City not found"},
        {"role": "user", "content": "Here are the results."},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]
    function = {"name": "get_weather", "parameters": WEATHER["input_schema"], "description": "The weather in a city"}
    assert turn.tools == [{"type": "function", "function": function}]
    assert (turn.tool_choice, turn.parallel_tool_calls) == ("get_weather", False)
    assert turn.template_kwargs == {"enable_thinking": True}


def test_tool_choices_thinking_off_and_an_empty_conversation():
    expected = {"auto": "auto", "any": "required", "none": "none"}
    for kind, choice in expected.items():
        turn = read_turn({"messages": [], "tool_choice": {"type": kind}})
        assert (turn.tool_choice, turn.parallel_tool_calls) == (choice, True)
    turn = read_turn({"system": "Be kind.", "messages": [], "thinking": {"type": "disabled"}})
    assert turn.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": ""}]
    assert turn.template_kwargs == {"enable_thinking": False}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 5}, "messages"),
        ({"max_tokens": 5, "messages": {"role": "user"}}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": 5}]}, "messages[0].content"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, "messages[0].content[0].source"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}, IMAGE]}]}]},
            "messages[0].content[0].content",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}, "messages[0].content[0].input"),
        ({"max_tokens": 5, "messages": [], "system": 5}, "system"),
        ({"max_tokens": 5, "messages": [], "tools": [{"name": "f"}]}, "tools[0]"),
        ({"max_tokens": 5, "messages": [], "tools": ["bash"]}, "tools[0]"),
        ({"max_tokens": 5, "messages": [], "tools": [{"name": "f", "input_schema": []}]}, "tools[0].input_schema"),
        ({"max_tokens": 5, "messages": [], "tool_choice": "auto"}, "tool_choice"),
        ({"max_tokens": 5, "messages": [], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"max_tokens": 5, "messages": [], "thinking": {"type": "maybe"}}, "thinking"),
        ({"messages": []}, "max_tokens"),
        ({"max_tokens": "5", "messages": []}, "max_tokens"),
        ({"max_tokens": 5, "messages": [], "temperature": 1.5}, "temperature"),
        ({"max_tokens": 5, "messages": [], "top_k": 0.5}, "top_k"),
        ({"max_tokens": 5, "messages": [], "stop_sequences": "END"}, "stop_sequences"),
        ({"max_tokens": 5, "messages": [], "stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}] * 10_001}, "messages"),
        ({"max_tokens": 5, "messages": [], "metadata": "tag"}, "metadata"),
        ({"max_tokens": 5, "messages": [], "mcp_servers": {"type": "url"}}, "mcp_servers"),
        ({"max_tokens": 5, "messages": [], "context_management": []}, "context_management"),
        ({"max_tokens": 5, "messages": [], "output_config": {"effort": 3}}, "output_config.effort"),
    ],
)  # fmt: skip
def test_bad_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as refused:
        read_turn(body)
        sampling(body)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_fields_no_reader_knows_and_server_tools_are_ignored_and_named():
    """What Claude Code sends beside the conversation (context_management, output_config, metadata, a server tool,
    a mid-conversation system message) is read or ignored, never refused; the ignored names are listed."""
    from minimlx.server.fields import Body, flag, ignore_unread

    body = Body(
        {
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}],
            "stream": False,
            "max_token": 3,
            "metadata": {"user_id": "u"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high", "format": None},
            "tools": [{"type": "web_search_20250305", "name": "web_search"}, {"name": "f", "input_schema": {}}],
        }
    )
    turn = read_turn(body)
    sampling(body), flag(body, "stream")
    ignore_unread(body, "messages")
    assert turn.messages[-1] == {"role": "system", "content": "be brief"}
    assert turn.template_kwargs == {"reasoning_effort": "high"}
    assert [tool["function"]["name"] for tool in turn.tools] == ["f"]
    assert set(body.ignored) == {
        "metadata", "context_management", "output_config.format", "tools[].type=web_search_20250305", "max_token"
    }  # fmt: skip
    assert body.headers() == {"x-minimlx-ignored": ", ".join(body.ignored)}


def test_image_blocks_are_read_in_place_and_other_sources_refused():
    """A user's image block becomes its place in the text (the model's image token, once rendered) and its bytes;
    a URL source is kept as its URL, refused when the request starts by a server that fetches none (without
    --allow-image-urls); an image inside a tool_result is refused."""
    from minimlx.server.images import ImageURL, fetched

    turn = read_turn({"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]}]})
    assert turn.messages == [{"role": "user", "content": "\ue000What is this?"}]
    assert turn.images == [b"\x89PNG\r\n\x1a\n"]
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    turn = read_turn({"messages": [{"role": "user", "content": [url]}]})
    assert turn.images == [ImageURL("https://example.com/cat.png", "messages[0].content[0].source.url")]
    with pytest.raises(APIError, match="does not fetch image URLs") as refused:
        fetched(turn.images, None)
    assert refused.value.param == "messages[0].content[0].source.url"
    result = {"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}
    with pytest.raises(APIError, match="images inside a tool_result are not read"):
        read_turn({"messages": [{"role": "user", "content": [result]}]})


def test_errors_take_anthropics_shape_and_type_by_status():
    types = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
    }
    for status, kind in types.items():
        body = error_body(APIError(status, f"failed with {status}"))
        assert body == {"type": "error", "error": {"type": kind, "message": f"failed with {status}"}}
        if status != 413:  # Anthropic's documented "request_too_large" is missing from its client's error types
            TypeAdapter(anthropic_types.ErrorResponse).validate_python(body)


# ---- the response ----


def reply(pieces, failure=None) -> Reply:
    return Reply("smollm2-135m", ScriptedAnswer(pieces, USAGE, failure))


def test_a_whole_message_lists_thinking_text_and_tool_use_blocks():
    message = asyncio.run(reply(THOUGHT_ANSWER_AND_CALL).whole())
    anthropic_types.Message.model_validate(message)
    assert message["id"].startswith("msg_")
    assert (message["type"], message["role"], message["model"]) == ("message", "assistant", "smollm2-135m")
    thinking, answer, tool_use = message["content"]
    assert thinking == {"type": "thinking", "thinking": "Thinking.", "signature": ""}
    assert answer == {"type": "text", "text": "Let me check."}
    assert tool_use["id"].startswith("toolu_")
    assert tool_use | {"id": ""} == {"type": "tool_use", "id": "", "name": "get_weather", "input": {"city": "Paris"}}
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    assert message["usage"] == {
        "input_tokens": 8,
        "output_tokens": 7,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    }


@pytest.mark.parametrize(
    "pieces, stop_reason, stop_sequence, content",
    [
        (text("content", "Hi") + end("stop"), "end_turn", None, [{"type": "text", "text": "Hi"}]),
        (text("content", "Hi") + end("stop", "END"), "stop_sequence", "END", [{"type": "text", "text": "Hi"}]),
        (text("content", "Once") + end("length"), "max_tokens", None, [{"type": "text", "text": "Once"}]),
        (end("stop"), "end_turn", None, [{"type": "text", "text": ""}]),
    ],
)
def test_stop_reasons(pieces, stop_reason, stop_sequence, content):
    message = asyncio.run(reply(pieces).whole())
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)
    assert message["content"] == content


def test_a_call_cut_off_inside_its_arguments_has_an_empty_input():
    message = asyncio.run(reply(call(0, "c", "get_weather", '{"city": "Pa') + end("length")).whole())
    assert message["content"][0]["input"] == {} and message["stop_reason"] == "max_tokens"


def test_the_event_stream_adds_up_to_the_whole_message():
    events = collect(reply(THOUGHT_ANSWER_AND_CALL).events())
    adapter = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    started = events[0]["message"]
    assert started["content"] == [] and started["stop_reason"] is None and started["usage"]["input_tokens"] == 8
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[1] == {"type": "text", "text": ""}
    assert starts[2]["name"] == "get_weather" and starts[2]["input"] == {} and starts[2]["id"].startswith("toolu_")
    assert "".join(e["delta"]["text"] for e in events[7:9]) == "Let me check."
    assert "".join(e["delta"]["partial_json"] for e in events[11:13]) == '{"city": "Paris"}'
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 7}


def test_a_generation_failing_midway_ends_the_stream_with_an_error_event():
    failure = APIError(500, "generation failed: boom", code="engine_error", kind="server_error")
    events = collect(reply(text("content", "Hel"), failure).events())
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1]["error"] == {"type": "api_error", "message": "generation failed: boom"}


# ---- end to end: the official anthropic client against `minimlx serve` ----

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(served):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=served.url, api_key="x", timeout=60, max_retries=0)


@pytest.mark.slow
def test_a_streamed_message_equals_the_whole_one_and_count_tokens_agrees(served):
    messages = client(served).messages
    greedy = {"temperature": 0}  # a field the client no longer takes, so sent as it is
    request = dict(model="smollm2-135m", system="Answer briefly.", messages=QUESTION, max_tokens=24, extra_body=greedy)
    whole = messages.create(**request)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and 0 < whole.usage.output_tokens <= 24
    with messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    counted = messages.count_tokens(model="smollm2-135m", system="Answer briefly.", messages=QUESTION)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_matches_its_schema_and_its_result_is_answered(served, stream):
    jsonschema = pytest.importorskip("jsonschema")
    messages = client(served).messages
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = dict(
        model="smollm2-135m",
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=60,
        extra_body={"temperature": 0},
    )
    if stream:
        with messages.stream(**request) as streaming:
            message = streaming.get_final_message()
    else:
        message = messages.create(**request)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    assert message.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 25 C"}
    history = ask + [{"role": "assistant", "content": message.content}, {"role": "user", "content": [result]}]
    answer = messages.create(model="smollm2-135m", messages=history, tools=[WEATHER], max_tokens=30)
    assert answer.content[0].type == "text" and answer.content[0].text


@pytest.mark.slow
def test_bad_requests_are_anthropic_errors(served):
    anthropic = pytest.importorskip("anthropic")
    messages = client(served).messages
    unknown_tool = {"type": "tool", "name": "x"}
    bad_requests = [
        (dict(messages=[{"role": "user", "content": [IMAGE, {"type": "text", "text": "What?"}]}]), "image input"),
        (dict(messages=QUESTION, extra_body={"temperature": 1.5}), "'temperature' must be from 0 to 1"),
        (dict(messages=QUESTION, tools=[WEATHER], tool_choice=unknown_tool), "'tool_choice' names 'x'"),
    ]
    for request, message in bad_requests:
        with pytest.raises(anthropic.BadRequestError) as refused:
            messages.create(model="smollm2-135m", max_tokens=5, **request)
        body = refused.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(message)
    status, body = served.post("/v1/messages", {"messages": QUESTION})
    assert (status, body["error"]["type"]) == (400, "invalid_request_error")
    assert body["error"]["message"].startswith("'max_tokens' is required")
    status, body = served.post("/v1/messages/nothing", {})
    assert (status, body["type"], body["error"]["type"]) == (404, "error", "not_found_error")
