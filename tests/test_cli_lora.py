"""`minimlx lora`: a run on a tiny model writes a PEFT adapter and says its progress; bad input (a malformed line, a
chat with no assistant turn, rank 0, a missing data folder) is one line and exit status 2."""

import json

import pytest
from click.testing import CliRunner
from command_line import one_line_error
from tuning import chat, write_jsonl

from minimlx.cli import main


def lora(*arguments):
    return CliRunner().invoke(main, ["lora", *map(str, arguments)])


def test_a_run_writes_the_adapter_and_reports(tune_folders, tmp_path):
    model, data = tune_folders
    out = tmp_path / "adapter"
    result = lora(
        "--model", model, "--data", data, "--iters", 4, "--steps-per-report", 2, "--steps-per-eval", 4,
        "--learning-rate", 1e-2, "--rank", 4, "--alpha", 8, "--targets", "q_proj,down_proj", "--num-layers", 2,
        "--adapter-path", out, "--train",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["iter 0", "iter 2", "iter 4", "iter 4"]
    assert "validation loss" in lines[0] and "tokens/s, peak memory" in lines[1]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["down_proj", "q_proj"])
    assert config["layers_to_transform"] == [1, 2] and config["base_model_name_or_path"] == str(model)


@pytest.mark.parametrize(
    "records, options, fragments",
    [
        ([chat("w4", "w5"), '{"messages": [}'], [], ["train.jsonl line 2 is not valid JSON"]),
        ([chat("w4", "w5"), {"messages": [{"role": "user", "content": "w4"}]}], [], ["line 2", "no assistant turn"]),
        ([chat("w4", "w5")], ["--rank", "0"], ["LoRA rank must be a positive integer, got 0"]),
        ([chat("w4", "w5")], ["--data", "missing"], ["data folder missing does not exist"]),
        ([chat("w4", "w5")], ["--batch-size", "4"], ["the train split has 1 rows, fewer than --batch-size 4"]),
        ([chat("w4", "w5")], ["--resume"], ["holds no training_state.safetensors to resume from"]),
    ],
)
def test_bad_input_is_one_line(tune_folders, tmp_path, monkeypatch, records, options, fragments):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "data" / "train.jsonl", records)
    result = lora("--model", tune_folders[0], "--data", "data", "--batch-size", 1, "--iters", 1, *options)
    one_line_error(result, *fragments)


def test_an_adapter_for_another_base_is_one_line(tune_folders, tmp_path):
    from tuning import tiny_llama

    model, data = tune_folders
    assert lora("--model", model, "--data", data, "--iters", 1, "--adapter-path", tmp_path / "adapter").exit_code == 0
    wider = tiny_llama(tmp_path / "wider", hidden_size=48)
    result = lora("--model", wider, "--data", data, "--iters", 1, "--resume-adapter-file", tmp_path / "adapter")
    one_line_error(result, "has shape (32, 8) but this model", "another base model")


def test_targets_all_adapts_the_experts(tune_folders, tmp_path):
    """`--targets all` on a mixture of experts: every linear map of the blocks (the routers excepted) and the experts'
    stacked projections, written as PEFT's target_parameters with its tensor names."""
    from safetensors import safe_open
    from tuning import MOE, tiny_llama

    model = tiny_llama(tmp_path / "moe", **MOE)
    out = tmp_path / "adapter"
    result = lora(
        "--model", model, "--data", tune_folders[1], "--iters", 1, "--rank", 4, "--targets", "all",
        "--num-layers", -1, "--adapter-path", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["gate_up_proj", "down_proj"]
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    with safe_open(out / "adapter_model.safetensors", "np") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    experts = "base_model.model.model.layers.2.mlp.experts"
    assert shapes[f"{experts}.base_layer.lora_A.weight"] == [4 * 4, 32]  # gate_up_proj: experts * rank, dims
    assert shapes[f"{experts}.base_layer.lora_B.weight"] == [2 * 16, 4 * 4]
    assert shapes[f"{experts}.lora_B.weight"] == [32, 4 * 4]  # down_proj
    assert len(shapes) == 3 * (4 * 2 + 2 * 2)
