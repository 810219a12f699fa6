"""How each family of chat templates writes tool calls and reasoning: the text that marks them, how to read calls
back from a reply as it streams, and an llguidance Lark grammar that forces a valid call.

A format is chosen from the template's own text, not the model's name. Calls are read by pure functions of the
text since the call's opening marker: `calls(text)` returns the calls seen so far, each `(name, arguments)` with
the arguments' compact JSON text as far as written, so that a longer text only ever extends them.
"""

import json
import re
import secrets
import string

from ..errors import InvalidSettingError

# A JSON string (possibly still unterminated) or a bracket: enough to find where an object or array ends.
JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\]]', re.DOTALL)
JSON_STRING_OR_SPACE = re.compile(r'("(?:[^"\\]|\\.)*"?)|\s+', re.DOTALL)
NAMED_OBJECT = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_end(text: str, start: int) -> int | None:
    """The index just after the JSON object or array that starts at `text[start:]`, None while it is unfinished."""
    depth = 0
    for token in JSON_TOKENS.finditer(text, start):
        if token[0] in "{[":
            depth += 1
        elif token[0] in "}]":
            depth -= 1
            if depth == 0:
                return token.end()
    return None


def compact(text: str) -> str:
    """JSON text without the whitespace between its tokens (a prefix of a value compacts to a prefix)."""
    return JSON_STRING_OR_SPACE.sub(lambda match: match[1] or "", text)


def compact_dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def skip(text: str, position: int, literal: str) -> int | None:
    """Where `literal` (after optional whitespace) ends in `text` from `position`; None while the text so far could
    still go on to it; `position` itself when it does not."""
    start = len(text) - len(text[position:].lstrip())
    if text.startswith(literal, start):
        return start + len(literal)
    return None if literal.startswith(text[start:]) else position


def json_call(text: str, start: int) -> tuple[tuple[str, str] | None, int | None]:
    """A call written as a JSON object with "name" and "arguments" (or "parameters") at `text[start:]`: the call as
    far as written (None until its name is known) and the index after the object (None while unfinished; with no
    call, the text is no such object)."""
    if text[start:].strip() and not text[start:].lstrip().startswith("{"):
        return None, start
    end = json_end(text, start)
    if head := NAMED_OBJECT.match(text, start):
        return (json.loads(head[1]), compact(text[head.end() : json_end(text, head.end())])), end
    if end is None:
        return None, None
    try:  # the keys in another order: read once whole
        value = json.loads(text[start:end])
        arguments = value.get("arguments", value.get("parameters"))
        return ((value["name"], compact_dumps(arguments)) if isinstance(value["name"], str) else None), end
    except (json.JSONDecodeError, AttributeError, KeyError):
        return None, end


def named_call(text: str, start: int, head: re.Pattern, tail: str):
    """A call written as a head naming it (`head`'s first group), its JSON arguments and `tail`, at `text[start:]`:
    the call as far as written (None until its head is whole) and the index after it (None while unfinished; just
    after the arguments when no `tail` follows them)."""
    match = head.match(text, start)
    if match is None:
        return None, None
    arguments_end = json_end(text, match.end())
    call = (match[1].strip(), compact(text[match.end() : arguments_end]))
    return call, (arguments_end and skip(text, arguments_end, tail))


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_function(tool) -> dict:
    """The `function` of one OpenAI-shaped tool, checked."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidSettingError(
            'A tool has no function name; write each tool as {"type": "function", "function": {"name": ..., '
            '"parameters": {...}}}'
        )
    return function


class ToolFormat:
    """The Hermes / Qwen shape, which the others vary: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    per call, and reasoning between `<think>` and `</think>`."""

    opens: tuple[str, ...] = ("<tool_call>",)  # text that starts a run of calls in a reply
    run_open, separator, run_close = "", "\n", ""  # around and between the calls of one run
    parallel = True  # whether the template writes several calls in one reply
    reasoning: dict[str, str] = {"<think>": "</think>"}  # marker opening reasoning -> the marker closing it
    dropped: tuple[str, ...] = ()  # markers between a reply's parts that carry no text

    def __init__(self, describes_tools: bool = True):
        self.describes_tools = describes_tools  # False: the template ignores `tools`, the system message lists them

    def calls(self, text: str) -> tuple[list[tuple[str, str]], int | None]:
        """The calls in `text` (which begins with one of `opens`) and where their run ends: None while it may go
        on; when no call was read, the text is not a call."""
        call, end = json_call(text, len("<tool_call>"))
        return ([call] if call else []), (end and skip(text, end, "</tool_call>"))

    def around_arguments(self, name: str) -> tuple[str, str]:
        """The text of a call to `name` before and after its JSON arguments."""
        return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', "}\n</tool_call>"

    def call_text(self, name: str, arguments: dict) -> str:
        before, after = self.around_arguments(name)
        return before + json.dumps(arguments, ensure_ascii=False) + after

    def call_lark(self, name: str, parameters: dict) -> str:
        before, after = self.around_arguments(name)
        return f"{lark_literal(before)} %json {json.dumps(parameters)} {lark_literal(after)}"

    def run_text(self, calls: list[dict]) -> str:
        """Calls (as `chat_messages_for_template` leaves them) as the model writes them."""
        texts = [self.call_text(call["function"]["name"], call["function"]["arguments"]) for call in calls]
        return self.run_open + self.separator.join(texts) + self.run_close

    def grammar(self, tools: list[dict], choice: str, parallel: bool = False) -> str:
        """A Lark grammar for exactly the calls `choice` allows: "required" (any of `tools`) or one tool's name;
        several calls in a row when `parallel` and the format has them. Tags are matched as text, also where the
        model's vocabulary holds them as special tokens; arguments follow each tool's `parameters` schema
        (llguidance writes an object's properties in the schema's order)."""
        functions = [tool_function(tool) for tool in tools]
        chosen = [f for f in functions if choice in ("required", f["name"])]
        if not chosen:
            names = ", ".join(f["name"] for f in functions) or "none"
            raise InvalidSettingError(
                f"tool_choice {choice!r} names no tool of the request (its tools: {names}); "
                'pass "required", "auto", "none" or one of their names'
            )
        calls = ["call: " + " | ".join(f"call_{k}" for k in range(len(chosen)))]
        calls += [
            f"call_{k}: {self.call_lark(f['name'], f.get('parameters') or {'type': 'object'})}"
            for k, f in enumerate(chosen)
        ]
        several = f"call ({lark_literal(self.separator)} call)*" if self.separator else "call+"
        run = [lark_literal(self.run_open), several if parallel and self.parallel else "call"]
        run = " ".join(part for part in [*run, lark_literal(self.run_close)] if part != '""')
        return "\n".join([f"start: {run}", *calls])

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def template_input(self, messages: list[dict], tools: list[dict] | None):
        """The messages and tools the template is given; a template that ignores tools gets them described in
        the system message, with the shape of a call."""
        if not tools or self.describes_tools:
            return messages, tools
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        example = self.run_open + self.call_text("tool_name", {"argument": "value"}) + self.run_close
        described = f"You can call these tools:\n{listed}\n\nTo call one, reply with:\n{example}"
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{described}".lstrip())
            return [first, *messages[1:]], None
        return [{"role": "system", "content": described}, *messages], None


class GenericFormat(ToolFormat):
    """For templates that know no tools: the Hermes shape, the tools described in the system message, and earlier
    calls and their results written into the messages' text."""

    def __init__(self):
        super().__init__(describes_tools=False)

    def template_input(self, messages, tools):
        written = []
        for message in messages:
            if message.get("tool_calls"):
                content = "\n".join(filter(None, [message.get("content"), self.run_text(message["tool_calls"])]))
                message = {"role": "assistant", "content": content}
            elif message.get("role") == "tool":
                message = {"role": "user", "content": f"<tool_response>\n{message.get('content')}\n</tool_response>"}
            written.append(message)
        return super().template_input(written, tools)


class LlamaFormat(ToolFormat):
    """Llama 3.x: one call per reply, `{"name": ..., "parameters": {...}}`, or after `<|python_tag|>`."""

    opens = ("<|python_tag|>", '{"name"')
    parallel = False

    def calls(self, text):
        call, end = json_call(text, skip(text, 0, "<|python_tag|>"))
        return ([call] if call else []), end

    def around_arguments(self, name):
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', "}"


class MistralFormat(ToolFormat):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 letters or digits>"}, ...]`."""

    opens = ("[TOOL_CALLS]",)
    run_open, separator, run_close = "[TOOL_CALLS][", ", ", "]"

    def calls(self, text):
        position = skip(text, len("[TOOL_CALLS]"), "[")
        if position is None or position == len("[TOOL_CALLS]"):
            return [], position
        calls = []
        while True:
            call, end = json_call(text, position)
            if call is None:  # unfinished, or the run stops before what is no call
                return calls, (end and position)
            calls.append(call)
            comma = end and skip(text, end, ",")
            if comma is None or comma == end:
                return calls, (comma and skip(text, end, "]"))
            position = comma

    def around_arguments(self, name):
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', f', "id": "{self.call_id()}"}}'

    def call_lark(self, name, parameters):
        before, _ = self.around_arguments(name)
        id_key, id_end = lark_literal(', "id": "'), lark_literal('"}')
        return f"{lark_literal(before)} %json {json.dumps(parameters)} {id_key} /[a-zA-Z0-9]{{9}}/ {id_end}"

    def call_id(self):
        """Mistral's templates accept only ids of 9 letters or digits."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class DeepSeekFormat(ToolFormat):
    """DeepSeek V3.1: `<｜tool▁calls▁begin｜>` then `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`
    per call, then `<｜tool▁calls▁end｜>`."""

    opens = ("<｜tool▁calls▁begin｜>",)
    run_open, separator, run_close = "<｜tool▁calls▁begin｜>", "", "<｜tool▁calls▁end｜>"
    head = re.compile(r"\s*<｜tool▁call▁begin｜>(.+?)<｜tool▁sep｜>", re.DOTALL)

    def calls(self, text):
        calls, position = [], len(self.run_open)
        while (end := skip(text, position, self.run_close)) == position:
            if skip(text, position, "<｜tool▁call▁begin｜>") == position:  # neither another call nor the run's end
                return calls, position
            call, end = named_call(text, position, self.head, "<｜tool▁call▁end｜>")
            if call is None or end is None:
                return calls + [call] * bool(call), None
            calls.append(call)
            position = end
        return calls, end

    def around_arguments(self, name):
        return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class HarmonyFormat(ToolFormat):
    """gpt-oss's harmony messages: reasoning in the analysis channel, a call as a commentary message to
    `functions.NAME` ending in `<|call|>`, one per reply; the header's other markers carry no text."""

    opens = ("<|channel|>commentary to=functions.", " to=functions.")
    parallel = False
    reasoning = {"<|channel|>analysis<|message|>": "<|end|>"}
    dropped = ("<|start|>assistant", "<|channel|>final<|message|>", "<|channel|>commentary<|message|>")
    dropped += ("<|end|>", "<|return|>")
    head = re.compile(r"(?:<\|channel\|>commentary)? to=functions\.([^\s<]+)(?:(?!<\|message\|>).)*<\|message\|>")

    def calls(self, text):
        call, end = named_call(text, 0, self.head, "<|call|>")
        return ([call] if call else []), end

    def around_arguments(self, name):
        return f" to=functions.{name}<|channel|>commentary json<|message|>", "<|call|>"


class GlmFormat(ToolFormat):
    """GLM-4.5/4.6: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>`,
    string values written bare, others as JSON (so a value that reads as JSON is taken as JSON)."""

    run_open = "\n"  # each call on a line of its own
    head = re.compile(r"<tool_call>([^\n<]+)(?=[\n<])")
    pair = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, text):
        head = self.head.match(text)
        if head is None:  # its name is still coming, or it is no call
            return [], (0 if re.search(r"[\n<]", text[len("<tool_call>") :]) else None)
        pairs, position = [], head.end()
        while pair := self.pair.match(text, position):
            pairs.append(f"{json.dumps(pair[1].strip(), ensure_ascii=False)}:{self.value(pair[2])}")
            position = pair.end()
        end = skip(text, position, "</tool_call>")
        if end == position and skip(text, position, "<arg_key>") != position:  # a pair is still coming
            end = None
        arguments = "{" + ",".join(pairs) + ("}" if end else "")
        return [(head[1].strip(), arguments)], end

    @staticmethod
    def value(text: str) -> str:
        try:
            return compact_dumps(json.loads(text))
        except json.JSONDecodeError:
            return json.dumps(text, ensure_ascii=False)

    def call_text(self, name, arguments):
        pairs = "".join(
            f"<arg_key>{key}</arg_key>\n<arg_value>"
            f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</arg_value>\n"
            for key, value in arguments.items()
        )
        return f"<tool_call>{name}\n{pairs}</tool_call>"

    def call_lark(self, name, parameters):
        required = set(parameters.get("required", ()))
        pairs = []
        for key, schema in (parameters.get("properties") or {}).items():
            value = "/[^<]*/" if schema.get("type") == "string" else f"%json {json.dumps(schema)}"
            opening, closing = lark_literal(f"<arg_key>{key}</arg_key>\n<arg_value>"), lark_literal("</arg_value>\n")
            pair = f"{opening} {value} {closing}"
            pairs.append(f"({pair})" + ("" if key in required else "?"))
        return " ".join([lark_literal(f"<tool_call>{name}\n"), *pairs, lark_literal("</tool_call>")])


def tool_format(template: str | None) -> ToolFormat:
    """The format `template` writes tool calls in, read from its text; templates that write none get the generic
    one."""
    if not template:
        return GenericFormat()
    describes_tools = re.search(r"\btools\b", template) is not None
    if "<|channel|>" in template and "functions." in template:
        return HarmonyFormat(describes_tools)
    if re.search(r"<｜tool▁call▁begin｜>'\s*\+\s*tool\['function'\]\['name'\]", template):
        return DeepSeekFormat(describes_tools)
    if "[TOOL_CALLS]" in template:
        return MistralFormat(describes_tools)
    if "<arg_key>" in template:
        return GlmFormat(describes_tools)
    if "<tool_call>" in template:
        return ToolFormat(describes_tools)
    if '"parameters": ' in template and "<|start_header_id|>" in template:
        return LlamaFormat(describes_tools)
    return GenericFormat()
