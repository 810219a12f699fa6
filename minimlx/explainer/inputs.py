"""Reading the API's request bodies: each field checked, each mistake a one-line 400."""

import mlx.nn as nn

from ..anatomy.ablation import Ablation
from ..anatomy.trace import patch_from
from ..decode.prompt import check_ids
from .images import ExplainedImage
from .walk import prompt_ids, prompt_of


class BadRequest(ValueError):
    """A field of the body is missing or wrong; the message says which and why."""


def text(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key} must be a non-empty string")
    return value


def integer(body: dict, key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if type(value) is not int:
        raise BadRequest(f"{key} must be an integer")
    return value


def number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if type(value) not in (int, float) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number between {low} and {high}")
    return float(value)


def ids(tokenizer, body: dict, image: ExplainedImage | None = None) -> tuple[list[int], str | None]:
    """The prompt's ids (`ids` as given, or `prompt` encoded, in the chat template when `chat_template`), bounded;
    holding `image` (`prompt_of`)."""
    if "ids" in body:
        given = body["ids"]
        if not isinstance(given, list) or not all(type(i) is int for i in given):
            raise BadRequest("ids must be a list of token ids")
        return prompt_of(check_ids(given, None), image)  # the trace checks them against the vocabulary
    chat = body.get("chat_template", False)
    if type(chat) is not bool:
        raise BadRequest("chat_template must be true or false")
    return prompt_of(prompt_ids(tokenizer, text(body, "prompt"), chat, image), image)


def pairs(spec: dict, key: str) -> tuple[tuple[int, int], ...]:
    value = spec.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(i) is int for i in p) for p in value
    ):
        raise BadRequest(f"ablate.{key} must be a list of [layer, index] pairs")
    return tuple(tuple(p) for p in value)


def ablation(model: nn.Module, tokenizer, body: dict) -> Ablation | None:
    """`ablate`: {"heads": [[layer, head]], "experts": [[layer, expert]], "blocks": [layer], "patch": {"prompt",
    "layer", "position" (default -1: its last token), "target_position" (default -1)}}."""
    spec = body.get("ablate")
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - {"heads", "experts", "blocks", "patch"}:
        raise BadRequest("ablate must be an object with heads, experts, blocks and/or patch")
    blocks = spec.get("blocks", [])
    if not isinstance(blocks, list) or not all(type(b) is int for b in blocks):
        raise BadRequest("ablate.blocks must be a list of layer numbers")
    patches = ()
    if "patch" in spec:
        patch = spec["patch"]
        if not isinstance(patch, dict):
            raise BadRequest("ablate.patch must be an object with prompt and layer")
        source, _ = ids(tokenizer, {"chat_template": body.get("chat_template", False), **patch})
        patches = (
            patch_from(
                model,
                source,
                integer(patch, "layer"),
                integer(patch, "position", -1),
                integer(patch, "target_position", -1),
            ),
        )
    return Ablation(pairs(spec, "heads"), pairs(spec, "experts"), tuple(blocks), patches)


def sampling(body: dict) -> tuple[float, float, int, float]:
    """(temperature, top_p, top_k, min_p) as the sampler takes them."""
    top_k = integer(body, "top_k", 0)
    if top_k < 0:
        raise BadRequest("top_k must be 0 (off) or more")
    return (
        number(body, "temperature", 1.0, 0.0, 10.0),
        number(body, "top_p", 1.0, 0.0, 1.0),
        top_k,
        number(body, "min_p", 0.0, 0.0, 1.0),
    )
