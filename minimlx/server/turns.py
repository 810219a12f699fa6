"""One chat turn in the form every endpoint builds (chat completions, Responses, Messages), and what it yields.

An endpoint reads its own body into a `Turn`, hands it to `Server.start`, and renders the `Piece`s of the
returned `Answer` in its own shapes, whole or streamed. Templates, tool-call grammars, reasoning and tool-call
parsing, logprobs and usage are the same for all three.
"""

import json
import re
from dataclasses import dataclass, field, replace

from ..decode.grammar import Constraint
from ..errors import InvalidSettingError
from ..text.replies import Delta


@dataclass
class Turn:
    """A chat request, API-neutral.

    `messages` are OpenAI-shaped: role "system", "user", "assistant" or "tool"; `content` a string; an assistant's
    `tool_calls` as [{"id", "type": "function", "function": {"name", "arguments": JSON text}}] and its
    `reasoning_content`; a tool message's `tool_call_id`. `tools` are OpenAI function tools
    [{"type": "function", "function": {"name", "description", "parameters"}}]; `tool_choice` is "auto", "none",
    "required" or a tool's name. `constraint` is the answer's grammar (response_format, text.format);
    `settings` the SamplingSettings fields (max_tokens, temperature, top_p, top_k, seed, stop, logit_bias);
    `logprobs` None (none) or how many alternatives to report beside each token's own (0-20);
    `template_kwargs` extra chat-template variables (enable_thinking, reasoning_effort, ...); `cache_key` the
    client's name for the conversation (`prompt_cache_key`), which the prompt cache keeps one entry of;
    `messages_param` the request field the messages came from, which errors about them name, and `params` the
    request field each setting came from where its name differs (Responses' max_output_tokens). `images` are the
    bytes of the messages' images (or the `images.ImageURL`s to fetch for them), in order, each one's place marked
    in its message's text (`images.IMAGE_PLACE`).
    """

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    constraint: Constraint | None = None
    settings: dict = field(default_factory=dict)
    logprobs: int | None = None
    template_kwargs: dict = field(default_factory=dict)
    n: int = 1
    cache_key: str | None = None
    messages_param: str = "messages"
    params: dict[str, str] = field(default_factory=dict)  # settings -> the request fields they came from
    images: list = field(default_factory=list)


@dataclass(frozen=True)
class ForcedCall:
    """A tool call the server makes the model write (`serve --force-tool-call NAME=JSON`, for testing agents with a
    model that would not call tools by itself): on a turn that `applies`, the answer is decoded under a grammar that
    allows exactly this call, whatever --max-tokens says (the call is the switch's own text)."""

    name: str
    arguments: dict

    @classmethod
    def parse(cls, spec: str) -> "ForcedCall":
        """NAME=JSON, the JSON an object of the call's arguments."""
        name, _, arguments = spec.partition("=")
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            value = None
        if not name or not isinstance(value, dict):
            raise InvalidSettingError(
                f"--force-tool-call takes NAME=JSON, the JSON an object of arguments, got {spec!r}; e.g. "
                '\'Bash={"command": "ls"}\''
            )
        return cls(name, value)

    def applies(self, turn: "Turn") -> bool:
        """Whether `turn` gets the call: its tools include NAME, its last message (system messages aside: Claude Code
        ends with one) is the user's, and no call was made yet (an agent that resends the conversation after the
        call's result, with a reminder of its own as a user message, gets an answer, not the call again)."""
        names = [tool["function"]["name"] for tool in turn.tools or ()]
        spoken = [m["role"] for m in turn.messages if m["role"] != "system"]
        called = any(m.get("tool_calls") for m in turn.messages) or "tool" in spoken
        return self.name in names and bool(spoken) and spoken[-1] == "user" and not called

    def applied(self, turn: "Turn") -> "Turn":
        """`turn` with this call forced, where it applies (else `turn` itself)."""
        if not self.applies(turn):
            return turn
        exact = {
            "type": "object",
            "properties": {key: {"const": value} for key, value in self.arguments.items()},
            "required": list(self.arguments),
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},  # exactly this text: no room for a model to ramble in
        }
        tool = {"type": "function", "function": {"name": self.name, "parameters": exact}}
        return replace(turn, tools=[tool], tool_choice=self.name, parallel_tool_calls=False)


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model, and the most likely alternatives at its place."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]  # (token, logprob, bytes), most likely first


@dataclass
class Piece:
    """What one generated token adds to choice `index`: its deltas (possibly none), its logprob when asked for,
    and `finish_reason` ("stop", "length" or "tool_calls") once the choice has ended; `stop_string` the stop
    string that ended it, if one did (Anthropic's stop_sequence names it)."""

    index: int
    deltas: list[Delta]
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    stop_string: str | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def check_tools(tools: list | None, choice: str) -> list[dict] | None:
    """The turn's function tools, checked: each {"type": "function", "function": {"name", "parameters"}} with a
    name of letters, digits, _ and - (at most 64) and parameters a JSON schema object; `choice` must name one."""
    from .fields import bad, check_schema_size

    if not tools:
        if choice not in ("auto", "none"):
            raise bad("tool_choice", f"'tool_choice' is {choice!r} but the request gives no tools")
        return None
    for i, tool in enumerate(tools):
        function = (
            tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        )
        name = function.get("name") if isinstance(function, dict) else None
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name)):
            raise bad(f"tools[{i}]", f"tools[{i}] must be a function tool with a name of letters, digits, _, . and -")
        if not isinstance(function.get("parameters", {}), dict):
            raise bad(f"tools[{i}].parameters", f"tools[{i}]'s parameters must be a JSON schema object")
        check_schema_size(function.get("parameters", {}), f"tools[{i}].parameters")
    names = [tool["function"]["name"] for tool in tools]
    if choice not in ("auto", "none", "required") and choice not in names:
        raise bad("tool_choice", f"'tool_choice' names {choice!r}, which is none of the tools ({', '.join(names)})")
    return tools
