"""Hugging Face `config.json` in the one layout the plugins read.

Two generations of transformers write configs differently:
- transformers 4: `rope_theta` and `rope_scaling` (with `type` or `rope_type`), `torch_dtype`;
- transformers 5: `rope_parameters` holding `rope_theta` and the scaling, `dtype`.
`normalize_config` returns the first shape with `rope_scaling` either None or a dict whose
`rope_type` names the scaling, and `dtype`. It is idempotent.
"""


def normalize_config(config: dict) -> dict:
    config = dict(config)
    rope = config.pop("rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" not in rope and rope:
        rope = next(iter(rope.values()))  # per-layer-type rope parameters: the first type's
    if rope:
        rope = dict(rope)
        if "rope_theta" in rope:
            config["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            config.setdefault("partial_rotary_factor", rope.pop("partial_rotary_factor"))
        config["rope_scaling"] = rope
    scaling = config.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type") or "default"
        config["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
    else:
        config["rope_scaling"] = None
    if "dtype" not in config and "torch_dtype" in config:
        config["dtype"] = config["torch_dtype"]
    config.pop("torch_dtype", None)
    return config
