"""The held-out check of an automatic window (hf_pma.core.window_check): pure logic, no files."""

from __future__ import annotations

import math

import pytest

from hf_pma.core.window_check import (
    MIN_SELECTION_DOCUMENTS,
    SELECTION_EVERY,
    WIDEST_SHARE,
    candidate_windows,
    checked_choice,
    describe_split,
    pick_window,
    split_for_selection,
)
from hf_pma.core.window_choice import RunPoint, WindowChoice, choose_window, widest_window


def test_every_fourth_document_selects_and_the_others_report():
    split = split_for_selection(40)
    assert split.skipped is None
    assert split.selection == tuple(range(SELECTION_EVERY - 1, 40, SELECTION_EVERY))
    assert set(split.selection).isdisjoint(split.report)
    assert sorted(split.selection + split.report) == list(range(40))
    assert split.to_dict() == {"selection_documents": 10, "report_documents": 30, "every": 4, "skipped": None}
    assert "10 of the 40" in split.describe() and "other 30" in split.describe()


def test_too_few_documents_for_a_selection_split_report_all_and_say_so():
    need = SELECTION_EVERY * MIN_SELECTION_DOCUMENTS
    assert split_for_selection(need).skipped is None
    split = split_for_selection(need - 1)
    assert split.selection == () and split.report == tuple(range(need - 1))
    assert f"needs at least {need}" in split.skipped
    assert describe_split(split.to_dict()).startswith("Automatic windows unchecked")
    with pytest.raises(ValueError, match="documents must be"):
        split_for_selection(-1)


@pytest.mark.parametrize(
    "count, expected",
    [(1, [1]), (2, [2, 1]), (3, [3, 2, 1]), (4, [4, 2, 1]), (10, [10, 5, 3, 2, 1]), (31, [31, 16, 8, 4, 2, 1])],
)
def test_candidates_are_the_window_its_halvings_and_the_last_snapshot(count, expected):
    assert candidate_windows(count) == expected


@pytest.mark.parametrize(
    "count, widest, expected",
    [
        (8, 16, [16, 12, 8, 4, 2, 1]),  # 1.5x and 2x the rule's window
        (8, 13, [12, 8, 4, 2, 1]),  # 2x would reach beyond the widest window
        (8, 8, [8, 4, 2, 1]),  # the rule's window is already the widest
        (3, 40, [6, 5, 3, 2, 1]),  # 1.5x rounds up
        (1, 40, [1]),  # too early: the last snapshot alone, nothing wider
    ],
)
def test_wider_candidates_stay_within_the_widest_window(count, widest, expected):
    assert candidate_windows(count, widest) == expected


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_a_bad_widest_window_is_refused(bad):
    with pytest.raises(ValueError, match="widest must be a positive integer"):
        candidate_windows(4, bad)


def test_the_widest_window_keeps_to_the_stretch_and_the_share():
    stable = [RunPoint(tokens=1000 * i, lr=1e-3, loss=3.0, phase="stable") for i in range(1, 11)]
    assert widest_window(stable, WIDEST_SHARE) == 6  # tokens 5,000 to 10,000: half of the run
    assert widest_window(stable, 1.0) == 10
    warm = [RunPoint(tokens=1000 * i, lr=1e-4 * i, loss=3.0, phase="warmup") for i in range(1, 8)]
    assert widest_window(warm + stable[7:], 1.0) == 3  # never into warmup
    lr_change = [RunPoint(tokens=p.tokens, lr=2e-3, loss=3.0, phase="stable") for p in stable[:8]] + stable[8:]
    assert widest_window(lr_change, 1.0) == 2  # never across a change of learning rate
    assert widest_window([RunPoint(loss=3.0)] * 5, 1.0) == 1  # no progress: nothing to measure a share by
    assert widest_window([], 1.0) == 0
    with pytest.raises(ValueError, match="max_share"):
        widest_window(stable, 0)


def test_an_unknown_newest_rate_or_phase_never_widens_across_a_change():
    """The newest snapshot's learning rate or phase unreadable (records are untrusted): the nearest
    known one stands for it, so neither the rule nor a wider candidate reaches across a change."""
    points = [RunPoint(tokens=1000 * i, lr=2e-3 if i <= 6 else 1e-3, loss=3.0, phase="stable") for i in range(1, 11)]
    assert widest_window(points, WIDEST_SHARE) == 4  # snapshots 7 to 10: one learning rate
    for unknown in (None, "0.001", float("nan")):
        blind = [*points[:-1], RunPoint(tokens=10_000, lr=unknown, loss=3.0, phase="stable")]
        assert widest_window(blind, WIDEST_SHARE) == 4
        assert widest_window(blind, 1.0) == 4
    late = [RunPoint(tokens=1000 * i, lr=2e-3 if i <= 8 else 1e-3, loss=3.0, phase="stable") for i in range(1, 11)]
    late[-1] = RunPoint(tokens=10_000, lr=None, loss=3.0, phase="stable")
    assert choose_window(late).count == 2  # the rule too: never the 2e-3 snapshots
    warm = [RunPoint(tokens=1000 * i, lr=1e-4 * i, loss=3.0, phase="warmup") for i in range(1, 6)]
    unknown = [RunPoint(tokens=1000 * i, loss=3.0) for i in range(6, 11)]
    assert widest_window(warm + unknown, 1.0) == 5  # every unknown phase, no warmup snapshot
    stable_then_unknown = [*points[6:-1], RunPoint(tokens=10_000, loss=3.0)]
    assert widest_window(warm[:3] + stable_then_unknown, 1.0) == 4


def test_a_run_still_in_warmup_has_no_wider_window():
    warm = [RunPoint(tokens=1000 * i, lr=1e-4 * i, loss=3.0, phase="warmup") for i in range(1, 11)]
    assert widest_window(warm, WIDEST_SHARE) == 1 and choose_window(warm).count == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda: widest_window(None, 0.5),
        lambda: candidate_windows(4, 0),
        lambda: pick_window({2: [5.0], 1: [5.0]}, prefer=[2]),
        lambda: pick_window({2: [None], 1: [5.0]}),
        lambda: pick_window({2: ["a"], 1: [5.0]}),
    ],
)
def test_bad_inputs_to_the_check_are_one_line_value_errors(call):
    with pytest.raises(ValueError) as err:
        call()
    assert "\n" not in str(err.value)


def test_extreme_losses_and_counts_stay_exact():
    assert candidate_windows(10**400, 10**401)[:3] == [2 * 10**400, 3 * 10**400 // 2, 10**400]
    assert pick_window({2: [math.inf], 1: [math.inf]}) == 2  # nothing strictly lower: the rule's
    assert pick_window({2: [1e308, 1e308], 1: [1.0, 1.0]}) == 1  # no overflow in the mean
    rule = WindowChoice(2, "cap", "...", share=0.2)
    odd = checked_choice(rule, {4: [4.8], 3: [4.9], 2: [5.0], 1: [5.1]}, [1000, 2000, 3000, 4000, None])
    assert odd.count == 4 and odd.share is None and "% of the run" not in odd.reason.split(";")[0]
    back = checked_choice(rule, {4: [4.8], 2: [5.0], 1: [5.1]}, [1000, 2000, 3000, 4000, 500])
    assert back.share is None


def test_a_wider_window_is_taken_only_when_strictly_lower_than_the_rules():
    tie = {8: [5.0, 5.0], 4: [5.1, 5.1], 1: [5.2, 5.2]}
    assert pick_window({16: [5.0, 5.0], **tie}, prefer=8) == 8
    assert pick_window({16: [4.9, 5.0], 12: [4.9, 5.0], **tie}, prefer=8) == 16  # equal others: the larger
    rule = WindowChoice(2, "cap", "tokens 4,000 to 5,000 (20% of the run): ...", share=0.2)
    wider = checked_choice(rule, {4: [4.8, 4.8], 3: [4.9, 4.9], 2: [5.0, 5.0], 1: [5.1, 5.1]}, [1000, 2000, 3000, 4000, 5000])
    assert (wider.count, wider.rule, wider.share) == (4, "held-out", 0.6)
    assert wider.reason.startswith("tokens 2,000 to 5,000 (60% of the run): the best on 2 selection documents")
    assert wider.reason.endswith("the rule had chosen the newest 2: " + rule.reason)


def test_the_lowest_mean_loss_wins_and_a_smaller_window_only_when_strictly_lower():
    assert pick_window({4: [5.0, 5.2], 2: [5.1, 5.0], 1: [5.3, 5.3]}) == 2
    assert pick_window({4: [5.0, 5.0], 2: [5.0, 5.0], 1: [5.0, 5.0]}) == 4  # a tie keeps the rule's window
    assert pick_window({3: [5.1, math.nan], 1: [5.2, 5.0]}) == 3  # a document with no token is left out
    with pytest.raises(ValueError, match="same selection documents"):
        pick_window({2: [5.0], 1: [5.0, 5.1]})
    with pytest.raises(ValueError, match="no selection document with scored tokens"):
        pick_window({2: [math.nan], 1: [math.nan]})


def test_a_checked_choice_says_what_the_selection_documents_showed():
    rule = WindowChoice(4, "cap", "tokens 2,000 to 5,000 (60% of the run): ...", share=0.6, trend=0.1, noise=0.05)
    positions = [1000, 2000, 3000, 4000, 5000]

    kept = checked_choice(rule, {4: [4.9, 4.9], 2: [5.0, 5.0], 1: [5.1, 5.1]}, positions)
    assert (kept.count, kept.rule, kept.share) == (4, "cap", 0.6)
    assert "the rule's window does best" in kept.reason and kept.reason.startswith(rule.reason)

    smaller = checked_choice(rule, {4: [5.2, 5.2], 2: [5.0, 5.0], 1: [5.1, 5.1]}, positions)
    assert (smaller.count, smaller.rule, smaller.share) == (2, "held-out", 0.2)
    assert smaller.reason.startswith("tokens 4,000 to 5,000 (20% of the run): the best on 2 selection documents")
    assert "newest 4: +0.1000; newest 2: -0.1000" in smaller.reason
    assert smaller.reason.endswith("the rule had chosen the newest 4: " + rule.reason)
    assert smaller.checked["rule_count"] == 4 and smaller.checked["documents"] == 2
    assert smaller.checked["against_last"]["2"] == pytest.approx(-0.1)
    assert (smaller.trend, smaller.noise) == (0.1, 0.05)  # the rule's, unchanged

    early = checked_choice(rule, {4: [5.3, 5.3], 2: [5.2, 5.2], 1: [5.1, 5.1]}, positions)
    assert early.count == 1 and early.share == 0.0
    assert early.reason.startswith("the last snapshot does best on 2 selection documents")
    assert "too early for a merge to help" in early.reason
    assert early.describe().startswith("auto window: the last snapshot alone")
    assert early.to_dict()["checked"]["against_last"] == {"4": pytest.approx(0.2), "2": pytest.approx(0.1)}
