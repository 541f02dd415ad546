"""hf_pma.snapshots.taker: the snapshot engine driven by plain calls, with no Trainer object at all;
``PMACallback`` as its front door for the Trainer; the ``snapshot_costs`` read-out."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import Trainer

from hf_pma.core.manifest import manifest_snapshots, read_manifest
from hf_pma.snapshots.callback import PMACallback
from hf_pma.snapshots.taker import SnapshotTaker, TakenSnapshot
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args

BATCH, SEQ, STEPS, LR = 4, 16, 6, 1e-3
TOKENS_PER_STEP = BATCH * SEQ


def _train_four_steps(taker: SnapshotTaker, model, optimizer) -> None:
    """Four optimizer steps of ``TOKENS_PER_STEP`` tokens each, with the engine's calls."""
    data = TokenDataset(n=4 * BATCH, seed=1)
    for step in range(1, 5):
        model(**pad_collate([data[(step - 1) * BATCH + j] for j in range(BATCH)])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        taker.optimizer_step(LR)
        taker.step_end(model, step=step, tokens=step * TOKENS_PER_STEP)


def test_the_engine_in_a_plain_torch_loop(tmp_path, no_trainer_objects):
    """A loop that calls the engine itself: snapshots every 2 steps; a step whose loss is logged
    hands its snapshot to the writer only at the log (its cost's write_s is None until then); a
    checkpoint lets the write in flight land first."""
    data = TokenDataset(n=STEPS * BATCH, seed=1)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    taker = SnapshotTaker(interval_tokens=2 * TOKENS_PER_STEP, phases=("warmup", "stable", "decay"))
    taker.begin(model, output_dir=tmp_path, optimizer=optimizer, planned_steps=STEPS)
    pending = None
    for step in range(1, STEPS + 1):
        batch = pad_collate([data[(step - 1) * BATCH + j] for j in range(BATCH)])
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        taker.optimizer_step(optimizer.param_groups[0]["lr"])
        log = step == 4
        taker.step_end(model, step=step, tokens=step * TOKENS_PER_STEP, epoch=step / STEPS, log_follows=log)
        if log:
            pending = taker.snapshot_costs[-1]
            taker.logged(step, loss.item())
        if step == 5:
            taker.before_checkpoint(tmp_path / "checkpoint-5")
            assert len(taker.snapshots()) == 2  # the checkpoint waited for the snapshot of step 4
    taker.end(model)

    assert pending.tokens == 4 * TOKENS_PER_STEP and pending.write_s is None and pending.num_bytes is None
    records = manifest_snapshots(tmp_path / "pma")
    assert [(r.tokens, r.step) for r in records] == [(2 * TOKENS_PER_STEP * i, 2 * i) for i in (1, 2, 3)]
    assert all(r.loss is not None and r.extra["loss_source"] == "model" for r in records)
    assert read_manifest(tmp_path / "pma")["token_count"] == "all"
    costs = taker.snapshot_costs
    assert [c.tokens for c in costs] == [r.tokens for r in records]
    assert all(c.blocked_s > 0 and c.write_s > 0 for c in costs)
    assert [c.num_bytes for c in costs] == [r.num_bytes for r in records]
    with pytest.raises(dataclasses.FrozenInstanceError):
        costs[0].write_s = 0.0
    # The folder is released at the end: a second run into it begins at once.
    again = SnapshotTaker(interval_tokens=TOKENS_PER_STEP, pma_dir=tmp_path / "pma")
    again.begin(
        model, step=STEPS, tokens=STEPS * TOKENS_PER_STEP, optimizer=optimizer, planned_steps=STEPS + 1
    )
    again.end(model)


def test_snapshot_costs_through_the_callback(tmp_path):
    """``PMACallback.snapshot_costs``: one frozen entry per snapshot of the last train(), in the
    manifest's order, with the blocked and write seconds and the bytes on disk."""
    callback = PMACallback(interval_tokens=3 * TOKENS_PER_STEP, async_write=True)
    assert callback.snapshot_costs == []
    Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(
            tmp_path, max_steps=9, lr_scheduler_type="constant", per_device_train_batch_size=BATCH
        ),
        train_dataset=TokenDataset(n=9 * BATCH),
        data_collator=pad_collate,
        callbacks=[callback],
    ).train()
    records = [record for record, _ in callback.snapshots()]
    costs = callback.snapshot_costs
    assert len(records) == 3 and all(isinstance(c, TakenSnapshot) for c in costs)
    assert [(c.tokens, c.num_bytes) for c in costs] == [(r.tokens, r.num_bytes) for r in records]
    assert all(c.blocked_s > 0 and c.write_s is not None and c.write_s > 0 for c in costs)


def test_the_callback_is_a_front_door_to_the_taker(tmp_path):
    """The callback's options live on its taker (read and set there); the Trainer rebuilds it from
    its ``state()`` as it does on resume with ``restore_callback_states_from_checkpoint``."""
    callback = PMACallback(
        interval_tokens=128, output_dir=tmp_path / "snaps", keep_last=3, save_dtype="bfloat16"
    )
    assert isinstance(callback.taker, SnapshotTaker)
    assert (callback.keep_last, callback.taker.keep_last) == (3, 3)
    assert callback.output_dir == str(tmp_path / "snaps") == callback.taker.requested_pma_dir
    engine = object()
    callback.accelerator = engine
    assert callback.taker.accelerator is engine
    saved = callback.state()
    assert (
        saved["args"]["output_dir"] == str(tmp_path / "snaps") and saved["args"]["save_dtype"] == "bfloat16"
    )
    rebuilt = PMACallback(**saved["args"])
    assert rebuilt.state() == saved and rebuilt.schedule is rebuilt.taker.schedule


@pytest.mark.parametrize("online_device, folded_off_thread", [("cpu", True), ("device", False)])
def test_snapshot_costs_of_an_online_average(tmp_path, online_device, folded_off_thread):
    """An online average writes nothing per snapshot (``num_bytes`` is ``None``); its fold is the
    background work with ``online_device="cpu"``, and happens while taking with ``"device"``
    (``write_s`` 0.0: nothing left off the training thread)."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    taker = SnapshotTaker(interval_tokens=TOKENS_PER_STEP, online="sma", online_device=online_device)
    taker.begin(model, output_dir=tmp_path, optimizer=optimizer, planned_steps=4)
    _train_four_steps(taker, model, optimizer)
    taker.wait()
    costs = taker.snapshot_costs
    assert [c.tokens for c in costs] == [TOKENS_PER_STEP * s for s in range(1, 5)] and taker.online_count == 4
    assert all(c.num_bytes is None and c.blocked_s > 0 for c in costs)
    assert all((c.write_s > 0) if folded_off_thread else (c.write_s == 0.0) for c in costs)
    taker.end(model)


@pytest.mark.parametrize("steps_apart, uneven", [(1.5, True), (2, False)])
def test_a_given_interval_says_once_how_its_snapshots_are_spaced(tmp_path, caplog, steps_apart, uneven):
    """A V given by the user that is not a whole number of steps is kept, with one line at the
    first step saying how far apart its snapshots will be."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    interval = int(steps_apart * TOKENS_PER_STEP)
    taker = SnapshotTaker(interval_tokens=interval, phases=("warmup", "stable", "decay"))
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        taker.begin(model, output_dir=tmp_path, optimizer=optimizer, planned_steps=4)
        _train_four_steps(taker, model, optimizer)
        taker.end(model)
    lines = [r.getMessage() for r in caplog.records if "snapshots will be" in r.getMessage()]
    assert lines == (
        [
            f"hf-pma: interval_tokens={interval} is 1.5 steps of {TOKENS_PER_STEP} tokens: snapshots will be 64 or 128 "
            "tokens apart; give a multiple of 64 for evenly spaced snapshots"
        ]
        if uneven
        else []
    )
    assert taker.interval_tokens == interval and [r.step for r, _ in taker.snapshots()] == (
        [2, 3] if uneven else [2, 4]
    )


@pytest.mark.parametrize("interval", [None, 2 * TOKENS_PER_STEP, TOKENS_PER_STEP // 2])
def test_steps_that_vary_in_tokens_are_said_once(tmp_path, caplog, interval):
    """Optimizer steps whose token counts vary (padding counted out, a short last batch): no
    crash, the automatic V is a whole number of the first step's tokens, and one line says
    once that the steps between snapshots vary; nothing is said when V is under a step (one
    snapshot every step either way)."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    taker = SnapshotTaker(interval_tokens=interval, phases=("warmup", "stable", "decay"))
    per_step = [TOKENS_PER_STEP, TOKENS_PER_STEP, 40, TOKENS_PER_STEP, 48, TOKENS_PER_STEP]
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        taker.begin(model, output_dir=tmp_path, optimizer=optimizer, planned_steps=len(per_step))
        tokens = 0
        for step, count in enumerate(per_step, 1):
            tokens += count
            taker.optimizer_step(LR)
            taker.step_end(model, step=step, tokens=tokens)
        taker.end(model)
    lines = [r.getMessage() for r in caplog.records if "vary in tokens" in r.getMessage()]
    if interval == TOKENS_PER_STEP // 2:
        assert lines == [] and len(taker.snapshots()) == len(per_step)
        return
    assert taker.interval_tokens % TOKENS_PER_STEP == 0
    assert lines == [
        f"hf-pma: optimizer steps vary in tokens (step 3: 40; the first: {TOKENS_PER_STEP}): snapshots stay every "
        f"{taker.interval_tokens} tokens ({'chosen as' if interval is None else 'given:'} "
        f"{taker.interval_tokens / TOKENS_PER_STEP:.2f} steps of the first step's tokens), so the number of steps "
        "between them varies"
    ]
    assert all(r.tokens % taker.interval_tokens < max(per_step) for r, _ in taker.snapshots())


@pytest.mark.parametrize("sharded", [1, 0, "yes", None])
def test_sharded_takes_a_bool_or_auto(sharded):
    with pytest.raises(ValueError, match="^sharded must be True, False or 'auto'"):
        SnapshotTaker(interval_tokens=64, sharded=sharded)


def test_bad_arguments_of_the_engines_calls(tmp_path):
    """begin()'s arguments are checked before the folder is claimed; step_end(), optimizer_step()
    and logged() refuse what is no count, LR or loss (a step or token count going back too); a
    call after end() is refused (the folder is released then: another run may hold it)."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for kwargs, named in [
        ({"world_size": True}, "world_size"),
        ({"world_size": 0}, "world_size"),
        ({"is_main": "no"}, "is_main"),
        ({"token_count": "bogus"}, "token_count"),
        ({"planned_steps": -3}, "planned_steps"),
        ({"planned_steps": "x"}, "planned_steps"),
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"tokens": -5}, "tokens"),
        ({"warmup_steps": "x"}, "warmup_steps"),
        ({"peak_lr": "x"}, "peak_lr"),
        ({"saved_state": "x"}, "saved_state"),
        ({"resume_dir": 5}, "resume_dir"),
        ({"output_dir": 5}, "output_dir"),
        ({"scheduler_name": 5}, "scheduler_name"),
        ({"average_tokens_across_devices": "no"}, "average_tokens_across_devices"),
    ]:
        call = {"output_dir": tmp_path, "optimizer": optimizer, **kwargs}
        with pytest.raises(ValueError, match=f"^{named} must"):
            SnapshotTaker(interval_tokens=64).begin(model, **call)
    assert list(tmp_path.iterdir()) == []
    taker = SnapshotTaker(interval_tokens=64, phases=("warmup", "stable", "decay"))
    taker.begin(model, output_dir=tmp_path, optimizer=optimizer, planned_steps=4)
    for lr in ("x", True, -1.0, float("nan")):
        with pytest.raises(ValueError, match="^lr must"):
            taker.optimizer_step(lr)
    taker.optimizer_step(LR)
    for kwargs, says in [
        ({"step": "x", "tokens": 64}, "step must"),
        ({"step": 0, "tokens": 64}, "step must"),
        ({"step": 1, "tokens": "64"}, "tokens must"),
        ({"step": 1, "tokens": 64.5}, "tokens must"),
        ({"step": 1, "tokens": -64}, "tokens must"),
        ({"step": 1, "tokens": 64, "epoch": "x"}, "epoch must"),
    ]:
        with pytest.raises(ValueError, match=f"^{says}"):
            taker.step_end(model, **kwargs)
    taker.step_end(model, step=1, tokens=128)
    taker.optimizer_step(LR)
    with pytest.raises(ValueError, match="^tokens must be an integer >= 128, got 64"):
        taker.step_end(model, step=2, tokens=64)  # the count went back
    with pytest.raises(ValueError, match="^step must be an integer >= 2, got 1"):
        taker.step_end(model, step=1, tokens=192)  # so did the step
    with pytest.raises(ValueError, match="^loss must"):
        taker.logged(1, "x")
    taker.end(model)
    taker.end(model)  # a no-op
    with pytest.raises(ValueError, match=r"step_end\(\) after end\(\)"):
        taker.step_end(model, step=2, tokens=192)
    assert [r.tokens for r, _ in taker.snapshots()] == [128]


def test_exclude_snapshots_takes_a_list_of_token_counts(tmp_path):
    """exclude_snapshots(64) raised a TypeError, ("64") looked for snapshots at 6 and 4 tokens,
    ([True]) at 1 token: each is one line naming the argument now, the manifest untouched."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    taker = SnapshotTaker(interval_tokens=64, phases=("warmup", "stable", "decay"))
    taker.begin(model, output_dir=tmp_path, optimizer=optimizer, planned_steps=2)
    taker.optimizer_step(LR)
    taker.step_end(model, step=1, tokens=64)
    taker.wait()
    for tokens, reason, named in [
        (64, "x", "tokens"),
        ("64", "x", "tokens"),
        ([True], "x", "tokens"),
        ([64], 5, "reason"),
    ]:
        with pytest.raises(ValueError, match=f"^{named} must"):
            taker.exclude_snapshots(tokens, reason)
    assert [r.extra.get("excluded") for r, _ in taker.snapshots(include_excluded=True)] == [None]
    assert [r.tokens for r in taker.exclude_snapshots((t for t in [64]), "spike")] == [64]
    taker.end(model)


def test_a_folder_that_is_no_path_is_named():
    """pma_dir=5 (and the callback's output_dir=5) raised a TypeError from os.fspath."""
    with pytest.raises(ValueError, match="^pma_dir must be a folder path or None, got 5"):
        SnapshotTaker(interval_tokens=64, pma_dir=5)
    with pytest.raises(ValueError, match="^output_dir must be a folder path or None, got 5"):
        PMACallback(interval_tokens=64, output_dir=5)


def test_the_callback_takes_the_engines_options_with_the_same_defaults():
    """PMACallback spells out SnapshotTaker's options (IDEs and help() show them on the class users
    build): the two signatures stay the same, but for the folder's name (output_dir / pma_dir)."""
    import inspect

    from hf_pma.snapshots.callback import PMACallback

    def options(cls, folder: str) -> list[tuple]:
        params = inspect.signature(cls.__init__).parameters
        return [("folder" if n == folder else n, p.default, p.kind) for n, p in params.items() if n != "self"]

    assert options(PMACallback, "output_dir") == options(SnapshotTaker, "pma_dir")
