"""Launched by tests/snapshots/test_forecast.py under ``accelerate launch`` with 2 CPU processes.

The loop of transformers' ``run_clm_no_trainer.py``: a scheduler built with its warmup and length
scaled by the number of processes (``num_warmup_steps * num_processes``), prepared by accelerate
(whose ``AcceleratedScheduler`` steps it once per process at every optimizer step), gradient
accumulation under ``accelerator.accumulate``, and :class:`hf_pma.training.loop.PMASnapshots`
called on every micro-batch with the automatic interval. Rank 0 writes ``forecast.json``: the
snapshot count the announce line said, and the world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from hf_pma.training.loop import PMASnapshots
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model

STEPS, WARMUP, ACCUMULATION, BATCH = 30, 4, 2, 4


class Said(logging.Handler):
    """The count of the announce line ("... disk: N snapshots of ...")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"disk: (\d+) snapshots of", record.getMessage())
        if found and self.count is None:
            self.count = int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scheduler", default="cosine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    said = Said()
    logging.getLogger("hf_pma").addHandler(said)
    logging.getLogger("hf_pma").setLevel(logging.INFO)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_scheduler(  # as run_clm_no_trainer.py builds it
        args.scheduler,
        optimizer=optimizer,
        num_warmup_steps=WARMUP * world,
        num_training_steps=STEPS * world,
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    pma = PMASnapshots(
        model, accelerator, optimizer=optimizer, lr_scheduler=scheduler, max_steps=STEPS, output_dir=args.out,
        max_overhead=None,
    )
    data = TokenDataset(n=STEPS * ACCUMULATION * BATCH * world, seed=1)
    micro = [pad_collate([data[i * BATCH + j] for j in range(BATCH)]) for i in range(STEPS * ACCUMULATION * world)]
    for i in range(STEPS * ACCUMULATION):
        batch = micro[i * world + rank]
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        pma.step(batch=batch)
    pma.end()
    if rank == 0:
        (args.out / "forecast.json").write_text(json.dumps({"said": said.count, "world_size": world, "steps": pma.global_step}))


if __name__ == "__main__":
    main()
