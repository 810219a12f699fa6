"""A fine-tuning run as `minimlx lora` starts it: the data read and checked, the model loaded with what it trains
(LoRA or DoRA adapters, or whole blocks), the trainer run, the adapter (or the trained weights) written."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import DataError, InvalidSettingError
from .data import Batches, Encoder, encode, pack, read_splits
from .formats import check_writable, load_adapter, save_adapter
from .lora import AdapterSettings, attach
from .train import differentiable
from .trainer import Trainer, TrainingSettings, saved_state

FINE_TUNE_TYPES = ("lora", "dora", "full")
FULL_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class FineTune:
    """What to fine-tune, on what, and where the result goes (the names of `minimlx lora`'s options).

    `fine_tune_type` "full" trains every parameter of the last `num_layers` blocks (None: all) and writes them to
    `adapter_path`/model.safetensors under the checkpoint's names; "lora" and "dora" train the adapter `adapter`
    describes on those blocks and write it in PEFT's format. `resume` continues the run whose checkpoint is in
    `adapter_path`; `resume_adapter_file` starts from the weights of an adapter folder (PEFT's or mlx-lm's)."""

    model: str
    data: str
    fine_tune_type: str = "lora"
    num_layers: int | None = 16
    adapter: AdapterSettings = field(default_factory=AdapterSettings)
    adapter_path: str = "adapters"
    max_seq_length: int = 2048
    mask_prompt: bool = True
    pack: bool = False
    resume: bool = False
    resume_adapter_file: str | None = None
    test: bool = False
    dtype: str | None = None

    def __post_init__(self):
        if self.fine_tune_type not in FINE_TUNE_TYPES:
            raise InvalidSettingError(f"--fine-tune-type must be one of {', '.join(FINE_TUNE_TYPES)}")
        if self.max_seq_length < 2:
            raise InvalidSettingError(f"--max-seq-length must be at least 2, got {self.max_seq_length}")
        if self.num_layers is not None and self.num_layers < 1:
            raise InvalidSettingError(f"--num-layers must be -1 (all) or at least 1, got {self.num_layers}")
        if self.fine_tune_type == "full" and self.resume_adapter_file:
            raise InvalidSettingError("--resume-adapter-file reads an adapter; --fine-tune-type full trains no adapter")
        if self.resume and self.resume_adapter_file:
            raise InvalidSettingError("--resume continues a run, --resume-adapter-file starts one: pass one of them")


def finetune(job: FineTune, settings: TrainingSettings, report: Callable = print, note: Callable = print) -> Trainer:
    """Run `job`: progress lines to `report`, notes (what --max-seq-length cut, a missing validation split) to
    `note`. Returns the trainer (its `losses`, `iteration`)."""
    from ..loading import load

    splits = read_splits(job.data)
    if not splits["train"]:
        raise DataError(f"{job.data} holds no training records; put them in {Path(job.data) / 'train.jsonl'}")
    if job.test and not splits["test"]:
        raise DataError(f"--test reads {Path(job.data) / 'test.jsonl'}, which is missing or empty")
    if job.resume:
        saved_state(Path(job.adapter_path))
    model, tokenizer = load(job.model, job.dtype or training_dtype())
    encoder = Encoder(tokenizer, job.mask_prompt)
    batches = {}
    for split, records in splits.items():
        examples, cut = encode(records, encoder, job.max_seq_length)
        if cut.count:
            note(f"{split}: {cut}")
        rows = pack(examples, job.max_seq_length) if job.pack and split == "train" else examples
        whole = split != "train"
        batches[split] = Batches(rows, settings.batch_size, split, whole) if rows else None
    if batches["valid"] is None:
        note(f"no validation records ({Path(job.data) / 'valid.jsonl'}): training without a validation loss")
    mx.random.seed(settings.seed)
    prepare(model, job)
    folder = Path(job.adapter_path)
    trainer = Trainer(model, settings, batches["train"], batches["valid"], folder, saver(job, folder), report)
    if job.resume:
        trainer.resume()
    trainer.run()
    if job.test:
        note(f"test loss {trainer.evaluate(batches['test']):.4f}")
    return trainer


def training_dtype() -> str | None:
    """float32 on the CPU (MLX's fast CPU matmuls are float32 ones; the native kernel's packed forms have no
    gradients), the checkpoint's own dtype elsewhere."""
    return "float32" if mx.default_device() == mx.cpu else None


def prepare(model: nn.Module, job: FineTune) -> None:
    """Make `model` train what `job` asks: adapters attached (or read from `resume_adapter_file`), or the last
    `num_layers` blocks unfrozen; everything else frozen."""
    differentiable(model)
    if job.fine_tune_type == "full":
        model.freeze()
        for block in model.layers[-job.num_layers if job.num_layers else 0 :]:
            block.unfreeze()
    elif job.resume_adapter_file:
        folder = Path(job.resume_adapter_file)
        load_adapter(model, folder if folder.is_dir() else folder.parent)
        check_writable(model)  # an adapter its checkpoints could not hold: refused before training, not after
    else:
        attach(model, replace(job.adapter, dora=job.fine_tune_type == "dora", layers=job.num_layers))


def saver(job: FineTune, folder: Path) -> Callable[[nn.Module], None]:
    """What a checkpoint writes: the adapter in PEFT's format, or the trained blocks under the checkpoint's names."""
    if job.fine_tune_type != "full":
        return lambda model: save_adapter(model, folder, base_model=job.model)

    def save_blocks(model: nn.Module) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        trained = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(str(folder / FULL_WEIGHTS), model.config.names.to_theirs(trained), {"format": "pt"})

    return save_blocks
