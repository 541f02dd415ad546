"""The automatic merge window (hf_pma.core.window_choice): pure rule, no files."""

from __future__ import annotations

import math
import random

import pytest

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
    points = run([5.0 - 0.2 * i + (0.01 if i % 2 else -0.01) for i in range(15)])
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
    counts = [choose_window(run(noisy(60, 5.0, 0.03, slope=s, seed=1))).count for s in (0.0, 0.005, 0.02, 0.08)]
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
    assert choice.describe().startswith(f"auto window: the newest {choice.count} snapshots:")
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
