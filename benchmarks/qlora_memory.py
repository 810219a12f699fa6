"""Peak memory of QLoRA training steps against what a run must hold: the packed model, the adapter and AdamW's state.

    python benchmarks/qlora_memory.py [--layers 30] [--tokens 64 256 512] [--work DIR]

A random llama of SmolLM2-135M's shape (576 wide, 9 heads of which 3 key-value, 1,536 FFN, 49,152 tokens, tied;
--layers of its blocks) written as a 4-bit MLX folder (groups of 64) by `minimlx convert`; LoRA rank 8 on every linear
map; three AdamW steps of one row of each --tokens, each in a fresh process (MLX's peak counter is per process),
differentiated whole and a stage at a time (`minimlx lora --grad-checkpoint`).
"""

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB, DIMS, FFN, HEADS, KV_HEADS = 49152, 576, 1536, 9, 3


def write_random_llama(
    folder: Path, layers: int, vocab=VOCAB, dims=DIMS, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, tied: bool = True
) -> None:
    """A random float32 llama (SmolLM2-135M's widths by default) written as a Hugging Face folder straight from MLX."""
    import mlx.core as mx

    head_dim = dims // heads
    shapes = {"model.embed_tokens.weight": (vocab, dims), "model.norm.weight": (dims,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, dims)
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (dims, dims),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, dims),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, dims),
            f"{p}.self_attn.o_proj.weight": (dims, dims),
            f"{p}.mlp.gate_proj.weight": (ffn, dims),
            f"{p}.mlp.up_proj.weight": (ffn, dims),
            f"{p}.mlp.down_proj.weight": (dims, ffn),
            f"{p}.input_layernorm.weight": (dims,),
            f"{p}.post_attention_layernorm.weight": (dims,),
        }
    tensors = {name: mx.random.uniform(-0.02, 0.02, shape, key=mx.random.key(i))
               for i, (name, shape) in enumerate(shapes.items())}  # fmt: skip
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    config = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=dims,
        intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=tied,
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))


def peaks(folder: str, tokens: int, stagewise: bool) -> tuple[int, int]:
    """(peak bytes over three steps, bytes of the model, adapter and AdamW state), in this (fresh) process."""
    import minimlx  # noqa: F401, I001  (before mlx: its CPU setup)
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from minimlx import load_model
    from minimlx.tune import AdapterSettings, adamw, attach, differentiable, masked_loss
    from minimlx.tune.stages import stagewise_loss_and_grad

    model = differentiable(load_model(folder, dtype="quantized"))
    attach(model, AdapterSettings(rank=8, alpha=16, targets="all-linear"))
    mx.eval(model.parameters())
    optimizer = adamw(1e-4, 10, 2)
    step = stagewise_loss_and_grad if stagewise else nn.value_and_grad(model, masked_loss)
    mx.reset_peak_memory()
    for i in range(3):
        ids = mx.random.randint(0, VOCAB, (1, tokens + 1), key=mx.random.key(i))
        (loss, _), grads = step(model, ids, mx.ones(ids.shape))
        optimizer.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), optimizer.state)
        del grads
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + sum(
        v.nbytes for _, v in tree_flatten(optimizer.state)
    )
    return mx.get_peak_memory(), held


def in_fresh_process(*args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(peaks, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minimlx-bench")
    args = parser.parse_args()
    packed = args.work / f"qlora-{args.layers}-q4"
    if not packed.exists():
        floats = args.work / f"qlora-{args.layers}-f32"
        if not floats.exists():
            write_random_llama(floats, args.layers)
        command = [sys.executable, "-m", "minimlx", "convert", str(floats), str(packed), "--bits", "4"]
        subprocess.run(command + ["--group-size", "64"], check=True, capture_output=True)
    print(f"QLoRA on SmolLM2-135M's shape with {args.layers} blocks, 4-bit, all-linear rank 8, one row per step")
    print("\n| tokens | step | peak MB | held MB | peak / held |\n|---:|---|---:|---:|---:|")
    for tokens in args.tokens:
        for stagewise in (False, True):
            peak, held = in_fresh_process(str(packed), tokens, stagewise)
            name = "a stage at a time" if stagewise else "whole"
            print(f"| {tokens} | {name} | {peak / 1e6:.1f} | {held / 1e6:.1f} | {peak / held:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
