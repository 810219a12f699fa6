"""minimlx.tune's training loop on a tiny random llama: it learns (LoRA, DoRA, full), a killed run resumes with the
same losses, gradient checkpointing and accumulation change memory and batching but not the numbers, `--seed`
repeats a run."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from minimlx.tune import AdapterSettings
from minimlx.tune.finetune import FULL_WEIGHTS, FineTune, finetune
from minimlx.tune.trainer import STATE_FILE, TrainingSettings

QUICK = dict(batch_size=4, learning_rate=1e-2, steps_per_report=1, steps_per_eval=1000, val_batches=-1)


def run(tune_folders, out, iters=8, report=lambda report: None, data=None, **options):
    model, task = tune_folders
    training = {k: options.pop(k) for k in list(options) if k in TrainingSettings.__dataclass_fields__}
    options.setdefault("num_layers", None)
    job = FineTune(str(model), str(data or task), adapter_path=str(out), **options)
    return finetune(job, TrainingSettings(iters=iters, **{**QUICK, **training}), report, note=lambda line: None)


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_training_lowers_the_validation_loss(tune_folders, tmp_path, kind):
    reports = []
    adapter = AdapterSettings(rank=4, alpha=8, targets="all-linear")
    run(tune_folders, tmp_path, iters=12, report=reports.append, fine_tune_type=kind, adapter=adapter)
    validation = [r.loss for r in reports if r.validation]
    assert len(validation) == 2 and validation[1] < 0.8 * validation[0]
    progress = [r for r in reports if not r.validation]
    assert [r.iteration for r in progress] == list(range(1, 13))
    assert all(r.tokens_per_second > 0 and r.peak_gb > 0 for r in progress)
    written = {p.name for p in tmp_path.iterdir()}
    expected = {FULL_WEIGHTS} if kind == "full" else {"adapter_config.json", "adapter_model.safetensors"}
    assert written == expected | {STATE_FILE}


def test_packing_trains_on_fewer_fuller_rows(tune_folders, tmp_path):
    packed = run(tune_folders, tmp_path, iters=2, pack=True, max_seq_length=40)
    rows = packed.train_batches.rows
    assert len(rows) == 12 and all(len(row.ids) == 36 for row in rows)  # 48 examples of 9 tokens, 4 a row
    assert all(loss > 0 for loss in packed.losses)


def test_full_fine_tuning_trains_the_last_blocks(tune_folders, tmp_path):
    model, _ = tune_folders
    trainer = run(tune_folders, tmp_path, iters=2, fine_tune_type="full", num_layers=1)
    saved = mx.load(str(tmp_path / FULL_WEIGHTS))
    assert saved and all(name.startswith("model.layers.2.") for name in saved)  # Hugging Face names, last block
    base = mx.load(str(model / "model.safetensors"))
    assert all(not mx.array_equal(saved[name], base[name]) for name in saved if name.endswith("proj.weight"))
    assert len(tree_flatten(trainer.model.trainable_parameters())) == len(saved)


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_same_losses(tune_folders, tmp_path):
    """Dropout draws random numbers and the batches are shuffled: both must come back as they were."""
    options = dict(adapter=AdapterSettings(rank=4, dropout=0.2, targets="all-linear"), save_every=3)
    whole = run(tune_folders, tmp_path / "whole", iters=8, **options).losses

    def kill_at_5(report):
        if report.iteration == 5 and not report.validation:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tune_folders, tmp_path / "killed", iters=8, report=kill_at_5, **options)
    resumed = run(tune_folders, tmp_path / "killed", iters=8, resume=True, **options)
    assert resumed.losses == whole[3:]  # from the checkpoint at iteration 3, exactly
    other_seed = run(tune_folders, tmp_path / "other", iters=4, seed=1, **options).losses
    assert run(tune_folders, tmp_path / "again", iters=4, seed=1, **options).losses == other_seed  # --seed repeats
    assert other_seed != whole[:4]


def test_resume_refuses_other_settings_or_no_checkpoint(tune_folders, tmp_path):
    from minimlx.errors import DataError, InvalidSettingError

    with pytest.raises(DataError, match="holds no training_state.safetensors to resume from"):
        run(tune_folders, tmp_path, iters=2, resume=True)
    run(tune_folders, tmp_path, iters=2)
    with pytest.raises(InvalidSettingError, match="was written with other settings \\(learning_rate\\)"):
        run(tune_folders, tmp_path, iters=2, resume=True, learning_rate=0.5)


def test_checkpointing_and_accumulation_keep_the_numbers(tune_folders, tmp_path):
    from tuning import copy_task

    plain = run(tune_folders, tmp_path / "plain", iters=3).losses
    checkpointed = run(tune_folders, tmp_path / "checkpointed", iters=3, grad_checkpoint=True).losses
    np.testing.assert_allclose(checkpointed, plain, rtol=1e-5)
    # four examples with as many trained tokens each: two batches of 2 averaged are one batch of 4
    four = copy_task(tmp_path / "four", train=4, valid=4)
    accumulated = run(tune_folders, tmp_path / "accumulated", 1, data=four, batch_size=2, grad_accumulation_steps=2)
    whole = run(tune_folders, tmp_path / "whole", iters=1, data=four, batch_size=4)
    np.testing.assert_allclose(accumulated.losses, whole.losses, rtol=1e-5)
    after = [dict(tree_flatten(t.model.trainable_parameters())) for t in (accumulated, whole)]
    for name, value in after[0].items():
        np.testing.assert_allclose(np.array(value), np.array(after[1][name]), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_gradient_checkpointing_keeps_less_memory():
    """A stage at a time, the backward pass recomputes what each block made instead of holding it, and the scores
    never exist whole: the same loss and gradients in less peak memory (a 4-block model over 2 x 256 tokens)."""
    from memory_peaks import checkpointing_peaks, in_fresh_process
    from tuning import CONFIG

    results = in_fresh_process(checkpointing_peaks, CONFIG)
    (plain_loss, plain_grads, plain_peak), (loss, grads, peak) = results[False], results[True]
    assert loss == pytest.approx(plain_loss, rel=1e-6) and peak < 0.75 * plain_peak
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, plain_grads[name], rtol=1e-4, atol=1e-7)


def test_resume_adapter_file_starts_from_its_weights(tune_folders, tmp_path):
    reports = []
    adapter = AdapterSettings(rank=4, targets="all-linear")
    run(tune_folders, tmp_path / "first", iters=4, report=reports.append, adapter=adapter)
    run(tune_folders, tmp_path / "second", iters=1, report=reports.append, resume_adapter_file=str(tmp_path / "first"))
    first_end, second_start = [r.loss for r in reports if r.validation][1:3]
    assert second_start == pytest.approx(first_end, rel=1e-6)  # the saved adapter, read back through PEFT's files
