"""Online averages under FSDP2 (gloo, CPU) killed by SIGKILL and resumed in a new launch; run twice by
tests/snapshots/test_online_sharded.py (the shared launch ``online-kill-resume``), which compares the
final averages with those of the uninterrupted run in tests/dist/online_sharded.py (the same model,
batches, steps and callbacks).

``--phase kill``: the weights of online_sharded.py trained with its online callbacks (``ema``'s
average kept with ``online_device="device"``, the others ``"cpu"``). At ``CHECKPOINT_STEP`` a
checkpoint is saved as the Trainer saves one under FSDP (``SHARDED_STATE_DICT``): model and
optimizer through torch DCP, ``trainer_state.json`` with the callbacks' state, all before any
callback's ``on_save``. Rank 1 kills itself (``os.kill(os.getpid(), signal.SIGKILL)``) right
then, before the online callbacks' ``on_save`` moves each rank's staged
``pma_online-rank<r>.safetensors`` into the checkpoint (rank 0 may move its own before the launch
stops it); the launch fails.

``--phase resume``: a new launch loads that checkpoint (DCP into a fresh sharded model and
optimizer, the Trainer state) and trains to the end with fresh callbacks, which move the staged
files into the checkpoint, restore their averages from it and write
``killed-<kind>/pma/online-<kind>/`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import TrainerCallback, TrainerState

from tests.dist.online_sharded import CHECKPOINT_STEP, KINDS, STEPS, drive, online_callback
from tests.dist.sharded_snapshots import TOKENS_PER_STEP, build

DEVICES = {"sma": "cpu", "ema": "device", "ema-fraction": "cpu", "1-sqrt-decay": "cpu"}
STATE = "state"  # the callback that saves the model, the optimizer and trainer_state.json


def checkpoint_dir(out: Path) -> Path:
    return out / f"run-{STATE}" / f"checkpoint-{CHECKPOINT_STEP}"


class TrainerCheckpoint(TrainerCallback):
    """What the Trainer writes into ``checkpoint-<step>`` under FSDP, besides the callbacks' files."""

    def __init__(self, pma_callbacks: list) -> None:
        self.pma_callbacks = pma_callbacks

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(folder / "dcp"))
        if dist.get_rank() == 0:
            saved = TrainerState(
                global_step=state.global_step,
                max_steps=state.max_steps,
                num_input_tokens_seen=state.num_input_tokens_seen,
                stateful_callbacks=self.pma_callbacks,
            )
            saved.save_to_json(str(folder / "trainer_state.json"))
        dist.barrier()


class KillBetween(TrainerCallback):
    """Rank 1 dies by SIGKILL at ``on_save`` of ``CHECKPOINT_STEP``: after the Trainer's checkpoint
    (listed after ``TrainerCheckpoint``), before the online callbacks' ``on_save`` (listed before them)."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == CHECKPOINT_STEP and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["kill", "resume"], required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    online = {kind: online_callback(args.out, kind, f"killed-{kind}", DEVICES[kind]) for kind in KINDS}
    if args.phase == "kill":
        callbacks = {STATE: TrainerCheckpoint(list(online.values())), "kill": KillBetween(), **online}
        drive(args.out, rank, world, callbacks, model, optimizer, 0)
        raise SystemExit(f"rank {rank} should have been killed at step {CHECKPOINT_STEP} of {STEPS}")
    folder = checkpoint_dir(args.out)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optimizer_state}
    dcp.load(loaded, checkpoint_id=str(folder / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    state = TrainerState.load_from_json(str(folder / "trainer_state.json"))
    assert (
        state.num_input_tokens_seen
        == state.global_step * TOKENS_PER_STEP
        == CHECKPOINT_STEP * TOKENS_PER_STEP
    )
    drive(args.out, rank, world, online, model, optimizer, state.global_step, state.stateful_callbacks)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
