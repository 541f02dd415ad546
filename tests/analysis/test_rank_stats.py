"""The statistics of a ranking (hf_pma.analysis.rank_stats): shared ranks for ties, tau-b against
scipy, the caveat over few runs, and the bootstrap interval of tau against an independent
recomputation; the power-law fit's refusals and flags (hf_pma.analysis.compare_runs)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import kendalltau

from hf_pma.analysis.compare_runs import fit_power_law
from hf_pma.analysis.rank_stats import (
    bootstrap_kendall_tau,
    kendall_tau,
    kendall_tau_b,
    rank_tiers,
    shared_ranks,
    tau_caveat,
)


def test_tied_values_share_a_rank_and_a_tier():
    values = {"a": 2.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": None, "f": math.nan}
    assert rank_tiers(values) == [["b"], ["a", "c"], ["d"]]
    assert shared_ranks(values) == {"b": 1, "a": 2, "c": 2, "d": 4}
    assert shared_ranks(values, higher_is_better=True) == {"d": 1, "a": 2, "c": 2, "b": 4}


def test_tau_b_equals_scipy_with_and_without_ties():
    rng = np.random.default_rng(3)
    for n in (3, 5, 8):
        for _ in range(20):
            a = rng.integers(0, 4, n).astype(float)  # many ties
            b = rng.integers(0, 4, n).astype(float)
            expected = kendalltau(a, b, variant="b").statistic
            found = kendall_tau_b(a.tolist(), b.tolist())
            if math.isnan(expected):
                assert found is None
            else:
                assert found == pytest.approx(expected, abs=1e-12)
    # A tie in the prediction neither helps nor hurts: tau-b, not tau-a (which would give 2/3).
    result = kendall_tau([1.0, 1.0, 3.0], [1.0, 2.0, 3.0])
    assert result["tau"] == pytest.approx(2 / math.sqrt(2 * 3)) and result["ties"] == 1
    assert kendall_tau([1.0, 1.0], [1.0, 2.0])["tau"] is None  # a constant side: undefined


def test_tau_over_few_runs_carries_its_caveat():
    assert "over 2 runs tau is +1 or -1 by construction" in kendall_tau([1.0, 2.0], [1.0, 2.0])["caveat"]
    assert "p = 0.33" in tau_caveat(3) and "p = 0.08" in tau_caveat(4)
    assert tau_caveat(5) is None and kendall_tau([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0])["caveat"] is None


def _runs(rng, runs: int, documents: int, shift: float):
    tokens = rng.integers(20, 60, documents)
    return [(list(rng.normal(3.0 + shift * r, 0.3, documents) * tokens), list(tokens)) for r in range(runs)]


def test_bootstrap_interval_equals_an_independent_recomputation_and_is_seeded():
    rng = np.random.default_rng(0)
    # 12 runs whose order the documents barely settle: tau takes 67 values, so the percentiles
    # move with any change in which documents each resample draws.
    predicted, target = _runs(rng, 12, 30, 0.02), _runs(rng, 12, 30, 0.02)
    found = bootstrap_kendall_tau(predicted, target, resamples=300, seed=7)
    # The same resamples drawn here, each run's loss per token and scipy's tau-b on them.
    draws = np.random.default_rng(7).integers(0, 30, size=(300, 30))

    def loss(side, rows):
        return [sum(nll[i] for i in rows) / sum(tok[i] for i in rows) for nll, tok in side]

    taus = [kendalltau(loss(predicted, rows), loss(target, rows), variant="b").statistic for rows in draws]
    low, high = np.percentile(taus, [2.5, 97.5])
    assert found["low"] == pytest.approx(low) and found["high"] == pytest.approx(high)
    assert found["defined"] == 300 and found["documents"] == 30 and found["seed"] == 7
    assert bootstrap_kendall_tau(predicted, target, resamples=300, seed=7) == found
    other = bootstrap_kendall_tau(predicted, target, resamples=300, seed=8)
    assert (other["low"], other["high"]) != (found["low"], found["high"])
    # Runs scored on other documents cannot be paired.
    with pytest.raises(ValueError, match="different numbers of documents"):
        bootstrap_kendall_tau(predicted, [(nll[:-1], tok[:-1]) for nll, tok in target])


def test_bootstrap_interval_narrows_with_clearly_separated_runs():
    rng = np.random.default_rng(1)
    far = _runs(rng, 4, 40, 1.0)  # runs 1 nat apart, noise 0.3: every resample orders them alike
    found = bootstrap_kendall_tau(far, far, resamples=200)
    assert found["low"] == found["high"] == 1.0


def test_fit_needs_more_distinct_x_than_parameters():
    xs = [1e6, 3e6, 1e7]
    # 3 points: the pure power law A * x^-alpha (2 parameters, one residual), never E, A and alpha.
    fit = fit_power_law(xs, [5.0 * (x / 1e6) ** -0.2 for x in xs])
    assert fit["fixed"] == ["E"] and fit["parameters"] == 2 and fit["degrees_of_freedom"] == 1
    assert fit["E"] == 0.0 and fit["alpha"] == pytest.approx(0.2, rel=1e-6) and fit["A"] == pytest.approx(5.0 * 1e6**0.2)
    assert "2 distinct x values" not in str(fit) and "3 distinct x values), got 2" in fit_power_law(xs[:2], [2.0, 1.0])["error"]
    # 4 distinct x: E, A and alpha.
    xs4 = [*xs, 3e7]
    fit = fit_power_law(xs4, [2.0 + 5.0 * (x / 1e6) ** -0.5 for x in xs4])
    assert fit["fixed"] == [] and fit["parameters"] == 3 and fit["E"] == pytest.approx(2.0, rel=1e-6)
    assert fit["flags"] == []
    # Duplicated x add points, not distinct x: 4 points on 3 x fit 2 parameters.
    assert fit_power_law([1e6, 1e6, 3e6, 1e7], [3.0, 3.1, 2.5, 2.2])["parameters"] == 2


@pytest.mark.parametrize(
    "ys, flag",
    [
        # A sharp drop, then flat: alpha runs to its upper bound 4.
        ([3.0, 2.0, 2.001, 1.999], "alpha sits on its upper bound 4"),
        # Loss rising with x: no decreasing law fits; E runs to its upper bound min(y).
        ([3.0, 2.5, 2.3, 2.35], "E sits on its upper bound 2.3"),
    ],
)
def test_a_fit_on_a_bound_is_flagged(ys, flag):
    fit = fit_power_law([1e6, 3e6, 1e7, 3e7], ys)
    assert any(f.startswith(flag) for f in fit["flags"]), fit


def test_every_permutation_of_three_runs_gives_the_tau_the_caveat_names():
    # Over 3 runs tau takes only 4 values, and tau = 1 comes from 1 of the 6 orders: p = 2/6 two-sided.
    taus = sorted({round(kendall_tau(list(p), [1.0, 2.0, 3.0])["tau"], 6) for p in itertools.permutations([1.0, 2.0, 3.0])})
    assert taus == [-1.0, round(-1 / 3, 6), round(1 / 3, 6), 1.0]
    assert kendall_tau([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])["p_value"] == pytest.approx(1 / 3)


def test_the_committed_ladder_is_fitted_with_two_parameters_and_flagged():
    # benchmarks/results/sweep_prediction/ladder.json: three sizes, the last snapshots' losses. The
    # three-parameter fit went through all three (rmse 1.6e-10 for the merge) with alpha on its
    # bound 4; now 2 parameters, and the flag that the law does not explain these points.
    params = [270656.0, 593568.0, 1578400.0]
    fit = fit_power_law(params, [4.938368764533339, 4.821801037709646, 4.864561845017263])
    assert fit["fixed"] == ["E"] and fit["rmse"] > 0.01
    assert any(f.startswith("the law explains only") for f in fit["flags"]) and fit["r_squared"] < 0.5
