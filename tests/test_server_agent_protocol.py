"""What coding agents and the official clients send `minimlx serve`, and what they need back, on the agents' test
model (tests/agent_model.py: 65,536 positions, answers that end by themselves).

Extra fields are ignored and named (log and header), known ones of the wrong type are a 400 naming them; a long
prompt's stream stays alive while it is read; a client that hangs up frees its row; answers are bounded by the room
left in the context, a cap stated; a Responses answer cut at its limit ends with response.incomplete and an
incomplete item, which the client may send back; every request leaves one log line.
"""

import json
import time
import urllib.request

import pytest
from agent_model import agent_model
from reference import require
from servers import Served

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server():
    served = Served("--model", str(agent_model()), "--max-batch", "4")
    yield served
    served.stop()


def health(server: Served) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
        return json.load(response)


def log_lines(server: Served, path: str) -> list[str]:
    return [line for line in server.log().splitlines() if f'"POST {path}' in line]


def test_the_openai_client_with_cache_key_effort_and_extras_is_answered_and_extras_named(server):
    openai = require("openai")
    client = server.client()
    extras = dict(store=False, metadata={"run": "1"}, user="u1", prompt_cache_key="session-1")
    reply = client.chat.completions.with_raw_response.create(
        model="local",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        reasoning_effort="low",
        extra_body={"frobnicate": 3},
        **extras,
    )
    assert reply.status_code == 200 and reply.parse().choices[0].finish_reason in ("stop", "length")
    assert set(reply.headers["x-minimlx-ignored"].split(", ")) == {"store", "metadata", "user", "frobnicate"}
    assert "ignoring the chat field 'frobnicate'" in server.log()
    responses = client.responses.with_raw_response.create(
        model="local", input="hi", max_output_tokens=8, reasoning={"effort": "low", "summary": "auto"}, **extras
    )
    assert responses.status_code == 200
    assert "reasoning.summary" in responses.headers["x-minimlx-ignored"]
    with pytest.raises(openai.BadRequestError) as refused:  # a known field of the wrong type is still a 400
        client.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}], store="no")
    assert refused.value.body["param"] == "store"


def test_the_anthropic_client_with_claude_codes_fields_is_answered(server):
    anthropic = require("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "Be brief."},  # Claude Code's mid-conversation system message
        {"role": "user", "content": "and again"},
    ]
    reply = client.messages.with_raw_response.create(
        model="local",
        max_tokens=8,
        messages=messages,
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "thinking": {"type": "adaptive"},
        },
        tools=[{"type": "web_search_20250305", "name": "web_search"}],
    )
    assert reply.status_code == 200 and reply.parse().stop_reason in ("end_turn", "max_tokens")
    ignored = set(reply.headers["x-minimlx-ignored"].split(", "))
    assert ignored == {"context_management", "tools[].type=web_search_20250305"}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="local", max_tokens=8, messages=messages, metadata="tag")
    assert "metadata" in str(refused.value)


def test_max_tokens_above_the_room_left_is_capped_and_said(server):
    code, reply = server.post("/v1/completions", {"prompt": "hello there", "max_tokens": 10**6, "temperature": 0})
    assert code == 200
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        json.dumps({"prompt": "hello there", "max_tokens": 10**6}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        room = 65_536 - len(json.load(response)["choices"][0]["text"]) * 0  # the header says the cap itself
        capped = int(response.headers["x-minimlx-max-tokens"])
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert capped == room - prompt_tokens
    assert f"max_tokens=1000000->{capped}" in log_lines(server, "/v1/completions")[-1]
    code, reply = server.post("/v1/completions", {"prompt": "w " * 65_540, "max_tokens": 4})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded" and reply["error"]["param"] == "prompt"


def test_a_responses_answer_cut_at_its_limit_is_incomplete_and_can_be_sent_back(server):
    require("openai")
    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = dict(model="local", input=ask, tools=[WEATHER], tool_choice="required", temperature=0)
    events = list(client.responses.create(**request, max_output_tokens=20, stream=True))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    item = final.response.output[-1]
    assert item.type == "function_call" and item.status == "incomplete"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"
    history = [*ask, item.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": item.call_id,
               "output": "the call was cut short"}]  # fmt: skip
    answer = client.responses.create(model="local", input=history, tools=[WEATHER], max_output_tokens=8)
    assert answer.status in ("completed", "incomplete")
    # without max_output_tokens the answer is not cut at a fixed default: it ends by itself (this model's answers do)
    free = client.responses.create(model="local", input="hi", temperature=1.0)
    assert free.status == "completed"


def test_chat_forced_call_cut_before_its_name_streams_no_raw_markup(server):
    client = server.client()
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    stream = client.chat.completions.create(
        model="local",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[tool],
        tool_choice="required",
        max_tokens=2,
        stream=True,
    )
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "<tool_call>" not in content


def prefilling_stream(server: Served, tokens: int, path: str = "/v1/messages"):
    """A streamed request to `path` whose prompt is about `tokens` long: the open response."""
    ask = [{"role": "user", "content": "w " * tokens}]
    body = {"model": "local", "stream": True} | (
        {"input": ask, "max_output_tokens": 4} if path == "/v1/responses" else {"messages": ask, "max_tokens": 4}
    )
    request = urllib.request.Request(
        f"{server.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=600)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
def test_a_30000_token_prompt_keeps_its_stream_alive(path):
    """While a 30,000-token prompt is read (a chunk a step, the event loop free), the stream sends a keep-alive
    whenever --heartbeat passes without an event: Anthropic's ping, a comment in OpenAI's streams. Measured between
    the lines that arrive; the heartbeat is short here because this model reads the prompt in seconds."""
    served = Served("--model", str(agent_model()), "--heartbeat", "0.25")
    try:
        started = time.monotonic()
        arrivals, lines = [], []
        with prefilling_stream(served, 30_000, path) as response:
            for line in response:
                arrivals.append(time.monotonic())
                lines.append(line.decode().strip())
    finally:
        served.stop()
    gaps = [b - a for a, b in zip([started, *arrivals], arrivals)]
    alive = "event: ping" if path == "/v1/messages" else ": keep-alive"
    assert alive in lines, f"the prompt took {arrivals[-1] - started:.1f} s with no keep-alive"
    assert max(gaps) <= 2.0, f"the stream was silent for {max(gaps):.1f} s"


def wait_for_running(server: Served, running: int, seconds: float) -> float:
    """Seconds until /health counts `running` answers; fails after `seconds`."""
    started = time.monotonic()
    while health(server)["running"] != running:
        if time.monotonic() - started > seconds:
            pytest.fail(f"/health still counts {health(server)['running']} running after {seconds} s")
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_client_hanging_up_mid_prefill_frees_its_row_and_the_retry_finds_its_prefix(server):
    with prefilling_stream(server, 20_000) as response:
        assert response.readline().startswith(b"event: message_start")
        wait_for_running(server, 1, 10)
        time.sleep(1.0)  # well inside the prefill
    assert wait_for_running(server, 0, 1.0) <= 1.0
    with prefilling_stream(server, 20_000) as response:  # the same request again: its fed prefix is cached
        response.read()
    line = log_lines(server, "/v1/messages")[-1]
    cached = int(line.split("cached=")[1].split()[0])
    assert cached > 0, line


def test_a_whole_answer_whose_client_hangs_up_is_cancelled(server):
    """Not streamed: the server notices the closed connection mid-prefill and cancels the answer within a step (the
    log line says 499, nginx's status for it)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"prompt": "w " * 30_000, "max_tokens": 2})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    wait_for_running(server, 1, 10)
    time.sleep(0.5)
    connection.close()
    assert wait_for_running(server, 0, 1.0) <= 1.0
    deadline = time.monotonic() + 10  # the line is written once the request is over
    while " 499 " not in log_lines(server, "/v1/completions")[-1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert '"POST /v1/completions HTTP/1.1" 499' in log_lines(server, "/v1/completions")[-1]


def test_fifty_hang_ups_leave_memory_flat(server):
    psutil = require("psutil")
    process = psutil.Process(server.process.pid)

    def hang_up():
        with prefilling_stream(server, 3_000) as response:
            response.readline()

    for _ in range(5):
        hang_up()
    wait_for_running(server, 0, 10)
    before = process.memory_info().rss
    for _ in range(50):
        hang_up()
    wait_for_running(server, 0, 10)
    after = process.memory_info().rss
    assert after - before < 100e6, f"resident memory grew {(after - before) / 1e6:.0f} MB over 50 hang-ups"


def test_every_request_leaves_one_log_line_with_its_figures(server):
    before = len(log_lines(server, "/v1/chat/completions"))
    code, _ = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    code_bad, _ = server.post("/v1/chat/completions", {"messages": "hi"})
    assert (code, code_bad) == (200, 400)
    deadline = time.monotonic() + 10  # a line is written once its response has gone out: a moment after the client
    while len(lines := log_lines(server, "/v1/chat/completions")[before:]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 2
    ok, bad = lines
    assert '"POST /v1/chat/completions HTTP/1.1" 200 prompt=' in ok
    for field in ("cached=", "generated=", "ttft=", "total="):
        assert field in ok
    assert " 400 " in bad and "error=" in bad and "messages" in bad


def test_json_log_lines_and_a_template_less_model_warns(tmp_path):
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(agent_model(), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    served = Served("--model", str(folder), "--log-format", "json")
    try:
        code, reply = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert code == 400 and "--chat-template" in reply["error"]["message"]
        ends = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens, which this random model favours
        done = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0, "logit_bias": ends})
        deadline = time.monotonic() + 10  # the line is written once the response has gone out
        while '"path": "/v1/completions"' not in served.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = served.log()
    finally:
        served.stop()
    assert "no chat template" in log and "--chat-template" in log.split("no chat template")[1].splitlines()[0]
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("path") == "/v1/completions"]
    assert access and access[-1]["status"] == 200 and access[-1]["generated_tokens"] >= 1, done
    assert {"prompt_tokens", "cached_tokens", "ttft_s", "total_s"} <= set(access[-1])
