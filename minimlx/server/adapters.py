"""Which adapter a request decodes with (`serve --adapter NAME=PATH`): named in its `model` as `BASE:NAME` (vLLM's and
LM Studio's way of naming a model's adapters), as `NAME` alone where no other model answers to it, or in an `adapter`
field. The choice rides with the request's context from reading its body to submitting its generations."""

import contextvars

from ..decode.adapters import Adapters
from .fields import APIError, Body

chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("adapter", default=None)


class AdapterChoice:
    """The names requests may give: the model's (`base`; with `any_name`, any name answers for it) and those of its
    `adapters` (the engine's `Adapters`, or None)."""

    def __init__(self, base: str, adapters: Adapters | None, any_name: bool):
        self.base, self.any_name = base, any_name
        self.adapters = adapters.names if adapters is not None else []

    def answered(self) -> str:
        """The model name this request's answer gives: the base's, or BASE:NAME for adapter NAME."""
        name = chosen.get()
        return self.base if name is None else f"{self.base}:{name}"

    def models(self) -> list[str]:
        """The model names /v1/models lists: the base, then each adapter as BASE:NAME."""
        return [self.base] + [f"{self.base}:{name}" for name in self.adapters]

    def read(self, body: Body) -> bool:
        """Note the adapter `body` asks for (in this request's context); whether its `model` names this server's
        model (or one of its adapters), for the caller's check of a served name. A named adapter not served is 404,
        two different adapters asked at once 400."""
        model, field = body.get("model"), body.get("adapter") if self.adapters else None
        by_model = None
        if isinstance(model, str):
            base, _, name = model.removesuffix(":latest").rpartition(":")  # Ollama's clients add a tag
            if base and (base == self.base or self.any_name) and name in self.adapters:
                by_model = name
            elif base == self.base and self.adapters:
                served = ", ".join(self.models())
                message = f"the model '{model}' is not served here; the models are: {served}"
                raise APIError(404, message, "model", "model_not_found", kind="not_found_error")
            elif model in self.adapters and model != self.base:
                by_model = model
        if field is not None and (not isinstance(field, str) or field not in self.adapters):
            served = ", ".join(self.adapters) or "none"
            message = f"no adapter {field!r} is served here; the adapters are: {served}"
            raise APIError(404, message, "adapter", "adapter_not_found", kind="not_found_error")
        if field is not None and by_model is not None and field != by_model:
            raise APIError(400, f"the model names adapter {by_model!r} but 'adapter' is {field!r}; give one", "adapter")
        chosen.set(field or by_model)
        return by_model is not None
