"""Checkpoint tensor names <-> the names of minimlx's modules.

`NameMap` holds `(theirs, ours)` name prefixes, where `{i}` stands for a layer number. The same
table reads a checkpoint (theirs -> ours) and writes one (ours -> theirs); in both directions the
first matching pair wins, so more specific prefixes come first, and where several checkpoint
layouts name a tensor differently, the first pair gives the name written.

`LLAMA_NAMES` and `LLAMA_GGUF_NAMES` are the tables most families share, each extending them with its own names.
"""

import re

import mlx.core as mx


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)"))


class NameMap:
    def __init__(self, pairs: list[tuple[str, str]], drop: list[str] = ()):
        self.templates, self.drop_patterns = list(pairs), list(drop)
        self.pairs = [(_pattern(theirs), theirs, _pattern(ours), ours) for theirs, ours in pairs]
        self.drop = [re.compile(d) for d in drop]

    def extended(self, pairs: list[tuple[str, str]], drop: list[str] = ()) -> "NameMap":
        """This map with `pairs` tried first (a family's own names before those it shares)."""
        return NameMap(pairs + self.templates, [*drop, *self.drop_patterns])

    @staticmethod
    def _swap(name: str, pattern: re.Pattern, template: str) -> str | None:
        match = pattern.match(name)
        if match is None:
            return None
        return template.replace("{i}", match.groupdict().get("i") or "") + name[match.end() :]

    def to_ours(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names -> model names; names in `drop` are skipped, names no pair matches kept as they are
        (the loader then reports them as unexpected)."""
        out = {}
        for name, value in weights.items():
            if any(d.search(name) for d in self.drop):
                continue
            renamed = (self._swap(name, theirs, ours) for theirs, _, _, ours in self.pairs)
            out[next((n for n in renamed if n is not None), name)] = value
        return out

    def to_theirs(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Model names -> checkpoint names (the first pair's layout)."""
        out = {}
        for name, value in weights.items():
            renamed = (self._swap(name, ours, theirs) for _, theirs, ours, _ in self.pairs)
            out[next((n for n in renamed if n is not None), name)] = value
        return out


LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
GGUF_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")


def within_stack(weights: dict, layers: int, index: re.Pattern = LAYER_INDEX) -> dict:
    """`weights` without the checkpoint layers past the model's `layers` (a multi-token-prediction module stored as
    one more layer: DeepSeek-V3's, GLM-4.5's), which minimlx does not run; `index` finds a tensor's layer
    (GGUF_LAYER_INDEX for llama.cpp's names)."""
    return {k: v for k, v in weights.items() if not ((m := index.match(k)) and int(m[1]) >= layers)}


# Hugging Face and mlx-lm names (mlx-lm's first where they differ: that is the layout `convert` writes).
# The router and expert names serve the mixture-of-experts families.
LLAMA_NAMES = NameMap(
    [
        ("model.embed_tokens.", "embed."),
        ("model.layers.{i}.self_attn.", "layers.{i}.attn."),
        ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.ffn.router.score_bias"),
        ("model.layers.{i}.mlp.gate.", "layers.{i}.ffn.router.proj."),
        ("model.layers.{i}.mlp.switch_mlp.", "layers.{i}.ffn.experts."),
        ("model.layers.{i}.mlp.", "layers.{i}.ffn."),
        ("model.layers.{i}.input_layernorm.", "layers.{i}.attn_norm."),
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.ffn_norm."),
        ("model.norm.", "norm."),
        ("lm_head.", "head."),
    ],
    drop=[r"rotary_emb\.inv_freq$"],
)

# llama.cpp's names (`llama`, and the families that share its tensors; shared experts: Qwen2-MoE's, DeepSeek's;
# the routers' correction biases: DeepSeek-V3's, GLM-4.5's, MiniMax-M2's).
LLAMA_GGUF_NAMES = NameMap(
    [
        ("token_embd.", "embed."),
        ("output_norm.", "norm."),
        ("output.", "head."),
        ("blk.{i}.attn_norm.", "layers.{i}.attn_norm."),
        ("blk.{i}.attn_q_norm.", "layers.{i}.attn.q_norm."),
        ("blk.{i}.attn_k_norm.", "layers.{i}.attn.k_norm."),
        ("blk.{i}.attn_q.", "layers.{i}.attn.q_proj."),
        ("blk.{i}.attn_k.", "layers.{i}.attn.k_proj."),
        ("blk.{i}.attn_v.", "layers.{i}.attn.v_proj."),
        ("blk.{i}.attn_output.", "layers.{i}.attn.o_proj."),
        ("blk.{i}.ffn_norm.", "layers.{i}.ffn_norm."),
        ("blk.{i}.ffn_gate_inp.", "layers.{i}.ffn.router.proj."),
        ("blk.{i}.exp_probs_b.bias", "layers.{i}.ffn.router.score_bias"),
        ("blk.{i}.ffn_gate_exps.", "layers.{i}.ffn.experts.gate_proj."),
        ("blk.{i}.ffn_up_exps.", "layers.{i}.ffn.experts.up_proj."),
        ("blk.{i}.ffn_down_exps.", "layers.{i}.ffn.experts.down_proj."),
        ("blk.{i}.ffn_gate_shexp.", "layers.{i}.ffn.shared_experts.gate_proj."),
        ("blk.{i}.ffn_up_shexp.", "layers.{i}.ffn.shared_experts.up_proj."),
        ("blk.{i}.ffn_down_shexp.", "layers.{i}.ffn.shared_experts.down_proj."),
        ("blk.{i}.ffn_gate.", "layers.{i}.ffn.gate_proj."),
        ("blk.{i}.ffn_up.", "layers.{i}.ffn.up_proj."),
        ("blk.{i}.ffn_down.", "layers.{i}.ffn.down_proj."),
    ],
    drop=[r"^rope_freqs\."],
)

# llama.cpp's names for the norms after each sub-layer (Gemma's and GLM-4's four-norm blocks), and for the fused
# projections it keeps as the checkpoint does (Phi-3's qkv; Phi-3's and GLM-4's gate_up, which it calls ffn_up).
POST_NORM_GGUF_NAMES = [
    ("blk.{i}.post_attention_norm.", "layers.{i}.post_attn_norm."),
    ("blk.{i}.post_ffw_norm.", "layers.{i}.post_ffn_norm."),
]
FUSED_QKV_GGUF_NAMES = [("blk.{i}.attn_qkv.", "layers.{i}.attn.qkv_proj.")]
FUSED_GATE_UP_GGUF_NAMES = [("blk.{i}.ffn_up.", "layers.{i}.ffn.gate_up_proj.")]
