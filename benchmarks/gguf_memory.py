"""Peak resident memory of generating from, and converting, a Q4_K_M GGUF that llama.cpp quantized: one table.

    python benchmarks/gguf_memory.py [--llama-quantize PATH] [--folder DIR] [--layers 32] [--hidden 2560]

A random llama (32k-token vocabulary, `--layers` blocks of width `--hidden`, GQA 16/4 heads, FFN 2.75x) is written as
an F16 GGUF and quantized to Q4_K_M by llama.cpp's own `llama-quantize` (the given one, or tests/llamacpp.py's build),
beside a one-block model of width 256 with the same vocabulary (the runtime: interpreter, MLX, tokenizer). Each row
is one `minimlx run` (16 tokens) or `minimlx convert` in a fresh process; its peak RSS is the process's own
(`ru_maxrss` from `wait4`: file-backed pages of a memory map count too). `--folder` keeps the files for the next run.
The default model (a 1.45 GB Q4_K_M file, 4.8 GB in F16; about 7 minutes to make on 2 cores) is large enough that
its weights, not the runtime, decide the peak; its `--dtype float32` row needs 10 GB of memory.

Then the re-packing error of each K-quant and IQ type against `gguf.quants.dequantize`, on llama-quantize's output
for a small random llama: relative (Frobenius) error and largest difference over the largest |w|, worst tensor.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32000
PROMPT = "the quick brown fox jumps over the lazy dog"
ROWS = {  # name -> minimlx command after the model path
    "run, default (CPU: native kernel)": ["run", "--max-tokens", "16", "--no-chat-template", PROMPT],
    "run, --dtype quantized": ["run", "--max-tokens", "16", "--no-chat-template", "--dtype", "quantized", PROMPT],
    "run, --dtype float32": ["run", "--max-tokens", "16", "--no-chat-template", "--dtype", "float32", PROMPT],
    "convert (tensors as stored)": ["convert"],
}
ERROR_TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS"]


def vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of VOCAB tokens: GPT-2's 256 byte symbols, then merges of lowercase letters
    into 2-, 3- and 4-letter tokens, and an end-of-text token."""
    sys.path.insert(0, str(ROOT / "tests"))
    from kquant_llama import byte_tokens

    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [f"{a} {b}" for a in letters for b in letters]
    merges += [f"{a}{b} {c}" for a in letters for b in letters for c in letters]
    merges += [f"{a}{b}{c} {d}" for a in letters for b in letters for c in letters for d in letters]
    merges = merges[: VOCAB - 257]
    return [*byte_tokens(), *(m.replace(" ", "") for m in merges), "<|endoftext|>"], merges


def write_f16(path: Path, layers: int, hidden: int, seed: int = 0) -> None:
    """A random llama as an F16 GGUF, written tensor by tensor (never the whole model in memory)."""
    import gguf

    rng = np.random.default_rng(seed)
    heads, kv_heads, ffn = 16, 4, hidden * 11 // 4 // 256 * 256
    head_dim = hidden // heads
    tokens, merges = vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("random llama (minimlx benchmark)")
    for add, value in [
        (writer.add_context_length, 2048),
        (writer.add_embedding_length, hidden),
        (writer.add_block_count, layers),
        (writer.add_feed_forward_length, ffn),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_freq_base, 10000.0),
        (writer.add_rope_dimension_count, head_dim),
        (writer.add_vocab_size, VOCAB),
        (writer.add_file_type, gguf.LlamaFileType.MOSTLY_F16),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "gpt-2"),
        (writer.add_token_list, tokens),
        (writer.add_token_types, [gguf.TokenType.NORMAL] * (VOCAB - 1) + [gguf.TokenType.CONTROL]),
        (writer.add_token_merges, merges),
        (writer.add_bos_token_id, VOCAB - 1),
        (writer.add_eos_token_id, VOCAB - 1),
        (writer.add_add_bos_token, False),
    ]:
        add(value)
    shapes = {"token_embd.weight": (VOCAB, hidden)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    shapes |= {"output_norm.weight": (hidden,), "output.weight": (VOCAB, hidden)}
    for name, shape in shapes.items():  # norms in float32, as llama.cpp keeps them
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape in shapes.values():
        if len(shape) == 1:
            writer.write_tensor_data((1 + rng.standard_normal(shape) * 0.1).astype(np.float32))
        else:
            scale = 1 / np.sqrt(shape[-1])
            writer.write_tensor_data((rng.standard_normal(shape, np.float32) * scale).astype(np.float16))
    writer.close()


def quantized(folder: Path, name: str, layers: int, hidden: int, recipe: str, llama_quantize: str) -> Path:
    """`folder/name-recipe.gguf`, made now unless it is there."""
    target = folder / f"{name}-{recipe}.gguf"
    if not target.is_file():
        source = folder / f"{name}-F16.gguf"
        if not source.is_file():
            write_f16(source, layers, hidden)
        subprocess.run([llama_quantize, str(source), str(target), recipe, "2"], check=True, capture_output=True)
    return target


def peak_rss(command: list[str], cwd: Path) -> int:
    """The peak resident set of `command` run to completion, in bytes."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{process.stderr.read().decode()[-3000:]}")
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def measure(model: Path, args: list[str], scratch: Path) -> int:
    minimlx = [sys.executable, "-m", "minimlx"]
    if args[0] == "convert":
        out = scratch / f"{model.stem}-mlx"
        try:
            return peak_rss([*minimlx, "convert", str(model), str(out), "--force"], scratch)
        finally:
            subprocess.run(["rm", "-rf", str(out)], check=True)
    return peak_rss([*minimlx, args[0], "--model", str(model), *args[1:]], scratch)


def largest_tensor(model: Path) -> int:
    """The bytes of the largest tensor as minimlx holds it (a packed triple counted whole)."""
    sys.path.insert(0, str(ROOT))
    from minimlx.io.gguf_file import GGUFFile

    file = GGUFFile(model)
    return max(
        sum(np.prod(shape, dtype=np.int64) * dtype.size for shape, dtype in file.layout(name).values())
        for name in file.tensors
    )


def repacking_errors(folder: Path, llama_quantize: str) -> list[tuple[str, str, float, float]]:
    """(type, recipe, relative error, max difference / max |w|) of each re-packed or rounded type."""
    import mlx.core as mx
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from minimlx.io.gguf_file import read_gguf

    worst = {}
    for recipe in ERROR_TYPES:
        path = quantized(folder, "small", 2, 512, recipe, llama_quantize)
        tensors = read_gguf(path)[0]
        for tensor in GGUFReader(path).tensors:
            kind, stem = tensor.tensor_type.name, tensor.name.removesuffix(".weight")
            if f"{stem}.biases" not in tensors or kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
                continue  # floats, and the types held exactly
            reference = dequantize(tensor.data, tensor.tensor_type)
            w = tensors[tensor.name]
            bits = w.shape[-1] * 32 // reference.shape[-1]
            scales, biases = (tensors[f"{stem}.{part}"].astype(mx.float32) for part in ("scales", "biases"))
            ours = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
            relative = float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))
            largest = float(np.abs(ours - reference).max() / np.abs(reference).max())
            held = {"Q4_K": "4-bit (float16 scales)", "Q5_K": "5-bit (float16 scales)"}.get(kind, f"{bits}-bit")
            previous = worst.get(kind, (held, recipe, 0.0, 0.0))
            worst[kind] = (held, recipe, max(previous[2], relative), max(previous[3], largest))
    return [(kind, *values) for kind, values in worst.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize (default: tests/llamacpp.py's build)")
    parser.add_argument("--folder", type=Path, help="where the GGUF files are made, and kept (default: a temp folder)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2560)
    args = parser.parse_args()
    if args.llama_quantize is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from llamacpp import llamacpp_tool

        args.llama_quantize = str(llamacpp_tool("llama-quantize"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        big = quantized(
            folder, f"llama-{args.layers}x{args.hidden}", args.layers, args.hidden, "Q4_K_M", args.llama_quantize
        )
        tiny = quantized(folder, "llama-1x256", 1, 256, "Q4_K_M", args.llama_quantize)
        size, largest = big.stat().st_size, largest_tensor(big)
        print(
            f"{big.name}: {size / 1e6:.0f} MB on disk, largest tensor {largest / 1e6:.0f} MB as held; "
            f"runtime: the same command on {tiny.name} ({tiny.stat().st_size / 1e6:.0f} MB)\n"
        )
        print("| command | peak RSS | vs file | runtime | (peak - runtime) vs file | vs largest tensor |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, command in ROWS.items():
            peak, runtime = measure(big, command, folder), measure(tiny, command, folder)
            print(
                f"| {name} | {peak / 1e6:.0f} MB | {peak / size:.2f}x | {runtime / 1e6:.0f} MB "
                f"| {(peak - runtime) / size:.2f}x | {(peak - runtime) / largest:.2f}x |",
                flush=True,
            )
        print("\n| type | held as | worst in | relative error | max difference / max abs |")
        print("| --- | --- | --- | ---: | ---: |")
        for kind, held, recipe, relative, largest in repacking_errors(folder, args.llama_quantize):
            print(f"| {kind} | {held} | {recipe} | {relative:.1e} | {largest:.1e} |")


if __name__ == "__main__":
    main()
