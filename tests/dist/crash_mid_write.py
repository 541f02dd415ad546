"""Train with PMACallback and die by SIGKILL while the background writer is half-way through
the weights file of the third snapshot (a power cut, an OOM kill).

Launched as a subprocess by tests/test_callback.py, which then checks the manifest left on
disk and resumes the run in-process with :func:`make_trainer`.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from transformers import Trainer

from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args

SEQ_LEN = 16
BATCH = 4
TOKENS_PER_STEP = SEQ_LEN * BATCH
INTERVAL_STEPS = 3
MAX_STEPS = 20
SAVE_STEPS = 4
CRASH_AT_SNAPSHOT = 3  # snapshots at steps 3, 6, 9: die while writing the one of step 9


def make_trainer(out: Path, callbacks: list) -> tuple[Trainer, PMACallback]:
    """The run's Trainer (the same for the crashed run and its resumption)."""
    torch.set_num_threads(1)
    args = make_args(
        out,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
    )
    callback = PMACallback(interval_tokens=INTERVAL_STEPS * TOKENS_PER_STEP)
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=TokenDataset(n=256, min_len=SEQ_LEN, max_len=SEQ_LEN),
        data_collator=pad_collate,
        callbacks=[*callbacks, callback],
    )
    return trainer, callback


def die_mid_write() -> None:
    """Make the writer thread kill the process after writing half of a tensor of the N-th file."""
    from hf_pma.io import safetensors as safetensors_io

    original = safetensors_io.SafetensorsWriter.write
    files: list[Path] = []

    def write(self, name, chunk):
        if self.path not in files:
            files.append(self.path)
        if len(files) == CRASH_AT_SNAPSHOT:
            original(self, name, chunk[: max(1, len(chunk) // 2)])
            self._fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, chunk)

    safetensors_io.SafetensorsWriter.write = write


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    die_mid_write()
    trainer, _ = make_trainer(a.out, [])
    trainer.train()
    raise SystemExit("the run should have been killed while writing a snapshot")
