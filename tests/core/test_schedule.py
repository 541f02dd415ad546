"""hf_pma.core.schedule: token boundaries, the LR phase of real schedules, the automatic interval."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import get_scheduler

from hf_pma.core.schedule import (
    MAX_AUTO_INTERVAL_TOKENS,
    PhaseTracker,
    SnapshotSchedule,
    check_phases,
    check_schedule_state,
    choose_interval,
    crossed_boundary,
    lr_phase,
    next_boundary,
    plan_run,
    planned_phases,
    snapshot_spacing,
)


def schedule_lrs(name: str, steps: int, lr: float = 1e-3, **kwargs) -> list[float]:
    """The LR each optimizer step uses under a real transformers / torch scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    if name == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=kwargs["step_size"], gamma=0.1)
    elif name == "half":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5)
    elif name == "cosine_restarts":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=kwargs["T_0"])
    else:
        scheduler = get_scheduler(name, optimizer, num_training_steps=steps, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def runs(phases: list[str]) -> list[tuple[str, int]]:
    """Run-length encoding: [("warmup", 3), ("stable", 10), ...]."""
    out: list[tuple[str, int]] = []
    for phase in phases:
        if out and out[-1][0] == phase:
            out[-1] = (phase, out[-1][1] + 1)
        else:
            out.append((phase, 1))
    return out


def test_crossed_boundary_first_step_reaching_each_multiple():
    assert crossed_boundary(0, 99, 100) is None
    assert crossed_boundary(0, 100, 100) == 100  # reaching exactly counts
    assert crossed_boundary(99, 150, 100) == 100
    assert crossed_boundary(100, 199, 100) is None
    assert crossed_boundary(150, 420, 100) == 400  # several multiples in one step: one snapshot, the last
    tokens = [0, 70, 140, 210, 280, 350, 420]
    due = [t for prev, t in zip(tokens, tokens[1:]) if crossed_boundary(prev, t, 100)]
    assert due == [140, 210, 350, 420]  # the first step at or past 100, 200, 300, 400
    assert next_boundary(0, 100) == 100 and next_boundary(100, 100) == 200 and next_boundary(199, 100) == 200


def test_crossed_boundary_rejects_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        crossed_boundary(0, 10, 0)
    with pytest.raises(ValueError, match="interval"):
        next_boundary(0, -5)


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("constant", {}, [("stable", 40)]),
        ("constant_with_warmup", {"num_warmup_steps": 5}, [("warmup", 5), ("stable", 35)]),
        (
            "warmup_stable_decay",
            {"num_warmup_steps": 4, "scheduler_specific_kwargs": {"num_decay_steps": 10}},
            # the first of the 10 decay steps still uses the peak LR (decay progress 0)
            [("warmup", 4), ("stable", 27), ("decay", 9)],
        ),
        # cosine / linear: at the peak for one step only, then decaying.
        ("cosine", {"num_warmup_steps": 5}, [("warmup", 5), ("stable", 1), ("decay", 34)]),
        ("linear", {"num_warmup_steps": 0}, [("stable", 1), ("decay", 39)]),
        # Step-downs: constant at a lower LR after the peak is still past the peak.
        ("step", {"step_size": 15}, [("stable", 15), ("decay", 25)]),
        # A schedule that never reaches the optimizer's LR but is constant.
        ("half", {}, [("warmup", 1), ("stable", 39)]),
        # Warm restarts jump back to the peak.
        ("cosine_restarts", {"T_0": 20}, [("stable", 1), ("decay", 19), ("stable", 1), ("decay", 19)]),
    ],
)
def test_phases_of_real_schedules(name, kwargs, expected):
    lrs = schedule_lrs(name, 40, **kwargs)
    assert runs(planned_phases(lrs, peak_lr=1e-3)) == expected


def test_phase_tracker_resumes_from_state():
    lrs = schedule_lrs(
        "warmup_stable_decay", 40, num_warmup_steps=4, scheduler_specific_kwargs={"num_decay_steps": 10}
    )
    full = planned_phases(lrs, 1e-3)
    first = PhaseTracker(1e-3)
    for lr in lrs[:33]:
        first.update(lr)
    resumed = PhaseTracker(1e-3)
    resumed.load_state(first.state())
    assert [resumed.update(lr) for lr in lrs[33:]] == full[33:]
    # Without the state, the first decay step after a restart would look like warmup.
    assert PhaseTracker(1e-3).update(lrs[35]) == "warmup"


def test_lr_phase_validates():
    with pytest.raises(ValueError, match="peak"):
        lr_phase(1e-3, 0.0, None, False)
    with pytest.raises(ValueError, match="finite"):
        lr_phase(float("nan"), 1e-3, None, False)
    with pytest.raises(ValueError, match="peak_lr"):
        PhaseTracker(-1.0)


def test_choose_interval_spreads_the_target_over_the_steps_that_snapshot():
    # 10k steps, 8k of them snapshot: 40 snapshots -> every 200 steps, a whole number of steps.
    choice = choose_interval(
        tokens_per_step=2**20, planned_steps=10_000, snapshot_steps=8_000, stable_steps=7_000
    )
    assert choice.interval_tokens == 200 * 2**20 and choice.expected_snapshots == 40
    assert choice.stable_steps == 7_000 and choice.to_dict()["expected_snapshots"] == 40
    # Unknown (0): all planned steps.
    assert choose_interval(1000, 400, 0).interval_tokens == 10 * 1000
    # Rounded to the nearest whole number of steps: 230 / 40 = 5.75 -> 6 steps, 38 snapshots.
    assert choose_interval(100, 300, 230).interval_tokens == 600
    # Closer snapshots too (87 steps: 2.175 apart -> 2 steps, 43 snapshots), and halves go up
    # (180 steps: 4.5 apart -> 5 steps, 36 snapshots; run_clm's 2.75 steps -> 3).
    close = choose_interval(64, 90, 87)
    assert close.interval_tokens == 2 * 64 and close.expected_snapshots == 43
    assert choose_interval(256, 200, 180).interval_tokens == 5 * 256
    assert choose_interval(1024, 120, 110).interval_tokens == 3 * 1024


def _snapshot_steps(interval: int, tokens_per_step: int, steps: int) -> list[int]:
    """The steps that snapshot with a fixed ``tokens_per_step``, as crossed_boundary decides."""
    return [
        s
        for s in range(1, steps + 1)
        if crossed_boundary((s - 1) * tokens_per_step, s * tokens_per_step, interval) is not None
    ]


@given(st.integers(1, 5000), st.integers(41, 20_000))
def test_the_automatic_interval_is_a_whole_number_of_steps_and_spaces_snapshots_evenly(tokens_per_step, span):
    choice = choose_interval(tokens_per_step, span + 10, span)
    steps, rest = divmod(choice.interval_tokens, tokens_per_step)
    assert rest == 0 and steps == max(1, int(span / 40 + 0.5))  # the nearest whole number, halves up
    taken = _snapshot_steps(choice.interval_tokens, tokens_per_step, span)
    assert {b - a for a, b in zip(taken, taken[1:])} == {steps}  # equally spaced
    assert len(taken) == choice.expected_snapshots == span // steps
    # The count: within 10% of 40 from 5 steps apart on, 30 to 60 when closer.
    assert abs(len(taken) - 40) <= (4 if span >= 5 * 40 else 20), (choice, len(taken))


@given(st.integers(1, 4096), st.integers(1, 32))
def test_snapshot_spacing_says_how_far_apart_the_snapshots_will_be(interval, tokens_per_step):
    line = snapshot_spacing(interval, tokens_per_step)
    # Enough steps for every gap to show: the pattern repeats after tokens_per_step boundaries.
    taken = _snapshot_steps(
        interval, tokens_per_step, (tokens_per_step + 2) * -(-interval // tokens_per_step)
    )
    gaps = {b - a for a, b in zip(taken, taken[1:])}
    apart = sorted(g * tokens_per_step for g in gaps)
    assert line.startswith(f"interval_tokens={interval:,} is ") and "\n" not in line
    if len(apart) == 1:  # evenly spaced: a whole number of steps, or a step or less
        assert line.endswith(
            f"snapshots will be {apart[0]:,} tokens apart"
            + (" (one every step)" if interval <= tokens_per_step else "")
        )
    elif len(apart) == 2:
        assert f"snapshots will be {apart[0]:,} or {apart[1]:,} tokens apart; " in line
        assert line.endswith(f"give a multiple of {tokens_per_step:,} for evenly spaced snapshots")


def test_snapshot_spacing_of_run_clms_default_batch():
    # transformers' run_clm.py with the zero-argument callback chose 2,816 tokens at 1,024 a step.
    assert snapshot_spacing(2816, 1024) == (
        "interval_tokens=2,816 is 2.75 steps of 1,024 tokens: snapshots will be 2,048 or 3,072 tokens apart; "
        "give a multiple of 1,024 for evenly spaced snapshots"
    )
    assert (
        snapshot_spacing(3072, 1024)
        == "interval_tokens=3,072 is 3 steps of 1,024 tokens: snapshots will be 3,072 tokens apart"
    )
    assert snapshot_spacing(1024, 1024).endswith(
        "is 1 step of 1,024 tokens: snapshots will be 1,024 tokens apart (one every step)"
    )
    with pytest.raises(ValueError, match="^tokens_per_step must be a positive integer, got 0"):
        snapshot_spacing(2816, 0)


def test_choose_interval_floor_and_ceiling():
    floor = choose_interval(tokens_per_step=512, planned_steps=30, snapshot_steps=20)
    assert floor.interval_tokens == 512 and "floor" in floor.reason
    huge = choose_interval(tokens_per_step=10**7, planned_steps=10**7, snapshot_steps=10**7)
    assert huge.interval_tokens <= MAX_AUTO_INTERVAL_TOKENS and "ceiling" in huge.reason
    assert huge.interval_tokens % 10**7 == 0
    # A step larger than the ceiling: one step is the least possible.
    assert choose_interval(10**11, 100, 100).interval_tokens == 10**11


@pytest.mark.parametrize(
    "bad", [{"tokens_per_step": 0}, {"planned_steps": -1}, {"snapshot_steps": -2}, {"tokens_per_step": True}]
)
def test_choose_interval_rejects_bad_input(bad):
    kwargs = {"tokens_per_step": 100, "planned_steps": 100, "snapshot_steps": 50, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        choose_interval(**kwargs)


@pytest.mark.parametrize(
    "name, kwargs, stable, selected, constant",
    [
        ("linear", {"num_warmup_steps": 0}, 1, 200, False),  # Trainer's default: decays from the first step
        ("cosine", {"num_warmup_steps": 20}, 1, 180, False),
        (
            "warmup_stable_decay",
            {"num_warmup_steps": 20, "scheduler_specific_kwargs": {"num_decay_steps": 40}},
            141,
            180,
            True,
        ),
        ("constant", {}, 200, 200, True),
        ("constant_with_warmup", {"num_warmup_steps": 20}, 180, 180, True),
    ],
)
def test_run_plan_of_real_schedules(name, kwargs, stable, selected, constant):
    lrs = schedule_lrs(name, 200, **kwargs)
    plan = plan_run(200, ("stable", "decay"), lrs, peak_lr=1e-3)
    assert (plan.stable_steps, plan.selected_steps(), plan.has_constant_phase) == (stable, selected, constant)
    assert plan.intended_snapshots() == 40 and plan.to_dict()["selected_steps"] == selected
    # After step 100: what is left of the run.
    assert plan.selected_steps(after_step=100) == 100
    assert plan_run(200, ("stable",), lrs, peak_lr=1e-3).selected_steps() == stable


def test_a_long_cosine_has_no_constant_phase_though_it_stays_near_its_peak_for_a_few_steps():
    lrs = schedule_lrs("cosine", 10_000, num_warmup_steps=500)
    plan = plan_run(10_000, ("stable", "decay"), lrs, peak_lr=1e-3)
    assert 1 < plan.stable_steps < 20 and not plan.has_constant_phase
    short_wsd = schedule_lrs(
        "warmup_stable_decay", 100, num_warmup_steps=5, scheduler_specific_kwargs={"num_decay_steps": 90}
    )
    assert not plan_run(100, ("stable",), short_wsd, peak_lr=1e-3).has_constant_phase  # 6 of 100 steps


def test_run_plan_at_a_stride_and_unprobed():
    lrs = schedule_lrs(
        "warmup_stable_decay", 1000, num_warmup_steps=100, scheduler_specific_kwargs={"num_decay_steps": 200}
    )
    strided = plan_run(1000, ("stable", "decay"), lrs[::10], peak_lr=1e-3, stride=10)
    assert strided.selected_steps() == 900 and abs(strided.stable_steps - 701) <= 10
    assert strided.selected_steps(after_step=500) == 500
    unknown = plan_run(1000, ("stable", "decay"), None, peak_lr=1e-3, warmup_steps=100)
    assert (unknown.stable_steps, unknown.selected_steps(), unknown.has_constant_phase) == (900, 900, True)
    assert unknown.selected_steps(after_step=950) == 50
    assert plan_run(30, ("stable",), None, 1e-3).intended_snapshots() == 30  # fewer steps than the target


def test_snapshot_schedule_takes_the_automatic_interval_and_resumes():
    lrs = schedule_lrs("constant_with_warmup", 100, num_warmup_steps=20)
    plan = plan_run(100, ("stable",), lrs, peak_lr=1e-3)
    schedule = SnapshotSchedule(phases="stable")
    schedule.begin(peak_lr=1e-3, tokens=0)
    due = []
    for step, lr in enumerate(lrs, start=1):
        tick = schedule.advance(step * 10, lr)
        if schedule.interval_tokens is None:
            schedule.choose_automatically(tick.step_tokens, plan)
        if schedule.due(tick) is not None:
            due.append(step)
        if step == 50:
            saved = schedule.state()
    # 80 stable steps / 40 snapshots: every 2 steps from the first stable one (21).
    assert schedule.interval_tokens == 20 and due == list(range(22, 101, 2))
    resumed = SnapshotSchedule(phases="stable")
    resumed.begin(peak_lr=1e-3, tokens=500, saved=saved)
    assert resumed.interval_tokens == 20 and resumed.interval_choice["auto"]
    assert [
        s for s, lr in enumerate(lrs[50:], start=51) if resumed.due(resumed.advance(s * 10, lr)) is not None
    ] == due[15:]
    with pytest.raises(ValueError, match="interval_tokens"):
        SnapshotSchedule(interval_tokens=0)
    # More than a manifest records: refused here, not once the snapshot folder was written.
    with pytest.raises(ValueError, match="^interval_tokens must be an integer from 1 to 9223372036854775807"):
        SnapshotSchedule(interval_tokens=10**30)


def test_check_phases():
    assert check_phases("stable") == ("stable",)
    assert check_phases(["decay", "stable", "decay"]) == ("decay", "stable")
    for bad in ([], ["annealing"], 3):
        with pytest.raises(ValueError, match="phases"):
            check_phases(bad)


def test_schedule_module_does_not_import_torch():
    code = "import sys, hf_pma.core.schedule; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_schedule_state_takes_what_state_gives_and_names_a_bad_field():
    schedule = SnapshotSchedule(None, ("stable",))
    schedule.begin(peak_lr=1e-3, tokens=0)
    schedule.choose_automatically(64, plan_run(100, ("stable",), None, 1e-3))
    schedule.advance(64, 1e-3)
    assert check_schedule_state(schedule.state(), "ckpt") == schedule.state()
    assert check_schedule_state({}, "ckpt") == {}
    for state, says in [
        ("x", "ckpt: the schedule state must be a dict"),
        ({"interval_tokens": True}, "ckpt: interval_tokens must be a positive integer or None, got True"),
        ({"phase": {"previous_lr": float("nan")}}, "ckpt: phase.previous_lr must be a finite number or None"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            check_schedule_state(state, "ckpt")
