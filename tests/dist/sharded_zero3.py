"""Launched by tests/snapshots/test_sharded.py under ``torchrun --nproc_per_node 2`` when DeepSpeed
is installed: a tiny Llama under DeepSpeed ZeRO-3 on CPU (gloo), one training step, then one
sharded snapshot (each rank writes its ``ds_tensor`` partitions, flat ranges) and one gathered
snapshot (``GatheredParameters``) of the same weights. Rank 0 reports whether they are equal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.merging.engine import merge_state_dict
    from hf_pma.snapshots.gather import sharding_kind
    from hf_pma.snapshots.sharded import ShardedSnapshotSink
    from hf_pma.snapshots.sinks import DiskSnapshotSink
    from tests.helpers.models import make_tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op when its communication starts:
    # a C++ build of over a minute of CPU on a fresh machine (every CI run). gloo's collectives do
    # the same job for two ranks; the snapshot code under test never calls that op.
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    model = make_tiny_model(seed=0, vocab_size=515)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = torch.randint(3, 515, (1, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    result = {"rank": rank, "kind": sharding_kind(engine)}
    for sink, name in (
        (ShardedSnapshotSink(args.out / "sharded", async_write=False), "sharded"),
        (DiskSnapshotSink(args.out / "gathered", is_main=rank == 0), "gathered"),
    ):
        sink.open(None)
        sink.update_manifest()
        sink.take(engine, SnapshotRecord(path="snapshot-16", tokens=16, step=1))
        sink.commit()
        sink.close(engine)
        result[name] = type(sink).__name__
    result["online"] = online_zero3(engine, ids, args.out, rank)
    dist.barrier()
    if rank == 0:
        sharded = merge_state_dict([args.out / "sharded" / "snapshot-16"])
        gathered = merge_state_dict([args.out / "gathered" / "snapshot-16"])
        result["same_names"] = sorted(sharded) == sorted(gathered)
        result["equal"] = result["same_names"] and all(torch.equal(sharded[k], gathered[k]) for k in gathered)
        result["layout"] = json.loads((args.out / "sharded" / "manifest.json").read_text())["shard_layout"]
    (args.out / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def online_zero3(engine, ids, out: Path, rank: int) -> dict:
    """The shard-local online SMA of two snapshots (each rank its ``ds_tensor`` partitions, with
    ``GatheredParameters`` patched to raise) against the merge of sharded snapshots of the same
    weights; rank 0 reports the largest difference."""
    import deepspeed

    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.merging.engine import merge_state_dict
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink, ShardedSnapshotSink

    online = ShardedOnlineAverageSink(out / "online", online="sma")
    snapshots = ShardedSnapshotSink(out / "online-reference", async_write=False)
    for sink in (online, snapshots):
        sink.open(None)
        sink.update_manifest()
    gathered = deepspeed.zero.GatheredParameters

    def refuse(*args, **kwargs):
        raise AssertionError("a full gather happened during online averaging")

    for tokens in (32, 48):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        deepspeed.zero.GatheredParameters = refuse
        try:
            online.take(engine, SnapshotRecord(path=f"snapshot-{tokens}", tokens=tokens, step=tokens // 16))
            online.commit()
        finally:
            deepspeed.zero.GatheredParameters = gathered
        snapshots.take(engine, SnapshotRecord(path=f"snapshot-{tokens}", tokens=tokens, step=tokens // 16))
        snapshots.commit()
    snapshots.close(engine)
    deepspeed.zero.GatheredParameters = refuse
    try:
        online.close(engine)
    finally:
        deepspeed.zero.GatheredParameters = gathered
    import torch.distributed as dist

    # Merged evaluation by local slice: the average swapped into the live partitions, then back.
    losses = {}
    with torch.no_grad():
        losses["live"] = float(engine(input_ids=ids, labels=ids).loss)
        restore = online.swap_in(engine)
        losses["swapped"] = float(engine(input_ids=ids, labels=ids).loss)
        restore()
        losses["restored"] = float(engine(input_ids=ids, labels=ids).loss)
    dist.barrier()
    if rank != 0:
        return {}
    reference = merge_state_dict([out / "online-reference" / f"snapshot-{t}" for t in (32, 48)])
    average = merge_state_dict([out / "online" / "online-sma"])
    from tests.helpers.models import make_tiny_model

    plain = make_tiny_model(seed=0, vocab_size=515)
    plain.load_state_dict(average, strict=False)  # a tied output embedding is stored once
    with torch.no_grad():
        losses["reference"] = float(plain(input_ids=ids, labels=ids).loss)
    return {
        "sink": type(online).__name__,
        "same_names": sorted(reference) == sorted(average),
        "max_diff": max(float((average[k] - reference[k]).abs().max()) for k in reference),
        "losses": losses,
    }


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
