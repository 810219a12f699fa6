"""Adapters per row in the decode engine (`decode.adapters`): LoRA and DoRA adapters of different ranks and targets,
and the base, in one batch over a float or a packed base; each row's tokens are those of the model loaded with its
adapter alone (the LoRA/DoRA forms of `minimlx.tune`). Rows of an adapter never reuse the base's prompt cache."""

import mlx.core as mx
import pytest
from adapter_files import peft_adapter
from mlx_lm_reference import save_hf_model

import minimlx
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.decode.adapters import RowAdaptedExperts
from minimlx.errors import InvalidSettingError
from minimlx.tune import load_adapter

GREEDY = SamplingSettings(max_tokens=8, temperature=0)
PROMPTS = [[3, 4, 5, 6, 7], [9, 8], [20, 21, 22], [3, 4, 5, 6, 7], [40, 41, 42, 43], [3, 4, 5, 6, 7]]
NAMES = [None, None, "lora", "lora", "dora", "dora"]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A tiny qwen3 and two PEFT adapters of it: LoRA rank 4 on q/v/down, DoRA rank 8 on k/o/gate."""
    root = tmp_path_factory.mktemp("adapters")
    torch_model = save_hf_model(root / "base", "qwen3")
    lora = peft_adapter(torch_model, root / "lora", seed=1)
    dora = peft_adapter(
        torch_model, root / "dora", seed=2, targets=("k_proj", "o_proj", "gate_proj"), rank=8, dora=True
    )
    return root / "base", {"lora": lora, "dora": dora}


def alone(base, folders, packed: bool) -> list[list[int]]:
    """Each request's tokens on the model loaded with its adapter alone (packed first where `packed`)."""
    from minimlx.tune import load_adapter

    tokens = []
    for prompt, name in zip(PROMPTS, NAMES):
        model, tokenizer = minimlx.load(base)
        if packed:
            minimlx.quantize(model, bits=8, group_size=32)
        if name is not None:
            load_adapter(model, folders[name])
            model.eval()
        engine = Engine(model, tokenizer, max_batch=1)
        generation = engine.submit(Request(prompt, GREEDY))
        engine.run()
        tokens.append(generation.tokens)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["float", "8-bit"])
def test_rows_of_different_adapters_decode_together_as_alone(adapted, packed):
    from minimlx.tune.serving import served_adapters

    base, folders = adapted
    model, tokenizer = minimlx.load(base)
    if packed:
        minimlx.quantize(model, bits=8, group_size=32)
    bank = served_adapters(model, folders)
    engine = Engine(model, tokenizer, max_batch=8, adapters=bank)
    generations = [engine.submit(Request(p, GREEDY, adapter=name)) for p, name in zip(PROMPTS, NAMES)]
    engine.run()
    assert max(engine.runner.batch_sizes) == 6
    together = [g.tokens for g in generations]
    assert together == alone(base, folders, packed)
    assert len({tuple(together[i]) for i in (0, 3, 5)}) == 3  # the same prompt, three answers
    # the stacked adapters: LoRA 4 x (in + out) on q, v, down and DoRA 8 x (in + out) + out on k, o, gate, per layer
    assert bank.parameter_count == sum(v.size for f in folders.values() for v in read_tensors(f).values())


def read_tensors(folder):
    import mlx.core as mx

    return mx.load(str(folder / "adapter_model.safetensors"))


@pytest.mark.slow
def test_an_adapter_row_does_not_reuse_the_base_rows_prompt_cache(adapted):
    from minimlx.tune.serving import served_adapters

    base, folders = adapted
    model, tokenizer = minimlx.load(base)
    engine = Engine(model, tokenizer, max_batch=2, prompt_cache_size=4, adapters=served_adapters(model, folders))
    first = engine.submit(Request(PROMPTS[0], GREEDY))
    engine.run()
    second = engine.submit(Request(PROMPTS[0], GREEDY, adapter="lora"))
    engine.run()
    assert second.cached_tokens == 0 and len(engine.prompt_cache.entries) == 1
    # between the engine's passes the model is the base (an embedding or a trace of it reads no adapter)
    ids = mx.array([PROMPTS[1]])
    assert mx.array_equal(model(ids), minimlx.load(base)[0](ids)).item()
    assert second.tokens == alone(base, folders, False)[3] and first.tokens != second.tokens
    with pytest.raises(InvalidSettingError, match="no adapter named 'cook' is served; the adapters are: lora, dora"):
        engine.submit(Request(PROMPTS[0], GREEDY, adapter="cook"))


def expert_adapter(base, folder, seed: int, rank: int, targets: tuple, experts: tuple):
    """An adapter minimlx attaches to the mixture in `base` (experts and `targets`) and saves, its B random."""
    from minimlx.tune import AdapterSettings, adapters, attach, save_adapter
    from minimlx.tune.lora import expert_adapters

    model = minimlx.load_model(base, "float32")
    attach(model, AdapterSettings(rank=rank, alpha=2.0 * rank, targets=targets, experts=experts))
    mx.random.seed(seed)
    low_ranks = [form[p] for form in expert_adapters(model).values() for p in form.adapted]
    for form in [*adapters(model).values(), *low_ranks]:
        form.lora_b = mx.random.normal(form.lora_b.shape) * 0.5
    return save_adapter(model, folder)


def test_rows_of_expert_adapters_decode_together_as_alone(tmp_path):
    """Adapters of a mixture's stacked experts (rank 4 on gate_up_proj and down_proj beside q_proj; rank 8 on
    down_proj alone) and the base in one batch: each row's tokens are those of its adapter alone. Prefill's 8-token
    prompts make enough (token, expert) pairs to be sorted by expert; decoding's are not."""
    from tuning import MOE, tiny_llama

    from minimlx.tune.serving import served_adapters

    base = tiny_llama(tmp_path / "moe", **MOE)
    folders = {
        "lora": expert_adapter(base, tmp_path / "a", 1, 4, ("q_proj",), ("gate_up_proj", "down_proj")),
        "dora": expert_adapter(base, tmp_path / "b", 2, 8, (), ("down_proj",)),  # NAMES' second adapter
    }
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10] if i % 2 == 0 else [11 + i, 4, 5, 6, 7, 8, 9, 10] for i in range(6)]
    model, tokenizer = minimlx.load(base)
    engine = Engine(model, tokenizer, max_batch=8, adapters=served_adapters(model, folders))
    assert all(isinstance(block.ffn.experts, RowAdaptedExperts) for block in model.layers)
    generations = [engine.submit(Request(p, GREEDY, adapter=name)) for p, name in zip(prompts, NAMES)]
    engine.run()
    assert max(engine.runner.batch_sizes) == 6
    expected = []
    for prompt, name in zip(prompts, NAMES):
        model, tokenizer = minimlx.load(base)
        if name is not None:
            load_adapter(model, folders[name])
        alone_engine = Engine(model.eval() or model, tokenizer, max_batch=1)
        expected.append(alone_engine.submit(Request(prompt, GREEDY)))
        alone_engine.run()
    assert [g.tokens for g in generations] == [g.tokens for g in expected]
    assert len({tuple(generations[i].tokens) for i in (0, 2, 4)}) == 3  # the same prompt, three answers
