"""What the endpoints (chat.py, responses.py, messages.py) need of the server: written down, so that they depend on
this and not on the `Server` that implements it (app.py), which imports them."""

from typing import Protocol

from starlette.requests import Request as HTTPRequest

from .answer import Answer
from .fields import Body
from .turns import Turn


class TurnServer(Protocol):
    model_name: str  # what answers report
    tokenizer: object  # the model's (completions encode their prompt with it)

    async def read(self, request: HTTPRequest) -> Body:
        """The request's JSON body, after the API key, size, draining and model-name checks."""

    def render(self, turn: Turn) -> str:
        """The prompt text of a chat turn."""

    def count_tokens(self, turn: Turn) -> int:
        """The prompt tokens a chat turn renders to."""

    async def start(self, turn: Turn) -> Answer:
        """Start a chat turn's answers (its template, tools, tool choice, settings)."""

    async def start_raw(self, prompt: list[int], turn: Turn, param: str) -> Answer:
        """Start answers to raw token ids (`param` the request field they came from)."""
