"""Claude Code and Codex CLI themselves (the two newest releases of each, pinned in tests/agents/package.json and
installed by `npm ci` there) complete their turns against `minimlx serve`, set up as docs/serve.md says.

The model is the agents' test model (tests/agent_model.py), whose answers are short and end by themselves; the
server's `--max-tokens` bounds them with room to spare, since both agents fail a turn whose answer was cut; the plain
turns' streams carry keep-alives (Anthropic's ping events, comments in OpenAI's) while the prompt is read. Each agent
talks to the server through a recording proxy that passes every byte on unchanged, so that a test can check that what
the agent printed is the text the server sent. A tool turn uses the server's `--force-tool-call`: the agent runs the
call (a shell command writing proof.txt in the agent's working directory), sends back its result, and prints the
server's answer to it.
"""

import json

import pytest
from agent_clients import (
    RecordingProxy,
    anthropic_text,
    anthropic_tool_uses,
    claude_code,
    codex,
    install_agents,
    pinned,
    responses_output,
    responses_text,
)
from agent_model import agent_model
from servers import Served

pytestmark = pytest.mark.slow

MAX_TOKENS = "64"  # an answer ends by itself within 64 tokens but for 0.85**64 = 3e-5 of them (agent_model.py)
HELLO = "Reply with the word hello."
PROOF = "Write the proof file."
BASH_CALL = {"command": "echo minimlx > proof.txt", "description": "write a proof file"}  # Claude Code's shell tool
EXEC_CALL = {"cmd": "echo minimlx > proof.txt"}  # Codex's


def serve(*args: str):
    install_agents()
    server = Served("--model", str(agent_model()), "--max-tokens", MAX_TOKENS, *args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server():
    """A server whose streams send keep-alives while the prompt is read (a long prompt's, shortened to 10 ms here)."""
    yield from serve("--heartbeat", "0.01")


@pytest.fixture(scope="module")
def bash_server():
    yield from serve("--force-tool-call", f"Bash={json.dumps(BASH_CALL)}")


@pytest.fixture(scope="module")
def exec_server():
    yield from serve("--force-tool-call", f"exec_command={json.dumps(EXEC_CALL)}")


@pytest.fixture
def workdir(tmp_path):
    """The agent's working directory (its home folders go beside it)."""
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def assert_ran(done, agent: str) -> None:
    assert done.returncode == 0, f"{agent} exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def assert_answered(proxy: RecordingProxy, path: str) -> None:
    statuses = [(e.path, e.status) for e in proxy.exchanges]
    assert proxy.posts(path) and all(status == 200 for _, status in statuses), statuses


def assert_wrote_the_proof(workdir, proxy: RecordingProxy) -> None:
    proof = workdir / "proof.txt"
    answers = [e.answer.decode()[-600:] for e in proxy.exchanges]
    assert proof.is_file() and proof.read_text() == "minimlx\n", f"the call did not run; the server sent: {answers}"


def result_event(done) -> dict:
    """Claude Code's last JSON line: the result event of --output-format json (its only line) or stream-json."""
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and result["subtype"] == "success" and result["is_error"] is False, result
    return result


@pytest.mark.parametrize("version", pinned("claude-code"))
@pytest.mark.parametrize("output", [["json"], ["stream-json", "--verbose"]], ids=["json", "stream-json"])
def test_claude_code_prints_the_servers_answer(server, workdir, version, output):
    with RecordingProxy(server.url) as proxy:
        done = claude_code(version, proxy.url, workdir, "-p", HELLO, "--output-format", output[0], *output[1:])
    assert_ran(done, f"Claude Code {version}")
    assert_answered(proxy, "/v1/messages")
    answer = proxy.posts("/v1/messages")[-1]
    assert b"event: ping\n" in answer.answer
    assert result_event(done)["result"] == anthropic_text(answer)
    if output[0] == "stream-json":  # the assistant's message event carries the same text
        events = [json.loads(line) for line in done.stdout.splitlines()]
        said = [b["text"] for e in events if e["type"] == "assistant" for b in e["message"]["content"] if "text" in b]
        assert "".join(said) == events[-1]["result"]


@pytest.mark.parametrize("version", pinned("codex"))
def test_codex_prints_the_servers_answer(server, workdir, version):
    with RecordingProxy(server.url) as proxy:
        done = codex(version, proxy.url, workdir, HELLO)
    assert_ran(done, f"Codex {version}")
    assert_answered(proxy, "/v1/responses")
    answer = proxy.posts("/v1/responses")[-1]
    assert b"\n: keep-alive\n" in answer.answer
    assert done.stdout.strip() == responses_text(answer).strip()


@pytest.mark.parametrize("version", pinned("claude-code"))
def test_claude_code_runs_a_tool_call_and_the_server_answers_its_result(bash_server, workdir, version):
    with RecordingProxy(bash_server.url) as proxy:
        done = claude_code(
            version, proxy.url, workdir, "-p", PROOF, "--output-format", "json", "--allowedTools", "Bash"
        )
    assert_ran(done, f"Claude Code {version}")
    assert_answered(proxy, "/v1/messages")
    assert_wrote_the_proof(workdir, proxy)
    exchanges = proxy.posts("/v1/messages")
    # the forced call, once
    [use] = [use for e in exchanges for use in anthropic_tool_uses(e)]
    assert use in anthropic_tool_uses(exchanges[0]) and use["name"] == "Bash" and use["input"] == BASH_CALL
    answer = exchanges[-1]  # after an empty answer, Claude Code asks again with a reminder
    [sent_back] = [b for b in answer.request()["messages"][-1]["content"] if b["type"] == "tool_result"]
    assert sent_back["tool_use_id"] == use["id"] and sent_back["is_error"] is False
    assert result_event(done)["result"] == anthropic_text(answer)


@pytest.mark.parametrize("version", pinned("codex"))
def test_codex_runs_a_tool_call_and_the_server_answers_its_result(exec_server, workdir, version):
    with RecordingProxy(exec_server.url) as proxy:  # no sandbox: bubblewrap needs user namespaces, which CI may lack
        done = codex(
            version, proxy.url, workdir, "--dangerously-bypass-approvals-and-sandbox", "-C", str(workdir), PROOF
        )
    assert_ran(done, f"Codex {version}")
    assert_answered(proxy, "/v1/responses")
    assert_wrote_the_proof(workdir, proxy)
    exchanges = proxy.posts("/v1/responses")
    # the forced call, once
    [item] = [i for e in exchanges for i in responses_output(e) if i["type"] == "function_call"]
    assert item in responses_output(exchanges[0]) and item["name"] == "exec_command"
    assert json.loads(item["arguments"]) == EXEC_CALL
    answer = exchanges[-1]
    [sent_back] = [i for i in answer.request()["input"] if i["type"] == "function_call_output"]
    assert sent_back["call_id"] == item["call_id"] and "Process exited with code 0" in sent_back["output"]
    assert done.stdout.strip() == responses_text(answer).strip()
