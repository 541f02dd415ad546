"""Merge windows by training progress: the last T tokens (or S steps), half-open, stages, errors."""

from __future__ import annotations

import pytest

from hf_pma.core.selection import WindowSpan, check_window, window_by_progress, window_span
from hf_pma.utils.argtypes import parse_count


def test_window_takes_the_last_span_half_open():
    positions = [1000, 2000, 3000, 4000, 5000, 6000]
    # (newest - T, newest]: T = N * V takes N snapshots taken every V.
    for n in range(1, 7):
        assert window_by_progress(positions, n * 1000) == list(range(6 - n, 6))
    assert window_by_progress(positions, 2001) == [3, 4, 5]
    assert window_by_progress(positions, 10**9) == [0, 1, 2, 3, 4, 5]
    assert window_by_progress(positions, 1) == [5]  # the newest alone is always in
    # Uneven gaps (Trainer checkpoints saved at irregular steps): the span decides, not the count.
    assert window_by_progress([10, 500, 900, 950, 1000], 120, "steps") == [2, 3, 4]
    assert window_by_progress([], 5) == []


def test_window_stops_at_a_stage_whose_counts_restart():
    # Two stages: counts restart; the window stays in the newest stage.
    assert window_by_progress([800, 900, 1000, 100, 200, 300], 10_000) == [3, 4, 5]


def test_window_needs_counts_within_reach():
    assert window_by_progress([None, 2000, 3000], 1000) == [2]  # the unknown one is out of reach
    with pytest.raises(ValueError, match="candidate 0 has no token count"):
        window_by_progress([None, 2000, 3000], 5000)
    with pytest.raises(ValueError, match="the newest candidate has no step count"):
        window_by_progress([1, None], 5, "steps")
    with pytest.raises(ValueError, match="positive number of tokens"):
        window_by_progress([1, 2], 0)
    with pytest.raises(ValueError, match="unknown window unit"):
        window_by_progress([1, 2], 3, "epochs")


def test_check_window_and_span():
    check_window(100)
    with pytest.raises(ValueError, match="give one of window_tokens and window_steps"):
        check_window(100, 5)
    with pytest.raises(ValueError, match="window_steps must be a positive integer"):
        check_window(None, 0)
    span = window_span([4000, 5000, 6000], [40, 50, 60], requested=3000)
    assert span == WindowSpan("tokens", 4000, 6000, 3000) and span.span == 2000
    assert span.describe() == "tokens 4,000 to 6,000 (span 2,000), window of 3,000 tokens"
    assert window_span([None, 5000], [40, 50]).to_dict() == {
        "unit": "steps",
        "first": 40,
        "last": 50,
        "span": 10,
        "requested": None,
    }
    assert window_span([None], [None]) is None


def test_parse_count():
    assert [parse_count(t) for t in ("40960", "40_960", "40,960", "40k", "2.5M", "1B")] == [
        40960,
        40960,
        40960,
        40_000,
        2_500_000,
        10**9,
    ]
    for bad in ("0", "-5", "1.5", "abc", "", "0.0001k"):
        with pytest.raises(ValueError, match="expected a positive"):
            parse_count(bad)
