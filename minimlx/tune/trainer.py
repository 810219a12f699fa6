"""The training loop: batches through the model's own forward pass, AdamW on a warm-up + cosine schedule, gradient
accumulation, a validation loss every K iterations, and checkpoints a killed run resumes from exactly.

An iteration is one optimizer update over `grad_accumulation_steps` batches. Which batch a step reads depends only on
the seed and the step (`data.Batches`), so do the random numbers an iteration draws (LoRA dropout), and a checkpoint
holds the trained parameters and the optimizer's state: a resumed run computes the same losses an uninterrupted one
does.
"""

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..errors import CheckpointError, DataError, InvalidSettingError
from .data import Batches
from .stages import stagewise_loss, stagewise_loss_and_grad
from .train import adamw, masked_loss

STATE_FILE = "training_state.safetensors"


@dataclass(frozen=True)
class TrainingSettings:
    """How to train (the names of `minimlx lora`'s options). `warmup` iterations of linear warm-up, then a cosine
    decay to 0 at `iters`; `val_batches` -1 reads the whole validation split; `save_every` 0 saves only at the end."""

    iters: int = 1000
    batch_size: int = 4
    learning_rate: float = 1e-5
    warmup: int = 0
    weight_decay: float = 0.0
    grad_accumulation_steps: int = 1
    grad_checkpoint: bool = False
    steps_per_report: int = 10
    steps_per_eval: int = 200
    val_batches: int = 25
    save_every: int = 100
    seed: int = 0

    def __post_init__(self):
        positive = ("iters", "batch_size", "grad_accumulation_steps", "steps_per_report", "steps_per_eval")
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidSettingError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise InvalidSettingError(f"--learning-rate must be positive, got {self.learning_rate}")
        if not 0 <= self.warmup < self.iters:
            raise InvalidSettingError(f"--warmup must be from 0 to --iters - 1, got {self.warmup}")
        if self.val_batches == 0 or self.val_batches < -1 or self.save_every < 0:
            raise InvalidSettingError(
                "--val-batches must be -1 (all) or at least 1, --save-every 0 (at the end) or more"
            )


@dataclass
class Report:
    """What a progress line says: an iteration's training loss (the mean since the last report), or a validation
    loss; tokens/s counts the tokens read (padding not counted), peak memory is MLX's since the run began."""

    iteration: int
    loss: float
    validation: bool = False
    learning_rate: float = 0.0
    tokens_per_second: float = 0.0
    peak_gb: float = 0.0

    def __str__(self) -> str:
        if self.validation:
            return f"iter {self.iteration}: validation loss {self.loss:.4f}"
        return (
            f"iter {self.iteration}: loss {self.loss:.4f}, learning rate {self.learning_rate:.3g}, "
            f"{self.tokens_per_second:,.0f} tokens/s, peak memory {self.peak_gb:.2f} GB"
        )


class Trainer:
    """Trains `model`'s trainable parameters (an adapter's, or chosen layers') on `train` batches.

    `save(model)` writes what the run produces (the adapter) and is called at each checkpoint and at the end, beside
    the training state in `folder`; `report(Report)` is called for each progress line."""

    def __init__(
        self,
        model: nn.Module,
        settings: TrainingSettings,
        train: Batches,
        valid: Batches | None,
        folder: Path,
        save: Callable[[nn.Module], None],
        report: Callable[[Report], None] = print,
    ):
        self.model, self.settings, self.train_batches, self.valid = model, settings, train, valid
        self.folder, self.save, self.report = Path(folder), save, report
        self.optimizer = adamw(settings.learning_rate, settings.iters, settings.warmup, 0.0, settings.weight_decay)
        self.iteration = 0
        self.losses: list[float] = []  # each iteration's training loss, from `iteration` on
        self.plain = stagewise_loss_and_grad if settings.grad_checkpoint else nn.value_and_grad(model, masked_loss)
        self.compiled = None if settings.grad_checkpoint else compiled_loss_and_grad(model)
        self.first_of_shape: dict[tuple[int, int], int] = {}  # each batch shape's first step in the schedule
        self.scanned = 0  # the schedule's steps read into first_of_shape
        model.checkpoint_blocks = settings.grad_checkpoint  # where the stages cannot be apart: `mx.checkpoint`

    def run(self) -> list[float]:
        """Train from `self.iteration` to `iters`; returns the losses of the iterations it ran."""
        s, model = self.settings, self.model
        mx.reset_peak_memory()
        if self.valid is not None and self.iteration == 0:
            self.report(Report(0, self.evaluate(), validation=True))
        model.train()
        window, tokens, elapsed = [], 0, 0.0
        while self.iteration < s.iters:
            start = time.perf_counter()
            loss, read = self.step()
            elapsed += time.perf_counter() - start  # training time only: reports and validation are left out
            self.iteration += 1
            self.losses.append(loss)
            window.append(loss)
            tokens += read
            it = self.iteration
            if it % s.steps_per_report == 0 or it == s.iters:
                rate, peak = self.optimizer.learning_rate.item(), mx.get_peak_memory() / 1e9
                self.report(Report(it, sum(window) / len(window), False, rate, tokens / elapsed, peak))
                window, tokens, elapsed = [], 0, 0.0
            if self.valid is not None and (it % s.steps_per_eval == 0 or it == s.iters):
                self.report(Report(it, self.evaluate(), validation=True))
                model.train()
            if (s.save_every and it % s.save_every == 0) or it == s.iters:
                self.checkpoint()
        return self.losses

    def step(self) -> tuple[float, int]:
        """One iteration: the gradients of `grad_accumulation_steps` batches, averaged, then one update. Returns the
        mean of the batches' losses and how many tokens they held."""
        s, accumulated, losses, read = self.settings, None, [], 0
        mx.random.seed(int(np.random.SeedSequence([s.seed, self.iteration]).generate_state(1)[0]))  # dropout's draws
        for k in range(s.grad_accumulation_steps):
            index = self.iteration * s.grad_accumulation_steps + k
            batch = self.train_batches.at(index, s.seed)
            (loss, _), grads = self.loss_and_grad(index)(self.model, batch.ids, batch.mask)
            accumulated = grads if accumulated is None else tree_map(mx.add, accumulated, grads)
            mx.eval(loss, accumulated)
            losses.append(loss.item())
            read += batch.tokens
        if s.grad_accumulation_steps > 1:
            accumulated = tree_map(lambda g: g / s.grad_accumulation_steps, accumulated)
        self.optimizer.update(self.model, accumulated)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)
        return sum(losses) / len(losses), read

    def loss_and_grad(self, index: int):
        """How batch `index` is differentiated: compiled where an earlier batch of the schedule had its shape (a shape
        met once would pay for its compilation and gain nothing), which depends on the schedule only, so that a
        resumed run computes each step as an uninterrupted one does."""
        if self.compiled is None:
            return self.plain
        shape = self.train_batches.shape_at(index, self.settings.seed)
        while self.scanned <= index:
            self.first_of_shape.setdefault(self.train_batches.shape_at(self.scanned, self.settings.seed), self.scanned)
            self.scanned += 1
        return self.compiled if self.first_of_shape[shape] < index else self.plain

    def evaluate(self, batches: Batches | None = None) -> float:
        """The mean loss over the trained tokens of the first `val_batches` validation batches (or of `batches`)."""
        self.model.eval()
        count = None if self.settings.val_batches == -1 or batches is not None else self.settings.val_batches
        total, tokens = mx.array(0.0), mx.array(0.0)
        for batch in (batches or self.valid).in_order(count):
            loss, counted = (stagewise_loss if self.settings.grad_checkpoint else masked_loss)(
                self.model, batch.ids, batch.mask
            )
            total, tokens = total + loss * counted, tokens + counted
            mx.eval(total, tokens)
        return (total / mx.maximum(tokens, 1)).item()

    def checkpoint(self) -> None:
        """Write the adapter (`save`) and the training state a resumed run starts from."""
        self.save(self.model)
        arrays = {f"model.{k}": v for k, v in tree_flatten(self.model.trainable_parameters())}
        arrays |= {f"optimizer.{k}": v for k, v in tree_flatten(self.optimizer.state)}
        metadata = {"iteration": str(self.iteration), "settings": json.dumps(asdict(self.settings))}
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f".{STATE_FILE}"
        mx.save_safetensors(str(partial), arrays, metadata)
        os.replace(partial, self.folder / STATE_FILE)  # a run killed while writing keeps the previous checkpoint

    def resume(self) -> None:
        """Continue from the checkpoint in `folder`: parameters, optimizer state and iteration."""
        path = saved_state(self.folder)
        arrays, metadata = mx.load(str(path), return_metadata=True)
        saved = TrainingSettings(**json.loads(metadata["settings"]))
        changed = [name for name, value in asdict(saved).items() if value != getattr(self.settings, name)]
        if any(name not in ("steps_per_report", "steps_per_eval", "val_batches", "save_every") for name in changed):
            raise InvalidSettingError(
                f"{path} was written with other settings ({', '.join(changed)}); resume with the same ones"
            )
        part = {prefix: {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)} for prefix in PARTS}
        trained = {k: v.shape for k, v in tree_flatten(self.model.trainable_parameters())}
        if {k: v.shape for k, v in part["model."].items()} != trained:
            raise CheckpointError(
                f"{path} holds other trained parameters than this run trains (another model, rank, layers or "
                "fine-tune type); resume with the settings it was written with"
            )
        self.model.load_weights(list(part["model."].items()), strict=False)
        self.optimizer.state = tree_unflatten(list(part["optimizer."].items()))
        self.iteration = int(metadata["iteration"])
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)


def compiled_loss_and_grad(model: nn.Module):
    """`masked_loss` and its gradients as one compiled graph (`mx.compile`: its elementwise ops fused), recompiled for
    each batch shape (`data.PAD_TO` keeps those few). The model's parameters and the random state (LoRA dropout's) are
    read as they are at each call."""
    value_and_grad = nn.value_and_grad(model, masked_loss)
    state = [model.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def loss_and_grad(ids: mx.array, mask: mx.array):
        return value_and_grad(model, ids, mask)

    return lambda model, ids, mask: loss_and_grad(ids, mask)


def saved_state(folder: Path) -> Path:
    """The training state file a run resumes from, in `folder`."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise DataError(f"{folder} holds no {STATE_FILE} to resume from; drop --resume to start afresh")
    return path


PARTS = ("model.", "optimizer.")
"""The parts of a training state file, by the prefix of their tensors' names."""
