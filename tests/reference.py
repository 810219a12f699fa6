"""Small random reference models built with transformers, and the helpers the parity tests share."""

import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest


def require(module: str):
    """Import a reference package; in CI a missing reference is a failure, elsewhere a skip."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def save_reference(
    folder: Path, config_class: str, seed: int = 0, random_buffers: tuple = (), model_class: str | None = None, **config
):
    """Build a seeded random transformers model from `config`, save it to `folder`, return the torch model.

    Buffers whose names end with one of `random_buffers` (e.g. a router's correction bias) are randomised too.
    `model_class` names the model's class where AutoModelForCausalLM has none for the config (image-text models).
    """
    torch = require("torch")
    transformers = require("transformers")
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**config)
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    else:
        model = getattr(transformers, model_class)(cfg).float().eval()
    with torch.no_grad():  # transformers initialises some weights (norms, biases) to constants: randomise all
        for p in model.parameters():
            p.copy_(
                torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.shape[0] == config.get("hidden_size", 0) else 0.0)
            )
        for name, b in model.named_buffers():
            if name.endswith(tuple(random_buffers)):
                b.copy_(torch.randn_like(b) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    torch = require("torch")
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def cache_errors(model, ids: np.ndarray, reference: np.ndarray, prompt: int = 9) -> tuple[float, float, float]:
    """`model`'s relative errors from `reference` over the whole sequence at once, token by token from an empty
    cache, and a `prompt`-token prompt then single steps."""
    import mlx.core as mx

    full = np.array(model(mx.array(ids)))
    cache = model.make_cache()
    stepped = mx.concatenate([model(mx.array(ids[:, t : t + 1]), cache) for t in range(ids.shape[1])], 1)
    cache = model.make_cache()
    continued = [model(mx.array(ids[:, :prompt]), cache)]
    continued += [model(mx.array(ids[:, t : t + 1]), cache) for t in range(prompt, ids.shape[1])]
    return tuple(
        relative_error(a, reference) for a in (full, np.array(stepped), np.array(mx.concatenate(continued, 1)))
    )


def relative_error(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def to_v4_layout(folder: Path) -> None:
    """Rewrite `config.json` the way transformers 4 wrote it (and published checkpoints hold it): rope_theta +
    rope_scaling, torch_dtype, Qwen3-MoE's num_experts, Granite 4's layer kinds, Qwen3-Next's attention interval."""
    path = folder / "config.json"
    config = v4_config(json.loads(path.read_text()))
    path.write_text(json.dumps(config))


def v4_config(config: dict) -> dict:
    if "text_config" in config:  # Gemma 3's image-text configs nest the text model's
        config["text_config"] = v4_config(config["text_config"])
    rope = config.pop("rope_parameters", None)
    if rope and "full_attention" in rope:  # Gemma 3: global layers' RoPE, and the local layers' base
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    kinds = config.pop("layer_types", None) if config.get("model_type") in ("gemma2", "gemma3_text") else None
    if kinds:  # sliding_window_pattern: every pattern-th layer global (Gemma 2 always alternated)
        config.pop("_sliding_window_pattern", None)
        pattern = kinds.index("full_attention") + 1 if "full_attention" in kinds else len(kinds) + 1
        assert kinds == ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(kinds))]
        if config["model_type"] == "gemma3_text":
            config["sliding_window_pattern"] = pattern
        else:
            assert pattern == 2
    if rope:
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    if "num_local_experts" in config and config.get("model_type") == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    if config.get("model_type") == "gpt2":
        config["n_ctx"] = config["n_positions"]
    kinds = config.get("layer_types", []) if config.get("model_type") == "qwen3_next" else []
    if kinds and kinds == ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(len(kinds))]:
        del config["layer_types"]  # Qwen3-Next's published configs: every fourth layer attends
        config["full_attention_interval"] = 4
    if config.get("model_type") == "granitemoehybrid":  # Granite 4's layer kinds; its Mamba2 limits not a setting
        published = {"linear_attention": "mamba", "full_attention": "attention"}
        config["layer_types"] = [published.get(kind, kind) for kind in config["layer_types"]]
        config.pop("time_step_limit", None)
    return config


def random_ids(vocab: int, batch: int = 2, tokens: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, tokens))


def reference_checkpoint(tmp_path_factory, name: str, config_class: str, config: dict, vocab: int):
    """(name, folder, transformers' logits, ids): the random model `config` saved, with its reference logits."""
    folder = tmp_path_factory.mktemp(name)
    torch_model = save_reference(folder, config_class, **config)
    ids = random_ids(vocab)
    return name, folder, reference_logits(torch_model, ids), ids


def save_deepseek_moe_reference(folder: Path, config: dict, seed: int = 0):
    """DeepSeek-MoE (`model_type: deepseek`), which transformers has no class for, assembled from transformers'
    own modules the way the published modeling_deepseek.py builds it, saved in the published layout; returns the torch
    model.

    LlamaForCausalLM gives the attention, norms and dense MLPs; from layer `first_k_dense_replace` on, every
    `moe_layer_freq`-th MLP is a DeepseekV2Moe (greedy softmax routing, `n_shared_experts` shared experts as one MLP),
    whose router renormalises the chosen weights (+1e-20, as published) when `norm_topk_prob`. `config` is the
    published config.json; tensors are written per expert, as DeepSeek's checkpoints hold them.
    """
    torch = require("torch")
    transformers = require("transformers")
    from safetensors.torch import save_file
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    torch.manual_seed(seed)
    llama_keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
    )
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: config[k] for k in llama_keys}, tie_word_embeddings=False)
    ).eval()
    moe_config = transformers.DeepseekV2Config(
        hidden_size=config["hidden_size"],
        moe_intermediate_size=config["moe_intermediate_size"],
        n_routed_experts=config["n_routed_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        n_shared_experts=config["n_shared_experts"],
        topk_method="greedy",
        routed_scaling_factor=1.0,
    )
    for i, layer in enumerate(model.model.layers):
        if i >= config["first_k_dense_replace"] and i % config["moe_layer_freq"] == 0:
            layer.mlp = DeepseekV2Moe(moe_config)
            if config["norm_topk_prob"]:
                layer.mlp.gate.register_forward_hook(
                    lambda _, __, out: (out[0], out[1] / (out[1].sum(-1, keepdim=True) + 1e-20), out[2])
                )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    tensors = {}
    for name, w in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # (experts, 2 * hidden, dims): gate rows, then up rows
            for e, (gate, up) in enumerate(zip(*w.chunk(2, dim=1))):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(w):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = down
        else:
            tensors[name] = w
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return model


def save_mxfp4_experts(dense: Path, folder: Path, seed: int = 0):
    """The gpt-oss checkpoint in `dense` with its experts in MXFP4, written in the published layout
    (`*_blocks` (experts, out, in / 32, 16) uint8 and `*_scales` (experts, out, in / 32) E8M0 exponents, random,
    `quantization_config.quant_method: mxfp4`); returns transformers' model of it, dequantized
    (`Mxfp4Config(dequantize=True)`) in float32."""
    torch = require("torch")
    transformers = require("transformers")
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(seed)
    tensors = load_file(str(dense / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_dims, out_dims = tensors.pop(name).shape
        blocks = rng.integers(0, 256, size=(experts, out_dims, in_dims // 32, 16), dtype=np.uint8)
        tensors[f"{name}_blocks"] = torch.from_numpy(blocks)
        tensors[f"{name}_scales"] = torch.from_numpy(rng.integers(120, 125, size=blocks.shape[:-1], dtype=np.uint8))
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
