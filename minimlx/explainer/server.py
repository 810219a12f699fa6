"""The explainer's page and its JSON API (Starlette on uvicorn, as `minimlx serve`).

`GET /` is the page (its script and style under /assets/); the API under it reads the walk through the one loop:
`POST /api/explain` (the walk), `/api/next` (the final distribution under sampling settings), `/api/attention`
(one layer's maps, for long prompts), `/api/compare` (a word in two contexts), `/api/precision` (the walk's
stream against a second precision of the model, when one is loaded) and `GET /api/ledger`. Each request is
computed in a worker thread, one at a time (ablations wrap the model's parts for the length of a pass).
"""

import json
import threading

import mlx.core as mx
import mlx.nn as nn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..anatomy.similarity import compare_word
from ..errors import MinimlxError
from . import inputs as fields
from .figures import ledger_figures, model_info
from .images import ExplainedImage
from .page import ASSETS, page
from .walk import attention_layer, sampled, walk

MAX_BODY = 1_000_000  # bytes: a prompt far past MAX_TOKENS still fits, a flood does not


class ExplainServer:
    """The page and API over one model (and, for `/api/precision`, a second precision of it)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        name: str,
        second: nn.Module | None = None,
        second_name=None,
        image: ExplainedImage | None = None,
    ):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.second, self.second_name = second, second_name
        self.image = image  # every prompt walked holds it
        self.lock = threading.Lock()
        mx.eval(
            [
                a
                for m in (model, second)
                if m is not None
                for mod in m.modules()
                for a in mod.values()
                if isinstance(a, mx.array)
            ]
        )  # evaluated here: a worker thread cannot evaluate another's arrays
        api = [
            Route("/api/explain", self.explain, methods=["POST"]),
            Route("/api/next", self.next, methods=["POST"]),
            Route("/api/attention", self.attention, methods=["POST"]),
            Route("/api/compare", self.compare, methods=["POST"]),
            Route("/api/precision", self.precision, methods=["POST"]),
            Route("/api/ledger", self.ledger),
            Route("/api/info", self.info),
        ]
        assets = [Route(f"/assets/{name}", self.asset) for name in ASSETS]
        self.app = Starlette(
            routes=[Route("/", self.index), *assets, *api],
            exception_handlers={404: self.not_found, 405: self.not_allowed},
        )

    async def index(self, request: Request) -> HTMLResponse:
        return HTMLResponse(page(self.name))

    async def asset(self, request: Request) -> Response:
        name = request.url.path.rsplit("/", 1)[1]
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return Response(ASSETS[name].read_text(), media_type=kind)

    async def not_found(self, request: Request, error) -> JSONResponse:
        return error_response(404, f"no such endpoint: {request.url.path}")

    async def not_allowed(self, request: Request, error) -> JSONResponse:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}")

    async def call(self, request: Request, answer) -> JSONResponse:
        """Read the JSON body, compute `answer(body)` in a worker thread, and answer 400 for bad input."""
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return error_response(413, f"the request is over {MAX_BODY} bytes")
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return error_response(400, "the body must be a JSON object")

        def compute():
            with self.lock:
                return answer(body)

        try:
            return JSONResponse(await run_in_threadpool(compute))
        except (fields.BadRequest, MinimlxError) as e:
            return error_response(400, str(e))

    async def explain(self, request: Request) -> JSONResponse:
        def answer(body):
            ids, note = fields.ids(self.tokenizer, body, self.image)
            ablate = fields.ablation(self.model, self.tokenizer, body)
            return {**walk(self.model, self.tokenizer, ids, ablate, self.image), "note": note}

        return await self.call(request, answer)

    async def next(self, request: Request) -> JSONResponse:
        def answer(body):
            ids, _ = fields.ids(self.tokenizer, body, self.image)
            ablate = fields.ablation(self.model, self.tokenizer, body)
            return sampled(self.model, self.tokenizer, ids, *fields.sampling(body), ablate=ablate, image=self.image)

        return await self.call(request, answer)

    async def attention(self, request: Request) -> JSONResponse:
        def answer(body):
            ids, _ = fields.ids(self.tokenizer, body, self.image)
            layer = fields.integer(body, "layer")
            ablate = fields.ablation(self.model, self.tokenizer, body)
            return {"layer": layer, "weights": attention_layer(self.model, ids, layer, ablate, self.image)}

        return await self.call(request, answer)

    async def compare(self, request: Request) -> JSONResponse:
        def answer(body):
            first, second, word = (fields.text(body, key) for key in ("first", "second", "word"))
            return compare_word(self.model, self.tokenizer, first, second, word).to_dict()

        return await self.call(request, answer)

    async def precision(self, request: Request) -> JSONResponse:
        from .precision import precision_drift

        def answer(body):
            if self.second is None:
                raise fields.BadRequest("no second precision is loaded; start minimlx explain with --against DTYPE")
            if self.image is not None:
                raise fields.BadRequest("the precision view reads text only yet; start minimlx explain without --image")
            ids, _ = fields.ids(self.tokenizer, body)
            drift = precision_drift(self.model, self.second, self.tokenizer, ids)
            return {"first": self.name, "second": self.second_name, **drift}

        return await self.call(request, answer)

    async def ledger(self, request: Request) -> JSONResponse:
        return JSONResponse(ledger_figures(self.model))

    async def info(self, request: Request) -> JSONResponse:
        return JSONResponse(model_info(self.model, self.tokenizer, self.name, self.second_name))


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "status": status}}, status_code=status)
