"""The zero-argument ``PMACallback()`` on any schedule: about the intended number of snapshots, a
warning exactly when there is no constant-LR phase, the disk and time budgets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.core.manifest import manifest_snapshots
from hf_pma.core.schedule import SNAPSHOTS_PER_WINDOW, WINDOWS_PER_STABLE_PHASE
from hf_pma.snapshots.budget import DiskBudget, SnapshotBudgetError, human_bytes
from hf_pma.snapshots.callback import PMACallback
from hf_pma.snapshots.gather import full_state_dict_bytes
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.repo import REPO_ROOT, load_pretrain_script
from tests.helpers.training import WeightRecorder, make_args

SEQ, BATCH, STEPS = 16, 4, 60
INTENDED = SNAPSHOTS_PER_WINDOW * WINDOWS_PER_STABLE_PHASE  # 40
NO_CONSTANT_PHASE = "has no constant-LR phase"


def train(out: Path, callbacks: list, args: TrainingArguments | None = None, **overrides) -> Trainer:
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args or make_args(out, **{"max_steps": STEPS, "logging_steps": 10, **overrides}),
        train_dataset=TokenDataset(n=STEPS * BATCH, min_len=SEQ, max_len=SEQ),
        data_collator=pad_collate,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hf_pma")]


@pytest.mark.parametrize(
    "schedule, overrides, constant",
    [
        # Transformers' default: linear decay from the first step (plain TrainingArguments below).
        ("linear", {}, False),
        ("cosine", {"lr_scheduler_type": "cosine", "warmup_steps": 6}, False),
        (
            "wsd",
            {"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": 6, "lr_scheduler_kwargs": {"num_decay_steps": 12}},
            True,
        ),
        ("constant", {"lr_scheduler_type": "constant"}, True),
    ],
)
def test_zero_argument_callback_takes_about_the_intended_count_and_warns_without_a_constant_phase(
    tmp_path, caplog, schedule, overrides, constant
):
    if schedule == "linear":  # the most common case: nothing but the required arguments
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, use_cpu=True,
            report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=10,
        )
        assert args.lr_scheduler_type == "linear" and args.learning_rate > 0
    else:
        args = None
    callback = PMACallback()
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        train(tmp_path, [callback], args=args, **overrides)
    taken = len(manifest_snapshots(tmp_path / "pma"))
    choice = callback.interval_choice
    # A whole number of steps (equally spaced snapshots): the target of 40 over 54-60 steps that
    # snapshot rounds to one step or two, so the count is 30-60, as expected_snapshots says.
    steps, rest = divmod(callback.interval_tokens, SEQ * BATCH)
    assert rest == 0 and steps == max(1, int(choice["snapshot_steps"] / INTENDED + 0.5)), choice
    assert abs(taken - choice["expected_snapshots"]) <= 1 and 30 <= taken <= 60, (taken, choice)
    warnings = [m for m in messages(caplog) if NO_CONSTANT_PHASE in m]
    if constant:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert "warmup_stable_decay" in warnings[0] and "'constant'" in warnings[0]
        assert "stable/decay phases (about 40 of them)" in warnings[0]  # what they get if they keep going


def test_over_budget_run_stops_before_the_first_step_with_nothing_written(tmp_path):
    model_bytes = full_state_dict_bytes(make_tiny_model(seed=0))
    budget = 10 * model_bytes  # the zero-argument default plans 40 snapshots
    recorder = WeightRecorder()
    with pytest.raises(SnapshotBudgetError) as info:
        train(tmp_path, [PMACallback(max_disk_bytes=budget), recorder])
    message = str(info.value)
    assert human_bytes(40 * model_bytes) in message and human_bytes(budget) in message
    for knob in ("interval_tokens", "keep_last", "save_dtype", "sharded", "max_disk_bytes"):
        assert knob in message
    assert recorder.tokens == {}  # no optimizer step ran
    assert not (tmp_path / "pma").exists()
    # The same budget holds 10 snapshots: keep_last=8 (+1 written before the oldest goes) fits,
    # with room for the files' headers as snapshots land.
    callback = PMACallback(max_disk_bytes=budget, keep_last=8)
    train(tmp_path / "fits", [callback])
    assert len(callback.snapshots()) == 8


def test_explicit_interval_is_checked_at_the_first_step_before_any_snapshot(tmp_path):
    model_bytes = full_state_dict_bytes(make_tiny_model(seed=0), "bfloat16")
    recorder = WeightRecorder()
    # One snapshot every 2 steps over 60 constant-LR steps: 30 snapshots of bfloat16 weights.
    callback = PMACallback(interval_tokens=2 * SEQ * BATCH, save_dtype="bfloat16", max_disk_bytes=20 * model_bytes)
    with pytest.raises(SnapshotBudgetError, match=r"30 snapshots of") as info:
        train(tmp_path, [callback, recorder], lr_scheduler_type="constant")
    assert human_bytes(30 * model_bytes) in str(info.value)
    assert max(recorder.tokens, default=0) == 0 and not list((tmp_path / "pma").glob("snapshot-*"))


def test_disk_budget_recheck_as_snapshots_land(tmp_path, caplog):
    budget = DiskBudget(tmp_path, max_disk_bytes=1000)
    budget.check_next(300, extra_folders=1, remaining=1, used_bytes=600)  # 400 left: the next fits, the rest too
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        budget.check_next(300, extra_folders=2, remaining=5, used_bytes=600)  # the next fits, the rest does not
    assert any("5 snapshots still to come" in m for m in messages(caplog))
    with pytest.raises(SnapshotBudgetError, match=r"next snapshot needs 300 B but only 100 B is left"):
        budget.check_next(300, extra_folders=0, remaining=0, used_bytes=900)
    # Without max_disk_bytes the free space of the folder's filesystem is the budget.
    real = DiskBudget(tmp_path / "not" / "yet")
    assert real.available()[0] > 0
    with pytest.raises(SnapshotBudgetError, match="free space of"):
        real.check_plan(2**62, folders=1, snapshots=1, what="a test")


def test_a_snapshots_cost_is_the_second_snapshots_and_is_logged_against_the_interval(tmp_path, caplog):
    callback = PMACallback(interval_tokens=3 * SEQ * BATCH, async_write=False)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        train(tmp_path, [callback], max_steps=12, lr_scheduler_type="constant")
    cost = [m for m in messages(caplog) if "snapshot cost" in m]
    assert len(cost) == 1
    first = callback.snapshots()[0][0]
    assert human_bytes(first.num_bytes) in cost[0] and "every 3.0 steps" in cost[0]
    assert "% of training time" in cost[0]
    # The first snapshot pays one-time costs (host buffers): the second's is what every snapshot costs.
    blocked = [cost.blocked_s for cost in callback.snapshot_costs]
    assert len(blocked) == 4
    assert cost[0].startswith(f"hf-pma: a snapshot costs {blocked[1]:.2f}s of blocked training (the first {blocked[0]:.2f}s")


def test_a_run_with_one_snapshot_reports_its_cost_at_the_end(tmp_path, caplog):
    callback = PMACallback(interval_tokens=4 * SEQ * BATCH, async_write=True)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        train(tmp_path, [callback], max_steps=6, lr_scheduler_type="constant")
    cost = [m for m in messages(caplog) if "snapshot cost" in m]
    assert len(callback.snapshots()) == 1 and len(cost) == 1
    assert cost[0].startswith(f"hf-pma: the only snapshot cost {callback.snapshot_costs[0].blocked_s:.2f}s of blocked training")


def test_the_time_share_is_the_steady_cost_not_the_first_snapshots(caplog, monkeypatch):
    import types

    from hf_pma.snapshots import budget as budget_module
    from hf_pma.snapshots.budget import SnapshotCost, TimeBudget

    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(budget_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))

    def after_ten_steps_of_one_second() -> TimeBudget:
        budget = TimeBudget()
        for _ in range(10):
            clock.now += 1.0
            budget.step_done()
        assert budget.step_seconds() == 1.0
        return budget

    # A first snapshot of 1000 s (pinned buffers) beside a steady cost of 1% of the 10 s interval.
    budget = after_ten_steps_of_one_second()
    cost = SnapshotCost(blocked_s=0.1, write_s=0.0, num_bytes=2**20, first_blocked_s=1000.0)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        message = budget.report(cost, steps_between=10, tokens_per_step=64, async_write=True)
    assert budget.reported and "1.0% of training time" in message and "above 5%" not in message
    assert "(the first 1000.00s, with one-time set-up)" in message
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # A steady cost above the limit warns, with the interval that would do (2 s / 5% = 40 steps).
    costly = SnapshotCost(blocked_s=2.0, write_s=0.0, num_bytes=2**20, first_blocked_s=2.0)
    message = after_ten_steps_of_one_second().report(costly, steps_between=10, tokens_per_step=64, async_write=True)
    assert "20.0% of training time, above 5%" in message
    assert "an interval_tokens of at least 2,560 (40 steps)" in message


def test_pmatrainer_applies_the_disk_budget(tmp_path):
    with pytest.raises(ValueError, match="pma_max_disk_bytes"):
        PMATrainingArguments(output_dir=str(tmp_path), pma_max_disk_bytes="lots")
    args = PMATrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=20, per_device_train_batch_size=BATCH, use_cpu=True,
        report_to=[], disable_tqdm=True, save_strategy="no", pma_max_disk_bytes="1KB",
    )
    trainer = PMATrainer(
        model=make_tiny_model(seed=0), args=args, train_dataset=TokenDataset(n=80, min_len=SEQ, max_len=SEQ),
        data_collator=pad_collate,
    )
    with pytest.raises(SnapshotBudgetError, match="max_disk_bytes is 1000 B"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "trainer" / "pma").exists()


@pytest.mark.slow
def test_pretrain_script_applies_the_disk_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    script = load_pretrain_script(monkeypatch)
    args = [
        str(REPO_ROOT / "scripts" / "configs" / "tiny.yaml"),
        "--output_dir", str(tmp_path / "script"), "--max_steps", "20", "--default_corpus_bytes", "200000",
        "--vocab_size", "512", "--block_size", "64", "--pma_max_disk_bytes", "10KB", "--anneal_steps", "0",
    ]
    with pytest.raises(SnapshotBudgetError, match="max_disk_bytes is 9.8 KiB"):
        script.main(args)
    assert not list((tmp_path / "script" / "pma").glob("snapshot-*"))


class LossRecorder(TrainerCallback):
    """Every logged training loss by step (log every step to get the loss of each)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_per_snapshot_losses_are_the_mean_since_the_previous_snapshot_whatever_logging_steps(tmp_path, accumulation):
    """Snapshots every 5 steps, logs every 10: each record still has its own, right loss."""
    overrides = {
        "max_steps": 30, "lr_scheduler_type": "constant", "per_device_train_batch_size": BATCH // accumulation,
        "gradient_accumulation_steps": accumulation,
    }
    callback = PMACallback(interval_tokens=5 * SEQ * BATCH)
    train(tmp_path / "sparse", [callback], logging_steps=10, **overrides)
    # The same run (same seed, same batches) logging every step: the Trainer's own loss of each step.
    reference = LossRecorder()
    train(tmp_path / "dense", [reference], logging_steps=1, **overrides)
    records = [r for r, _ in callback.snapshots()]
    assert [r.step for r in records] == [5, 10, 15, 20, 25, 30]
    previous = 0
    for record in records:
        window = [reference.losses[s] for s in range(previous + 1, record.step + 1)]
        assert record.loss == pytest.approx(sum(window) / len(window), rel=1e-5)
        assert record.extra["step_loss"] == pytest.approx(reference.losses[record.step], rel=1e-5)
        assert record.extra["loss_steps"] == 5 and record.extra["loss_since_step"] == previous
        previous = record.step
    assert len({round(r.loss, 6) for r in records}) == len(records)  # distinct, not repeated logs


def test_card_shows_the_per_snapshot_losses(tmp_path):
    from hf_pma.merging.engine import merge_checkpoints
    from hf_pma.publishing.card import build_model_card

    callback = PMACallback(interval_tokens=5 * SEQ * BATCH)
    train(tmp_path, [callback], max_steps=20, logging_steps=10, lr_scheduler_type="constant")
    merged = tmp_path / "merged"
    merge_checkpoints([str(tmp_path / "pma")], merged, strategy="sma")
    card = str(build_model_card(merged))
    for record, _ in callback.snapshots():
        assert f"{record.loss:.4f}" in card
