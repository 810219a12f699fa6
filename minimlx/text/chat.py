"""Chat templates rendered the way Hugging Face transformers renders them.

Templates are Jinja written for transformers' sandbox: `trim_blocks`/`lstrip_blocks`, a `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`, loop controls and `{% generation %}` blocks.
"""

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidSettingError


class GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment.from_string(source)


def render_chat(
    source: str, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None, **variables
) -> str:
    """The prompt text for `messages`, with `tools` and other template variables (bos_token, eos_token, the
    request's chat_template_kwargs such as enable_thinking) passed as transformers passes them."""
    try:
        return compile_template(source).render(
            **{"documents": None, **variables},
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as error:  # a template is a program: any error in it is the template's, not minimlx's
        reason = " ".join(str(error).split())
        reason = reason if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {reason}"
        raise InvalidSettingError(
            f"The model's chat template failed: {reason}; check the messages' roles and order, "
            "or pass --no-chat-template to send the prompt as raw text"
        ) from None


def chat_messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped messages as templates read them (transformers' chat format): a call's `function.arguments`
    JSON text parsed into an object, a tool-calling message's missing content as "", `reasoning_content` also as
    `thinking` (gpt-oss's name for it), and a tool result's `name` taken from the call it answers."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InvalidSettingError('The messages must be a list of objects, such as {"role": "user", "content": ...}')
    converted, names = [], {}
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise InvalidSettingError("A message's tool_calls must be a list of calls")
            message["tool_calls"] = [template_call(call) for call in message["tool_calls"]]
            names.update(
                (call["id"], call["function"]["name"])
                for call in message["tool_calls"]
                if isinstance(call.get("id"), str)
            )
            message["content"] = message.get("content") or ""
        if message.get("reasoning_content") is not None:
            message.setdefault("thinking", message["reasoning_content"])
        call_id = message.get("tool_call_id")
        if message.get("role") == "tool" and "name" not in message and isinstance(call_id, str) and call_id in names:
            message["name"] = names[call_id]
        converted.append(message)
    return converted


def template_call(call: dict) -> dict:
    """One OpenAI tool call with its arguments as an object rather than JSON text. A call marked
    `"status": "incomplete"` (cut by the answer's token limit, as the Responses API sends it back) keeps the text
    that was written: templates write a string of arguments as it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidSettingError(
            'A tool call has no function name; write each call as {"type": "function", "function": '
            '{"name": ..., "arguments": "{...}"}}'
        )
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            if call.get("status") == "incomplete":
                return call
            arguments = None
    if not isinstance(arguments, dict):
        raise InvalidSettingError(
            f"The arguments of the call to {function['name']} are not a JSON object; send them as JSON text "
            'of an object, such as "{\\"city\\": \\"Paris\\"}"'
        )
    return {**call, "function": {**function, "arguments": arguments}}
