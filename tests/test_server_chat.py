"""`minimlx serve` as clients see it: a real server process on a free port, the official `openai` client.

SmolLM2 answers, streams and reuses a conversation's cached prefix; every bad request gets its status and
an OpenAI-style error body; a client that disconnects frees its slot; a tiny random model takes 700
requests (sequential and from 16 clients at once) with no error and flat memory.
"""

import collections
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlx_lm_reference import save_hf_model
from models import smollm2_path
from reference import require
from servers import QUESTION, Served

from minimlx.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2_server():
    smollm2_path()
    server = Served("--max-batch", "1", "--max-queue", "1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer():
    path = smollm2_path()
    import mlx.core as mx

    return Tokenizer.from_gguf(mx.load(str(path), return_metadata=True)[1])


@pytest.mark.slow
def test_chat_answers_paris_with_the_tokenizers_counts(smollm2_server, tokenizer):
    reply = smollm2_server.client().chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0)
    answer = reply.choices[0].message.content
    assert "Paris" in answer and reply.choices[0].finish_reason == "stop"
    prompt = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(tokenizer.encode(answer, add_special_tokens=False))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.slow
def test_streamed_deltas_make_the_whole_answer(smollm2_server):
    client = smollm2_server.client()
    whole = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=QUESTION,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_a_resent_conversation_reuses_its_cached_prefix(smollm2_server):
    client = smollm2_server.client()
    first = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0)
    turns = QUESTION + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Germany?"},
    ]
    second = client.chat.completions.create(model="smollm2-135m", messages=turns, temperature=0)
    assert "Berlin" in second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens


@pytest.mark.slow
def test_completions_and_models(smollm2_server):
    client = smollm2_server.client()
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]
    reply = client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


CHAT = "/v1/chat/completions"
BAD_REQUESTS = {
    "malformed_json": (CHAT, b'{"messages": [', 400, None),
    "not_an_object": (CHAT, [1, 2], 400, None),
    "empty_messages": (CHAT, {"messages": []}, 400, "messages"),
    "unknown_role": (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    "content_not_text": (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    "max_tokens_zero": (CHAT, {"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens_string": (CHAT, {"messages": QUESTION, "max_tokens": "10"}, 400, "max_tokens"),
    "temperature_too_high": (CHAT, {"messages": QUESTION, "temperature": 3}, 400, "temperature"),
    "temperature_not_a_number": (CHAT, {"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    "top_p_zero": (CHAT, {"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    "stream_not_bool": (CHAT, {"messages": QUESTION, "stream": "yes"}, 400, "stream"),
    "include_usage_null_unstreamed": (
        CHAT,
        {"messages": QUESTION, "stream_options": {"include_usage": None}},
        400,
        "include_usage",
    ),
    "prompt_longer_than_context": (CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    "completion_without_prompt": ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    "completion_ids_outside_the_vocabulary": (
        "/v1/completions",
        {"prompt": [1, 49152], "max_tokens": 3},
        400,
        "prompt",
    ),
    "json_nested_100000_deep": (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    "stop_list_of_numbers": (CHAT, {"messages": QUESTION, "stop": [1]}, 400, "stop"),
    "tools_not_a_list": (CHAT, {"messages": QUESTION, "tools": "weather"}, 400, "tools"),
    "tool_without_a_name": (
        CHAT,
        {"messages": QUESTION, "tools": [{"type": "function", "function": {}}]},
        400,
        "tools[0]",
    ),
    "tool_parameters_not_a_schema": (
        CHAT,
        {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
        400,
        "tools[0].parameters",
    ),
    "tool_choice_naming_no_tool": (
        CHAT,
        {
            "messages": QUESTION,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),
    "tool_choice_required_without_tools": (CHAT, {"messages": QUESTION, "tool_choice": "required"}, 400, "tool_choice"),
    "top_logprobs_above_20": (CHAT, {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "logit_bias_outside_the_vocabulary": (
        CHAT,
        {"messages": QUESTION, "logit_bias": {"99999999": 5}},
        400,
        "logit_bias",
    ),
    "logit_bias_not_a_number": (CHAT, {"messages": QUESTION, "logit_bias": {"5": "up"}}, 400, "logit_bias"),
    "n_above_max_batch": (CHAT, {"messages": QUESTION, "n": 2}, 400, "n"),
    "schema_nested_5000_deep": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
        + b'"json_schema": {"name": "deep", "schema": '
        + b'{"type": "array", "items": ' * 5000
        + b"{}"
        + b"}" * 5000
        + b"}}}",
        400,
        None,
    ),
    "two_grammars": (CHAT, {"messages": QUESTION, "regex": "a+", "grammar": 'root ::= "a"'}, 400, "grammar"),
    "invalid_gbnf": (CHAT, {"messages": QUESTION, "grammar": "root ::= this is (not valid GBNF"}, 400, "grammar"),
    "messages_200000": (CHAT, {"messages": [{"role": "user", "content": ""}] * 200_000}, 400, "messages"),
    "stop_10000_strings": (CHAT, {"messages": QUESTION, "stop": ["x"] * 10_000}, 400, "stop"),
    "tools_200": (
        CHAT,
        {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}] * 200},
        400,
        "tools",
    ),
    "schema_of_300_kb": (
        CHAT,
        {
            "messages": QUESTION,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": {"description": "x" * 300_000}},
            },
        },
        400,
        "response_format",
    ),
    "user_not_a_string": (CHAT, {"messages": QUESTION, "user": 5}, 400, "user"),
    "metadata_not_an_object": (CHAT, {"messages": QUESTION, "metadata": "tag"}, 400, "metadata"),
    "audio_not_an_object": (CHAT, {"messages": QUESTION, "audio": "wav"}, 400, "audio"),
    "modalities_not_a_list": (CHAT, {"messages": QUESTION, "modalities": "text"}, 400, "modalities"),
    "presence_penalty_not_a_number": (
        CHAT,
        {"messages": QUESTION, "presence_penalty": "high"},
        400,
        "presence_penalty",
    ),
    "completion_echo_not_a_flag": ("/v1/completions", {"prompt": "w3", "echo": "yes"}, 400, "echo"),
    "prompt_cache_key_not_a_string": (CHAT, {"messages": QUESTION, "prompt_cache_key": 5}, 400, "prompt_cache_key"),
    "max_output_tokens_zero": ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    "llamacpp_extension_wrong_type": (CHAT, {"messages": QUESTION, "cache_prompt": "yes"}, 400, "cache_prompt"),
    "format_and_grammar": (
        CHAT,
        {"messages": QUESTION, "response_format": {"type": "json_object"}, "regex": "a+"},
        400,
        "response_format",
    ),
    "an_image": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        400,
        "messages[0].content[0].image_url.url",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_an_openai_error(smollm2_server, case):
    path, body, status, param = BAD_REQUESTS[case]
    started = time.monotonic()
    code, reply = smollm2_server.post(path, body)
    assert time.monotonic() - started < 1.0
    assert code == status
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["message"]
    assert reply["error"]["param"] == param


@pytest.mark.slow
def test_a_disconnected_stream_frees_its_slot_and_a_full_queue_answers_429(smollm2_server):
    """One slot and one queue place: a long stream holds the slot, one request waits, the next is refused;
    closing the stream lets the waiting request through."""
    client = smollm2_server.client()
    long = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=2000,
        logit_bias={"2": -100},  # SmolLM2's end of turn, <|im_end|>: the story goes on while the test runs
        stream=True,
    )
    next(iter(long))
    smollm2_server.wait_for(running=1, waiting=0)  # the stream has left the queue for the slot
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            client.chat.completions.create, model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=8
        )
        smollm2_server.wait_for(running=1, waiting=1)
        code, reply = smollm2_server.post(CHAT, {"messages": QUESTION, "max_tokens": 8})
        assert code == 429 and reply["error"]["code"] == "rate_limit_exceeded"
        long.close()
        assert "Paris" in waiting.result(timeout=60).choices[0].message.content


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model(folder, "llama")
    server = Served("--model", str(folder), "--max-batch", "8", "--api-key", "secret")
    yield server
    server.stop()


@pytest.mark.slow
def test_the_api_key_is_required(tiny_server):
    openai = require("openai")
    with pytest.raises(openai.AuthenticationError):
        tiny_server.client("wrong").completions.create(model="x", prompt="w3", max_tokens=1)
    code, reply = tiny_server.post("/v1/completions", {"prompt": "w3 w4", "max_tokens": 1})
    assert code == 401 and reply["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_many_requests_no_errors_and_flat_memory(tiny_server):
    """500 requests from 16 clients: a third are streams cut off after their first event, a tenth bad bodies, the
    rest whole answers. No 5xx, every bad one a 400 with an OpenAI body, and the server's RSS at the end within
    10% of its RSS after the first 20."""
    import http.client

    psutil = require("psutil")

    def ask(i: int) -> int:
        if i % 10 == 1:  # bad
            body = {"prompt": "w3", "max_tokens": "two"}
        else:
            body = {"prompt": f"w{i % 90 + 3} w5 w{i % 7 + 9}", "max_tokens": 2 if i % 3 else 64, "temperature": 0.5}
        connection = http.client.HTTPConnection("127.0.0.1", tiny_server.port, timeout=60)
        headers = {"Content-Type": "application/json", "Authorization": "Bearer secret"}
        connection.request("POST", "/v1/completions", json.dumps(body | {"stream": i % 3 == 0}), headers)
        response = connection.getresponse()
        if i % 3 == 0 and response.status == 200:
            response.readline()  # the first event, then the client goes away mid-stream
        else:
            reply = json.loads(response.read())
            assert ("error" in reply) == (response.status != 200), reply
        connection.close()
        return response.status

    server = psutil.Process(tiny_server.process.pid)
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(ask, range(20)))
        after_20 = server.memory_info().rss
        statuses += pool.map(ask, range(20, 500))
    tiny_server.wait_for(running=0, waiting=0)
    assert collections.Counter(statuses) == {200: 450, 400: 50}
    assert server.memory_info().rss <= 1.1 * after_20, (after_20, server.memory_info().rss)


@pytest.mark.slow
def test_an_idle_connection_outlives_the_clients_pool_expiry(tiny_server):
    """httpx drops pooled connections after 5 s idle: the server must not close them first, or a client
    reusing one at that moment gets "Server disconnected without sending a response"."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", tiny_server.port, timeout=30)
    try:
        for pause in (0, 6):
            time.sleep(pause)
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())
    finally:
        connection.close()


def test_an_address_in_use_is_refused_before_loading(tmp_path):
    import socket

    from click.testing import CliRunner

    from minimlx.cli import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--port", str(port), "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        result.stderr.strip()
        == f"error: cannot listen on 127.0.0.1:{port} (Address already in use); pick another --port or --host"
    )


WRONG_TYPES = {  # every field a chat body may carry, given a value of the wrong type
    "messages": 5,
    "max_tokens": "9",
    "max_completion_tokens": "9",
    "temperature": "hot",
    "top_p": [],
    "top_k": 0.5,
    "min_p": "x",
    "seed": "x",
    "stop": 5,
    "n": "2",
    "logit_bias": [],
    "logprobs": "yes",
    "top_logprobs": "5",
    "stream": "yes",
    "stream_options": 5,
    "tools": {},
    "tool_choice": 5,
    "parallel_tool_calls": "no",
    "response_format": "json",
    "chat_template_kwargs": [],
    "regex": 5,
    "grammar": 5,
    "lark_grammar": 5,
    "json_schema": 5,
    "user": 5,
    "metadata": "x",
    "store": "x",
    "cache_prompt": "x",
}


@pytest.mark.slow
def test_hostile_requests_are_4xx_in_time_and_leave_memory_as_it_was(smollm2_server):
    """A 100 MB body, JSON nested 100,000 deep, 200,000 messages, a schema nested 5,000 deep, 10,000 stop strings
    and every field given a wrong type: each a 4xx with an OpenAI error body within 2 s, and the server's RSS
    afterwards within 10% of its RSS before them."""
    import http.client

    psutil = require("psutil")
    server = psutil.Process(smollm2_server.process.pid)
    smollm2_server.post(CHAT, {"messages": QUESTION, "max_tokens": 2})  # warm
    before = server.memory_info().rss
    bodies = [BAD_REQUESTS[case][1] for case in ("json_nested_100000_deep", "messages_200000", "stop_10000_strings")]
    bodies += [BAD_REQUESTS["schema_nested_5000_deep"][1]]
    bodies += [{"messages": QUESTION, name: value} for name, value in WRONG_TYPES.items() if name != "messages"]
    bodies += [{"messages": WRONG_TYPES["messages"]}]
    for body in bodies:
        started = time.monotonic()
        code, reply = smollm2_server.post(CHAT, body)
        assert 400 <= code < 500 and time.monotonic() - started < 2, (code, str(body)[:80])
        assert set(reply["error"]) == {"message", "type", "param", "code"}
    connection = http.client.HTTPConnection("127.0.0.1", smollm2_server.port, timeout=10)
    connection.putrequest("POST", CHAT)
    connection.putheader("Content-Length", str(100_000_000))
    connection.endheaders(b"{" * 1000)
    assert connection.getresponse().status == 413
    connection.close()
    assert server.memory_info().rss <= 1.1 * before, (before, server.memory_info().rss)


@pytest.mark.slow
def test_a_body_over_the_limit_is_refused_from_its_length_before_it_is_read(smollm2_server):
    """A client announcing 100 MB gets a 413 with an OpenAI body at once, having sent a few bytes of it."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", smollm2_server.port, timeout=10)
    started = time.monotonic()
    connection.putrequest("POST", CHAT)
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(100_000_000))
    connection.endheaders(b'{"messages": [')
    response = connection.getresponse()
    reply = json.loads(response.read())
    connection.close()
    assert response.status == 413 and time.monotonic() - started < 2
    assert set(reply["error"]) == {"message", "type", "param", "code"} and "8 MB" in reply["error"]["message"]


@pytest.mark.slow
def test_a_grammar_over_a_tokenizer_llguidance_cannot_read_is_a_400(tiny_server):
    """The tiny model's word-level vocabulary has no byte-level or SentencePiece decoder to map ids to bytes."""
    headers = {"Authorization": "Bearer secret"}
    code, reply = tiny_server.post("/v1/completions", {"prompt": "w3 w4", "regex": "w[0-9]"}, headers)
    assert code == 400 and "cannot be constrained by a grammar" in reply["error"]["message"]


@pytest.mark.slow
def test_a_request_refused_after_its_prompt_was_read_leaves_nothing_running(smollm2_server):
    """A bad field read last (`stream`) is refused before anything starts: no generation runs on for nobody."""
    code, _ = smollm2_server.post(CHAT, {"messages": QUESTION, "stream": "yes"})
    assert code == 400
    smollm2_server.wait_for(running=0, waiting=0, seconds=5)


LONG_STORY = {
    "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    "max_tokens": 2000,
    "logit_bias": {"2": -100},  # SmolLM2's <|im_end|>: the story goes on past any test's patience
    "stream": True,
}


def stream_lines(server: Served, body: dict):
    """The open response of a streaming POST, read line by line."""
    request = urllib.request.Request(f"{server.url}{CHAT}", data=json.dumps(body).encode())
    return urllib.request.urlopen(request, timeout=60)


@pytest.mark.slow
def test_health_answers_during_a_long_stream_which_the_request_timeout_ends():
    smollm2_path()
    server = Served("--request-timeout", "3")
    try:
        started = time.monotonic()
        with stream_lines(server, LONG_STORY) as stream:
            stream.readline()
            for _ in range(5):
                asked = time.monotonic()
                with urllib.request.urlopen(f"{server.url}/health", timeout=5) as health:
                    assert json.load(health) == {"status": "ok", "running": 1, "waiting": 0}
                assert time.monotonic() - asked < 0.5
            events = [json.loads(line[6:]) for line in stream if line.startswith(b"data: {")]
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"] and 3 <= time.monotonic() - started < 8
        assert len(events) < 1000  # ended by the clock, not by max_tokens
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_lets_a_running_stream_finish_refuses_new_requests_and_exits_0():
    import http.client
    import signal

    smollm2_path()
    server = Served("--shutdown-timeout", "30")
    late = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = json.dumps({"messages": QUESTION}).encode()
    with stream_lines(server, {**LONG_STORY, "max_tokens": 40}) as stream:
        stream.readline()
        # a request whose headers are in (so shutting down waits for it: an idle connection is closed at once)
        late.putrequest("POST", CHAT)
        late.putheader("Content-Length", str(len(body)))
        late.endheaders()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late.send(body)  # its body arrives once the server drains
        response = late.getresponse()
        assert (response.status, json.loads(response.read())["error"]["code"]) == (503, "shutting_down")
        events = [line for line in stream if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]\n" and b'"finish_reason": "length"' in events[-2]
    assert server.process.wait(timeout=30) == 0


@pytest.mark.slow
def test_sigint_ends_a_stream_at_the_shutdown_timeout_and_exits_0():
    import signal

    smollm2_path()
    server = Served("--shutdown-timeout", "2")
    with stream_lines(server, LONG_STORY) as stream:
        stream.readline()
        server.process.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        events = [line for line in stream if line.startswith(b"data: ")]
        assert 2 <= time.monotonic() - stopped < 5
    assert events[-1] == b"data: [DONE]\n" and b'"finish_reason": "length"' in events[-2]
    assert server.process.wait(timeout=30) == 0
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_a_public_host_without_an_api_key_warns(tmp_path):
    folder = tmp_path / "tiny"
    save_hf_model(folder, "llama")
    server = Served("--model", str(folder), "--host", "0.0.0.0")
    server.stop()
    assert server.log().count("without --api-key") == 1


@pytest.mark.slow
def test_llamacpps_extension_fields_are_accepted_and_ignored(smollm2_server):
    body = {"messages": QUESTION, "max_tokens": 2, "cache_prompt": True, "id_slot": 0, "timings_per_token": False}
    code, reply = smollm2_server.post(CHAT, body)
    assert code == 200 and reply["usage"]["completion_tokens"] == 2


def test_the_fields_ignored_and_refused_are_the_ones_serve_md_lists():
    import re
    from pathlib import Path

    from minimlx.server.fields import IGNORED
    from minimlx.server.responses import UNSTORED

    page = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    table = page.split("### Fields: honoured, ignored, refused")[1]
    rows = {"chat completions": "chat", "completions": "completions", "Responses": "responses", "Messages": "messages"}
    for title, api in rows.items():
        row = re.search(rf"^\| {title} \|(.*)\|(.*)\|(.*)\|$", table, re.M)
        ignored, refused = ({n for n in re.findall(r"`([a-z_]+)`", cell)} for cell in row.groups()[1:])
        assert ignored == set(IGNORED[api])
        assert refused == (set(UNSTORED) if api == "responses" else set())


def test_a_failure_in_one_requests_step_fails_it_alone(hf_folder, monkeypatch, caplog):
    """A sampler that raises for one request (seed 13): that request is a 500 in OpenAI's shape, logged; the one
    decoded beside it in the same batch answers."""
    from starlette.testclient import TestClient

    import minimlx
    from minimlx.decode import Engine
    from minimlx.decode.engine import Generation
    from minimlx.server.app import Server
    from minimlx.server.models import Models

    model, tokenizer = minimlx.load(hf_folder("llama"))
    sample = Generation.sample

    def failing(generation, logits, fed):
        if generation.request.settings.seed == 13 and generation.sampled == 3:
            raise RuntimeError("boom")
        return sample(generation, logits, fed)

    monkeypatch.setattr(Generation, "sample", failing)
    body = {"prompt": "w3 w4 w5", "max_tokens": 40, "temperature": 1.0}
    with TestClient(Server(Models.one(Engine(model, tokenizer, max_batch=4), "tiny")).app) as client:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda seed: client.post("/v1/completions", json={**body, "seed": seed}), [13, 1]))
    failed, answered = answers
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
    assert "RuntimeError: boom" in failed.json()["error"]["message"]
    assert answered.status_code == 200 and answered.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert any("a generation failed" in r.message for r in caplog.records)


def test_requests_sent_together_to_an_idle_server_prefill_as_one_group(hf_folder, monkeypatch):
    """Four requests sent at once reach the engine one by one; the idle server waits while they keep coming
    (`EngineBridge.gather`, its quiet time raised here so that a slow machine's gaps fit) and prefills them in one
    pass."""
    from starlette.testclient import TestClient

    import minimlx
    from minimlx.decode import Engine
    from minimlx.decode.runner import Runner
    from minimlx.server import app, bridge
    from minimlx.server.models import Models

    model, tokenizer = minimlx.load(hf_folder("llama"))
    monkeypatch.setattr(bridge, "GATHER_QUIET", 0.2)
    groups, together, alone = [], Runner.prefill_together, Runner.prefill_alone
    monkeypatch.setattr(Runner, "prefill_together", lambda self, g: groups.append(len(g)) or together(self, g))
    monkeypatch.setattr(Runner, "prefill_alone", lambda self, *a: groups.append(1) or alone(self, *a))
    body = {"prompt": "w3 w4 w5", "max_tokens": 4, "temperature": 0}
    with TestClient(app.Server(Models.one(Engine(model, tokenizer, max_batch=4), "tiny")).app) as client:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert groups == [4]


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, {"messages": QUESTION, "stream": "yes"}),
        (CHAT, {"messages": QUESTION, "stream": True, "stream_options": {"include_usage": "yes"}}),
        ("/v1/completions", {"prompt": "w3 w4", "stream": 1}),
        ("/v1/responses", {"input": "w3 w4", "stream": "yes"}),
        ("/v1/messages", {"messages": QUESTION, "max_tokens": 5, "stream": "yes"}),
    ],
)
def test_a_request_refused_starts_nothing(hf_folder, path, body):
    """Every field is read before a generation starts: a refused request leaves nothing behind (no generation
    in the engine, no listener left for one)."""
    from starlette.testclient import TestClient

    import minimlx
    from minimlx.decode import Engine
    from minimlx.server.app import Server
    from minimlx.server.models import Models, Serving

    engine = Engine(*minimlx.load(hf_folder("llama")), max_batch=4)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    server = Server(Models.one(engine, "tiny", Serving(chat_template=template)))
    with TestClient(server.app) as client:
        refusal = client.post(path, json={**body, "max_tokens": 200})
        assert refusal.status_code == 400 and ("stream" in refusal.text or "include_usage" in refusal.text)
        assert not engine.busy and server.listeners == {}
