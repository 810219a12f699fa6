"""The walk from tokens to the next token, as plain data: what the explainer page draws and its JSON API returns.

Every figure is read from one `trace` of the prompt (with the ablation asked for) through the one loop: the lens
rows from its residual stream (`top_guesses`, as `logit_lens` reads them), the attention weights, what attention
and the FFN add, and the router's choices. A model with adapters is traced once more with them detached, for the
walk's `adapter` figures (the base against the adapted model, `block_changes`). With a picture
(`images.ExplainedImage`) every trace has its soft tokens in place, and the walk carries the image panel's figures.
Prompts are bounded: at most `MAX_TOKENS` tokens besides an image's (longer ones keep their last `MAX_TOKENS`, with a
note; one with an image is refused instead), and attention maps are inlined only up to `INLINE_ATTENTION` tokens;
above that the page asks for one layer at a time (`attention_layer`).
"""

import mlx.core as mx
import mlx.nn as nn

from ..anatomy.ablation import Ablation
from ..anatomy.adapted import base_trace, block_changes
from ..anatomy.lens import top_guesses
from ..anatomy.similarity import cosine
from ..anatomy.trace import trace
from ..core.sampling import filtered_logits
from ..decode.prompt import encode_prompt
from ..errors import InvalidSettingError
from ..tune.lora import adapters
from .images import ExplainedImage, placed

MAX_TOKENS = 256  # the trace's attention weights then take at most layers * heads * 256^2 floats (70 MB on SmolLM2)
INLINE_ATTENTION = 64  # tokens up to which every layer's attention maps come with the walk
LENS_TOP = 5
NEXT_TOP = 20
KEPT_SHOWN = 50


def prompt_ids(tokenizer, prompt: str, chat_template: bool = False, image: ExplainedImage | None = None) -> list[int]:
    """The ids of `prompt`, as a user message in the model's chat template when `chat_template`; with `image`, its
    start token before the text (unless the text writes it), written out as the model's processor writes it."""
    if chat_template and tokenizer.chat_template is None:
        raise InvalidSettingError("this model has no chat template; turn chat_template off")
    if image is None:
        return encode_prompt(tokenizer, prompt, chat_template)
    return encode_prompt(tokenizer, image.prompt(prompt), chat_template, write_images=image.written)


def bounded(ids: list[int]) -> tuple[list[int], str | None]:
    """`ids` cut to their last MAX_TOKENS, and the note that says so (None when nothing was cut)."""
    if not ids:
        raise InvalidSettingError("the prompt has no tokens; type something")
    if len(ids) <= MAX_TOKENS:
        return ids, None
    return ids[-MAX_TOKENS:], f"the prompt has {len(ids)} tokens; the walk shows its last {MAX_TOKENS}"


def prompt_of(ids: list[int], image: ExplainedImage | None) -> tuple[list[int], str | None]:
    """`bounded(ids)`; with `image`, the ids with the image's places written out (`image.ids`), never cut (a cut
    would split the image): a prompt of more than MAX_TOKENS tokens besides the image's is refused."""
    return (image.ids(ids, MAX_TOKENS), None) if image is not None else bounded(ids)


def rounded(values: mx.array, digits: int = 6) -> list:
    return mx.round(values.astype(mx.float32), digits).tolist()


def walk(
    model: nn.Module, tokenizer, ids: list[int], ablate: Ablation | None = None, image: ExplainedImage | None = None
) -> dict:
    """The whole walk of `ids` (already bounded; with `image`, its places written out by `image.ids`) under `ablate`:
    tokens, lens, attention, contributions, routing and the next-token distribution, all with the image's soft tokens
    in place; for a model with adapters, the base against it (`adapter`, else None); the image panel's figures
    (`image`, else None)."""
    layers = len(model.layers)
    values = trace(model, ids, attention=True, ablate=ablate, images=placed(image, ids))
    stream = mx.stack([values["embed"][0]] + [values[f"layers.{i}.resid_post"][0] for i in range(layers)])
    lens_ids, lens_probs = top_guesses(model, stream, LENS_TOP)
    decode = tokenizer.decode
    blocks = []
    for i in range(layers):
        pre, post = values[f"layers.{i}.resid_pre"][0], values[f"layers.{i}.resid_post"][0]
        blocks.append(
            {
                "attn_norm": rounded(mx.linalg.norm(values[f"layers.{i}.attn_out"][0].astype(mx.float32), axis=-1)),
                "mlp_norm": rounded(mx.linalg.norm(values[f"layers.{i}.mlp_out"][0].astype(mx.float32), axis=-1)),
                "resid_norm": rounded(mx.linalg.norm(post.astype(mx.float32), axis=-1)),
                "cos_embed": rounded(cosine(post, stream[0])),
                "cos_prev": rounded(cosine(post, pre)),
                "routing": routing(model, values, i),
                "state_norm": state_norm(values, i),
            }
        )
    inline = len(ids) <= INLINE_ATTENTION
    return {
        "ids": ids,
        "tokens": [decode([i]) for i in ids],
        "layers": ["embed"] + [str(i) for i in range(layers)],
        "heads": [layer.attn.heads if layer.attn.attends else 0 for layer in model.layers],  # 0: a recurrent layer
        "lens": [
            [
                {"tokens": [decode([t]) for t in top], "ids": top, "probs": probs}
                for top, probs in zip(row_ids, row_probs)
            ]
            for row_ids, row_probs in zip(lens_ids, lens_probs)
        ],
        "attention": [attention_of(values, i) for i in range(layers)] if inline else None,
        "blocks": blocks,
        "next": top_tokens(tokenizer, values["logits"][0, -1], NEXT_TOP),
        "adapter": adapter_figures(model, tokenizer, ids, values, ablate, image) if adapters(model) else None,
        "image": image.panel(ids) if image is not None else None,
    }


def adapter_figures(
    model: nn.Module, tokenizer, ids: list[int], after: dict, ablate: Ablation | None, image: ExplainedImage | None
) -> dict:
    """The base (`model` with its adapters detached) against the adapted model's trace `after`, under the same
    `ablate`: per block, what attention and the FFN add before and after and how far the stream moved, at each
    position; and the base's next-token distribution (the adapted model's is the walk's `next`)."""
    before = base_trace(model, ids, ablate, placed(image, ids))
    blocks = [{k: rounded(v) for k, v in block.items()} for block in block_changes(before, after, len(model.layers))]
    return {"blocks": blocks, "next_base": top_tokens(tokenizer, before["logits"][0, -1], NEXT_TOP)}


def routing(model: nn.Module, values: dict, layer: int) -> dict | None:
    """Which experts each token went to in `layer` (as the trace records them), with their weights and load."""
    name = f"layers.{layer}.expert_indices"
    if name not in values:
        return None
    experts = values[name][0]
    load = (experts[..., None] == mx.arange(model.layers[layer].ffn.num_experts)).sum(axis=(0, 1))
    return {
        "experts": experts.tolist(),
        "weights": rounded(values[f"layers.{layer}.expert_weights"][0]),
        "load": load.tolist(),
    }


def top_tokens(tokenizer, logits: mx.array, k: int) -> list[dict]:
    """The k most likely tokens of the distribution of `logits` (vocab,), most likely first."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    order = mx.argsort(-probs)[:k].tolist()
    chosen = probs[mx.array(order)].tolist()
    return [{"token": tokenizer.decode([i]), "id": i, "prob": p} for i, p in zip(order, chosen)]


def attention_layer(
    model: nn.Module, ids: list[int], layer: int, ablate: Ablation | None = None, image: ExplainedImage | None = None
) -> list:
    """One layer's attention weights (heads, tokens, tokens) for `ids` (holding `image`): the page's on-demand map of
    a long prompt."""
    if not 0 <= layer < len(model.layers):
        raise InvalidSettingError(f"layer must be between 0 and {len(model.layers) - 1}, got {layer}")
    if not model.layers[layer].attn.attends:
        return []  # a recurrent layer: no heads, no map
    name = f"layers.{layer}.attn_weights"
    return rounded(trace(model, ids, [name], ablate=ablate, images=placed(image, ids))[name][0])


def state_norm(values: dict, layer: int) -> float | None:
    """The norm of the state a recurrent layer's pass left (None for an attention layer)."""
    name = f"layers.{layer}.state_norm"
    return round(values[name][0].item(), 4) if name in values else None


def attention_of(values: dict, layer: int) -> list:
    """A traced layer's attention weights (heads, tokens, tokens), rounded; none for a recurrent layer."""
    name = f"layers.{layer}.attn_weights"
    return rounded(values[name][0]) if name in values else []


def sampled(
    model: nn.Module,
    tokenizer,
    ids: list[int],
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float = 0.0,
    ablate: Ablation | None = None,
    image: ExplainedImage | None = None,
) -> dict:
    """The final distribution and the tokens sampling keeps at these settings (the sampler's own filter chain),
    with the probabilities it draws them with."""
    logits = trace(model, ids, ["logits"], ablate=ablate, images=placed(image, ids))["logits"][0, -1]
    if temperature == 0:
        top = top_tokens(tokenizer, logits, 1)
        return {"next": top_tokens(tokenizer, logits, NEXT_TOP), "kept": top, "kept_count": 1}
    filtered = filtered_logits(logits[None], temperature, top_p, top_k, min_p)[0]
    count = int((filtered > -mx.inf).sum().item())
    return {
        "next": top_tokens(tokenizer, logits, NEXT_TOP),
        "kept": top_tokens(tokenizer, filtered, min(count, KEPT_SHOWN)),
        "kept_count": count,
    }
