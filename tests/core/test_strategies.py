"""Merge weights: values, normalization, refusal of bad input, and WSM decay emulation."""

from __future__ import annotations

import math
import random

import pytest

from hf_pma.core.strategies import (
    DECAY_SHAPES,
    STRATEGIES,
    decay_emulation_weights,
    ema_weights,
    gradient_weights,
    merge_coefficients,
    normalize_weights,
    sma_weights,
    wma_weights,
)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 6, 10, 15])
def test_weights_sum_to_one_and_are_non_negative(strategy, n):
    w = merge_coefficients(n, strategy)
    assert len(w) == n
    assert math.isclose(sum(w), 1.0, rel_tol=0, abs_tol=1e-12)
    assert all(x >= 0 for x in w)


def test_sma_and_wma_values():
    assert sma_weights(4) == [0.25] * 4
    assert wma_weights(4) == pytest.approx([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("alpha", [0.1, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_ema_matches_the_recursion(alpha, n):
    # Run M^(1) = M_1, M^(i) = a M_i + (1-a) M^(i-1) on one-hot "models": the result is the weights.
    acc = [1.0] + [0.0] * (n - 1)
    for i in range(1, n):
        onehot = [1.0 if j == i else 0.0 for j in range(n)]
        acc = [alpha * o + (1 - alpha) * a for o, a in zip(onehot, acc)]
    assert ema_weights(n, alpha) == pytest.approx(acc, abs=1e-15)


def test_ema_is_normalized_unlike_the_papers_closed_form():
    n, a = 10, 0.2
    closed_form = [a * (1 - a) ** (n - i) for i in range(1, n + 1)]
    assert sum(closed_form) == pytest.approx(1 - (1 - a) ** n)  # 0.89: the trap
    assert sum(ema_weights(n, a)) == pytest.approx(1.0)
    assert ema_weights(n, a)[1:] == pytest.approx(closed_form[1:])


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, float("nan")])
def test_ema_refuses_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        ema_weights(3, alpha)


def test_explicit_weights_are_normalized():
    assert merge_coefficients(3, weights=[1, 1, 2]) == pytest.approx([0.25, 0.25, 0.5])
    assert merge_coefficients(2, weights=[0, 3]) == [0.0, 1.0]


@pytest.mark.parametrize(
    "weights, match",
    [([1, -1, 1], "weight 1 is negative"), ([0, 0, 0], "all weights are zero"), ([1, float("inf"), 1], "not finite")],
)
def test_explicit_weights_refused(weights, match):
    with pytest.raises(ValueError, match=match):
        normalize_weights(weights)


def test_explicit_weights_must_match_the_number_of_snapshots():
    with pytest.raises(ValueError, match="2 weights for 3 snapshots"):
        merge_coefficients(3, weights=[1, 2])


def test_unknown_strategy_and_bad_count():
    with pytest.raises(ValueError, match="unknown merge strategy 'median'"):
        merge_coefficients(3, "median")
    with pytest.raises(ValueError, match="positive integer"):
        merge_coefficients(0)


def test_linear_decay_is_sma():
    assert decay_emulation_weights(7, "linear") == pytest.approx(sma_weights(7))


@pytest.mark.parametrize("shape", sorted(DECAY_SHAPES))
@pytest.mark.parametrize("n", [2, 5, 10])
def test_decay_emulation_equals_a_brute_force_decayed_run(shape, n):
    """Constant-LR snapshots merged with the WSM weights == the run whose LR decays over the window.

    The simulated run applies fixed updates D_k (the first-order picture WSM rests on):
    constant LR gives M_j = M_0 + sum_{k<=j} D_k; the decayed run scales the update of segment k
    (between snapshots k-1 and k) by f((k-1)/n), the LR schedule sampled at the segment's start.
    """
    rng = random.Random(n)
    dim = 4
    m0 = [rng.gauss(0, 1) for _ in range(dim)]
    updates = [[rng.gauss(0, 1) for _ in range(dim)] for _ in range(n)]  # D_1..D_n
    snapshots, current = [], list(m0)
    for d in updates:
        current = [c + x for c, x in zip(current, d)]
        snapshots.append(list(current))
    f = DECAY_SHAPES[shape]
    decayed = list(m0)
    for k, d in enumerate(updates, start=1):
        lr_scale = f((k - 1) / n)
        decayed = [c + lr_scale * x for c, x in zip(decayed, d)]
    w = merge_coefficients(n, f"{shape}-decay")
    merged = [sum(wj * s[i] for wj, s in zip(w, snapshots)) for i in range(dim)]
    assert merged == pytest.approx(decayed, abs=1e-12)
    # and the implied per-update factors are the schedule itself
    assert gradient_weights(w) == pytest.approx([f((k - 1) / n) for k in range(1, n + 1)])


def test_decay_shapes_differ_where_the_schedule_drops_fastest():
    cos, sqrt = decay_emulation_weights(10, "cosine"), decay_emulation_weights(10, "1-sqrt")
    # cosine drops fastest mid-window: symmetric weights peaking in the middle
    assert cos == pytest.approx(cos[::-1]) and max(cos) == cos[4] > 0.1 > cos[0]
    # 1-sqrt drops fastest at the start: the oldest snapshot weighs most, then decreasing
    assert sqrt == sorted(sqrt, reverse=True) and sqrt[0] > 0.3


# ---------------------------------------------------------------- running averages and EMA half-lives


def test_running_average_weights_and_an_ema_half_life_as_a_share_of_the_tokens_seen():
    from hf_pma.core.strategies import ema_half_life_update, ema_half_life_updates, running_average_weights

    # Snapshots at 100, 200 and 400 tokens, half-life half the tokens seen: at 200 the old average
    # decays over 100 tokens with H = 100 (a = 1/2); at 400 over 200 tokens with H = 200 (a = 1/2).
    updates = ema_half_life_updates([100, 200, 400], half_life_fraction=0.5)
    assert updates == pytest.approx([1.0, 0.5, 0.5])
    assert running_average_weights(updates) == pytest.approx([0.25, 0.25, 0.5])
    # Horizon-free: the weights of snapshots taken at the same shares of a run do not depend on its length.
    short = running_average_weights(ema_half_life_updates([10 * i for i in range(1, 21)], half_life_fraction=0.05))
    long = running_average_weights(ema_half_life_updates([1000 * i for i in range(1, 21)], half_life_fraction=0.05))
    assert short == pytest.approx(long) and sum(long) == pytest.approx(1.0)
    # A snapshot one half-life (5% of the tokens seen) before the newest weighs half as much per token.
    weights = running_average_weights(ema_half_life_updates([20 * i for i in range(1, 101)], half_life_fraction=0.05))
    assert weights[-1] / weights[-1 - 5] == pytest.approx(2.0, rel=0.1)
    # In tokens: a = 1 - 2^(-dt/H) whatever the time, the rule the online EMA by half-life uses.
    assert ema_half_life_update(100, 300, half_life_tokens=100) == pytest.approx(0.75)
    assert ema_half_life_update(None, 300, half_life_tokens=100) == 1.0
    with pytest.raises(ValueError, match="give one of half_life_tokens and half_life_fraction"):
        ema_half_life_update(100, 300, half_life_tokens=100, half_life_fraction=0.1)


def test_auto_takes_the_automatic_windows_weights_and_sma_without_one():
    """``strategy="auto"`` (every merge's default) resolves to the weights the automatic window
    chose with it, to SMA without a choice (a window given), and one snapshot is itself."""
    from hf_pma.core.strategies import merge_coefficients, resolve_strategy, wma_weights
    from hf_pma.core.window_choice import WindowChoice

    choice = WindowChoice(5, "trend", "why", strategy="wma")
    assert resolve_strategy("auto", choice) == "wma"
    assert merge_coefficients(5, resolve_strategy("auto", choice)) == wma_weights(5)
    assert resolve_strategy("auto", None) == "sma"
    assert resolve_strategy("ema", choice) == "ema"  # a strategy named wins
    assert resolve_strategy("auto", choice, count=1) == "sma"
    assert merge_coefficients(4, "auto") == [0.25] * 4
