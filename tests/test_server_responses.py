"""OpenAI's Responses API: request bodies read into Turns, scripted answers rendered as response objects and
events (no model), then the official `openai` client against a real `minimlx serve`."""

import asyncio
import json

import pytest
from pydantic import TypeAdapter
from scripted_answer import THOUGHT_ANSWER_AND_CALL, ScriptedAnswer, collect, end, text

from minimlx.decode.grammar import Constraint
from minimlx.server.fields import APIError
from minimlx.server.responses import Reply, read_request
from minimlx.server.turns import Usage

openai_types = pytest.importorskip("openai.types.responses")
USAGE = Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=4)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


# ---- the request ----


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    turn, echo, _ = read_request(
        {"input": "Hi", "instructions": "Be brief", "max_output_tokens": 9, "temperature": 0, "store": True}
    )
    assert turn.messages == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert turn.settings == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 9}
    assert (turn.tools, turn.tool_choice, turn.parallel_tool_calls, turn.constraint) == (None, "auto", True, None)
    assert echo["instructions"] == "Be brief" and echo["max_output_tokens"] == 9
    assert echo["text"] == {"format": {"type": "text"}} and echo["tools"] == [] and echo["metadata"] == {}


def test_input_items_become_chat_messages_with_tool_calls_and_results():
    arguments = '{"city": "Paris"}'
    turn, *_ = read_request(
        {
            "input": [
                {"role": "developer", "content": "Use tools"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                                {"type": "input_text", "text": "in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
                {"type": "function_call_output", "call_id": "call_2",
                 "output": [{"type": "input_text", "text": "Rain"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
            ]
        }
    )  # fmt: skip
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
    ]
    assert turn.messages == [
        {"role": "system", "content": "Use tools"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
        {"role": "assistant", "content": "Sunny."},
    ]


def test_a_reasoning_item_joins_the_assistant_message_after_it():
    turn, *_ = read_request(
        {
            "input": [
                {"role": "user", "content": "2+2?"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Add."}]},
                {"type": "message", "role": "assistant", "content": "4"},
            ]
        }
    )
    assert turn.messages[1:] == [{"role": "assistant", "content": "4", "reasoning_content": "Add."}]


def test_function_tools_tool_choice_and_text_format():
    turn, echo, _ = read_request(
        {
            "input": "Weather?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_object"}},
        }
    )
    parameters = WEATHER["parameters"]
    function = {"name": "get_weather", "description": "The weather in a city", "parameters": parameters, "strict": True}
    assert turn.tools == [{"type": "function", "function": function}]
    assert (turn.tool_choice, turn.parallel_tool_calls) == ("get_weather", False)
    assert turn.constraint == Constraint.json_object()
    assert echo["tools"] == [WEATHER] and echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    turn, *_ = read_request(
        {"input": "n?", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}}
    )
    assert turn.constraint == Constraint.json_schema(schema, True)
    for choice in ("auto", "none", "required"):
        assert read_request({"input": "x", "tool_choice": choice})[0].tool_choice == choice


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": {}, "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "message_of_another_kind", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "instructions": ["x"]}, "instructions"),
        ({"input": "x", "tools": [{"type": "robot"}]}, "tools[0]"),
        ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": {}}]}, "tools[0].tools"),
        ({"input": "x", "prompt_cache_key": 5}, "prompt_cache_key"),
        ({"input": "x", "reasoning": {"effort": 1}}, "reasoning.effort"),
        ({"input": "x", "client_metadata": "x"}, "client_metadata"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
        ({"input": "x", "tool_choice": "always"}, "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": "{}"}}}, "text.format.schema"),
        ({"input": "x", "text": "json"}, "text"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "max_output_tokens": "8"}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": "x"}] * 10_001}, "input"),
        ({"input": "x", "metadata": 5}, "metadata"),
        ({"input": "x", "store": "no"}, "store"),
        ({"input": "x", "background": "yes"}, "background"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}] * 129}, "tools"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as refused:
        read_request(body)
    assert (refused.value.status, refused.value.param) == (400, param)


# ---- the response ----


def reply(pieces, failure=None, echo=None) -> Reply:
    echo = echo or read_request({"input": "x", "tools": [WEATHER]})[1]
    return Reply("smollm2-135m", echo, ScriptedAnswer(pieces, USAGE, failure))


def test_a_whole_response_lists_reasoning_message_and_function_call_items():
    response = asyncio.run(reply(THOUGHT_ANSWER_AND_CALL).whole())
    parsed = openai_types.Response.model_validate(response)  # every field the official client requires
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert (response["status"], response["incomplete_details"]) == ("completed", None)
    assert response["model"] == "smollm2-135m"
    reasoning, message, function_call = response["output"]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["id"].startswith("msg_")
    assert (message["type"], message["status"], message["role"]) == ("message", "completed", "assistant")
    assert message["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": []}]
    assert function_call["id"].startswith("fc_")
    assert {k: function_call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call",
        "call_id": "call_9",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    assert parsed.output_text == "Let me check."
    assert response["usage"] == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 19,
    }
    assert response["tools"] == [WEATHER] and response["parallel_tool_calls"] is True


def test_an_answer_cut_at_max_output_tokens_is_incomplete_and_an_empty_one_still_has_a_message():
    response = asyncio.run(reply(text("content", "Once upon") + end("length")).whole())
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"][0]["text"] == "Once upon"
    response = asyncio.run(reply(end("stop")).whole())
    assert [item["type"] for item in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == ""


def test_the_event_stream_adds_up_to_the_whole_response():
    events = collect(reply(THOUGHT_ANSWER_AND_CALL).events())
    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    created, completed = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == completed["id"]
    whole = asyncio.run(reply(THOUGHT_ANSWER_AND_CALL).whole())
    assert [strip_ids(item) for item in completed["output"]] == [strip_ids(item) for item in whole["output"]]
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done_items == completed["output"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [item["status"] for item in added] == ["in_progress"] * 3 and added[2]["arguments"] == ""
    message_id = added[1]["id"]
    text_events = [e for e in events if e["type"].startswith(("response.output_text", "response.content_part"))]
    assert {e["item_id"] for e in text_events[2:-2]} == {message_id}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Let me check." == next(e["text"] for e in events if e["type"] == "response.output_text.done")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == '{"city": "Paris"}' == events[-3]["arguments"] and events[-3]["name"] == "get_weather"


def strip_ids(item: dict) -> dict:
    return {k: v for k, v in item.items() if k != "id"}


def test_a_generation_failing_midway_ends_the_stream_with_an_error_and_a_failed_response():
    failure = APIError(500, "generation failed: boom", code="engine_error", kind="server_error")
    events = collect(reply(text("content", "Hel"), failure).events())
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["message"] == "generation failed: boom" and events[-2]["code"] == "engine_error"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "generation failed: boom"}
    with pytest.raises(APIError):
        asyncio.run(reply(text("content", "Hel"), failure).whole())


# ---- end to end: the official openai client against `minimlx serve` ----

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_a_streamed_response_equals_the_whole_one(served):
    client = served.client()
    request = dict(model="smollm2-135m", input=QUESTION, instructions="Answer briefly.", max_output_tokens=24)
    whole = client.responses.create(**request, temperature=0)
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_") and whole.output_text
    assert whole.status in ("completed", "incomplete") and whole.model == "smollm2-135m"
    assert 0 < whole.usage.output_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = list(client.responses.create(**request, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**request, temperature=0) as accumulated:  # the client's own event accumulator
        final = list(accumulated)[-1]  # response.incomplete when cut: get_final_response() waits for completed only
    assert final.type == f"response.{whole.status}" and final.response.output_text == whole.output_text


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_matches_its_schema_and_its_output_is_answered(served, stream):
    jsonschema = pytest.importorskip("jsonschema")
    client = served.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = "required" if stream else {"type": "function", "name": "get_weather"}
    request = dict(input=ask, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, temperature=0)
    if stream:
        events = list(client.responses.create(**request, max_output_tokens=60, stream=True))
        response = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == response.output[-1].arguments
    else:
        response = client.responses.create(**request, max_output_tokens=60)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 25 C"}
    call = calls[0].model_dump(include={"type", "call_id", "name", "arguments"})
    answer = client.responses.create(input=ask + [call, result], tools=[WEATHER], max_output_tokens=30, temperature=0)
    assert answer.output_text


@pytest.mark.slow
def test_a_json_schema_format_is_followed(served):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = served.client().responses.create(
        input="Name the capital of France as JSON.",
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.slow
def test_bad_requests_are_openai_errors(served):
    openai = pytest.importorskip("openai")
    client = served.client()
    bad_requests = [
        (dict(input=[{"type": "robot_call", "id": "msg_1"}]), "input[0].type"),
        (dict(input="x", previous_response_id="resp_1"), "previous_response_id"),
        (dict(input="x", tools=[{"type": "robot"}]), "tools[0]"),
        (dict(input="x", tool_choice={"type": "function", "name": "nowhere"}), "tool_choice"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {"type": 5}}}), None),
    ]
    for request, param in bad_requests:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**request, max_output_tokens=5)
        error = refused.value.body
        assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param
    status, body = served.post("/v1/responses", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
