"""Trainer settings for fast, quiet CPU runs, a ready (model, tokenizer, data, collator) set, and
callbacks that watch or break a run: real components only (the Trainer's own collation path, a
callback that keeps a copy of the weights after every optimizer step, so that tests compare
snapshots with the weights the model really had)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

from tests.helpers.data import lm_datasets
from tests.helpers.models import make_tiny_model, train_tiny_tokenizer


def lm_setup(tokenizer=None, seed: int = 0):
    """(model, tokenizer, train, eval, collator) for a tiny Llama."""
    tokenizer = tokenizer or train_tiny_tokenizer()
    train, evaluation = lm_datasets(tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return make_tiny_model(seed=seed), tokenizer, train, evaluation, collator


def quiet_args(**overrides) -> dict:
    """TrainingArguments keywords for fast, silent CPU runs."""
    base = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    base.update(overrides)
    return base


def make_args(output_dir: str | Path, **overrides) -> TrainingArguments:
    """Small, quiet CPU training arguments (:func:`quiet_args`); ``overrides`` win."""
    kwargs = quiet_args(max_steps=12, learning_rate=1e-3)
    kwargs.pop("per_device_eval_batch_size")
    kwargs.pop("data_seed")
    kwargs.update(overrides)
    return TrainingArguments(output_dir=str(output_dir), **kwargs)


class WeightRecorder(TrainerCallback):
    """Keeps, on the main process, the weights and token count after every optimizer step.

    Add it *after* PMACallback: both see the same weights at ``on_step_end``.
    """

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.tokens: dict[int, int] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.tokens[state.global_step] = int(state.num_input_tokens_seen)
        if state.is_world_process_zero:
            self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


class StopAt(TrainerCallback):
    """Raises at the end of optimizer step ``step``: a crash in the middle of training.

    Add it *before* PMACallback, which then never sees that step.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"simulated crash at step {self.step}")


TRAIN_SMALL_TPS = 16 * 4  # tokens per step of train_small: 16-token rows, make_args' batch of 4


def train_small(out: str | Path, callbacks: list, resume: str | None = None, **overrides) -> Trainer:
    """An 8-step Trainer run of a tiny Llama on 16-token rows (``TRAIN_SMALL_TPS`` tokens a step), a
    checkpoint every 4 steps, into ``out`` (``overrides`` go to :func:`make_args`), resumed from
    the checkpoint ``resume`` if given; waits for every PMACallback's writes. Returns the trainer."""
    from hf_pma.snapshots.callback import PMACallback
    from tests.helpers.data import TokenDataset, pad_collate

    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(out, **{"max_steps": 8, "save_strategy": "steps", "save_steps": 4, **overrides}),
        train_dataset=TokenDataset(n=256, min_len=16, max_len=16),
        data_collator=pad_collate,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume)
    for callback in callbacks:
        if isinstance(callback, PMACallback):
            callback.wait()
    return trainer
