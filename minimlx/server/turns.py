"""One chat turn in the form every endpoint builds (chat completions, Responses, Messages), and what it yields.

An endpoint reads its own body into a `Turn`, hands it to `Server.start`, and renders the `Piece`s of the
returned `Answer` in its own shapes, whole or streamed. Templates, tool-call grammars, reasoning and tool-call
parsing, logprobs and usage are the same for all three.
"""

import re
from dataclasses import dataclass, field

from ..decode.grammar import Constraint
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
    `template_kwargs` extra chat-template variables (enable_thinking, ...).
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
