"""`minimlx lora`: fine-tune a model (LoRA, DoRA or chosen blocks in full) with mlx-lm's option names."""

import click

from .group import dtype_option, main


def layers(_context, _option, value: int) -> int | None:
    return None if value == -1 else value


@main.command()
@click.option("--model", required=True, help="A checkpoint folder, .gguf file, repo id or short name.")
@click.option("--train", is_flag=True, expose_value=False, help="Train (what lora does; for mlx-lm's users).")
@click.option("--data", default="data", show_default=True, help="Folder of train/valid/test.jsonl or save_to_disk's.")
@click.option("--fine-tune-type", type=click.Choice(["lora", "dora", "full"]), default="lora", show_default=True)
@click.option("--num-layers", type=int, default=16, show_default=True, callback=layers, help="Last N blocks; -1: all.")
@click.option("--rank", type=int, default=8, show_default=True, help="LoRA rank.")
@click.option("--alpha", type=float, default=16.0, show_default=True, help="LoRA alpha (scale = alpha / rank).")
@click.option("--dropout", type=float, default=0.0, show_default=True, help="LoRA dropout on the adapter's input.")
@click.option(
    "--targets",
    default="q_proj,v_proj",
    show_default=True,
    help="Projections to adapt: Hugging Face names separated by commas (experts: the routed experts' stacked "
    "projections, as PEFT's target_parameters), all-linear, or all (all-linear and the experts).",
)
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--iters", type=int, default=1000, show_default=True, help="Optimizer updates.")
@click.option("--val-batches", type=int, default=25, show_default=True, help="-1: the whole validation split.")
@click.option("--learning-rate", type=float, default=1e-5, show_default=True)
@click.option("--warmup", type=int, default=0, show_default=True, help="Iterations of linear warm-up.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, help="AdamW's decoupled weight decay.")
@click.option("--grad-accumulation-steps", type=int, default=1, show_default=True, help="Batches per update.")
@click.option("--steps-per-report", type=int, default=10, show_default=True)
@click.option("--steps-per-eval", type=int, default=200, show_default=True)
@click.option("--save-every", type=int, default=100, show_default=True, help="Checkpoint every N iterations.")
@click.option("--adapter-path", default="adapters", show_default=True, help="Where the adapter and checkpoints go.")
@click.option("--resume", is_flag=True, help="Continue the run whose checkpoint is in --adapter-path.")
@click.option("--resume-adapter-file", metavar="PATH", help="Start from this adapter's weights (PEFT or mlx-lm).")
@click.option("--max-seq-length", type=int, default=2048, show_default=True, help="Longer examples are cut.")
@click.option("--pack", is_flag=True, help="Concatenate short training examples into rows of --max-seq-length.")
@click.option(
    "--mask-prompt/--no-mask-prompt",
    default=True,
    show_default=True,
    help="Train on the assistant's turns only (or on every token).",
)
@click.option(
    "--grad-checkpoint",
    is_flag=True,
    help="Train a stage at a time: recompute each block in the backward pass, score the vocabulary in tiles "
    "(less memory).",
)
@click.option("--test", is_flag=True, help="After training, print the loss on test.jsonl.")
@click.option("--seed", type=int, default=0, show_default=True)
@dtype_option
def lora(model, data, fine_tune_type, num_layers, rank, alpha, dropout, targets, **options):
    """Fine-tune MODEL on --data, writing the adapter to --adapter-path (PEFT's adapter_config.json and
    adapter_model.safetensors: transformers + PEFT, vLLM and llama.cpp read it).

    Records are chats ({"messages": [...], "tools": [...]}, through the model's chat template), prompt/completion
    pairs or plain text. A progress line every --steps-per-report iterations gives the loss, tokens/s and peak
    memory; the validation loss comes every --steps-per-eval. A run killed mid-way continues with --resume from its
    last checkpoint and computes the same losses an uninterrupted run would.
    """
    from ..tune import AdapterSettings
    from ..tune.finetune import FineTune, finetune
    from ..tune.lora import named_targets
    from ..tune.trainer import TrainingSettings

    training = {name: options.pop(name) for name in list(options) if name in TrainingSettings.__dataclass_fields__}
    settings = TrainingSettings(**training)
    adapter = AdapterSettings(rank=rank, alpha=alpha, dropout=dropout, **named_targets(targets))
    job = FineTune(model, data, fine_tune_type, num_layers, adapter, **options)
    finetune(job, settings, report=click.echo, note=lambda line: click.echo(line, err=True))
