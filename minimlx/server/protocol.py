"""What the endpoints (chat.py, responses.py, messages.py, embeddings.py, ollama.py) need of the server and of the
model a request names: written down, so that they depend on this and not on the `Server` (app.py) and `ServedModel`
(models.py) that implement it, which import them."""

from typing import TYPE_CHECKING, Protocol

from starlette.requests import Request as HTTPRequest

from .answer import Answer
from .fields import Body
from .turns import Turn

if TYPE_CHECKING:
    from .models import Models, ServedModel


class TurnModel(Protocol):
    name: str  # what answers report
    tokenizer: object  # the model's (completions encode their prompt with it)

    def render(self, turn: Turn) -> str:
        """The prompt text of a chat turn."""

    def count_tokens(self, turn: Turn) -> int:
        """The prompt tokens a chat turn renders to."""

    async def start(self, turn: Turn) -> Answer:
        """Start a chat turn's answers (its template, tools, tool choice, settings)."""

    async def start_raw(self, prompt: list[int], turn: Turn, param: str) -> Answer:
        """Start answers to raw token ids (`param` the request field they came from)."""


class TurnServer(Protocol):
    models: "Models"  # every model it knows, and those loaded

    async def read(self, request: HTTPRequest) -> Body:
        """The request's JSON body, after the API key, size and draining checks."""

    async def model(self, body: Body, keep_alive: float | None = None, strict: bool = False) -> "ServedModel":
        """The model the body names (404 unknown, 403 not allowed), loaded and held until the response is over."""
