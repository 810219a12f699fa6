"""Adapters per row in the decode engine (`decode.adapters`): LoRA and DoRA adapters of different ranks and targets,
and the base, in one batch over a float or a packed base; each row's tokens are those of the model loaded with its
adapter alone (the LoRA/DoRA forms of `minimlx.tune`). Rows of an adapter never reuse the base's prompt cache."""

import mlx.core as mx
import pytest
from adapter_files import peft_adapter
from mlx_lm_reference import save_hf_model

import minimlx
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.errors import InvalidSettingError

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
