"""A tiny Trainer run with an online average, killed by SIGKILL at a chosen point around a
checkpoint, or resumed from its latest checkpoint; run by tests/snapshots/test_online_kill_resume.py,
which compares the resumed run's final average with an uninterrupted run's (``--kill none``).

Kill points (``--kill``), at the checkpoint of ``KILL_STEP``:

* ``on_save``: the Trainer has written ``checkpoint-<KILL_STEP>`` whole (model, optimizer,
  ``trainer_state.json``, and the rotation of older checkpoints), and PMACallback's ``on_save``,
  which puts the average into it, has not run: the callback listed before it dies there.
* ``after_stage``: the step's checkpoint is due and PMACallback has seen the step's last event
  before it (the average's state for it is staged); the Trainer has not begun the checkpoint.
* ``none``: no kill; ``--resume`` resumes from the latest checkpoint, ``--resume-from`` from the one named.

At the end the average (float32, as the run holds it) is written to ``<out>/final.safetensors``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainerCallback

from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args

SEQ_LEN = 16
BATCH = 4
TOKENS_PER_STEP = SEQ_LEN * BATCH
MAX_STEPS = 12
SAVE_STEPS = 4
KILL_STEP = 8


class KillOnSave(TrainerCallback):
    """Dies at ``on_save`` of ``KILL_STEP``; listed before PMACallback, whose ``on_save`` never runs."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


class KillAfterStage(TrainerCallback):
    """Dies once PMACallback has seen the last event of ``KILL_STEP`` before its checkpoint (the
    step's log, or its end when it logs nothing); listed after PMACallback."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == KILL_STEP and control.should_save and not control.should_log:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_log(self, args, state, control, **kwargs):
        if state.global_step == KILL_STEP and control.should_save:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill", choices=["none", "on_save", "after_stage"], default="none")
    parser.add_argument("--resume", action="store_true", help="from the latest checkpoint")
    parser.add_argument("--resume-from", default=None, help="from this checkpoint")
    parser.add_argument("--online", default="sma")
    parser.add_argument("--window-steps", type=int, default=None)
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--save-total-limit", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    window = args.window_steps * TOKENS_PER_STEP if args.window_steps else None
    callback = PMACallback(interval_tokens=TOKENS_PER_STEP, online=args.online, online_window_tokens=window)
    before = [KillOnSave()] if args.kill == "on_save" else []
    after = [KillAfterStage()] if args.kill == "after_stage" else []
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(
            args.out,
            max_steps=MAX_STEPS,
            per_device_train_batch_size=BATCH,
            save_strategy="steps",
            save_steps=SAVE_STEPS,
            save_total_limit=args.save_total_limit,
            logging_steps=args.logging_steps,
        ),
        train_dataset=TokenDataset(n=256, min_len=SEQ_LEN, max_len=SEQ_LEN),
        data_collator=pad_collate,
        callbacks=[*before, callback, *after],
    )
    trainer.train(resume_from_checkpoint=args.resume_from or (True if args.resume else None))
    if args.kill != "none":
        raise SystemExit(f"should have been killed at step {KILL_STEP}")
    save_file(callback.online_state_dict(), str(args.out / "final.safetensors"))


if __name__ == "__main__":
    main()
