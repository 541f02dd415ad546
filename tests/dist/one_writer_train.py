"""Launched by tests/test_one_writer.py: a tiny training with PMACallback into ``OUT``.

``python one_writer_train.py OUT [READY GO]``: with READY and GO, the training writes the file
READY once its first optimizer step is done (it holds its snapshot folder then) and goes on only
once the file GO exists (a barrier the test controls). ``python one_writer_train.py OUT --after
READY``: the training starts once the file READY exists (its imports are done by then). A training refused at its start prints
``REFUSED rank <r>: <the error>`` on stderr and exits with status 3. Under ``torchrun`` every
rank does the same (gloo on CPU).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args

SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


class Barrier(TrainerCallback):
    """After optimizer step 1: write ``ready``, then wait for ``go`` (polled: the test creates it)."""

    def __init__(self, ready: Path, go: Path) -> None:
        self.ready, self.go = ready, go

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        self.ready.write_text(str(os.getpid()))
        wait_for(self.go)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def main(out: Path, ready: Path | None = None, go: Path | None = None, after: Path | None = None) -> int:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = make_args(
        out,
        max_steps=4,
        per_device_train_batch_size=BATCH,
        save_strategy="no",
        ddp_backend="gloo" if world > 1 else None,
    )
    callbacks = [PMACallback(interval_tokens=TPS * world)]
    if ready is not None:
        callbacks.append(Barrier(ready, go))
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=TokenDataset(n=64, min_len=SEQ, max_len=SEQ),
        data_collator=pad_collate,
        callbacks=callbacks,
    )
    if after is not None:
        wait_for(after)
    try:
        trainer.train()
    except FileExistsError as err:
        print(f"REFUSED rank {args.process_index}: {err}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[1:2] == ["--after"]:
        sys.exit(main(Path(argv[0]), after=Path(argv[2])))
    sys.exit(main(*map(Path, argv)))
