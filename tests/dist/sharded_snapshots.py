"""Launched by tests/snapshots/test_sharded.py under ``torchrun --nproc_per_node W`` (gloo, CPU).

One run of a tiny FSDP2 (``fully_shard``) Llama whose vocabulary (515 rows) does not split
evenly. At every snapshot point the same weights are saved four ways: sharded (every rank its
own slices, :class:`ShardedSnapshotWriter`) in float32 and bfloat16, and gathered to rank 0
(:func:`gather_full_state_dict` + :class:`SnapshotWriter`) in float32 and bfloat16. The test
then checks that merges of the sharded snapshots are bit-identical to merges of the gathered
ones. The last point is also written by torch DCP itself
(``HuggingFaceStorageWriter(save_distributed=True)``), and FSDP1 is checked once.

``--crash-at K``: rank 1 is killed (SIGKILL) half-way through writing its file of the K-th
snapshot. ``--resume-at TOKENS``: start as a run resumed at TOKENS tokens (the manifest is
truncated there, as PMACallback does) and take the snapshots after it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from hf_pma.core.manifest import SnapshotRecord, snapshot_dirname
from hf_pma.snapshots import sharded as sharded_mod
from hf_pma.snapshots.sharded import ShardedSnapshotWriter
from hf_pma.snapshots.writer import SnapshotWriter, gather_full_state_dict, prepare_snapshot
from tests.dist.fsdp_gather import train_steps
from tests.testing_utils import make_tiny_model

SNAPSHOTS = 3
DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def tokens_at(k: int, world: int) -> int:
    """Distinct token counts per world size, so that runs of two world sizes interleave when mixed."""
    return 1000 * k + world


def die_half_way(at: int) -> None:
    """Rank 1 dies (SIGKILL) after writing half of its file of the ``at``-th sharded snapshot."""
    original = sharded_mod.SafetensorsWriter.write
    calls = {"files": []}

    def write(self, name, chunk):
        if self.path not in calls["files"]:
            calls["files"].append(self.path)
        if len(calls["files"]) == at:
            original(self, name, chunk[: max(1, chunk.numel() // 2)])
            self._fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, chunk)

    sharded_mod.SafetensorsWriter.write = write


def build(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    model = make_tiny_model(seed=seed, vocab_size=515)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def open_writers(out: Path, rank: int, world: int, resume_at: int | None) -> tuple[dict, dict]:
    sharded = {
        name: ShardedSnapshotWriter(out / f"sharded-{name}", rank=rank, world_size=world, save_dtype=dtype)
        for name, dtype in DTYPES.items()
    }
    gathered = {name: SnapshotWriter(out / f"gathered-{name}", async_write=True) for name in DTYPES} if rank == 0 else {}
    if rank == 0:
        for writer in [w.manifest for w in sharded.values()] + list(gathered.values()):
            writer.open()
            if resume_at is not None:
                writer.truncate(resume_at)
    dist.barrier()
    return sharded, gathered


def snapshot(model, k: int, world: int, rank: int, sharded: dict, gathered: dict) -> None:
    tokens = tokens_at(k, world)
    record = SnapshotRecord(path=snapshot_dirname(tokens), tokens=tokens, step=2 * k)
    for name, dtype in DTYPES.items():
        sharded[name].stage(model, copy.deepcopy(record))
        sharded[name].submit()
        full = gather_full_state_dict(model, dtype=dtype)
        if rank == 0:
            gathered[name].submit(prepare_snapshot(model, full, copy.deepcopy(record)))


def write_with_dcp(model, folder: Path) -> None:
    """The same weights saved by torch DCP's own HF writer (tied duplicate dropped, as save_pretrained)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    state.pop("lm_head.weight")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def check_fsdp1(out: Path, rank: int, world: int) -> dict:
    """FSDP1 (``FullyShardedDataParallel``): the sharded snapshot holds the gathered weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        model = FullyShardedDataParallel(make_tiny_model(seed=3, vocab_size=515), device_id=torch.device("cpu"), use_orig_params=True)
        train_steps(model, 1)
        writer = ShardedSnapshotWriter(out / "fsdp1", rank=rank, world_size=world, async_write=False)
        if rank == 0:
            writer.manifest.open()
        dist.barrier()
        writer.stage(model, SnapshotRecord(path="snapshot-7", tokens=7, step=1))
        writer.submit()
        full = gather_full_state_dict(model)
        if rank == 0:
            from hf_pma.merging.engine import merge_state_dict

            full = prepare_snapshot(model, full, SnapshotRecord(path="x", tokens=0, step=0)).state_dict
            merged = merge_state_dict([out / "fsdp1" / "snapshot-7"])
            return {"equal": merged.keys() == full.keys() and all(torch.equal(merged[k], v) for k, v in full.items())}
        return {}
    except Exception as err:  # reported to the test
        return {"error": f"{type(err).__name__}: {err}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume-at", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.crash_at and rank == 1:
        die_half_way(args.crash_at)
    model = build()
    sharded, gathered = open_writers(args.out, rank, world, args.resume_at)
    first = 1
    if args.resume_at is not None:
        first = next(k for k in range(1, SNAPSHOTS + 2) if tokens_at(k, world) > args.resume_at)
        for k in range(1, first):  # replay: the weights the resumed run starts from
            train_steps(model, 2, seed=k)
    for k in range(first, SNAPSHOTS + 1):
        train_steps(model, 2, seed=k)
        snapshot(model, k, world, rank, sharded, gathered)
    if not args.crash_at:
        write_with_dcp(model, args.out / "dcp")
    for writer in [*sharded.values(), *gathered.values()]:
        writer.wait()
    result = {
        "rank": rank,
        "world_size": world,
        "bytes_written": {name: w.bytes_written for name, w in sharded.items()},
        "staging_bytes": {name: w.staging.num_bytes for name, w in sharded.items()},
    }
    if not args.crash_at and args.resume_at is None:
        result["fsdp1"] = check_fsdp1(args.out, rank, world)
    dist.barrier()
    (args.out / f"result-rank{rank}.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
