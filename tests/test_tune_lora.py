"""minimlx.tune's adapters against transformers + PEFT (the reference for LoRA and DoRA): gradients of one batch,
20 AdamW steps, adapter files both ways; mlx-lm's adapter folders; LoRA on packed 4-bit weights (QLoRA)."""

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from memory_peaks import in_fresh_process, qlora_peaks
from mlx.utils import tree_flatten, tree_unflatten
from reference import relative_error, require, save_reference
from tune_models import (
    EXPERTS,
    FAMILIES,
    MIXTURES,
    SMALL,
    TARGETS,
    batches,
    peft_name,
    peft_twin,
    randomize_adapters,
    save_family,
    torch_loss,
)

from minimlx import convert, load_model
from minimlx.core.moe import ExpertLinear, QuantizedExpertLinear
from minimlx.cpu.linear import NativeBlockLinear
from minimlx.errors import CheckpointError, InvalidSettingError
from minimlx.tune import (
    AdapterSettings,
    adamw,
    adapter_weights,
    adapters,
    attach,
    differentiable,
    fused_weights,
    load_adapter,
    masked_loss,
    save_adapter,
)
from minimlx.tune.formats import peft_layout
from minimlx.tune.lora import base_weight, expert_adapters

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def family_folder(tmp_path_factory):
    """family -> its tiny Hugging Face folder (tune_models.FAMILIES), saved once per module."""
    folders = {}

    def get(family):
        if family not in folders:
            folders[family] = tmp_path_factory.mktemp(family)
            save_family(folders[family], family)
        return folders[family]

    return get


def torch_model(folder):
    torch, transformers = require("torch"), require("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def adapted(folder, settings: AdapterSettings, seed: int = 0, dtype: str | None = "float32"):
    """The minimlx model of `folder` with a random non-zero adapter of `settings`, ready for gradients."""
    model = differentiable(load_model(folder, dtype=dtype))
    attach(model, settings)
    randomize_adapters(model, seed)
    return model


def loss_of(model, ids, mask):
    return masked_loss(model, ids, mask)[0]


def settings_for(family: str, dora: bool = False) -> AdapterSettings:
    return AdapterSettings(rank=RANK, alpha=ALPHA, targets=TARGETS[family], dora=dora)


def gradient_errors(
    family_folder, tmp_path, family: str, dora: bool, settings: AdapterSettings | None = None, tokens: int = 12
) -> tuple[float, dict[str, float]]:
    """(|loss - PEFT's|, relative error of each adapter gradient against PEFT's, in PEFT's layouts) for one batch."""
    folder = family_folder(family)
    settings = settings or settings_for(family, dora)
    model = adapted(folder, settings)
    save_adapter(model, tmp_path)
    twin = peft_twin(torch_model(folder), settings, tmp_path)
    ids, mask = batches(1, tokens=tokens)[0]
    loss, grads = nn.value_and_grad(model, loss_of)(model, mx.array(ids), mx.array(mask))
    reference = torch_loss(twin, ids, mask)
    reference.backward()
    theirs = dict(twin.named_parameters())
    errors = {
        name: relative_error(
            peft_layout(g, name, model.config.experts_layout) if g.ndim == 3 else g,
            theirs[peft_name(model, name)].grad.numpy(),
        )
        for name, g in tree_flatten(grads)
    }
    assert len(errors) == sum(p.requires_grad for p in theirs.values())
    return abs(loss.item() - reference.item()), errors


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_gradients_equal_peft_llama(family_folder, tmp_path, dora):
    loss_error, errors = gradient_errors(family_folder, tmp_path, "llama", dora)
    assert loss_error < 1e-5
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.slow
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "gpt_oss", "llama4_text")])
def test_gradients_equal_peft(family_folder, tmp_path, family, dora):
    loss_error, errors = gradient_errors(family_folder, tmp_path, family, dora)
    assert loss_error < 1e-5
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("family", MIXTURES)
def test_expert_gradients_equal_peft(family_folder, tmp_path, family):
    """LoRA on the stacked experts of a mixture (PEFT's target_parameters gate_up_proj and down_proj, adapted by its
    ParamWrapper) beside two attention projections: one batch's gradients equal PEFT + torch's, on Qwen3-MoE's
    experts (stored (experts, out, in), gate rows first), gpt-oss's ((experts, in, out), gate and up interleaved,
    biased) and Llama 4's ((experts, in, out) unflagged: PEFT's A reads the outputs). 40 tokens a row: the (token,
    expert) pairs are many enough to be sorted by expert."""
    settings = AdapterSettings(rank=RANK, alpha=ALPHA, **EXPERTS)
    loss_error, errors = gradient_errors(family_folder, tmp_path, family, False, settings, tokens=40)
    layers = [1] if family == "qwen3_moe" else [0, 1]  # Qwen3-MoE's first layer is dense
    assert {name for name in errors if ".experts." in name} == {
        f"layers.{i}.ffn.experts.{p}.{k}"
        for i in layers
        for p in ("gate_up_proj", "down_proj")
        for k in ("lora_a", "lora_b")
    }
    assert loss_error < 1e-5
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])


def warmup_cosine(step: int, iters: int, warmup: int) -> float:
    """The fraction of the peak learning rate at `step`: linear warm-up, then a cosine down to 0 at `iters`."""
    if step < warmup:
        return step / warmup
    return 0.5 * (1 + np.cos(np.pi * (step - warmup) / (iters - warmup)))


@pytest.mark.slow
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama4_text"])
def test_adamw_losses_equal_peft(family_folder, tmp_path, family, dora):
    """20 AdamW steps (warm-up 3, cosine decay, weight decay) from the same adapter on the same batches: the loss of
    every step within 1e-3 of PEFT + torch's."""
    torch = require("torch")
    iters, warmup, rate = 20, 3, 1e-2
    folder = family_folder(family)
    settings = settings_for(family, dora)
    model = adapted(folder, settings)
    save_adapter(model, tmp_path)
    twin = peft_twin(torch_model(folder), settings, tmp_path)
    optimizer = adamw(rate, iters, warmup, weight_decay=0.01)
    trained = [p for p in twin.parameters() if p.requires_grad]
    torch_optimizer = torch.optim.AdamW(trained, lr=rate, weight_decay=0.01)
    torch_schedule = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, lambda s: warmup_cosine(s, iters, warmup))
    step = nn.value_and_grad(model, loss_of)
    data = batches(4, seed=1)
    ours, theirs = [], []
    for i in range(iters):
        ids, mask = data[i % len(data)]
        loss, grads = step(model, mx.array(ids), mx.array(mask))
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state)
        torch_optimizer.zero_grad()
        reference = torch_loss(twin, ids, mask)
        reference.backward()
        torch_optimizer.step()
        torch_schedule.step()
        ours.append(loss.item())
        theirs.append(reference.item())
    assert ours[0] - min(ours) > 0.1  # the adapter learned
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3, list(zip(ours, theirs))


@pytest.mark.parametrize(
    "family", ["llama", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f != "llama")]
)
def test_saved_adapter_loads_in_peft(family_folder, tmp_path, family):
    """The PEFT folder minimlx writes loads with PeftModel.from_pretrained on the Hugging Face base and gives the
    adapted model's logits (DoRA for the families after llama; Gemma 3's last two layers only)."""
    peft, torch = require("peft"), require("torch")
    folder = family_folder(family)
    settings = replace(settings_for(family, dora=family != "llama"), layers=2 if family == "gemma3" else None)
    model = adapted(folder, settings)
    save_adapter(model, tmp_path / "adapter", base_model=str(folder))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    twin = peft.PeftModel.from_pretrained(torch_model(folder), tmp_path / "adapter")
    assert sum(name.endswith(".lora_A") for name, _ in twin.named_modules()) == len(adapters(model))
    ids = batches(1)[0][0]
    with torch.no_grad():
        expected = twin(torch.tensor(ids)).logits.numpy()
    logits = np.array(model(mx.array(ids)))
    assert np.abs(logits - expected).max() < 1e-3
    assert np.abs(np.array(load_model(folder)(mx.array(ids))) - expected).max() > 0.1  # the adapter counts


@pytest.mark.parametrize("family", ["qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_peft_adapter_loads(family_folder, tmp_path, family, dora):
    """An adapter PEFT made (get_peft_model, non-zero tensors, save_pretrained) loads into minimlx with PEFT's
    logits (its dropout off, as in PEFT's eval mode)."""
    peft, torch = require("peft"), require("torch")
    folder = family_folder(family)
    targets = ["k_proj", "o_proj", "up_proj"]
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.1, target_modules=targets, use_dora=dora)
    twin = peft.get_peft_model(torch_model(folder), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.requires_grad:
                p.copy_(
                    p * torch.empty_like(p).uniform_(0.8, 1.2) if "magnitude" in name else torch.randn_like(p) * 0.2
                )
    twin.save_pretrained(tmp_path)
    twin.eval()
    model = load_model(folder)
    adapter = load_adapter(model, tmp_path)
    assert (adapter.settings.rank, adapter.settings.scale, adapter.settings.dora) == (RANK, ALPHA / RANK, dora)
    assert len(adapters(model)) == 3 * FAMILIES[family][1]["num_hidden_layers"]
    ids = batches(1)[0][0]
    with torch.no_grad():
        expected = twin(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.array(model(mx.array(ids))) - expected).max() < 1e-3


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_mlx_lm_adapter_loads(hf_folder, tmp_path, dora):
    """An adapter folder mlx-lm writes (its LoRA layers on its own loading of the model, adapters.safetensors and
    adapter_config.json as its trainer saves them) gives mlx-lm's logits in minimlx."""
    require("mlx_lm")
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model as mlx_lm_load

    folder = hf_folder("llama")
    reference, _ = mlx_lm_load(folder)
    parameters = {"rank": RANK, "scale": 2.5, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.down_proj"]}
    reference.freeze()  # as mlx-lm's trainer does before it adds the LoRA layers
    linear_to_lora_layers(reference, 1, parameters, use_dora=dora)
    rng = np.random.default_rng(2)
    trained = dict(tree_flatten(reference.trainable_parameters()))
    trained = {
        k: mx.array(rng.normal(0, 0.2, v.shape).astype(np.float32)) * (5 if k.endswith(".m") else 1)
        for k, v in trained.items()
    }
    reference.update(tree_unflatten(list(trained.items())))
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), trained)
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": 1, "lora_parameters": parameters}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    ids = mx.array(batches(1)[0][0])
    model = load_model(folder)
    adapter = load_adapter(model, tmp_path)
    assert adapter.source == "mlx-lm" and sorted(adapters(model)) == ["layers.1.attn.q_proj", "layers.1.ffn.down_proj"]
    assert np.abs(np.array(model(ids)) - np.array(reference(ids))).max() < 1e-3


def test_mlx_lm_expert_adapter_loads(tmp_path):
    """An adapter mlx-lm makes of a mixture (its default keys: every linear map of the last two blocks, the routers
    too, and its LoRASwitchLinear on switch_mlp's gate, up and down projections apart, each expert its own A and B;
    dropout, off for use), saved as its trainer saves it, gives mlx-lm's logits in minimlx: loaded, served per row and
    fused. minimlx does not write it as PEFT's, which cannot hold gate and up adapted apart."""
    require("mlx_lm")
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model as mlx_lm_load
    from tuning import MOE, tiny_llama

    from minimlx.tune.finetune import FineTune, prepare
    from minimlx.tune.fuse import fold
    from minimlx.tune.serving import served_adapters

    mlx_lm_keys = dict(decoder_sparse_step=1, mlp_only_layers=[], head_dim=8, norm_topk_prob=True)  # it requires
    folder = tiny_llama(tmp_path / "moe", **MOE, **mlx_lm_keys, vocab_size=SMALL["vocab_size"])
    reference, _ = mlx_lm_load(folder)
    reference.freeze()
    parameters = {"rank": RANK, "scale": 2.5, "dropout": 0.1}
    linear_to_lora_layers(reference, 2, parameters)
    rng = np.random.default_rng(3)
    trained = {
        k: mx.array(rng.normal(0, 0.3, v.shape).astype(np.float32))
        for k, v in tree_flatten(reference.trainable_parameters())
    }
    assert trained["model.layers.2.mlp.switch_mlp.gate_proj.lora_a"].shape == (4, RANK, 32)  # (experts, rank, in)
    reference.update(tree_unflatten(list(trained.items())))
    adapter_folder = tmp_path / "adapter"
    adapter_folder.mkdir()
    mx.save_safetensors(str(adapter_folder / "adapters.safetensors"), trained)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": parameters}
    (adapter_folder / "adapter_config.json").write_text(json.dumps(config))
    ids = mx.array(batches(1, tokens=40)[0][0])  # enough (token, expert) pairs to be sorted by expert
    expected = np.array(reference.eval()(ids))

    model = load_model(folder)
    adapter = load_adapter(model, adapter_folder)
    assert adapter.settings.experts == ("gate_proj", "up_proj", "down_proj")
    assert sorted(expert_adapters(model)) == ["layers.1.ffn.experts", "layers.2.ffn.experts"]
    assert "layers.2.ffn.router.proj" in adapters(model)
    assert np.abs(np.array(model(ids)) - expected).max() < 1e-4
    assert np.abs(np.array(load_model(folder)(ids)) - expected).max() > 0.1  # the adapter counts
    with pytest.raises(InvalidSettingError, match="gate_proj and up_proj apart, as mlx-lm's LoRASwitchLinear"):
        save_adapter(model, tmp_path / "peft")
    job = FineTune(str(folder), str(tmp_path), resume_adapter_file=str(adapter_folder))
    with pytest.raises(InvalidSettingError, match="gate_proj and up_proj apart"):  # before training, not at its end
        prepare(load_model(folder), job)
    assert len(fold(model)) == 2 * 5 + 2 and not expert_adapters(model)  # attention, router; the experts
    assert np.abs(np.array(model(ids)) - expected).max() < 1e-4

    model = load_model(folder)
    served_adapters(model, {"mlx-lm": adapter_folder}).select(["mlx-lm", "mlx-lm"])
    assert np.abs(np.array(model(ids)) - expected).max() < 1e-4


@pytest.mark.parametrize(
    "family, theirs", [("qwen3_moe", "down_proj"), ("gpt_oss", "gate_up_proj"), ("llama4_text", "gate_up_proj")]
)
def test_expert_adapters_load_both_ways(family_folder, tmp_path, family, theirs):
    """An adapter of the experts (and attention) minimlx saved loads with PeftModel.from_pretrained and gives minimlx's
    logits; one PEFT made (get_peft_model with target_parameters `theirs`, non-zero tensors, save_pretrained) loads
    into minimlx with PEFT's logits. gpt-oss's gate_up_proj is stored (experts, in, out), gate and up interleaved:
    so are the outputs of PEFT's adapter of it; Llama 4's too, gate rows first, and PEFT takes it as (experts, out,
    in)."""
    peft, torch = require("peft"), require("torch")
    folder = family_folder(family)
    settings = AdapterSettings(rank=RANK, alpha=ALPHA, **EXPERTS)
    model = adapted(folder, settings)
    save_adapter(model, tmp_path / "ours", base_model=str(folder))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["gate_up_proj", "down_proj"]
    twin = peft.PeftModel.from_pretrained(torch_model(folder), tmp_path / "ours")
    ids = batches(1)[0][0]
    with torch.no_grad():
        expected = twin(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.array(model(mx.array(ids))) - expected).max() < 1e-3
    assert np.abs(np.array(load_model(folder)(mx.array(ids))) - expected).max() > 0.1  # the adapter counts

    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["k_proj"], target_parameters=[theirs])
    twin = peft.get_peft_model(torch_model(folder), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in twin.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.2)
    twin.save_pretrained(tmp_path / "theirs")
    model = load_model(folder)
    adapter = load_adapter(model, tmp_path / "theirs")
    layers = [1] if family == "qwen3_moe" else [0, 1]
    assert adapter.settings.experts == (theirs,)
    assert sorted(expert_adapters(model)) == [f"layers.{i}.ffn.experts" for i in layers]
    with torch.no_grad():
        expected = twin(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.array(model(mx.array(ids))) - expected).max() < 1e-3


def test_adapter_for_another_base_is_refused(family_folder, tmp_path):
    """A Qwen3 adapter (queries of 4 heads x 16) on the llama (4 x 8): one line naming the tensor and the fix, before
    anything is wrapped."""
    save_adapter(adapted(family_folder("qwen3"), settings_for("qwen3")), tmp_path, base_model="tiny-qwen3")
    model = load_model(family_folder("llama"))
    with pytest.raises(CheckpointError, match=r"q_proj.lora_b has shape \(64, 4\).*another base model \(tiny-qwen3\)"):
        load_adapter(model, tmp_path)
    assert not adapters(model)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(rank=0), "rank must be a positive integer"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(targets=()), "no projections to adapt"),
    ],
)
def test_settings_refused(settings, message):
    with pytest.raises(InvalidSettingError, match=message):
        AdapterSettings(**settings)


def test_adapters_of_stacked_projections_are_not_written(tmp_path):
    """Phi-3's checkpoints stack q, k and v in one qkv_proj, which minimlx splits: an adapter of q_proj has no PEFT
    form to write, and is refused in one line; one of o_proj is written."""
    save_reference(tmp_path / "phi3", "Phi3Config", **SMALL, pad_token_id=0)
    model = adapted(tmp_path / "phi3", AdapterSettings(rank=RANK, targets=("q_proj", "o_proj")))
    with pytest.raises(InvalidSettingError, match=r"stack q_proj in one projection \(qkv_proj, gate_up_proj\)"):
        save_adapter(model, tmp_path / "adapter")
    model = adapted(tmp_path / "phi3", AdapterSettings(rank=RANK, targets=("o_proj",)))
    assert save_adapter(model, tmp_path / "adapter").is_dir()


def test_targets_matching_nothing_are_refused(family_folder):
    with pytest.raises(InvalidSettingError, match="matches the targets"):
        attach(load_model(family_folder("llama")), AdapterSettings(targets=("c_attn",)))


def test_last_layers_and_fused_weights(family_folder):
    """`layers=1` adapts the last layer only; each fused weight is the map the adapted model computes (DoRA: the
    magnitude times the adapted weight's direction)."""
    model = adapted(family_folder("llama"), AdapterSettings(rank=RANK, targets="all-linear", dora=True, layers=1))
    assert {path.split(".")[1] for path in adapters(model)} == {"1"}
    rng = np.random.default_rng(3)
    fused = fused_weights(model)
    for path, module in adapters(model).items():
        x = mx.array(rng.normal(size=(3, module.lora_a.shape[1])).astype(np.float32))
        assert relative_error(x @ fused[f"{path}.weight"].T, module(x)) < 1e-5
    assert set(adapter_weights(model)) == {
        f"{p}.{k}" for p in adapters(model) for k in ("lora_a", "lora_b", "magnitude")
    }


def packed_folder(source, target, group_size: int = 32):
    """`source` as the 4-bit MLX folder `minimlx convert` writes."""
    return convert(source, target, bits=4, group_size=group_size)


def dequantized(model):
    """`model` with each packed linear map (MLX's groups or GGUF's blocks) replaced by a float32 `nn.Linear` holding
    its dequantized weight, and each packed stack of experts' maps by an `ExpertLinear`."""
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if isinstance(module, QuantizedExpertLinear):
            parent, _, name = path.rpartition(".")
            modules[parent][name] = ExpertLinear(1, 1, 1)
            modules[parent][name].weight = base_weight(module).astype(mx.float32)
        if isinstance(module, (nn.QuantizedLinear, NativeBlockLinear)):
            parent, _, name = path.rpartition(".")
            weight = base_weight(module)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.update({k: v for k, v in module.items() if k == "bias"} | {"weight": weight})
            modules[parent][name] = linear
    return model


def packed_and_float_gradients(path, settings: AdapterSettings):
    """(the adapted packed bases, max relative error of the adapter's gradients on the packed model against those on
    the same weights dequantized to float32, the loss's difference), from the same adapter and batch."""
    packed = adapted(path, settings, dtype="quantized")
    floats = differentiable(dequantized(load_model(path, dtype="quantized")))
    attach(floats, settings)
    randomize_adapters(floats)
    ids, mask = (mx.array(a) for a in batches(1)[0])
    loss, grads = nn.value_and_grad(packed, loss_of)(packed, ids, mask)
    reference_loss, reference = nn.value_and_grad(floats, loss_of)(floats, ids, mask)
    reference = dict(tree_flatten(reference))
    errors = [relative_error(g, reference[name]) for name, g in tree_flatten(grads)]
    bases = [module.base for module in adapters(packed).values()]
    return bases, max(errors), abs(loss.item() - reference_loss.item())


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_qlora_gradients_through_packed_weights(hf_folder, tmp_path, dora):
    """LoRA on a 4-bit MLX folder keeps every adapted base packed, and its gradients equal those of the same adapter
    on the dequantized float32 weights: they flow through the quantized products."""
    folder = packed_folder(hf_folder("llama"), tmp_path / "q4")
    settings = AdapterSettings(rank=RANK, alpha=ALPHA, targets="all-linear", dora=dora)
    bases, error, loss_error = packed_and_float_gradients(folder, settings)
    assert len(bases) == 14 and all(isinstance(b, nn.QuantizedLinear) and b.weight.dtype == mx.uint32 for b in bases)
    assert error < 1e-4 and loss_error < 1e-4


def test_qlora_on_packed_experts(tmp_path):
    """LoRA on the stacked experts of a 4-bit MLX mixture (and on its queries) keeps the experts packed, and its
    gradients equal those of the same adapter on the experts dequantized to float32: they flow through the gathered
    quantized products."""
    from tuning import MOE, tiny_llama

    moe = MOE | dict(vocab_size=SMALL["vocab_size"], moe_intermediate_size=32)  # every map packable in groups of 32
    folder = packed_folder(tiny_llama(tmp_path / "moe", **moe), tmp_path / "q4")
    settings = AdapterSettings(rank=RANK, alpha=ALPHA, **EXPERTS)
    _, error, loss_error = packed_and_float_gradients(folder, settings)
    packed = adapted(folder, settings, dtype="quantized")
    bases = [form.base[p] for form in expert_adapters(packed).values() for p in ("gate_proj", "up_proj", "down_proj")]
    assert len(bases) == 9 and all(type(b) is QuantizedExpertLinear and b.weight.dtype == mx.uint32 for b in bases)
    assert error < 1e-4 and loss_error < 1e-4


@pytest.mark.slow
def test_qlora_on_gguf_kquants(kquant_llama):
    """The same on a Q4_K_M GGUF file, whose K-quants stay in their stored blocks (uint8 rows)."""
    settings = AdapterSettings(rank=RANK, alpha=ALPHA, targets="all-linear")
    bases, error, loss_error = packed_and_float_gradients(kquant_llama["Q4_K_M"], settings)
    assert len(bases) == 7 and all(isinstance(b, NativeBlockLinear) and b.weight.dtype == mx.uint8 for b in bases)
    assert error < 1e-4 and loss_error < 1e-4


def save_random_llama(folder, vocab: int, dims: int, ffn_dims: int, layers: int, heads: int, kv_heads: int, tied=False):
    """A random float32 llama written as a Hugging Face folder straight from MLX (faster than torch at this size)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from qlora_memory import write_random_llama

    write_random_llama(folder, layers, vocab, dims, ffn_dims, heads, kv_heads, tied)


def nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree))


@pytest.mark.slow
def test_qlora_peak_memory(tmp_path):
    """QLoRA's peak memory over training steps, a stage at a time as `--grad-checkpoint` trains, is at most 1.3x the
    packed model plus the adapter and AdamW's state: no weight is held dequantized beyond a tile of rows. SmolLM2-135M's
    blocks (576 wide, 9 heads) and vocabulary (49,152, tied), 12 of its 30 blocks, in 4 bits, all-linear rank 8, one
    row of 64 tokens; the rest of the peak is the step's activations, which grow with its tokens (docs/finetune.md
    gives the figures)."""
    save_random_llama(tmp_path / "hf", vocab=49152, dims=576, ffn_dims=1536, layers=12, heads=9, kv_heads=3, tied=True)
    folder = packed_folder(tmp_path / "hf", tmp_path / "q4", group_size=64)
    shutil.rmtree(tmp_path / "hf")
    peak, held, packed = in_fresh_process(qlora_peaks, str(folder), 49152, 1, 64)
    assert packed < 0.2 * 4 * 71e6  # the base stayed packed (float32 would be 4 bytes a weight)
    assert peak <= 1.3 * held, (peak / held, peak, held)
