"""Nothing on the training thread between snapshots: what PMACallback runs in every Trainer event
and in its loss hook, counted op by op (torch's dispatcher) through a real Trainer run; the LR read
of an optimizer that keeps it in a tensor; the first snapshot's host buffers allocated at train
begin, off the training thread."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer, TrainerCallback

from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args

BATCH, SEQ, STEPS, EVERY = 4, 16, 12, 4
TOKENS_PER_STEP = BATCH * SEQ
EVENTS = ("on_step_begin", "on_optimizer_step", "on_step_end", "on_log", "on_save")
# A view of the loss (no kernel, no copy, no sync): the one op the loss hook runs per micro-batch.
VIEWS = {"aten.detach.default"}


class OpCounter(TorchDispatchMode):
    """Every ATen op dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class StepOps(TrainerCallback):
    """Put first in the callback list: numbers the steps (the events PMACallback sees next)."""

    def __init__(self) -> None:
        self.step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1


def count_ops_per_step(callback: PMACallback, steps: StepOps) -> dict[int, collections.Counter]:
    """Wrap the callback's events and its loss hook so that the ops each dispatches are counted,
    by the optimizer step they belong to."""
    per_step: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def counted(function):
        def run(*args, **kwargs):
            with OpCounter() as counter:
                result = function(*args, **kwargs)
            per_step[steps.step].update(counter.ops)
            return result

        return run

    for event in EVENTS:
        setattr(callback, event, counted(getattr(callback, event)))
    tracker = callback.taker._losses
    tracker._hook = counted(tracker._hook)  # attached at train begin, through this attribute
    return per_step


def train(tmp_path, callback: PMACallback, optimizers=(None, None), **overrides) -> tuple[Trainer, StepOps]:
    steps = StepOps()
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(
            tmp_path,
            **{
                "max_steps": STEPS,
                "lr_scheduler_type": "constant",
                "per_device_train_batch_size": BATCH,
                "logging_steps": 5,
                **overrides,
            },
        ),
        train_dataset=TokenDataset(n=STEPS * BATCH * 2),
        data_collator=pad_collate,
        callbacks=[steps, callback],
        optimizers=optimizers,
    )
    return trainer, steps


@pytest.mark.parametrize("accumulation", [1, 2])
def test_steps_without_a_snapshot_run_no_tensor_op_but_a_view_of_the_loss(tmp_path, accumulation):
    callback = PMACallback(interval_tokens=EVERY * TOKENS_PER_STEP, max_overhead=None)
    trainer, steps = train(
        tmp_path, callback, per_device_train_batch_size=BATCH // accumulation, gradient_accumulation_steps=accumulation
    )
    per_step = count_ops_per_step(callback, steps)
    trainer.train()
    snapshot_steps = {r.step for r, _ in callback.snapshots()}
    assert snapshot_steps == {4, 8, 12}
    for step in range(1, STEPS + 1):
        ops = per_step[step]
        if step in snapshot_steps:
            assert ops, step  # the copy, the loss window: work at a snapshot only
            continue
        assert set(ops) <= VIEWS, (step, dict(ops))
        if step > 1:  # the first step also reads the weights' shapes for the disk plan (views)
            assert ops["aten.detach.default"] == accumulation  # one per micro-batch: the hook ran
    # The losses kept as views still make the right records (the mean since the previous snapshot).
    records = [r for r, _ in callback.snapshots()]
    assert all(r.extra["loss_steps"] == EVERY and r.extra["loss_source"] == "model" for r in records)


def test_a_learning_rate_kept_in_a_tensor_is_read_only_at_steps_that_may_snapshot(tmp_path):
    """An optimizer whose LR is a tensor (its scheduler updates it in place): a step without a
    snapshot copies it and never reads it (no ``item``: a device would wait); the phases and LRs
    of the records are those of the same run with a float LR (warmup, then constant)."""

    def run(folder, lr):
        callback = PMACallback(interval_tokens=EVERY * TOKENS_PER_STEP, max_overhead=None, phases=("warmup", "stable"))
        trainer, steps = train(folder, callback, warmup_steps=6, lr_scheduler_type="constant_with_warmup")
        trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=lr)
        per_step = count_ops_per_step(callback, steps)
        trainer.train()
        return [(r.step, r.phase, r.lr) for r, _ in callback.snapshots()], per_step

    tensor_records, per_step = run(tmp_path / "tensor", torch.tensor(1e-3))
    float_records, _ = run(tmp_path / "float", 1e-3)
    assert [r[:2] for r in tensor_records] == [(4, "warmup"), (8, "stable"), (12, "stable")]
    assert [r[:2] for r in float_records] == [r[:2] for r in tensor_records]
    assert [r[2] for r in tensor_records] == pytest.approx([r[2] for r in float_records], rel=1e-6)
    for step in set(range(2, STEPS + 1)) - {4, 8, 12}:
        ops = per_step[step]
        assert "aten._local_scalar_dense.default" not in ops, (step, dict(ops))
        assert set(ops) <= VIEWS | {"aten.clone.default"} and ops["aten.clone.default"] == 1, (step, dict(ops))


def test_the_first_snapshots_host_buffers_are_allocated_at_train_begin(tmp_path):
    """Allocated on a background thread from train begin: the first snapshot copies into that
    memory (as every later one does into the same), it allocates none on the training thread."""
    callback = PMACallback(interval_tokens=EVERY * TOKENS_PER_STEP, max_overhead=None)
    trainer, _ = train(tmp_path, callback)
    seen: dict[str, dict[str, int]] = {}

    class Buffers(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:  # before the first step: reserved (the thread may still run)
                reservation = callback.sink._reservation
                reservation._thread.join()
                seen["reserved"] = {n: t.data_ptr() for n, t in reservation._result.items()}

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (4, 8):  # after PMACallback took the snapshot of this step
                seen[state.global_step] = {n: t.data_ptr() for n, t in callback.sink._buffers.items()}

    trainer.add_callback(Buffers())
    trainer.train()
    reserved = seen["reserved"]
    assert reserved and set(reserved) <= set(seen[4])
    assert all(seen[4][name] == ptr for name, ptr in reserved.items())
    assert seen[8] == seen[4]


class _Losses(torch.nn.Module):
    """A module whose training forward returns the loss it is given (as a model's output does)."""

    def forward(self, loss, num_items_in_batch=None):
        return {"loss": loss * 1.0}


@pytest.mark.parametrize("scaled", [False, True])
def test_a_long_window_is_summed_on_the_device_with_the_same_result(monkeypatch, scaled):
    from hf_pma.snapshots import loss as loss_module
    from hf_pma.snapshots.loss import StepLossTracker

    def window(limit: int):
        monkeypatch.setattr(loss_module, "MAX_HELD_LOSSES", limit)
        module, tracker = _Losses(), StepLossTracker()
        tracker.attach(module)
        generator = torch.Generator().manual_seed(0)
        with torch.enable_grad():
            for _ in range(10):  # 10 steps of 3 micro-batches
                for _ in range(3):
                    value = torch.rand((), generator=generator, requires_grad=True)
                    module(value, num_items_in_batch=7 if scaled else None)
                tracker.end_step()
        held = tracker._held
        return tracker.take_window(), held

    kept, held_all = window(10_000)
    folded, held_few = window(4)  # folded every 2 steps (6 losses)
    assert held_all == 30 and held_few < 6
    assert folded.steps == kept.steps == 10
    assert folded.mean == pytest.approx(kept.mean, rel=1e-6) and folded.last == pytest.approx(kept.last, rel=1e-6)
