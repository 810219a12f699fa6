"""Reading request bodies: typed fields, refused with an APIError that each endpoint answers in its own shape."""

import json

from starlette.responses import JSONResponse

from ..decode import SamplingSettings
from ..errors import InvalidSettingError

ROLES = ("system", "developer", "user", "assistant")


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


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


# ---- reading a request body ----


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


def sampling_settings(**fields) -> SamplingSettings:
    """The request's SamplingSettings, whose checks are the only ones: a refusal is a 400 naming the field."""
    try:
        return SamplingSettings(**fields)
    except InvalidSettingError as e:
        name = str(e).split(" ", 1)[0]
        raise bad(name if name in fields else None, str(e)) from None


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


def text_content(content, param: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(param, f"'{param}' must be a string or a list of text parts")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}] needs a role out of {', '.join(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        rendered.append({"role": role, "content": text_content(message.get("content"), f"messages[{i}].content")})
    return rendered
