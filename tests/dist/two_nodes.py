"""Two simulated nodes: ``torchrun --nproc_per_node 2`` where each rank has its own output folder.

With ``--separate`` each rank trains into ``OUT/node<rank>`` (as ranks on two machines with
node-local disks would see one path on two disks); without it both share ``OUT/shared``.
Each rank writes ``result-rank<r>.json``: the error it stopped with (or none) and when.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import Trainer

from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args


def run(out: Path, separate: bool = True) -> dict:
    """Train with each rank in its own folder (``separate``) or a shared one; writes and returns the report."""
    rank = int(os.environ["RANK"])
    folder = out / (f"node{rank}" if separate else "shared")
    args = make_args(folder, max_steps=2, ddp_backend="gloo", per_device_train_batch_size=2)
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=TokenDataset(n=16),
        data_collator=pad_collate,
        callbacks=[PMACallback(interval_tokens=32)],
    )
    start = time.monotonic()
    error = None
    try:
        trainer.train()
    except RuntimeError as err:
        error = str(err)
    report = {
        "rank": rank,
        "world_size": args.world_size,
        "error": error,
        "seconds": time.monotonic() - start,
    }
    (out / f"result-rank{rank}.json").write_text(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--separate", action="store_true")
    a = parser.parse_args()
    torch.set_num_threads(1)
    run(a.out, a.separate)


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
