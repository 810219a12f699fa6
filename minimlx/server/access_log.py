"""One log line per HTTP request, in uvicorn's access-log style or as JSON: who asked what, the status, the model it
used, and for an answer its prompt, cached and generated tokens, time to first token, total time, any cap on its
length and, for a 4xx or 5xx, the error's message."""

import contextvars
import json
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("minimlx.serve.access")


@dataclass
class RequestRecord:
    """What one request's log line says, filled in as the request is answered."""

    client: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    error: str | None = None
    answer: object | None = None  # the server's Answer, once the request started one
    held: list[str] = field(default_factory=list)  # the models it holds loaded until its response is over

    def fields(self) -> dict:
        line = {"client": self.client, "method": self.method, "path": self.path, "status": self.status}
        if self.held:
            line["model"] = self.held[0]
        answer = self.answer
        if answer is not None:
            usage = answer.usage()
            line |= {"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens}
            line |= {"generated_tokens": usage.completion_tokens}
            if answer.first_output_at is not None:
                line["ttft_s"] = round(answer.first_output_at - self.started, 3)
            if answer.capped is not None:
                line["max_tokens_capped"] = {"asked": answer.capped[0], "given": answer.capped[1]}
        line["total_s"] = round(time.monotonic() - self.started, 3)
        if self.error is not None:
            line["error"] = self.error
        return line


current_request: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("request", default=None)


def text_line(line: dict) -> str:
    """uvicorn's access line (`127.0.0.1:5000 - "POST /v1/messages HTTP/1.1" 200`) and the answer's figures."""
    head = f'{line["client"]} - "{line["method"]} {line["path"]} HTTP/1.1" {line["status"]}'
    figures = []
    for name, label in (("prompt_tokens", "prompt"), ("cached_tokens", "cached"), ("generated_tokens", "generated")):
        if name in line:
            figures.append(f"{label}={line[name]}")
    if "ttft_s" in line:
        figures.append(f"ttft={line['ttft_s']:.3f}s")
    figures.append(f"total={line['total_s']:.3f}s")
    if "model" in line:
        figures.append(f"model={line['model']}")
    if "max_tokens_capped" in line:
        figures.append(f"max_tokens={line['max_tokens_capped']['asked']}->{line['max_tokens_capped']['given']}")
    if "error" in line:
        figures.append(f"error={json.dumps(line['error'])}")
    return " ".join([head, *figures])


class AccessLog:
    """ASGI middleware writing one line per HTTP request once its response is over (a stream's last event sent,
    or its client gone); `json_lines` writes each line as a JSON object, for machines. `observers` are called with
    each finished request's record too (the metrics)."""

    def __init__(self, app, json_lines: bool = False, observers: tuple = ()):
        self.app, self.json_lines = app, json_lines
        self.observers = observers  # called with each finished request's record (the metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client") or ("-", 0)
        query = f"?{scope['query_string'].decode()}" if scope.get("query_string") else ""
        record = RequestRecord(f"{client[0]}:{client[1]}", scope["method"], scope["path"] + query)
        token = current_request.set(record)

        async def sending(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException as e:
            record.status = record.status or 500
            record.error = record.error or f"{type(e).__name__}: {e}"
            raise
        finally:
            current_request.reset(token)
            line = record.fields()
            log.info(json.dumps(line) if self.json_lines else text_line(line))
            for observe in self.observers:
                observe(record)
            # uvicorn's keep-alive timer, set while the response was sent, holds a copy of this request's context (and
            # so this record) for --keep-alive seconds: the answer, and through it its model, must not stay with it
            record.answer = None


class JSONFormatter(logging.Formatter):
    """Every log record as one JSON object: an access line's fields as they are, any other message as `message`."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name == log.name and message.startswith("{"):
            return message
        line = {"level": record.levelname.lower(), "logger": record.name, "message": message}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def log_to_stderr(log_format: str) -> None:
    """minimlx's server logs (the access lines, ignored fields, warnings) on stderr at INFO, as text or JSON."""
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if log_format == "json" else logging.Formatter("%(levelname)s: %(message)s"))
    logger = logging.getLogger("minimlx")
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
