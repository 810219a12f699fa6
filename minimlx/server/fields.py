"""Reading request bodies: typed fields, refused with an APIError that each endpoint answers in its own shape."""

import json
import logging
import re

from starlette.responses import JSONResponse

from ..decode import SamplingSettings
from ..errors import InvalidSettingError

log = logging.getLogger("minimlx.serve")


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


def unsupported_image(param: str) -> APIError:
    return APIError(400, "image input is not supported by this model (it reads text only)", param, "unsupported_input")


# ---- reading a request body ----


class Body(dict):
    """A request's JSON object that remembers which fields were read, so that the fields no reader asked for (ones
    this server does not know) can be named: ignored, logged once and listed in the response's
    `x-minimlx-ignored` header (`ignore_unread`), as llama-server and vLLM ignore them."""

    def __init__(self, fields: dict):
        super().__init__(fields)
        self.read = set()
        self.ignored: list[str] = []  # what the answer's x-minimlx-ignored header names

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def __contains__(self, name):
        self.read.add(name)
        return super().__contains__(name)

    def ignore(self, name: str, api: str) -> None:
        """Note the field `name` as ignored: logged once per API and name, and named in the response header (cut
        short, and quoted as JSON unless plain: a hostile body's field names are anything, a header's are ASCII)."""
        name = (
            name[:MAX_NAME] if PLAIN_NAME.fullmatch(name[:MAX_NAME]) else json.dumps(name[:MAX_NAME])
        )  # ASCII, quoted
        if name not in self.ignored and len(self.ignored) < MAX_NAMED:
            self.ignored.append(name)
        if (api, name) not in LOGGED and len(LOGGED) < MAX_LOGGED:
            LOGGED.add((api, name))
            log.info("ignoring the %s field '%s' (not implemented by this server)", api, name)

    def headers(self) -> dict[str, str]:
        return {IGNORED_HEADER: ", ".join(self.ignored)} if self.ignored else {}


IGNORED_HEADER = "x-minimlx-ignored"
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\[\]=-]+")
MAX_NAME, MAX_NAMED, MAX_LOGGED = 64, 32, 1024  # a name's length, names in one header, distinct names ever logged
LOGGED: set[tuple[str, str]] = set()  # (api, field) pairs already logged as ignored


def ignore_unread(body: Body, api: str) -> None:
    """Ignore the fields of `body` that reading its request never looked at (call it once every field the
    endpoint knows has been read): real clients send fields this server does not implement."""
    for name in body:
        if name not in body.read:
            body.ignore(name, api)


def integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, got {json.dumps(value)}")
    return value


def number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"'{name}' must be a number, got {json.dumps(value)}")
    return float(value)


def sampling_settings(params: dict[str, str] | None = None, **fields) -> SamplingSettings:
    """The request's SamplingSettings, whose checks are the only ones: a refusal is a 400 naming the request field
    the setting came from (`params` maps settings to the API's own field names where they differ)."""
    try:
        return SamplingSettings(**fields)
    except InvalidSettingError as e:
        raise bad((params or {}).get(e.field, e.field), str(e)) from None


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {json.dumps(value)}")
    return value


def stop_strings(body: dict) -> str | list | None:
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > 4:  # OpenAI's limit; what a stop string is, SamplingSettings checks
        raise bad("stop", "'stop' must be a non-empty string or a list of at most 4 of them")
    return stop


def text_content(content, param: str, kinds=("text", "input_text", "output_text")) -> str:
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") in ("image", "image_url", "input_image") for p in content):
            raise bad(param, f"'{param}' cannot hold images: only a user message does; move the image there")
        if all(p.get("type", "text") in kinds and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    raise bad(param, f"'{param}' must be a string or a list of text parts")


def optional(body: dict, name: str, kind: type, what: str):
    """The field `name` when given (None when absent), refused unless it is a `kind`."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise bad(name, f"'{name}' must be {what}, got {json.dumps(value)[:80]}")
    return value


def checked_schema(schema, strict: bool, param: str):
    """The Constraint of a JSON schema given in field `param`; a schema llguidance cannot compile is a 400."""
    from ..decode.grammar import Constraint

    if not isinstance(schema, (dict, bool)):
        raise bad(param, f"the JSON schema in '{param}' must be an object, got {json.dumps(schema)[:80]}")
    check_schema_size(schema, param)
    try:
        return Constraint.json_schema(schema, strict)
    except InvalidSettingError as e:
        raise bad(param, str(e)) from None


GRAMMAR_FIELDS = ("regex", "grammar", "lark_grammar", "json_schema")


def constraint_fields(body: dict):
    """The Constraint of the extension fields: `regex`, `grammar` (llama.cpp's GBNF), `lark_grammar` (llguidance's
    Lark) or `json_schema` (a schema, as llama.cpp takes it); at most one."""
    from ..decode.grammar import Constraint

    given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise bad(given[1], f"give one of {', '.join(GRAMMAR_FIELDS)}, not {' and '.join(given)}")
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "json_schema":
        return checked_schema(value, False, name)
    if not isinstance(value, str) or not value:
        raise bad(name, f"'{name}' must be a non-empty string")
    make = {"regex": Constraint.regex, "grammar": Constraint.gbnf, "lark_grammar": Constraint.lark}[name]
    try:
        return make(value)
    except InvalidSettingError as e:
        raise bad(name, str(e)) from None


def text_field(part: dict, name: str, param: str) -> str:
    """The string field `name` of a part of a request (a content block, an input item) at `param`."""
    value = part.get(name)
    if not isinstance(value, str):
        raise bad(f"{param}.{name}", f"{param}.{name} must be a string")
    return value


# ---- what a body may carry: list lengths, and the fields this server does not implement ----

# The most items of each list a body carries, checked before anything is rendered or tokenized: each stays well
# above what a real request needs (OpenAI's own limits where it has one: 4 stop strings, 128 tools).
LIST_LIMITS = {"messages": 10_000, "input": 10_000, "tools": 128, "stop": 4, "stop_sequences": 16}
MAX_SCHEMA_BYTES = 200_000  # a JSON schema (response format, tool parameters) longer than this is refused

# Fields of the APIs this server reads but does not act on, per API, with their documented types: a wrong type is
# still a 400 naming the field. Fields not listed anywhere are ignored too (`ignore_unread`); both kinds are logged
# once and named in the response's x-minimlx-ignored header. docs/serve.md lists them ("Fields").
LLAMACPP_IGNORED = {"cache_prompt": bool, "id_slot": int, "timings_per_token": bool, "return_progress": bool}
OPENAI_IGNORED = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "safety_identifier": str}
PENALTIES = {"frequency_penalty": (int, float), "presence_penalty": (int, float)}
IGNORED = {
    "chat": OPENAI_IGNORED
    | LLAMACPP_IGNORED
    | PENALTIES
    | {"modalities": list, "audio": dict, "prediction": dict, "web_search_options": dict, "verbosity": str},
    "completions": {"user": str, "best_of": int, "echo": bool, "suffix": str} | PENALTIES | LLAMACPP_IGNORED,
    "responses": OPENAI_IGNORED
    | {
        "truncation": str,
        "include": list,
        "background": bool,
        "prompt": dict,
        "client_metadata": dict,
        "prompt_cache_retention": str,
        "max_tool_calls": int,
        "stream_options": dict,
    },
    "messages": {
        "metadata": dict,
        "service_tier": str,
        "context_management": dict,
        "mcp_servers": list,
        "container": (str, dict),
    },
}
KIND_NAMES = {str: "a string", dict: "an object", bool: "true or false", list: "a list", int: "an integer"}


def kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = ("a number" if k in (int, float) and float in kinds else KIND_NAMES[k] for k in kinds)
    return " or ".join(dict.fromkeys(names))


def check_body(body: Body, api: str) -> None:
    """Refuse a body whose lists are too long or whose ignored fields have the wrong type, before any other work
    ("chat", "completions", "responses" or "messages"); note the ignored fields it holds."""
    for name, most in LIST_LIMITS.items():
        value = body.get(name)
        if isinstance(value, list) and len(value) > most:
            raise bad(name, f"'{name}' holds {len(value)} items; this server takes at most {most}")
    for name, kind in IGNORED[api].items():
        value = body.get(name)
        if value is None:
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise bad(name, f"'{name}' must be {kind_name(kind)}, got {json.dumps(body[name])[:80]}")
        body.ignore(name, api)


def check_schema_size(schema, param: str) -> None:
    """Refuse a JSON schema too long to compile in reasonable time, or nested too deeply to serialize."""
    try:
        size = len(json.dumps(schema))
    except (RecursionError, ValueError):
        raise bad(param, f"the JSON schema in '{param}' is nested too deeply; flatten it") from None
    if size > MAX_SCHEMA_BYTES:
        raise bad(param, f"the JSON schema in '{param}' is {size} bytes; this server takes at most {MAX_SCHEMA_BYTES}")


def effort_variable(body: Body, name: str, api: str) -> dict:
    """The chat-template variable `reasoning_effort` from the object field `name` of `body` (Responses' `reasoning`,
    Messages' `output_config`): its `effort`, which templates that take an effort read; its other keys ignored."""
    holder = optional(body, name, dict, 'an object, such as {"effort": "high"}') or {}
    for key in holder:
        if key != "effort":
            body.ignore(f"{name}.{key}", api)
    effort = holder.get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise bad(f"{name}.effort", f'\'{name}.effort\' must be a string such as "low" or "high"')
    return {"reasoning_effort": effort}
