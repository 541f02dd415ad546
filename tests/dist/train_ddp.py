"""Train a tiny Llama with PMACallback and report what happened, one JSON file per rank.

The ``ddp`` scenario of tests/dist/scenarios.py (``accelerate launch --multi_gpu --num_processes 2``,
gloo, CPU), read by tests/snapshots/test_callback_distributed.py; ``main()`` also runs in the
test process as the single-process reference with the same global batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import Trainer

from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import load_weights, make_tiny_model, max_weight_diff
from tests.helpers.training import WeightRecorder, make_args

INTERVAL_TOKENS = 150
MAX_STEPS = 10


def main(out: Path, per_device: int, grad_accum: int, expect_world_size: int) -> dict:
    """Train; return (and write) this rank's report."""
    torch.set_num_threads(1)
    args = make_args(
        out,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=grad_accum,
        include_num_input_tokens_seen="non_padding",
        # gloo only when launched with several processes (a backend makes a single process wait for peers).
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        logging_steps=3,
    )
    if args.world_size != expect_world_size:
        raise SystemExit(f"expected world size {expect_world_size}, got {args.world_size}")
    callback = PMACallback(interval_tokens=INTERVAL_TOKENS)
    recorder = WeightRecorder()
    dataset = TokenDataset(n=128, min_len=8, max_len=32, seed=0)
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=dataset,
        data_collator=pad_collate,
        callbacks=[callback, recorder],
    )
    trainer.train()
    report = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "token_count": args.include_num_input_tokens_seen,
        "tokens_by_step": [recorder.tokens[s] for s in sorted(recorder.tokens)],
        "has_writer": callback.writer is not None,
        "written": [r.path for r in callback.writer.written] if callback.writer is not None else [],
    }
    if args.process_index == 0:
        snapshots = callback.snapshots()
        report["snapshots"] = [[r.tokens, r.step, r.phase] for r, _ in snapshots]
        report["max_diff"] = max(
            max_weight_diff(load_weights(p), recorder.weights[r.step]) for r, p in snapshots
        )
        report["folders"] = sorted(p.name for p in callback.pma_dir.iterdir())
    (Path(out) / f"result-rank{args.process_index}.json").write_text(json.dumps(report, indent=2))
    return report
