"""Training speed of `minimlx lora` beside `mlx_lm.lora` on SmolLM2-135M-Instruct: same weights, data, rank, batch.

    python benchmarks/lora.py [--iters 30] [--rounds 3] [--num-layers 16] [--batch-size 4] [--rank 8]
                              [--mlx-lm-own-blas] [--work DIR]

Both train LoRA (rank --rank, every linear map of the last --num-layers blocks: mlx-lm's default, minimlx's
`--targets all-linear`) on examples/finetune/data with the loss on every token (mlx-lm's default, minimlx's
`--no-mask-prompt`), in float32 on the SmolLM2 GGUF dequantized to a Hugging Face folder by transformers (cached in
--work). Each run is a fresh process; rounds interleave the two so that a busy machine slows both alike. Tokens/s is
what each prints: the tokens its training steps read over the time they took (validation and loading left out), the
median of its reports after the first (which holds MLX's first-call costs and mlx-lm's compilation).

By default mlx-lm runs with the BLAS minimlx puts under MLX (the same backend: `import minimlx.cpu.blas` first);
`--mlx-lm-own-blas` adds a row for mlx-lm as installed, on the wheel's reference BLAS.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare import ENVIRONMENT, float32_folder, machine, smollm2_gguf  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "examples" / "finetune" / "data"
MLX_LM_REPORT = re.compile(r"^\s*(\d+)\s+[\d.]+ [▼▲]\s+([\d,]+)\s+")  # "  10    1.234 ▼    1,234    5.6k"
MINIMLX_REPORT = re.compile(r"^iter (\d+): loss .*, ([\d,]+) tokens/s")
COLOR = re.compile(r"\x1b\[[0-9;]*m")  # mlx-lm's reports are colored even into a pipe
MLX_LM_MAIN = "import sys{blas}; sys.argv[0] = 'mlx_lm.lora'; from mlx_lm.lora import main; main()"


def minimlx_command(folder: Path, args, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "minimlx", "lora", "--model", str(folder), "--data", str(DATA),
        "--iters", str(args.iters), "--batch-size", str(args.batch_size), "--num-layers", str(args.num_layers),
        "--rank", str(args.rank),
        "--targets", "all-linear", "--no-mask-prompt", "--steps-per-report", str(args.report),
        "--steps-per-eval", str(10 * args.iters), "--val-batches", "1", "--save-every", "0",
        "--learning-rate", "1e-4", "--adapter-path", str(out),
    ]  # fmt: skip


def mlx_lm_command(folder: Path, args, out: Path, own_blas: bool) -> list[str]:
    main = MLX_LM_MAIN.format(blas="" if own_blas else "; import minimlx.cpu.blas")
    return [
        sys.executable, "-c", main, "--model", str(folder), "--train", "--data", str(DATA), "--iters", str(args.iters),
        "--batch-size", str(args.batch_size), "--num-layers", str(args.num_layers), "--steps-per-report",
        str(args.report), "--steps-per-eval", str(10 * args.iters), "--val-batches", "1",
        "--save-every", str(10 * args.iters), "--learning-rate", "1e-4", "--adapter-path", str(out),
    ]  # fmt: skip


def tokens_per_second(command: list[str], report: re.Pattern, rank: int) -> float:
    """The median tokens/s of a run's reports after its first."""
    if "mlx_lm" in command[2]:
        config = Path(command[command.index("--adapter-path") + 1]).with_suffix(".yaml")
        config.write_text(f"lora_parameters:\n  rank: {rank}\n  scale: 2.0\n  dropout: 0.0\n")
        command = [*command, "--config", str(config)]
    finished = subprocess.run(command, capture_output=True, text=True, env=ENVIRONMENT)
    lines = COLOR.sub("", finished.stdout).splitlines()
    rates = [float(m[2].replace(",", "")) for line in lines if (m := report.match(line))]
    if finished.returncode != 0 or len(rates) < 2:
        sys.exit(f"{' '.join(command[:4])} failed:\n{finished.stdout[-2000:]}\n{finished.stderr[-2000:]}")
    return statistics.median(rates[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--report", type=int, default=5, help="iterations per progress report")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--mlx-lm-own-blas", action="store_true")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minimlx-bench")
    args = parser.parse_args()
    folder = float32_folder(smollm2_gguf(), args.work)
    runs = {
        "minimlx lora": lambda out: tokens_per_second(minimlx_command(folder, args, out), MINIMLX_REPORT, args.rank),
        "mlx_lm.lora (same BLAS)": lambda out: tokens_per_second(
            mlx_lm_command(folder, args, out, False), MLX_LM_REPORT, args.rank
        ),
    }
    if args.mlx_lm_own_blas:
        runs["mlx_lm.lora (as installed)"] = lambda out: tokens_per_second(
            mlx_lm_command(folder, args, out, True), MLX_LM_REPORT, args.rank
        )
    rates = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            names = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for name in names:
                rates[name].append(runs[name](Path(scratch) / f"{round_}-{len(rates[name])}-{name.split()[0]}"))
                print(f"round {round_ + 1}: {name}: {rates[name][-1]:,.0f} tokens/s", file=sys.stderr)
    print(f"\nLoRA training on SmolLM2-135M-Instruct (float32), {machine()}")
    print(f"rank {args.rank}, all linear maps of the last {args.num_layers} blocks, batch {args.batch_size},")
    print(f"{args.iters} iterations, examples/finetune/data, medians over {args.rounds} interleaved rounds\n")
    ours = statistics.median(rates["minimlx lora"])
    print(f"| {'run':<28} | {'tokens/s':>9} | {'minimlx / it':>12} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 14}|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name:<28} | {median:>9,.0f} | {ours / median:>11.2f}x |")


if __name__ == "__main__":
    main()
