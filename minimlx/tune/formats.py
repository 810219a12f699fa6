"""Adapter folders as the ecosystem writes them: PEFT's (written and read) and mlx-lm's (read).

PEFT: `adapter_config.json` (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules,
use_dora, base_model_name_or_path) and `adapter_model.safetensors` holding, for each adapted Hugging Face module M,
`base_model.model.M.lora_A.weight` (rank, in), `base_model.model.M.lora_B.weight` (out, rank) and, for DoRA,
`base_model.model.M.lora_magnitude_vector` (out,): what transformers + PEFT, vLLM and llama.cpp's
`convert_lora_to_gguf.py` read. Module names go through the family's `NameMap`, so they are the Hugging Face model's.
Adapted experts are PEFT's `target_parameters` (`LoRAExperts`): for each stacked parameter P of the experts module
E, `E.lora_A.weight` (experts * rank, in), expert e's A in rows e * rank ..., and `E.lora_B.weight` (out,
rank * experts), expert e's B in columns e, e + experts, ... (PEFT's layout, whichever way the family's checkpoints
transpose the stacked weights), B's rows of gate_up_proj in the order the family's checkpoints fuse gate and up (its
declared `experts_layout`: gate rows first, or gpt-oss's interleaved); where transformers keeps the weights
(experts, in, out) without flagging them so (Llama 4), PEFT reads their axes the other way round and its A and B are
our B and A, transposed. PEFT nests one wrapper per adapted parameter in the order the module defines them
(gate_up_proj, down_proj), so each but the last adapted one's names have a `.base_layer` after E for every one after
it.

mlx-lm: `adapter_config.json` (fine_tune_type lora or dora, lora_parameters {rank, scale, dropout, keys}) and
`adapters.safetensors` with `M.lora_a` (in, rank), `M.lora_b` (rank, out) and DoRA's `M.m`, M in mlx-lm's names;
for a stacked projection P of the experts (its `LoRASwitchLinear`, M `...switch_mlp.P`), `M.lora_a` (experts, rank,
in) and `M.lora_b` (experts, out, rank), `LoRAExperts`' own layout. Its gate_proj and up_proj adapted apart are no
PEFT adapter: minimlx applies, serves and fuses them but does not write them.

In memory an adapter is `Adapter`: its settings and its tensors under the model's names in PEFT's layouts
(`<path>.lora_a`, `<path>.lora_b`, `<path>.magnitude`, as `lora.adapter_weights` gives them).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..archs.experts import GATE_FIRST, ExpertsLayout
from ..core import Experts
from ..errors import CheckpointError, InvalidSettingError, ModelNotFoundError
from .lora import (
    ADAPTER_FORMS,
    EXPERT_PARAMETERS,
    EXPERT_PROJECTIONS,
    SPLIT_PROJECTIONS,
    AdapterSettings,
    DoRALinear,
    LoRAExperts,
    adapter_weights,
    adapters,
    checkpoint_name,
    expert_adapters,
    expert_dims,
    is_linear,
    linear_dims,
    projection_dims,
    wrap,
    wrap_experts,
)

PEFT_CONFIG, PEFT_WEIGHTS, MLX_LM_WEIGHTS = "adapter_config.json", "adapter_model.safetensors", "adapters.safetensors"
PEFT_PREFIX = "base_model.model."
PEFT_SUFFIXES = {".lora_A.weight": "lora_a", ".lora_B.weight": "lora_b", ".lora_magnitude_vector": "magnitude"}
MLX_LM_SUFFIXES = {".lora_a": "lora_a", ".lora_b": "lora_b", ".m": "magnitude"}


@dataclass
class Adapter:
    """An adapter read from a folder: its settings, its tensors (model names, PEFT's layouts: see the module
    docstring), the base model it names and the format it came in ("peft" or "mlx-lm")."""

    settings: AdapterSettings
    weights: dict[str, mx.array]
    base_model: str | None = None
    source: str = "peft"

    @property
    def paths(self) -> list[str]:
        """The adapted linear maps' paths (model names)."""
        return sorted({name.rpartition(".")[0] for name, value in self.weights.items() if value.ndim < 3})

    @property
    def experts(self) -> dict[str, tuple[str, ...]]:
        """The adapted routed experts' paths (model names), each with the stacked projections adapted."""
        adapted = {}
        for name, value in self.weights.items():
            if value.ndim == 3:
                path, _, parameter = name.rpartition(".")[0].rpartition(".")
                adapted.setdefault(path, set()).add(parameter)
        return {path: tuple(p for p in EXPERT_PROJECTIONS if p in adapted[path]) for path in sorted(adapted)}


def settings_of(model: nn.Module) -> AdapterSettings:
    """The settings of the adapters attached to `model` (rank, alpha, dropout and form from the modules; targets the
    Hugging Face names they adapt; layers None)."""
    found, experts = adapters(model), expert_adapters(model)
    if not found and not experts:
        raise CheckpointError("the model has no adapter to save; attach one first (minimlx.tune.attach)")
    first = next(iter(found.values())) if found else next(iter(experts.values()))
    targets = tuple(sorted({checkpoint_name(model, path).rpartition(".")[2] for path in found}))
    return AdapterSettings(
        rank=first.rank,
        alpha=first.scale * first.rank,
        dropout=first.dropout if found else 0.0,
        targets=targets,
        dora=isinstance(first, DoRALinear),
        experts=tuple({p for module in experts.values() for p in module.adapted}),
    )


def experts_name(model: nn.Module, path: str) -> str:
    """The Hugging Face module name of the routed experts at `path` (`layers.1.ffn.experts` ->
    `model.layers.1.mlp.experts`): their parent's name, then their own."""
    parent, _, name = path.rpartition(".")
    return f"{checkpoint_name(model, parent)}.{name}"


def peft_names(model: nn.Module) -> dict[str, str]:
    """The PEFT tensor name of each adapter tensor of `model` (`lora.adapter_weights`' names)."""
    suffix_of = {ours: theirs for theirs, ours in PEFT_SUFFIXES.items()}
    experts_forms = expert_adapters(model)
    names = {}
    for name in adapter_weights(model):
        path, _, kind = name.rpartition(".")
        experts, _, parameter = path.rpartition(".")
        form = experts_forms.get(experts)
        if isinstance(form, LoRAExperts):
            adapted = form.adapted
            nested = ".base_layer" * (len(adapted) - 1 - adapted.index(parameter))
            kind = other_factor(kind) if model.config.experts_layout.peft_swapped else kind  # see peft_layout
            names[name] = f"{PEFT_PREFIX}{experts_name(model, experts)}{nested}{suffix_of[kind]}"
        else:
            names[name] = f"{PEFT_PREFIX}{checkpoint_name(model, path)}{suffix_of[kind]}"
    return names


def other_factor(kind: str) -> str:
    return "lora_b" if kind == "lora_a" else "lora_a"


def peft_layout(value: mx.array, name: str, layout: ExpertsLayout) -> mx.array:
    """An expert adapter's factor `<parameter>.<kind>` in PEFT's layout: A (experts, rank, in) -> (experts * rank,
    in), B (experts, out, rank) -> (out, rank * experts); gate_up_proj's outputs (gate then up in `LoRAExperts`) in
    the order the family's checkpoints fuse them, its declared `layout`. Where PEFT takes the stacked weight's axes
    the other way round (`layout.peft_swapped`), our B is its A and our A its B, each transposed."""
    parameter, kind = name.split(".")[-2:]
    if kind == "lora_b" and parameter == "gate_up_proj":
        value = layout.fuse_gate_up(*GATE_FIRST.split_gate_up(value, axis=1), axis=1)
    if layout.peft_swapped:
        value, kind = value.swapaxes(1, 2), other_factor(kind)
    if kind == "lora_a":
        return value.reshape(-1, value.shape[-1])
    return value.transpose(1, 2, 0).reshape(value.shape[1], -1)


def expert_layout(value: mx.array, parameter: str, kind: str, num_experts: int, layout: ExpertsLayout):
    """PEFT's factor `kind` of the experts' `parameter` -> (the `LoRAExperts` factor it is, its value): `peft_layout`
    undone."""
    if kind == "lora_a":
        value = value.reshape(num_experts, -1, value.shape[-1])
    else:
        value = value.reshape(value.shape[0], -1, num_experts).transpose(2, 0, 1)
    if layout.peft_swapped:
        value, kind = value.swapaxes(1, 2), other_factor(kind)
    if kind == "lora_b" and parameter == "gate_up_proj":
        value = GATE_FIRST.fuse_gate_up(*layout.split_gate_up(value, axis=1), axis=1)
    return kind, value


def check_writable(model: nn.Module) -> AdapterSettings:
    """The settings of the model's adapters, checked to be an adapter PEFT's files can hold (before a training run
    as before a save): no parts of a projection the family's checkpoints stack in one, no experts' gate and up
    adapted apart."""
    settings = settings_of(model)
    apart = sorted(set(settings.experts) & set(SPLIT_PROJECTIONS))
    if apart:
        raise InvalidSettingError(
            f"this adapter adapts the experts' {' and '.join(apart)} apart, as mlx-lm's LoRASwitchLinear does, which "
            "PEFT's files cannot hold (its target_parameters adapt gate_up_proj as one); fuse or serve it as it is, or "
            "train the experts anew with --targets experts",
            "targets",
        )
    split = {part for parts in model.config.fused_parts().values() for part, _ in parts}
    stacked = sorted({path.rpartition(".")[2] for path in adapters(model)} & split)
    if stacked:
        raise InvalidSettingError(
            f"this family's checkpoints stack {', '.join(stacked)} in one projection "
            f"({', '.join(model.config.fused)}), which PEFT adapts as one; minimlx cannot write adapters of the parts "
            "yet: adapt the other projections",
            "targets",
        )
    return settings


def save_adapter(model: nn.Module, folder: str | Path, base_model: str | None = None) -> Path:
    """Write the model's adapters to `folder` as PEFT writes them; `base_model` is recorded as
    base_model_name_or_path (a Hugging Face repo id lets the other tools find the base). Returns the folder."""
    settings = check_writable(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = sorted({int(path.split(".")[1]) for path in adapters(model) | expert_adapters(model)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": list(settings.targets),
        "target_parameters": list(settings.experts) or None,
        "use_dora": settings.dora,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": layers if len(layers) < len(model.layers) else None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
    }
    names = peft_names(model)
    tensors = {
        names[name]: peft_layout(value, name, model.config.experts_layout) if value.ndim == 3 else value
        for name, value in adapter_weights(model).items()
    }
    mx.save_safetensors(str(folder / PEFT_WEIGHTS), tensors, metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_adapter(model: nn.Module, folder: str | Path) -> Adapter:
    """The adapter in `folder` (PEFT's or mlx-lm's), its tensors renamed for `model` and checked against it: every
    adapted module a linear map of `model`, every tensor of the shape that map takes. A mismatch is a CheckpointError
    naming the tensor (an adapter made for another base)."""
    folder = Path(folder)
    if not (folder / PEFT_CONFIG).is_file():
        raise ModelNotFoundError(
            f"{folder} holds no adapter_config.json; pass the folder PEFT, mlx-lm or minimlx wrote the adapter to"
        )
    config = json.loads((folder / PEFT_CONFIG).read_text())
    if (folder / PEFT_WEIGHTS).is_file():
        adapter = read_peft(model, folder, config)
    elif (folder / MLX_LM_WEIGHTS).is_file():
        adapter = read_mlx_lm(model, folder, config)
    else:
        raise ModelNotFoundError(f"{folder} has an adapter_config.json but neither {PEFT_WEIGHTS} nor {MLX_LM_WEIGHTS}")
    check_adapter(model, adapter, folder)
    return adapter


def model_path(model: nn.Module, checkpoint_module: str) -> str:
    """The model's module path of a checkpoint's module name (the family's NameMap)."""
    return model.config.names.to_ours({f"{checkpoint_module}.weight": None}).popitem()[0].removesuffix(".weight")


def renamed(model: nn.Module, tensors: dict, suffixes: dict[str, str], prefix: str, folder: Path) -> dict:
    """`tensors` (checkpoint module name + one of `suffixes`) under model names (`<path>.<kind>`)."""
    out = {}
    for name, value in tensors.items():
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None or not name.startswith(prefix):
            raise CheckpointError(
                f"{folder}: tensor {name} is not a LoRA matrix of a linear map, which minimlx cannot apply; "
                "train the adapter with linear-map targets only"
            )
        module = name[len(prefix) : -len(suffix)]
        out[f"{model_path(model, module)}.{suffixes[suffix]}"] = value
    return out


def read_peft(model: nn.Module, folder: Path, config: dict) -> Adapter:
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{folder} holds a {config['peft_type']} adapter; minimlx applies LoRA and DoRA only")
    unsupported = [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if unsupported or config.get("fan_in_fan_out"):
        raise CheckpointError(
            f"{folder}: adapter_config.json sets {', '.join(unsupported) or 'fan_in_fan_out'}, which minimlx does not "
            "apply; train the adapter with one rank and alpha for every module"
        )
    tensors = mx.load(str(folder / PEFT_WEIGHTS))
    tensors = {k.replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector"): v for k, v in tensors.items()}
    rank = config.get("r", 8)
    experts = [
        p
        for p in EXPERT_PARAMETERS
        if any(t == p or t.endswith(f".{p}") for t in config.get("target_parameters") or ())
    ]
    weights = expert_tensors(model, tensors, experts, rank, folder)
    weights |= renamed(model, tensors, PEFT_SUFFIXES, PEFT_PREFIX, folder)
    alpha = config.get("lora_alpha", rank)
    if config.get("use_rslora"):  # scale alpha / sqrt(rank): the same scale as this alpha over rank
        alpha = alpha * math.sqrt(rank)
    targets = config.get("target_modules") or ()
    settings = AdapterSettings(
        rank=rank,
        alpha=alpha,
        dropout=config.get("lora_dropout", 0.0),
        targets=targets if isinstance(targets, str) else tuple(targets),
        dora=bool(config.get("use_dora")),
        experts=tuple(experts),
    )
    return Adapter(settings, weights, config.get("base_model_name_or_path"), "peft")


def expert_tensors(model: nn.Module, tensors: dict, experts: list[str], rank: int, folder: Path) -> dict:
    """PEFT's tensors of the stacked expert parameters `experts` (its target_parameters, in the order PEFT nests
    them) under model names in `LoRAExperts`' layouts; they are taken out of `tensors`."""
    if not experts:
        return {}
    modules = dict(model.named_modules())
    out = {}
    for name in list(tensors):
        suffix = next((s for s in (".lora_A.weight", ".lora_B.weight") if name.endswith(s)), None)
        if suffix is None or not name.startswith(PEFT_PREFIX):
            continue
        module = name[len(PEFT_PREFIX) : -len(suffix)]
        path = model_path(model, module.replace(".base_layer", ""))
        form = modules.get(path)
        if not isinstance(form, (Experts, LoRAExperts)):
            continue
        nested = module.count(".base_layer")
        if nested >= len(experts):
            raise CheckpointError(
                f"{folder}: tensor {name} adapts a parameter of the experts beyond target_parameters "
                f"({', '.join(experts)}); save the adapter with PEFT again"
            )
        kind, value = PEFT_SUFFIXES[suffix], tensors.pop(name)
        num_experts = expert_dims((form.base if isinstance(form, LoRAExperts) else form).gate_proj)[0]
        if value.ndim != 2 or value.shape[0 if kind == "lora_a" else 1] != num_experts * rank:
            raise CheckpointError(
                f"{folder}: adapter tensor {name} has shape {tuple(value.shape)}, not that of rank {rank} on this "
                f"model's {num_experts} experts at {path}; this adapter was made for another base model"
            )
        parameter = experts[len(experts) - 1 - nested]
        kind, value = expert_layout(value, parameter, kind, num_experts, model.config.experts_layout)
        out[f"{path}.{parameter}.{kind}"] = value
    return out


def read_mlx_lm(model: nn.Module, folder: Path, config: dict) -> Adapter:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise CheckpointError(
            f"{folder} holds mlx-lm's {kind!r} fine-tune, which is a whole model, not an adapter; load it as a model"
        )
    parameters = config.get("lora_parameters") or {}
    tensors = {  # a linear map's factors transposed to PEFT's layouts; the experts' (3 axes) are LoRAExperts' already
        k: v.T if k.endswith((".lora_a", ".lora_b")) and v.ndim == 2 else v
        for k, v in mx.load(str(folder / MLX_LM_WEIGHTS)).items()
    }
    weights = renamed(model, tensors, MLX_LM_SUFFIXES, "", folder)
    ranks = {v.shape[-2] for k, v in weights.items() if k.endswith(".lora_a")}
    rank = parameters.get("rank") or (ranks.pop() if len(ranks) == 1 else 8)
    keys = parameters.get("keys") or ()
    settings = AdapterSettings(
        rank=rank,
        alpha=parameters.get("scale", 20.0) * rank,
        dropout=parameters.get("dropout", 0.0),
        targets=tuple(sorted({key.rpartition(".")[2] for key in keys})) or "all-linear",
        dora=kind == "dora",
        experts=tuple({name.split(".")[-2] for name, value in weights.items() if value.ndim == 3}),
    )
    return Adapter(settings, weights, config.get("model"), "mlx-lm")


def check_adapter(model: nn.Module, adapter: Adapter, folder: Path) -> None:
    """Every adapted module is a linear map of `model` and every tensor has the shape it takes (before anything is
    wrapped)."""
    modules = dict(model.named_modules())
    made_for = f" ({adapter.base_model})" if adapter.base_model else ""
    fix = f"this adapter was made for another base model{made_for}; load it on that model"
    for name, value in adapter.weights.items():
        path, _, kind = name.rpartition(".")
        if value.ndim == 3:
            check_expert_tensor(modules, name, value, adapter.settings.rank, f"{folder}: ", fix)
            continue
        base = modules.get(path)
        base = base.base if isinstance(base, ADAPTER_FORMS) else base
        if base is None or not is_linear(base):
            raise CheckpointError(f"{folder}: the adapter adapts {path}, which is no linear map of this model; {fix}")
        in_dims, out_dims = linear_dims(base)
        expected = {
            "lora_a": (adapter.settings.rank, in_dims),
            "lora_b": (out_dims, adapter.settings.rank),
            "magnitude": (out_dims,),
        }[kind]
        if tuple(value.shape) != expected:
            raise CheckpointError(
                f"{folder}: adapter tensor for {path}.{kind} has shape {tuple(value.shape)} but this model's "
                f"{path} takes {expected}; {fix}"
            )


def check_expert_tensor(modules: dict, name: str, value: mx.array, rank: int, where: str, fix: str) -> None:
    """An expert adapter's factor `<experts path>.<parameter>.<kind>` has the shape the model's experts take."""
    path, parameter, kind = name.rsplit(".", 2)
    form = modules.get(path)
    base = form.base if isinstance(form, LoRAExperts) else form
    if not isinstance(base, Experts) or parameter not in EXPERT_PROJECTIONS:
        raise CheckpointError(f"{where}the adapter adapts experts at {path}, which this model does not have; {fix}")
    num_experts = base.gate_proj.weight.shape[0]
    in_dims, out_dims = projection_dims(base)[parameter]
    expected = (num_experts, rank, in_dims) if kind == "lora_a" else (num_experts, out_dims, rank)
    if tuple(value.shape) != expected:
        raise CheckpointError(
            f"{where}adapter tensor for {name} has shape {tuple(value.shape)} but this model's {path} takes "
            f"{expected}; {fix}"
        )


def load_adapter(model: nn.Module, folder: str | Path) -> Adapter:
    """Read the adapter in `folder` (PEFT's or mlx-lm's), wrap the modules it adapts and install its tensors.
    The forms are in eval mode (no dropout: an adapter read is for use; `model.train()` to train it on). Returns the
    adapter."""
    adapter = read_adapter(model, folder)
    wrap(model, adapter.paths, adapter.settings)
    wrap_experts(model, adapter.experts, adapter.settings)
    install(model, adapter.weights)
    for module in [*adapters(model).values(), *expert_adapters(model).values()]:
        module.eval()
    return adapter


def install(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Put adapter tensors (model names) into the model's adapter forms."""
    modules = dict(model.named_modules())
    for name, value in weights.items():
        path, _, kind = name.rpartition(".")
        modules[path][kind] = value.astype(mx.float32)
