"""A shard-local online average under FSDP2 (``fully_shard``, gloo, CPU), run by the shared launch
``world2`` (tests/dist/scenarios.py) and read by tests/snapshots/test_online_sharded.py.

A tiny Llama whose vocabulary (515 rows) does not split evenly is trained for ``STEPS`` steps
while four :class:`PMACallback` instances watch the same weights: sharded snapshots on disk
(``sharded=True``), and online ``sma``, ``ema`` and ``1-sqrt-decay`` (WSM, over one window of every
snapshot) averages (``sharded="auto"``). The Trainer does
not shard on CPU, so the callbacks are driven the way the Trainer drives them. Every gather is
patched to raise for the whole run (``_gather_fsdp``, the sinks' ``gather_full_state_dict`` and
``DTensor.full_tensor``): the online averages must never gather, not even when the SMA is swapped
into the live shards to compute a loss (merged evaluation). A Trainer checkpoint is saved at
``CHECKPOINT_STEP`` (``on_save``), and a second pair of online callbacks resumes from it with the
weights of that step: their final averages must be bit-identical to the uninterrupted ones.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import TrainerControl, TrainerState

from hf_pma.snapshots.callback import PMACallback
from tests.dist.sharded_snapshots import LR, TOKENS_PER_STEP, build, train_step

STEPS = 5
CHECKPOINT_STEP = 3
ALPHA = 0.3
FRACTION = 0.25  # "ema-fraction": the EMA whose half-life is this share of the tokens seen so far
# The online averages, by name: the decay over one window of all STEPS snapshots; "ema-fraction"
# is online="ema" with online_half_life_fraction=FRACTION.
KINDS = ("sma", "ema", "ema-fraction", "1-sqrt-decay")


def online_kind(name: str) -> str:
    """The ``online`` kind of an average of this scenario (its folder is ``online-<kind>``)."""
    return "ema" if name == "ema-fraction" else name


class GatherCalled(AssertionError):
    pass


@contextlib.contextmanager
def forbid_gathers() -> Iterator[None]:
    """Every way to gather the full weights raises inside (this process; put back afterwards)."""
    from torch.distributed.tensor import DTensor

    from hf_pma.snapshots import gather, sinks

    def refuse(*args, **kwargs):
        raise GatherCalled("a full gather happened during online averaging")

    patched = [
        (gather, "_gather_fsdp"),
        (gather, "gather_full_state_dict"),
        (sinks, "gather_full_state_dict"),
        (DTensor, "full_tensor"),
    ]
    saved = [getattr(owner, name) for owner, name in patched]
    for owner, name in patched:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for (owner, name), value in zip(patched, saved):
            setattr(owner, name, value)


def fsdp1_swap(out: Path) -> str:
    """FSDP1: the average is taken (its sharded state dict's local shards), but they are copies of
    the flat parameter, so swapping the average in for an evaluation is refused on every rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink
    from tests.helpers.models import make_tiny_model

    model = FullyShardedDataParallel(
        make_tiny_model(seed=3, vocab_size=515), device_id=torch.device("cpu"), use_orig_params=True
    )
    sink = ShardedOnlineAverageSink(out / "fsdp1", online="sma")
    sink.open(None)
    sink.take(model, SnapshotRecord(path="snapshot-7", tokens=7, step=1))
    sink.commit()
    try:
        sink.swap_in(model)
    except ValueError as err:
        return str(err)
    return "swapped"


def eval_batch() -> torch.Tensor:
    """The batch the merged-evaluation check computes its loss on."""
    return torch.randint(3, 515, (2, 16), generator=torch.Generator().manual_seed(1234))


def online_callback(out: Path, kind: str, folder: str, device: str = "cpu") -> PMACallback:
    """An online callback of this scenario, its average written under ``out/<folder>/pma``."""
    decay = {"online_half_life_fraction": FRACTION} if kind == "ema-fraction" else {"online_alpha": ALPHA}
    return PMACallback(
        interval_tokens=TOKENS_PER_STEP,
        output_dir=out / folder / "pma",
        phases=("warmup", "stable", "decay"),
        online=online_kind(kind),
        online_window_tokens=STEPS * TOKENS_PER_STEP if kind.endswith("-decay") else None,
        online_device=device,
        **decay,
    )


def drive(
    out: Path,
    rank: int,
    world: int,
    callbacks: dict,
    model,
    optimizer,
    start: int,
    stateful_callbacks: dict | None = None,
) -> None:
    """Train from step ``start`` to ``STEPS`` with ``callbacks`` driven as the Trainer drives them;
    each callback has its own Trainer output folder ``out/run-<name>`` (its checkpoints).
    ``stateful_callbacks``: what a resumed Trainer reads from the checkpoint's ``trainer_state.json``."""
    args = {
        name: SimpleNamespace(
            output_dir=str(out / f"run-{name}"),
            include_num_input_tokens_seen="all",
            world_size=world,
            learning_rate=LR,
            get_warmup_steps=lambda steps: 0,
        )
        for name in callbacks
    }
    state = TrainerState(max_steps=STEPS, global_step=start, num_input_tokens_seen=start * TOKENS_PER_STEP)
    state.is_world_process_zero = rank == 0
    state.stateful_callbacks = stateful_callbacks or {}
    control = TrainerControl()
    for name, cb in callbacks.items():
        cb.on_train_begin(args[name], state, control, model=model, optimizer=optimizer, lr_scheduler=None)
    for step in range(start + 1, STEPS + 1):
        for name, cb in callbacks.items():
            cb.on_step_begin(args[name], state, control)
        train_step(model, optimizer, step)
        for name, cb in callbacks.items():
            cb.on_optimizer_step(args[name], state, control, optimizer=optimizer)
        state.global_step = step
        state.num_input_tokens_seen = step * TOKENS_PER_STEP
        # As the Trainer's flow callback says at the step's end: a checkpoint follows.
        control.should_save = step == CHECKPOINT_STEP and start == 0
        for name, cb in callbacks.items():
            cb.on_step_end(args[name], state, control, model=model, lr_scheduler=None)
        if control.should_save:
            if rank == 0:  # what the Trainer writes before on_save
                for name in callbacks:
                    (out / f"run-{name}" / f"checkpoint-{step}").mkdir(parents=True)
            dist.barrier()
            for name, cb in callbacks.items():
                cb.on_save(args[name], state, control)
            control.should_save = False
    for name, cb in callbacks.items():
        cb.on_train_end(args[name], state, control, model=model)


def run(out: Path) -> dict:
    with forbid_gathers():
        report = _run(out)
    ddp_swap(out)
    return report


def ddp_swap(out: Path) -> None:
    """Unsharded (DDP-like: every rank holds the whole model): the main process keeps the average,
    and swapping it in broadcasts it to every rank; each rank reports its losses."""
    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.snapshots.sinks import OnlineAverageSink
    from tests.helpers.models import make_tiny_model

    rank = dist.get_rank()
    model = make_tiny_model(seed=0, vocab_size=515)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sink = OnlineAverageSink(out / "ddp", online="sma", is_main=rank == 0, async_write=False)
    sink.open(None)
    for step in (1, 2):
        train_step(model, optimizer, step)
        sink.take(model, SnapshotRecord(path=f"snapshot-{step}", tokens=step, step=step))
        sink.commit()
    ids = eval_batch()
    with torch.no_grad():
        losses = {"live": float(model(input_ids=ids, labels=ids).loss)}
        restore = sink.swap_in(model)
        losses["swapped"] = float(model(input_ids=ids, labels=ids).loss)
        restore()
        losses["restored"] = float(model(input_ids=ids, labels=ids).loss)
    (out / f"ddp-rank{rank}.json").write_text(json.dumps(losses))


def _run(out: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()

    def online(kind: str, folder: str) -> PMACallback:
        return online_callback(out, kind, folder)

    model, optimizer = build()
    callbacks = {
        "sharded": PMACallback(
            interval_tokens=TOKENS_PER_STEP,
            output_dir=out / "sharded",
            phases=("warmup", "stable", "decay"),
            sharded=True,
        ),
        **{kind: online(kind, f"straight-{kind}") for kind in KINDS},  # checkpoints in run-<kind>
    }
    drive(out, rank, world, callbacks, model, optimizer, 0)
    report = {
        "rank": rank,
        "world_size": world,
        "sinks": {name: type(cb.sink).__name__ for name, cb in callbacks.items()},
        "online_state_dict": callbacks["sma"].online_state_dict() is None,
        "average_bytes": callbacks["sma"].sink.average.num_bytes,
    }
    # On request (here after train end): the same folder written again, replacing the first.
    saved = callbacks["sma"].save_online_average(model)
    report["saved_on_request"] = str(saved) if saved is not None else None
    # Merged evaluation by local slice: the average swapped into the live shards, then put back.
    from hf_pma.merging.slices import reshard

    ids = eval_batch()
    with torch.no_grad():
        report["live_loss"] = float(model(input_ids=ids, labels=ids).loss)
        reshard(model)
        restore = callbacks["sma"].swap_in_online(model)
        report["swapped_loss"] = float(model(input_ids=ids, labels=ids).loss)
        reshard(model)
        restore()
        report["restored_loss"] = float(model(input_ids=ids, labels=ids).loss)
    # The resumed run: the weights of the checkpoint's step, then the online callbacks resume.
    model, optimizer = build()
    for step in range(1, CHECKPOINT_STEP + 1):
        train_step(model, optimizer, step)
    resumed = {kind: online(kind, f"resumed-{kind}") for kind in KINDS}
    drive(out, rank, world, resumed, model, optimizer, CHECKPOINT_STEP)
    report["resumed_counts"] = {kind: cb.sink.count for kind, cb in resumed.items()}
    report["fsdp1_swap"] = fsdp1_swap(out)
    dist.barrier()
    (out / f"result-rank{rank}.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from tests.helpers.rank_main import run_on_gloo

    run_on_gloo(run)
