"""hf_pma.snapshots.planning: the planned snapshot count, the disk plan, the widened interval and
the messages, as pure functions (no model, no training)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hf_pma.core.schedule import choose_interval, plan_run
from hf_pma.snapshots import planning
from hf_pma.snapshots.budget import DiskBudget, human_bytes
from hf_pma.snapshots.overhead import OverheadEstimate

PEAK = 1e-3
# 100 planned steps: 10 of warmup, 60 at the peak LR, 30 of decay.
LRS = [PEAK * (s + 1) / 11 for s in range(10)] + [PEAK] * 60 + [PEAK * (30 - s) / 31 for s in range(30)]
WSD = plan_run(100, ("stable", "decay"), LRS, PEAK)
# The LR decays from the first step (transformers' default "linear"): no constant phase.
LINEAR = plan_run(100, ("stable", "decay"), [PEAK * (100 - s) / 100 for s in range(100)], PEAK)


def test_planned_snapshots_by_interval_and_step_size():
    # The automatic interval (not chosen yet): what it aims at.
    assert planning.planned_snapshots(WSD, None, None, 0) == (40, "the automatic interval aims at 40")
    # A given interval before the first step's tokens are known: unknown.
    assert planning.planned_snapshots(WSD, 1000, None, 0) == (None, "unknown before the first step")
    # 90 steps snapshot (stable + decay); 3 steps of 100 tokens between snapshots of 300.
    count, what = planning.planned_snapshots(WSD, 300, 100, 0)
    assert count == 30 and what == "90 steps snapshot, 300 tokens apart at 100 a step"
    # After 40 steps, 60 remain in the selected phases.
    assert planning.planned_snapshots(WSD, 300, 100, 40)[0] == 20
    # An interval below one step: at most one snapshot a step.
    assert planning.planned_snapshots(WSD, 50, 100, 0) == (
        90,
        "90 steps snapshot, at most one snapshot a step",
    )


def test_disk_plan_fits_or_says_why_not(tmp_path: Path):
    budget = DiskBudget(tmp_path, max_disk_bytes=1000)
    error, plan = planning.check_disk_plan(
        budget, 100, folders=5, listed=0, used_bytes=0, count=5, what="a test"
    )
    assert error is None and plan.startswith("5 snapshots of 100 B (all kept; a test) take 500 B of 1000 B")
    error, plan = planning.check_disk_plan(
        budget, 300, folders=5, listed=0, used_bytes=0, count=5, what="a test"
    )
    assert plan is None and "would take 1.5 KiB" in error and "Nothing was written" in error
    # A resumed run: the 2 listed snapshots' 600 bytes count against the budget; 3 more folders come.
    error, _ = planning.check_disk_plan(
        budget, 150, folders=5, listed=2, used_bytes=600, count=3, what="a test"
    )
    assert error is not None and "max_disk_bytes is 400 B" in error
    assert (
        planning.extra_folders(5, 2) == 2
        and planning.extra_folders(None, 2) == 0
        and planning.extra_folders(1, 3) == 0
    )


def _estimate(extra_s: float, step_s: float = 0.1, extra_se_s: float = 0.0) -> OverheadEstimate:
    return OverheadEstimate(
        step_s=step_s, step_se_s=0.0, clean_steps=10, extra_s=extra_s, extra_se_s=extra_se_s, intervals=2,
        steps_between=2.0,
    )


def test_a_costly_automatic_interval_is_widened_in_multiples_down_to_ten_snapshots_in_the_constant_phase():
    # 0.05 s per snapshot on 0.1 s steps: 1% needs 50 steps apart; WSD's 60 constant steps allow 6.
    widened = planning.widened_interval(_estimate(0.05), 0.01, 200, 100, WSD)
    assert (widened.interval_tokens, widened.steps_between, widened.needed_steps) == (600, 6, 50)
    assert widened.max_steps == 6 and widened.constant_steps == 60 and not widened.budget_met
    # 0.002 s per snapshot: 1% needs 2 steps apart, met by widening 1 -> 2 (a multiple of the V in use).
    met = planning.widened_interval(_estimate(0.002), 0.01, 100, 100, WSD)
    assert (met.interval_tokens, met.budget_met) == (200, True)
    # The uncertainty counts: the upper end of the interval must be under the budget.
    sure = planning.widened_interval(_estimate(0.002, extra_se_s=0.001), 0.01, 100, 100, WSD)
    assert sure.needed_steps == 4 and sure.interval_tokens == 400
    # No constant phase (linear): the steps that snapshot count instead (100: at most 10 steps apart).
    linear = planning.widened_interval(_estimate(0.05), 0.01, 300, 100, LINEAR)
    assert linear.constant_steps == 100 and linear.interval_tokens == 900  # 3 steps x 3 <= 10
    line = planning.widened_message(widened, _estimate(0.05), 0.01, 14)
    assert line.startswith("hf-pma: the first snapshots cost 25% (± 0.0%) of training time at every 2 steps")
    assert "widened interval_tokens to 600 (every 6 steps: about 8.3% ± 0.0%; 14 snapshots in all)" in line
    assert "needs every 50 steps, but the 60-step constant phase must keep at least 10 snapshots" in line
    assert "cannot be met" not in planning.widened_message(met, _estimate(0.002), 0.01, 40)


def test_the_cost_line_projects_the_run_from_what_the_first_snapshots_measured():
    estimate = dataclasses.replace(_estimate(0.05, extra_se_s=0.01), first_extra_s=0.2, intervals=1)
    message, over = planning.cost_message(
        estimate, steps_between=5, tokens_per_step=100, run_steps=100, snapshots=20, setup_s=0.5,
        blocked_s=[0.3, 0.01, 0.02], write_s=0.04, num_bytes=2**20, budget=0.01, automatic=False,
    )
    # 0.5 s set-up + 0.2 s (first) + 0.05 s x 19 + 0.04 s (the last write) over 100 steps of 0.1 s.
    assert message.startswith("hf-pma: snapshots cost 17% (± 3.8%) of training time in this run: each adds 0.050s")
    assert "10% (± 4.0%) at a snapshot every 5 steps, plus 0.50s of set-up" in message and over
    assert "an interval_tokens of at least 7,000 (70 steps) keeps snapshots under it" in message
    quiet, over = planning.cost_message(
        estimate, steps_between=5, tokens_per_step=100, run_steps=100, snapshots=20, setup_s=0.5,
        blocked_s=[0.3], write_s=0.04, num_bytes=None, budget=None, automatic=True,
    )
    assert not over and "above" not in quiet


def test_the_messages():
    warning = planning.no_constant_phase_warning(LINEAR, ("stable", "decay"), "linear")
    assert warning.startswith(
        "hf-pma: lr_scheduler_type='linear' has no constant-LR phase (1 of 100 planned steps"
    )
    assert "stable/decay phases (about 40 of them)" in warning
    assert planning.no_constant_phase_warning(WSD, ("stable", "decay"), "warmup_stable_decay") is None
    assert planning.varying_steps_message(128, 64, 40, 3, True) == (
        "hf-pma: optimizer steps vary in tokens (step 3: 40; the first: 64): snapshots stay every 128 tokens "
        "(chosen as 2.00 steps of the first step's tokens), so the number of steps between them varies"
    )
    # From a loop of one's own: the scheduler's class, and advice in get_scheduler words.
    loop = planning.no_constant_phase_warning(LINEAR, ("stable", "decay"), "LambdaLR")
    assert loop.startswith("hf-pma: the lr_scheduler (LambdaLR) has no constant-LR phase")
    assert "get_scheduler('warmup_stable_decay'" in loop and "lr_scheduler_type" not in loop

    choice = choose_interval(64, 100, WSD.selected_steps(), stable_steps=WSD.stable_steps)
    line = planning.interval_choice_message(choice, 64, ("stable", "decay"))
    assert line.startswith(
        f"hf-pma: interval_tokens not given: chose {choice.interval_tokens:,} tokens (every "
    )
    assert "(90 of 100 planned steps; 60 at the peak LR)" in line

    where = planning.destination(Path("/runs/a"), None)
    assert where == "into /runs/a"
    assert (
        planning.destination(Path("/runs/a"), "ema")
        == "into an online ema average, saved at the end to /runs/a/online-ema"
    )
    # A folder name with a control character is shown escaped, on one line.
    assert "\n" not in planning.destination(Path("/runs/a\nb"), None)
    announce = planning.announce_message(256, 64, True, ("stable",), where, "4 snapshots of 1 KiB")
    assert announce == (
        "hf-pma: a snapshot every 256 tokens (4.0 steps; chosen automatically, see Choosing V in the docs) in the "
        "stable phases into /runs/a; disk: 4 snapshots of 1 KiB"
    )
    end = planning.end_message(3, 3 * 2**20, Path("/runs/my run/pma"))
    assert end == (
        f"hf-pma: 3 snapshots ({human_bytes(3 * 2**20)}) in /runs/my run/pma; "
        "`hf-pma merge '/runs/my run/pma' --last N -o MERGED` averages the last N"
    )
    assert planning.small_interval_warning(100, 64) is None
    assert planning.small_interval_warning(32, 64).startswith(
        "hf-pma: interval_tokens=32 is smaller than one step"
    )


def test_a_given_interval_that_is_not_whole_steps_gets_one_line_on_its_spacing():
    # run_clm.py's default batch: 1,024 tokens a step; V=2,816 gives snapshots 2,048 or 3,072 apart.
    line = planning.uneven_spacing_message(2816, 1024, automatic=False)
    assert line == (
        "hf-pma: interval_tokens=2,816 is 2.75 steps of 1,024 tokens: snapshots will be 2,048 or 3,072 "
        "tokens apart; give a multiple of 1,024 for evenly spaced snapshots"
    )
    assert planning.uneven_spacing_message(3072, 1024, automatic=False) is None  # whole steps
    assert planning.uneven_spacing_message(512, 1024, automatic=False) is None  # one every step
    # The automatic V is always whole steps.
    assert planning.uneven_spacing_message(2816, 1024, automatic=True) is None


def test_an_interval_is_widened_only_when_its_cost_is_surely_over_the_budget():
    """The same run on a busy machine (noisier steps, a wider interval of the cost) keeps the
    interval that an idle one keeps: the low end of the cost's interval decides, not its point."""
    # 0.015 s per snapshot every 10 steps of 0.1 s: 1.5% against a 1% budget, by how sure?
    sure, noisy = _estimate(0.015, extra_se_s=0.001), _estimate(0.015, extra_se_s=0.005)
    assert sure.share(10) == noisy.share(10) > 0.01
    assert planning.should_widen(sure, 10, 0.01) and sure.share_low(10) > 0.01
    assert not planning.should_widen(noisy, 10, 0.01) and abs(noisy.share_low(10) - 0.005) < 1e-12
    record = planning.cost_record(noisy, 10, 0.01, widened=False)
    assert record["decision"] == "kept" and record["share_low"] < record["budget"] < record["share"] < record["share_high"]
    assert record["measured"]["extra_s"] == 0.015
