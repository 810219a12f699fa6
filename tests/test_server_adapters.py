"""Adapters served side by side (`serve --adapter NAME=PATH`): a request picks one by its `model` (BASE:NAME or NAME)
or an `adapter` field, and rows of different adapters, or none, decode in one batch, each giving what it gives alone."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from adapter_files import peft_adapter
from mlx_lm_reference import save_hf_model

from minimlx.server.adapters import AdapterChoice
from minimlx.server.fields import APIError, Body


class Named:
    """The engine's adapters as AdapterChoice reads them: their names."""

    def __init__(self, *names):
        self.names = list(names)


def chosen(choice: AdapterChoice, body: dict):
    from minimlx.server.adapters import chosen as current

    named = choice.read(Body(body))
    return current.get(), named


def test_a_request_names_its_adapter_in_its_model_or_an_adapter_field():
    choice = AdapterChoice("tiny", Named("chef", "poet"), any_name=False)
    assert choice.models() == ["tiny", "tiny:chef", "tiny:poet"]
    assert chosen(choice, {"model": "tiny"}) == (None, False)
    assert chosen(choice, {"model": "tiny:chef"}) == ("chef", True)
    assert chosen(choice, {"model": "tiny:poet:latest"}) == ("poet", True)  # Ollama's clients add a tag
    assert chosen(choice, {"model": "poet"}) == ("poet", True)
    assert chosen(choice, {"model": "tiny", "adapter": "chef"}) == ("chef", False)
    assert chosen(choice, {"adapter": "poet"}) == ("poet", False)
    with pytest.raises(APIError, match="no adapter 'cook' is served here; the adapters are: chef, poet") as error:
        chosen(choice, {"model": "tiny", "adapter": "cook"})
    assert error.value.status == 404 and error.value.param == "adapter"
    with pytest.raises(APIError, match="the models are: tiny, tiny:chef, tiny:poet") as error:
        chosen(choice, {"model": "tiny:cook"})
    assert error.value.status == 404
    with pytest.raises(APIError, match="names adapter 'chef' but 'adapter' is 'poet'") as error:
        chosen(choice, {"model": "tiny:chef", "adapter": "poet"})
    assert error.value.status == 400


def test_without_adapters_the_adapter_field_is_not_read():
    choice = AdapterChoice("tiny", None, any_name=True)
    body = Body({"model": "anything:else", "adapter": "chef"})
    assert choice.read(body) is False and "adapter" not in body.read


@pytest.mark.slow
def test_six_requests_on_two_adapters_and_the_base_decode_in_one_batch(tmp_path, monkeypatch):
    """Two requests per adapter and two on the base, sent together, decode in one batch of six rows (the runner's
    count of decode steps by batch size); each gives the greedy tokens it gives alone, on the model loaded with its
    adapter through PEFT's own file (`load(adapter=)`, the LoRA forms) or without one."""
    from starlette.testclient import TestClient

    import minimlx
    from minimlx.decode import Engine, Request, SamplingSettings
    from minimlx.server import app, bridge
    from minimlx.server.models import Models
    from minimlx.tune.serving import served_adapters

    torch_model = save_hf_model(tmp_path / "base", "llama")
    folders = {
        "chef": peft_adapter(torch_model, tmp_path / "chef", seed=1),
        "poet": peft_adapter(torch_model, tmp_path / "poet", seed=2, targets=("k_proj", "o_proj", "up_proj"), rank=8),
    }
    model, tokenizer = minimlx.load(tmp_path / "base")
    engine = Engine(model, tokenizer, max_batch=8, adapters=served_adapters(model, folders))
    monkeypatch.setattr(bridge, "GATHER_QUIET", 0.3)  # the six arrive while the idle server waits for more
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    picks = [{"model": "tiny"}, {"model": "tiny:chef"}, {"adapter": "chef"}, {"model": "poet"}, {"model": "tiny:poet"}]
    picks.insert(0, {})
    requests = [
        ({**pick, "prompt": prompts[i % 2], "max_tokens": 10, "temperature": 0}) for i, pick in enumerate(picks)
    ]
    with TestClient(app.Server(Models.one(engine, "tiny")).app) as client:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda body: client.post("/v1/completions", json=body), requests))
        listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert listed == ["tiny", "tiny:chef", "tiny:poet"]
    assert [a.status_code for a in answers] == [200] * 6
    assert max(engine.runner.batch_sizes) == 6
    texts = [a.json()["choices"][0]["text"] for a in answers]
    named = ["tiny", "tiny", "tiny:chef", "tiny:chef", "tiny:poet", "tiny:poet"]
    assert [a.json()["model"] for a in answers] == named  # each answer names the model and adapter it ran on

    adapter_of = [None, None, "chef", "chef", "poet", "poet"]
    alone = {}
    for name in (None, "chef", "poet"):
        adapted, _ = minimlx.load(tmp_path / "base", adapter=folders[name] if name else None)
        for prompt in prompts:
            single = Engine(adapted, tokenizer, max_batch=1)
            generation = single.submit(Request(prompt, SamplingSettings(max_tokens=10, temperature=0)))
            single.run()
            alone[name, tuple(prompt)] = tokenizer.decode(
                [t for t in generation.tokens if t not in generation.stop_ids]
            )
    expected = [alone[name, tuple(r["prompt"])] for name, r in zip(adapter_of, requests)]
    assert texts == expected
    assert len({alone[name, (3, 4, 5, 6)] for name in (None, "chef", "poet")}) == 3  # each adapter changes the answer


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--adapter", "chef"], "error: --adapter takes NAME=PATH (a name without ':'), got 'chef'"),
        (["serve", "--adapter", "a=x", "--adapter", "a=y"], "error: two adapters are named 'a'; give each one its own"),
    ],
)
def test_a_malformed_adapter_option_is_one_line_before_anything_loads(args, message):
    from click.testing import CliRunner

    from minimlx.cli import main

    result = CliRunner().invoke(main, [*args, "--model", "no-such-model"])
    assert result.exit_code == 2 and result.output.strip() == message
