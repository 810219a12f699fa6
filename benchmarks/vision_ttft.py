"""Time to first token for one 1024 x 768 picture: minimlx beside mlx-vlm on the same backend (MLX on the CPU), reading
the same folders.

    python benchmarks/vision_ttft.py --peer-python /tmp/mlxvlm/bin/python --rounds 2 --dtype float32

Each folder is built here once (under --folder): the published configuration of SmolVLM-256M-Instruct (Idefics3:
SigLIP 12 x 768 over 512-pixel tiles, pixel shuffle by 4, a 30-layer 576-wide LLaMA) or of Qwen2.5-VL-3B-Instruct
(a 32-block 1280-wide window-attention tower, a 36-layer 2048-wide Qwen2), random weights (bfloat16 as published, or
--dtype float32), saved by transformers with its processor (Pillow's image processor, the published settings) and a
byte-level tokenizer whose special tokens sit at the published ids: the layout mlx-vlm reads. mlx-vlm runs in its own
environment (`--peer-python`, e.g. a venv made by `python -m venv /tmp/mlxvlm && /tmp/mlxvlm/bin/pip install
mlx-vlm mlx[cpu]==0.32.4`), which shares nothing with this project's but the BLAS under MLX's float32 matmuls: the
Linux `mlx[cpu]` wheel links the reference BLAS, so the library minimlx loads is preloaded into the peer too
(`--peer-blas`), and both engines run the same MLX on the same BLAS.

Every measurement is a fresh process: it loads the folder (timed apart), answers a short text prompt once (so that
one-time setup is not counted), then times the image prompt from the call to its first token: the picture decoded
and preprocessed, encoded, the prompt prefilled, the token sampled. Rounds interleave the engines; the table gives
medians and the load average during the run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PICTURE = (1024, 768)  # width, height
QUESTION = "Describe this image."

SMOLVLM_256M = dict(  # HuggingFaceTB/SmolVLM-256M-Instruct's config.json
    text_config=dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49280,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=49279,
    ),
    vision_config=dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=512,
        patch_size=16,
    ),
    scale_factor=4,
    image_token_id=49190,
    tie_word_embeddings=False,
)
SMOLVLM_PROCESSOR = dict(  # its preprocessor_config.json
    do_image_splitting=True,
    size={"longest_edge": 2048},
    max_image_size={"longest_edge": 512},
    resample=1,  # Lanczos
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)

QWEN2_5_VL_3B = dict(  # Qwen/Qwen2.5-VL-3B-Instruct's config.json
    text_config=dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=128000,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_chans=3,
        out_hidden_size=2048,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        hidden_act="silu",
        tokens_per_second=2,
    ),
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    tie_word_embeddings=True,
)
QWEN_PROCESSOR = dict(  # its preprocessor_config.json
    min_pixels=3136,
    max_pixels=12845056,
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
QWEN_SPECIALS = [  # from id 151643 on, as Qwen2.5's tokenizer numbers them
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
SMOLVLM_SPECIALS = [  # from id 49152 on: the global image, the 6 x 6 tile positions, the image tokens
    "<global-img>",
    *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
    "<fake_token_around_image>",
    "<image>",
    "<|im_start|>",
    "<end_of_utterance>",
]

MODELS = {
    "smolvlm": dict(
        label="SmolVLM-256M shape (Idefics3)",
        family="Idefics3",
        config=SMOLVLM_256M,
        processor=SMOLVLM_PROCESSOR,
        specials=(49152, SMOLVLM_SPECIALS),
        eos="<end_of_utterance>",
        prompt=f"<|im_start|>User:<image>{QUESTION}<end_of_utterance>\nAssistant:",
    ),
    "qwen2_5_vl": dict(
        label="Qwen2.5-VL-3B shape",
        family="Qwen2_5_VL",
        config=QWEN2_5_VL_3B,
        processor=QWEN_PROCESSOR,
        specials=(151643, QWEN_SPECIALS),
        eos="<|im_end|>",
        prompt="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
    ),
}


def save_tokenizer(folder: Path, first_special: int, specials: list[str], eos: str) -> None:
    """A byte-level tokenizer (one token per byte, GPT-2's alphabet), padded with unused tokens so that `specials`
    take the ids from `first_special` on, as the published tokenizer numbers them."""
    import tokenizers
    import transformers

    alphabet = [chr(b) if 33 <= b < 127 else chr(256 + b) for b in range(256)]
    vocab = {c: i for i, c in enumerate(alphabet)} | {f"<unused_{i}>": i for i in range(256, first_special)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos)
    return tokenizer


def build(name: str, folder: Path, dtype: str = "bfloat16") -> None:
    """The folder of model `name`: random weights in `dtype`, saved by transformers with its processor."""
    import torch
    import transformers

    spec = MODELS[name]
    if (folder / "config.json").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    config = getattr(transformers, f"{spec['family']}Config")(**spec["config"])
    torch.manual_seed(0)
    model_class = getattr(transformers, f"{spec['family']}ForConditionalGeneration")
    model = model_class._from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # norms about 1: activations stay in range over the depth of a random model
        for parameter_name, weight in model.named_parameters():
            if weight.ndim == 1 and ("norm" in parameter_name or "ln_q" in parameter_name):
                weight.fill_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    tokenizer = save_tokenizer(folder, *spec["specials"], spec["eos"])
    if spec["family"] == "Qwen2_5_VL":  # (its processor wants a video processor too: the parts saved one by one)
        transformers.Qwen2VLImageProcessorPil(**spec["processor"]).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        saved = json.loads((folder / "config.json").read_text())  # the text settings at the top too, as published
        saved["vision_config"].pop("model_type", None)  # (the published tower names none)
        (folder / "config.json").write_text(json.dumps({**saved["text_config"], **saved}, indent=2))
    else:
        images = transformers.Idefics3ImageProcessorPil(**spec["processor"])
        processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=64)
        processor.save_pretrained(folder)
    print(f"built {folder} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def picture(path: Path) -> Path:
    """A 1024 x 768 picture with structure (gradients and noise), as a PNG."""
    if not path.is_file():
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(0)
        y, x = np.mgrid[: PICTURE[1], : PICTURE[0]]
        pixels = np.stack([x * 255 / PICTURE[0], y * 255 / PICTURE[1], (x + y) % 256], axis=-1)
        pixels = np.clip(pixels + rng.normal(0, 20, pixels.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path)
    return path


def measure(engine: str, folder: str, image: str, prompt: str) -> dict:
    """(in the worker process) load seconds and time to first token of `prompt` with `image`."""
    started = time.perf_counter()
    if engine == "minimlx":
        import minimlx

        model, tokenizer = minimlx.load(folder)
        loaded = time.perf_counter()

        def first_token(text, images):
            options = dict(chat_template=False, images=images, max_tokens=1)
            return next(iter(minimlx.stream_generate(model, tokenizer, text, **options))).token
    else:
        from mlx_vlm import load, stream_generate

        model, processor = load(folder)
        loaded = time.perf_counter()

        def first_token(text, images):
            return next(iter(stream_generate(model, processor, text, image=images, max_tokens=1))).token

    first_token("Hello there.", None)  # one-time setup, not counted
    begin = time.perf_counter()
    token = first_token(prompt, [image])
    return {"load_s": loaded - started, "ttft_s": time.perf_counter() - begin, "token": int(token)}


def run_worker(
    python: str, engine: str, folder: Path, image: Path, prompt: str, timeout: float, peer_blas: str | None
) -> dict | None:
    """One measurement in a fresh process; None where it failed or ran past `timeout`."""
    command = [python, __file__, "--worker", engine, "--folder", str(folder), "--image", str(image), "--prompt", prompt]
    env = dict(os.environ)
    if engine != "minimlx":
        env.pop("PYTHONPATH", None)  # the peer's environment holds nothing of this project
        if peer_blas:  # bound before mlx.core's own reference BLAS, as minimlx binds its library
            env |= {"LD_PRELOAD": peer_blas, "MKL_THREADING_LAYER": "GNU", "OMP_WAIT_POLICY": "PASSIVE"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        print(f"{engine}: past {timeout:.0f} s", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"{engine} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-python", help="the python of an environment with mlx-vlm (none: minimlx alone)")
    parser.add_argument(
        "--peer-blas",
        default="same",
        help="the BLAS library preloaded into the peer: 'same' (the one minimlx loads), a path, or 'none'",
    )
    parser.add_argument("--folder", default="/tmp/minimlx-vision-ttft", help="where the model folders are built")
    parser.add_argument("--models", default="smolvlm,qwen2_5_vl", help="of: " + ", ".join(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the weights' dtype in the folders both engines read (MLX's CPU matmuls are far faster in float32)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one measurement may take")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--image", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.folder, args.image, args.prompt)))
        return

    if args.peer_blas == "same":
        from minimlx.cpu import blas

        args.peer_blas = blas.loaded
    peer_blas = None if args.peer_blas == "none" else args.peer_blas
    if peer_blas is not None and not os.path.isfile(peer_blas):
        parser.error(f"--peer-blas {peer_blas}: no such library; give a BLAS library's path, 'same' or 'none'")
    root = Path(args.folder) / args.dtype
    root.mkdir(parents=True, exist_ok=True)
    image = picture(root / "picture-1024x768.png")
    engines = [("minimlx", sys.executable)] + ([("mlx-vlm", args.peer_python)] if args.peer_python else [])
    rows = []
    loads = [os.getloadavg()[0]]
    for name in args.models.split(","):
        spec = MODELS[name]
        folder = root / name
        build(name, folder, args.dtype)
        times: dict[str, list[dict]] = {engine: [] for engine, _ in engines}
        for round_ in range(args.rounds):
            for engine, python in engines if round_ % 2 == 0 else engines[::-1]:
                result = run_worker(python, engine, folder, image, spec["prompt"], args.timeout, peer_blas)
                loads.append(os.getloadavg()[0])
                if result is not None:
                    times[engine].append(result)
                    print(f"{name} round {round_ + 1} {engine}: {result}", file=sys.stderr)
        for engine, _ in engines:
            got = times[engine]
            ttft = statistics.median(r["ttft_s"] for r in got) if got else None
            load = statistics.median(r["load_s"] for r in got) if got else None
            rows.append((spec["label"], engine, ttft, load, len(got)))
    print(
        f"\n1024 x 768 picture, {args.dtype} weights, {args.rounds} interleaved rounds, medians; MLX on the CPU; "
        f"the peer's BLAS: {peer_blas or 'its own'}; "
        f"load average {min(loads):.1f}-{max(loads):.1f} (1 min) during the run\n"
    )
    print("| model | engine | time to first token s | load s | runs |")
    print("| --- | --- | ---: | ---: | ---: |")
    for label, engine, ttft, load, runs in rows:
        shown = f"{ttft:.2f}" if ttft is not None else "did not finish"
        print(
            f"| {label} | {engine} | {shown} | {load:.1f} | {runs} |"
            if load
            else f"| {label} | {engine} | {shown} | - | 0 |"
        )


if __name__ == "__main__":
    main()
