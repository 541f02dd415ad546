"""Merged evaluation by local slice against the full merge, under ``torchrun --nproc_per_node W`` (gloo, CPU).

1. DDP through PMATrainer: train with snapshots, then ``eval_pma_loss`` of the slice path
   (``trainer.evaluate()``) and of the full-merge path (every rank merges everything with
   ``merge_state_dict``, loads it, evaluates) at the same moment; the bytes each rank read.
2. FSDP2 (``fully_shard``) and FSDP1: :class:`hf_pma.merging.slices.SliceSwap` on the sharded
   model against the full merge loaded into an unsharded copy: the loss of a fixed batch,
   the bytes each rank read and backed up, and the live weights after ``restore()``.
3. The final merge written by every rank (``merge_checkpoints(distributed=True)``) against a
   single process's merge of the same snapshots: the files, byte for byte.

Each rank writes ``result-rank<r>.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
from hf_pma.merging.slices import SliceSwap
from hf_pma.merging.swap import backup_weights, load_weights, restore_weights
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import quiet_args

WINDOW = 3


def ddp_trainer(out: Path) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = PMATrainingArguments(
        output_dir=str(out / "run"),
        **quiet_args(
            max_steps=8,
            per_device_train_batch_size=8 // world,  # the same global batch at every world size
            per_device_eval_batch_size=4,
            ddp_backend="gloo" if world > 1 else None,
            pma_interval_tokens=128,
            pma_window=WINDOW,
            pma_merge_at_end=False,
        ),
    )
    trainer = PMATrainer(
        make_tiny_model(seed=0),
        args,
        train_dataset=TokenDataset(n=96, seed=0),
        eval_dataset=TokenDataset(n=16, seed=1),
        data_collator=pad_collate,
    )
    trainer.train()
    live_before = trainer.evaluate()
    paths = trainer._pma_merge_window(WINDOW)[0]
    # Today's full-merge path, at the same moment: every rank merges everything and loads it.
    backup = backup_weights(trainer.model)
    load_weights(trainer.model, merge_state_dict(paths, strategy=args.pma_strategy))
    full = trainer.evaluation_loop(
        trainer.get_eval_dataloader(), "full merge", prediction_loss_only=True, metric_key_prefix="full"
    )
    restore_weights(trainer.model, backup)
    model_bytes = sum(t.numel() * t.element_size() for t in merge_state_dict(paths[-1:]).values())
    return {
        "world_size": args.world_size,
        "slice_loss": live_before["eval_pma_loss"],
        "full_loss": full.metrics["full_loss"],
        "live_loss": live_before["eval_loss"],
        "live_loss_after": trainer.evaluate()["eval_loss"],
        "num_snapshots": live_before["eval_pma_num_snapshots"],
        "bytes_read": trainer.pma_last_merge_stats["bytes_read"],
        "backup_bytes": trainer.pma_last_merge_stats["backup_bytes"],
        "model_bytes": model_bytes,
        "paths": [str(p) for p in paths],
    }


def batch_loss(model) -> float:
    ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def sharded_swap(kind: str, paths: list[str]) -> dict:
    model = make_tiny_model(seed=3)
    reference = copy.deepcopy(model)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    live = batch_loss(model)
    swap = SliceSwap(model, paths, strategy="wma")
    merged = batch_loss(model)
    backup_bytes = swap.backup_bytes
    swap.restore()
    load_weights(reference, merge_state_dict(paths, strategy="wma"))
    return {
        "slice_loss": merged,
        "full_loss": batch_loss(reference),
        "live_loss": live,
        "live_loss_after": batch_loss(model),
        "bytes_read": swap.bytes_read,
        "backup_bytes": backup_bytes,
    }


def final_merge(out: Path, paths: list[str], rank: int) -> dict:
    distributed = merge_checkpoints(
        paths, out / "merged-dist", max_shard_size="30KB", progress=False, distributed=True
    )
    dist.barrier()
    if rank != 0:
        return {}
    single = merge_checkpoints(paths, out / "merged-single", max_shard_size="30KB", progress=False, workers=1)
    files = sorted(p.name for p in single.iterdir() if p.name != "pma_merge.json")
    same = all((single / f).read_bytes() == (distributed / f).read_bytes() for f in files)
    return {
        "files": files,
        "dist_files": sorted(p.name for p in distributed.iterdir() if p.name != "pma_merge.json"),
        "identical": same,
    }


def run(out: Path) -> dict:
    """Every check; writes and returns this rank's report."""
    report = {"ddp": ddp_trainer(out)}
    if not dist.is_initialized():  # a single process: FSDP still needs a process group
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{out / 'pg'}")
    rank = dist.get_rank()
    paths = report["ddp"]["paths"]
    for kind in ("fsdp2", "fsdp1"):
        report[kind] = sharded_swap(kind, paths)
    report["final_merge"] = final_merge(out, paths, rank)
    report["rank"] = rank
    (out / f"result-rank{rank}.json").write_text(json.dumps(report, indent=2))
    dist.barrier()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    torch.set_num_threads(1)
    run(a.out)


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
