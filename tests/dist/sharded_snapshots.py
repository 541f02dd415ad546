"""Launched by tests/snapshots/test_sharded.py under ``torchrun --nproc_per_node W`` (gloo, CPU).

A tiny FSDP2 (``fully_shard``) Llama whose vocabulary (515 rows) does not split evenly, trained
for a few steps while four :class:`PMACallback` instances take snapshots of the same weights:
``sharded=True`` and ``sharded=False`` (the full-gather path), each in float32 and bfloat16.
The Trainer does not shard on CPU, so the callbacks are driven the way the Trainer drives them,
with a hand-built ``TrainerState``. The test checks that merges of the sharded snapshots are
bit-identical to merges of the gathered ones. At the end the same weights are also written by
torch DCP itself (``HuggingFaceStorageWriter(save_distributed=True)``), and FSDP1 is checked.

``--crash-at K``: rank 1 is killed (SIGKILL) half-way through writing its K-th rank file.
``--resume-at STEP``: a run resumed from a checkpoint at optimizer step STEP.

At step ``CHECKPOINT_STEP`` every rank waits until its snapshot writes are done (rank 0's: until
the snapshots at 128 tokens are listed), as a Trainer checkpoint written at that step gives them
the time to be: the run killed later always resumes from a checkpoint whose snapshots are listed
(without the wait, a loaded machine could kill rank 1 before rank 0 had seen its files).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import TrainerControl, TrainerState

from hf_pma.snapshots import sharded as sharded_mod
from hf_pma.snapshots.callback import PMACallback
from tests.helpers.models import make_tiny_model

STEPS = 6
TOKENS_PER_STEP = 64
INTERVAL = 2 * TOKENS_PER_STEP  # a snapshot every 2 steps: at 128, 256, 384 tokens
CHECKPOINT_STEP = 2  # the step a killed run resumes from (tests/snapshots/test_sharded.py)
LR = 1e-2
DTYPES = {"float32": None, "bfloat16": "bfloat16"}


def die_half_way(at: int) -> None:
    """This process dies (SIGKILL) after writing half of a tensor of its ``at``-th rank file."""
    original = sharded_mod.SafetensorsWriter.write
    files: list[Path] = []

    def write(self, name, chunk):
        if self.path not in files:
            files.append(self.path)
        if len(files) == at:
            original(self, name, chunk[: max(1, len(chunk) // 2)])
            self._fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, chunk)

    sharded_mod.SafetensorsWriter.write = write


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = make_tiny_model(seed=seed, vocab_size=515)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_step(model, optimizer, step: int) -> None:
    """The same batch on every rank (so the result does not depend on the world size)."""
    ids = torch.randint(3, 515, (2, 16), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def run(out: Path, rank: int, world: int, resume_at: int) -> dict:
    """Train, with the four callbacks driven as the Trainer drives them."""
    model, optimizer = build()
    for step in range(1, resume_at + 1):  # a resumed run starts from the checkpoint's weights
        train_step(model, optimizer, step)
    args = SimpleNamespace(
        output_dir=str(out),
        include_num_input_tokens_seen="all",
        world_size=world,
        learning_rate=LR,
        get_warmup_steps=lambda steps: 0,
    )
    state = TrainerState(
        max_steps=STEPS, global_step=resume_at, num_input_tokens_seen=resume_at * TOKENS_PER_STEP
    )
    state.is_world_process_zero = rank == 0
    control = TrainerControl()
    callbacks = {
        f"{kind}-{name}": PMACallback(
            interval_tokens=INTERVAL,
            output_dir=out / f"{kind}-{name}",
            phases=("warmup", "stable", "decay"),
            save_dtype=dtype,
            sharded=kind == "sharded",
        )
        for kind in ("sharded", "gathered")
        for name, dtype in DTYPES.items()
    }
    for cb in callbacks.values():
        cb.on_train_begin(args, state, control, model=model, optimizer=optimizer, lr_scheduler=None)
    for step in range(resume_at + 1, STEPS + 1):
        for cb in callbacks.values():
            cb.on_step_begin(args, state, control)
        train_step(model, optimizer, step)
        for cb in callbacks.values():
            cb.on_optimizer_step(args, state, control, optimizer=optimizer)
        state.global_step = step
        state.num_input_tokens_seen = step * TOKENS_PER_STEP
        for cb in callbacks.values():
            cb.on_step_end(args, state, control, model=model, lr_scheduler=None)
        if step == CHECKPOINT_STEP:
            for cb in callbacks.values():
                cb.sink.wait()
            dist.barrier()
    for cb in callbacks.values():
        cb.on_train_end(args, state, control, model=model)
    sinks = {name: cb.sink for name, cb in callbacks.items()}
    return {
        "sinks": {name: type(sink).__name__ for name, sink in sinks.items()},
        "bytes_written": {name: getattr(sink, "bytes_written", None) for name, sink in sinks.items()},
        "model": model,
    }


def write_with_dcp(model, folder: Path) -> None:
    """The same weights saved by torch DCP's own HF writer (tied duplicate dropped, as save_pretrained)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    state.pop("lm_head.weight")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def check_fsdp1(out: Path, rank: int) -> dict:
    """FSDP1 (``FullyShardedDataParallel``): the sharded snapshot holds the gathered weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.snapshots.gather import gather_full_state_dict
    from hf_pma.snapshots.sharded import ShardedSnapshotSink
    from hf_pma.snapshots.writer import strip_for_save

    try:
        model = FullyShardedDataParallel(
            make_tiny_model(seed=3, vocab_size=515), device_id=torch.device("cpu"), use_orig_params=True
        )
        sink = ShardedSnapshotSink(out / "fsdp1", async_write=False)
        sink.open(None)
        sink.update_manifest()
        sink.take(model, SnapshotRecord(path="snapshot-7", tokens=7, step=1))
        sink.commit()
        sink.close(model)
        full = gather_full_state_dict(model)
        if rank != 0:
            return {}
        from hf_pma.merging.engine import merge_state_dict

        full = strip_for_save(model, full)
        merged = merge_state_dict([out / "fsdp1" / "snapshot-7"])
        return {
            "equal": merged.keys() == full.keys() and all(torch.equal(merged[k], v) for k, v in full.items())
        }
    except Exception as err:  # reported to the test
        return {"error": f"{type(err).__name__}: {err}"}


def run_all(out: Path, crash_at: int | None = None, resume_at: int = 0) -> dict:
    """Every check on the initialized process group; writes and returns this rank's report."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if crash_at and rank == 1:
        die_half_way(crash_at)
    result = run(out, rank, world, resume_at)
    model = result.pop("model")
    if not crash_at:
        write_with_dcp(model, out / "dcp")
        result["fsdp1"] = check_fsdp1(out, rank)
    dist.barrier()
    report = {"rank": rank, "world_size": world, **result}
    (out / f"result-rank{rank}.json").write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume-at", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run_all(args.out, args.crash_at, args.resume_at)
    dist.destroy_process_group()


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
