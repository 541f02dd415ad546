"""Launched by tests/training/test_loop.py under ``accelerate launch`` with 2 CPU processes.

The loop of tests/training/test_loop.py with DDP: every process trains on its half of each
batch, :class:`hf_pma.training.loop.PMASnapshots` sums the tokens over both. At step 5 the
merge of the last 2 snapshots is swapped in on every process and the live weights put back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator

from hf_pma.training.loop import PMASnapshots
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model

# The loop's data and schedule (tests/training/test_loop.py runs the same loop in one process).
STEPS = 6
BATCH = 4
SEQ = 16
INTERVAL = 2 * BATCH * SEQ  # a snapshot every 2 steps
LR = 3e-3


def batches() -> list[dict]:
    data = TokenDataset(n=STEPS * BATCH, seed=1)
    return [pad_collate([data[i * BATCH + j] for j in range(BATCH)]) for i in range(STEPS)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    pma = PMASnapshots(
        model,
        accelerator,
        optimizer=optimizer,
        output_dir=args.out,
        interval_tokens=INTERVAL,
        phases=("warmup", "stable", "decay"),
    )
    restored = None
    for step, full in enumerate(batches(), 1):
        batch = {k: v[rank::world] for k, v in full.items()}
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        pma.step(batch=batch)
        if step == 5:
            before = [p.detach().clone() for p in model.parameters()]
            with pma.swapped(model, last=2):
                pass
            restored = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    pma.end()
    report = {"rank": rank, "tokens": pma.tokens, "steps": pma.global_step, "restored": restored}
    (args.out / f"result-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
