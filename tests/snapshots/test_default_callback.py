"""The zero-argument ``PMACallback()`` on any schedule: about the intended number of snapshots, a
warning exactly when there is no constant-LR phase, the disk and time budgets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.core.manifest import manifest_snapshots, read_manifest
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
    # The count the automatic V aims at, before the cost budget widens it (these tiny CPU steps
    # exceed 1%; test_a_costly_automatic_interval_is_widened... below).
    callback = PMACallback(max_overhead=None)
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


def test_the_cost_line_says_what_the_first_snapshots_measured(tmp_path, caplog):
    callback = PMACallback(interval_tokens=3 * SEQ * BATCH, async_write=False, max_overhead=None)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        train(tmp_path, [callback], max_steps=12, lr_scheduler_type="constant")
    cost = [m for m in messages(caplog) if "of training time" in m]
    assert len(callback.snapshot_costs) == 4 and len(cost) == 1  # said once, after the third snapshot
    first = callback.snapshots()[0][0]
    assert cost[0].startswith("hf-pma: snapshots cost ") and "of training time in this run: each adds" in cost[0]
    assert human_bytes(first.num_bytes) in cost[0] and "at a snapshot every 3 steps" in cost[0]
    assert "measured over 1 interval(s)" in cost[0] and "above" not in cost[0]


def test_a_run_with_one_snapshot_says_what_it_blocked_and_wrote_at_the_end(tmp_path, caplog):
    callback = PMACallback(interval_tokens=4 * SEQ * BATCH, async_write=True)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        train(tmp_path, [callback], max_steps=6, lr_scheduler_type="constant")
    cost = [m for m in messages(caplog) if "snapshot(s) cost" in m]
    assert len(callback.snapshots()) == 1 and len(cost) == 1
    assert cost[0].startswith(f"hf-pma: 1 snapshot(s) cost {callback.snapshot_costs[0].blocked_s:.2f}s of blocked training")
    assert "too few to measure what they add to the step time" in cost[0]


def test_a_costly_automatic_interval_is_widened_keeping_ten_snapshots_in_the_constant_phase(tmp_path, caplog, slow_copy):
    callback = PMACallback()
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        train(tmp_path, [callback], lr_scheduler_type="constant")
    step = SEQ * BATCH
    # 60 constant steps: 40 snapshots would be 2 steps apart; 10 in the phase allow 6 at most.
    widened = [m for m in messages(caplog) if "widened interval_tokens" in m]
    assert len(widened) == 1 and f"widened interval_tokens to {6 * step:,} (every 6 steps" in widened[0]
    assert "the 60-step constant phase must keep at least 10 snapshots" in widened[0]
    steps = [r.step for r, _ in callback.snapshots()]
    # Steps 1-3 give the step time without snapshots; 3 snapshots 2 steps apart show the cost.
    assert steps == [4, 6, 8, 12, 18, 24, 30, 36, 42, 48, 54, 60]
    manifest = read_manifest(tmp_path / "pma")
    assert manifest["interval_tokens"] == 6 * step and callback.interval_tokens == 6 * step
    record = manifest["interval_choice"]["widened"]
    assert record["from_interval_tokens"] == 2 * step and record["budget_met"] is False
    # the decision and what it rests on are in the manifest: a resumed run keeps them
    measured = manifest["interval_choice"]["cost"]
    assert manifest["interval_choice"]["cost_reviewed"] and measured["decision"] == "widened"
    assert measured["share_low"] > measured["budget"] == 0.01 and measured["steps_between"] == 2
    # One line says what they cost: the widened one (no second cost line at the new interval).
    cost = [m for m in messages(caplog) if "snapshots cost" in m]
    assert len(cost) == 1 and "(every 6 steps: about" in cost[0]


def test_a_given_interval_is_kept_and_a_warning_says_which_would_do(tmp_path, caplog, slow_copy):
    callback = PMACallback(interval_tokens=4 * SEQ * BATCH)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        train(tmp_path, [callback], max_steps=16, lr_scheduler_type="constant")
    assert [r.step for r, _ in callback.snapshots()] == [4, 8, 12, 16]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "of training time" in r.getMessage()]
    assert len(warned) == 1 and "above max_overhead=1.0%: an interval_tokens of at least" in warned[0]


def test_without_a_budget_the_automatic_interval_is_kept(tmp_path, slow_copy):
    callback = PMACallback(max_overhead=None)
    train(tmp_path, [callback], max_steps=12, lr_scheduler_type="constant")
    assert [r.step for r, _ in callback.snapshots()] == list(range(1, 13))  # 12 steps < 40: every step


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, "1%", True])
def test_max_overhead_is_a_share_between_zero_and_one(bad):
    with pytest.raises(ValueError, match="^max_overhead must be a share of training time"):
        PMACallback(max_overhead=bad)
    with pytest.raises(ValueError, match="^pma_max_overhead must be a share of training time"):
        PMATrainingArguments(output_dir="unused", pma_max_overhead=bad)


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
