"""The automatic merge window (hf_pma.core.window_choice): pure rule, no files."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys

import pytest

from hf_pma.core import window_choice
from hf_pma.core.selection import DEFAULT_WINDOW
from hf_pma.core.window_choice import (
    MAX_SHARE,
    RunPoint,
    check_window_count,
    choose_window,
    point_from_record,
)

V = 20_480  # tokens between snapshots, as the default run


def run(losses, *, start=1, lr=3e-3, phase="stable"):
    """Points every V tokens from ``start`` * V, one per loss."""
    return [
        RunPoint(tokens=(start + i) * V, step=(start + i) * 20, lr=lr, loss=loss, phase=phase)
        for i, loss in enumerate(losses)
    ]


def noisy(n, level, sd, slope=0.0, seed=0):
    rng = random.Random(seed)
    return [level - slope * i + rng.gauss(0, sd) for i in range(n)]


def test_a_loss_that_still_falls_fast_is_too_early_for_a_merge():
    points = run([5.0 - 0.4 * i + (0.01 if i % 2 else -0.01) for i in range(15)])
    choice = choose_window(points)
    assert choice.count == 1
    assert choice.rule == "too-early"
    assert "too early" in choice.reason and "last snapshot" in choice.describe()


def test_a_flat_noisy_loss_takes_the_longest_window_the_cap_allows():
    points = run(noisy(60, 4.0, 0.05), start=1)
    choice = choose_window(points)
    newest = points[-1].tokens
    taken = points[-choice.count :]
    assert newest - taken[0].tokens <= MAX_SHARE * newest  # within the cap
    assert newest - points[-choice.count - 1].tokens > MAX_SHARE * newest  # one more would pass it
    assert choice.rule == "cap" and choice.share <= MAX_SHARE


def test_the_window_shrinks_as_the_trend_steepens():
    counts = [choose_window(run(noisy(60, 5.0, 0.03, slope=s, seed=1))).count for s in (0.0, 0.005, 0.02, 0.2)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > counts[-1] == 1


def test_the_window_never_reaches_back_across_a_learning_rate_change_or_into_warmup():
    before = run(noisy(20, 4.0, 0.02), lr=6e-3)
    after = run(noisy(5, 4.0, 0.02, seed=3), start=21, lr=3e-3)
    choice = choose_window(before + after)
    assert choice.count <= 5
    warm = run(noisy(10, 4.0, 0.02), phase="warmup") + run(noisy(4, 4.0, 0.02, seed=4), start=11)
    assert choose_window(warm).count <= 4
    assert choose_window(run([4.0, 3.9], phase="warmup")).rule == "too-early"


def test_without_losses_the_window_is_a_share_of_the_tokens_trained():
    points = [RunPoint(tokens=(i + 1) * V, step=(i + 1) * 20, lr=3e-3, phase="stable") for i in range(50)]
    choice = choose_window(points)
    assert choice.rule == "no-loss"
    assert 1 < choice.count <= 6  # 10% of 50 snapshots' tokens: 5 gaps
    assert "no training loss" in choice.reason


def test_without_progress_the_window_is_the_papers_n_and_says_so():
    points = [RunPoint(loss=4.0) for _ in range(30)]
    choice = choose_window(points)
    assert choice.count == DEFAULT_WINDOW and choice.rule == "no-progress"
    assert choose_window(points[:1]).count == 1
    with pytest.raises(ValueError, match="no snapshots"):
        choose_window([])


def test_hostile_record_values_are_unknown_not_errors():
    point = point_from_record(
        {"lr": "3e-3", "loss": float("nan"), "phase": 7, "tokens": True, "step": -1}, None, None
    )
    assert point == RunPoint()
    assert point_from_record("not a dict") == RunPoint()
    good = point_from_record({"lr": 3e-3, "loss": 4.2, "phase": "stable"}, 1024, 10)
    assert good == RunPoint(tokens=1024, step=10, lr=3e-3, loss=4.2, phase="stable")


def test_every_choice_says_why_and_serializes():
    choice = choose_window(run(noisy(40, 4.0, 0.05, slope=0.002)))
    record = choice.to_dict()
    assert record["mode"] == "auto" and record["count"] == choice.count
    assert all(math.isfinite(record[k]) for k in ("trend", "noise", "share"))
    assert choice.describe().startswith(f"auto window: the newest {choice.count} snapshots, WMA (")
    assert choice.strategy == "wma" and record["strategy"] == "wma"
    assert "% of the run" in choice.reason


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_auto_is_read_in_any_case(value):
    assert check_window_count(value) == "auto"


@pytest.mark.parametrize("value,expected", [(8, 8), ("8", 8), (" 3 ", 3)])
def test_counts_are_read_from_text(value, expected):
    assert check_window_count(value, text=True) == expected


def test_from_python_a_count_is_an_int():
    assert check_window_count(8) == 8
    with pytest.raises(ValueError, match="^window must be 'auto' or a positive number of snapshots, got '8'"):
        check_window_count("8")


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "x", "", None, [3]])
def test_bad_windows_are_one_line_errors_naming_the_option(value):
    with pytest.raises(ValueError, match=r"^pma_window must be 'auto' or a positive number") as err:
        check_window_count(value, "pma_window")
    assert "\n" not in str(err.value)


# Totality: every value a point can hold gives a choice, never an error.

def _alternating(n, low, high):
    return run([low if i % 2 else high for i in range(n)])


@pytest.mark.parametrize("low,high", [(0.0, 1e200), (-1.7e308, 1.7e308), (0.0, 5e-324), (-1e300, -1e300)])
def test_finite_but_extreme_losses_give_a_choice_with_finite_numbers(low, high):
    choice = choose_window(_alternating(40, low, high))
    assert 1 <= choice.count <= 40 and choice.reason and "\n" not in choice.reason
    json.dumps(choice.to_dict(), allow_nan=False)  # the merge record stays valid JSON
    assert len(choice.describe()) < 300


def test_huge_losses_are_shown_short():
    choice = choose_window(_alternating(40, 0.0, 1e200))
    assert "e+19" in choice.reason and "0" * 50 not in choice.reason


def test_scaling_every_loss_by_a_power_of_two_changes_no_decision():
    losses = noisy(60, 5.0, 0.03, slope=0.005, seed=1)
    plain = choose_window(run(losses))
    for power in (-1000, -60, 60, 1000):
        scaled = choose_window(run([math.ldexp(x, power) for x in losses]))
        assert (scaled.count, scaled.rule) == (plain.count, plain.rule)
        assert scaled.trend == math.ldexp(plain.trend, power)


@pytest.mark.parametrize(
    "field,value",
    [("loss", math.nan), ("loss", math.inf), ("loss", -math.inf), ("loss", 10**400), ("loss", "4.0"),
     ("loss", True), ("tokens", 10**400), ("tokens", -5), ("tokens", 2.5), ("tokens", True),
     ("lr", math.nan), ("lr", 10**400), ("lr", -math.inf), ("phase", ["stable"])],
)
def test_a_value_the_rule_cannot_use_is_unknown(field, value):
    points = run(noisy(30, 4.0, 0.05))
    bad = [dataclasses.replace(p, **{field: value}) if i == 20 else p for i, p in enumerate(points)]
    unknown = [dataclasses.replace(p, **{field: None}) if i == 20 else p for i, p in enumerate(points)]
    assert choose_window(bad) == choose_window(unknown)


def test_records_with_numbers_no_float_holds_are_unknown():
    point = point_from_record({"lr": 10**400, "loss": -(10**400), "tokens": 10**400, "step": 2**63})
    assert point == RunPoint()
    assert point_from_record({"tokens": 2**63 - 1}).tokens == 2**63 - 1


@pytest.mark.parametrize(
    "setting,value", [("max_share", math.nan), ("max_share", 0), ("fallback_share", 1.5), ("trend_limit", math.inf),
                      ("trend_limit", -1), ("max_share", "0.2")]
)
def test_settings_out_of_range_are_one_line_errors(setting, value):
    with pytest.raises(ValueError, match=rf"^{setting} must be ") as err:
        choose_window(run(noisy(10, 4.0, 0.05)), **{setting: value})
    assert "\n" not in str(err.value)


# Cost: the rule's work grows about linearly with the snapshots (it was quadratic).

def _work(points):
    """How many lines of the rule's module run for one choice: a count, not a time."""
    lines, module = 0, window_choice.__file__

    def local(frame, event, arg):
        nonlocal lines
        lines += 1
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == module else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        choose_window(points)
    finally:
        sys.settrace(previous)
    return lines


def test_the_rule_does_linear_work_in_its_worst_layout():
    # The worst layout: a flat loss far from the run's start, so the cap never ends the window.
    def far_flat(n):
        return run(noisy(n, 4.0, 0.05, seed=2), start=10**8)

    small, large = _work(far_flat(400)), _work(far_flat(1600))
    assert choose_window(far_flat(1600)).count == 1600
    assert large < 5 * small  # 4x the snapshots: about 4x the work (quadratic was about 16x)


# The commands that show the rule's choice: a run whose records hold hostile losses.

def _no_constant(name):
    raise AssertionError(f"the record holds {name}: not JSON")


def test_merge_and_inspect_take_a_run_whose_losses_overflow_a_fit(tmp_path):
    from tests.helpers.cli import run_cli
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    losses = [0.0 if i % 2 else 1e200 for i in range(8)]  # finite, but their squares are not
    run_dir, _ = write_run(tmp_path / "run", 8, noise_deviation(), losses=losses, interval=1000)
    merged = run_cli("merge", run_dir, "--last", "auto", "--output", tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    record = json.loads((tmp_path / "merged" / "pma_merge.json").read_text(), parse_constant=_no_constant)
    assert 2 <= record["window"]["auto"]["count"] <= 8 and "e+19" in record["window"]["auto"]["reason"]
    inspected = run_cli("inspect", run_dir)
    assert inspected.returncode == 0 and "Traceback" not in inspected.stderr, inspected.stderr
    assert "auto window: the newest" in inspected.stdout


def test_a_rising_loss_is_said_as_a_rise():
    """A window over which the training loss rose says so ("rises by 0.020"), never "falls by -0.020"."""
    points = [RunPoint(tokens=1000 * (i + 1), step=i + 1, lr=1e-3, loss=3.0 + 0.01 * i, phase="stable") for i in range(12)]
    choice = choose_window(points)
    assert choice.trend < 0 and "the training loss rises by 0.030 (± 0.000) over them" in choice.reason
    assert "falls by -" not in choice.reason
