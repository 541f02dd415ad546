"""How far to trust a ranking of runs: ranks with ties, Kendall's tau-b, its bootstrap interval
over held-out documents, and the caveat of a tau over few runs.

Pure arithmetic on plain values (numpy for the bootstrap, scipy for the p-value of tau); what
``hf-pma compare`` reports (:mod:`hf_pma.analysis.compare_runs`).

* Tied values share a rank (``1, 2, 2, 4``) and are grouped in the printed order (``a > b = c``):
  a tie is never shown as an order.
* Kendall's tau is tau-b (ties in either ranking count as neither concordant nor discordant, and
  the denominator leaves them out), so tied runs neither help nor hurt the agreement.
* The interval resamples the held-out documents (with replacement, the same documents for every
  run and model, so their pairing is kept), recomputes every run's loss per token on each resample
  and tau-b on those, and takes the percentiles: how much tau owes to which text was held out.
  Seeded, hence the same interval for the same inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "kendall_tau",
    "kendall_tau_b",
    "bootstrap_kendall_tau",
    "rank_tiers",
    "shared_ranks",
    "tau_caveat",
]

# Resamples of the bootstrap interval by default (the interval's ends move by about 0.01 between seeds).
BOOTSTRAP_RESAMPLES = 1000


def _finite(values: Mapping[str, float | None]) -> dict[str, float]:
    return {name: float(v) for name, v in values.items() if v is not None and math.isfinite(v)}


def rank_tiers(values: Mapping[str, float | None], higher_is_better: bool = False) -> list[list[str]]:
    """The runs from best to worst by ``values``, equal values together in one tier (in the
    order given); runs without a finite value left out."""
    scored = _finite(values)
    tiers: list[list[str]] = []
    for value in sorted(set(scored.values()), reverse=higher_is_better):
        tiers.append([name for name, v in scored.items() if v == value])
    return tiers


def shared_ranks(values: Mapping[str, float | None], higher_is_better: bool = False) -> dict[str, int]:
    """Each run's rank, 1 the best; tied runs share the best rank of their tier and the next tier
    skips as many ranks (``1, 2, 2, 4``)."""
    ranks, taken = {}, 0
    for tier in rank_tiers(values, higher_is_better):
        ranks.update({name: taken + 1 for name in tier})
        taken += len(tier)
    return ranks


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Kendall's tau-b of two paired sequences: ``(C - D) / sqrt((P - T_a)(P - T_b))`` with ``C`` /
    ``D`` the concordant / discordant pairs, ``P`` all pairs and ``T_a`` / ``T_b`` the pairs tied in
    ``a`` / ``b``. ``None`` when a side is constant or there are fewer than 2 pairs."""
    import numpy as np

    taus = _tau_b_rows(np.asarray([a], dtype=float), np.asarray([b], dtype=float))
    return None if math.isnan(taus[0]) else float(taus[0])


def _tau_b_rows(a: Any, b: Any) -> Any:
    """Tau-b of each row of ``a`` with the same row of ``b`` (arrays ``(rows, n)``): NaN where undefined."""
    import numpy as np

    n = a.shape[1]
    i, j = np.triu_indices(n, k=1)
    sa, sb = np.sign(a[:, i] - a[:, j]), np.sign(b[:, i] - b[:, j])
    pairs = len(i)
    untied_a, untied_b = pairs - (sa == 0).sum(axis=1), pairs - (sb == 0).sum(axis=1)
    denominator = np.sqrt(untied_a.astype(float) * untied_b)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (sa * sb).sum(axis=1) / np.where(denominator > 0, denominator, 1.0), np.nan)


def tau_caveat(runs: int) -> str | None:
    """What a tau over so few runs cannot say, or ``None`` from 5 runs on (where a perfect
    agreement is unlikely by chance: ``p = 2/5! = 0.017``)."""
    if runs == 2:
        return "over 2 runs tau is +1 or -1 by construction: it says which run is better, not how well rankings agree"
    if 2 < runs < 5:
        return f"over {runs} runs even tau = 1 has p = {2 / math.factorial(runs):.2f}: too few runs to show agreement"
    return None


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Kendall's tau-b of two paired sequences (:func:`kendall_tau_b`; its p-value from
    :func:`scipy.stats.kendalltau`): ``{"tau", "p_value", "n", "ties", "caveat"}``. ``tau`` is
    ``None`` with fewer than 2 pairs or when one side is constant; ``ties`` counts the pairs tied
    in either sequence; ``caveat`` is :func:`tau_caveat` of ``n``."""
    n = len(a)
    if n != len(b):
        raise ValueError(f"kendall_tau needs paired values, got {n} and {len(b)}")
    out: dict[str, Any] = {"tau": None, "p_value": None, "n": n, "ties": 0, "caveat": tau_caveat(n)}
    if n < 2:
        return out
    out["ties"] = sum(1 for i in range(n) for j in range(i + 1, n) if a[i] == a[j] or b[i] == b[j])
    out["tau"] = kendall_tau_b(a, b)
    if out["tau"] is not None:
        from scipy.stats import kendalltau

        p = float(kendalltau(list(a), list(b), variant="b").pvalue)
        out["p_value"] = p if math.isfinite(p) else None
    return out


def bootstrap_kendall_tau(
    predicted: Sequence[tuple[Sequence[float], Sequence[int]]],
    target: Sequence[tuple[Sequence[float], Sequence[int]]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """The percentile bootstrap interval of Kendall's tau-b between two rankings of the same runs,
    resampling held-out documents.

    ``predicted`` / ``target``: per run (in the same order), its per-document ``(nll, tokens)``
    (the summed negative log-likelihood and scored tokens of each document, the ``per_text`` of
    :func:`hf_pma.evaluation.language_modeling.evaluate_language_modeling`), every run on the same
    documents. Each resample draws the documents with replacement (one draw for all runs and both
    rankings), computes each run's loss per token ``sum(nll) / sum(tokens)`` and tau-b. Returns
    ``{"low", "high", "confidence", "resamples", "defined", "seed", "documents"}``: ``defined`` the
    resamples where tau is defined (a side not constant), of which ``low`` / ``high`` are the
    percentiles (``None`` when fewer than half are). ``ValueError`` when the runs were not scored
    on the same documents."""
    import numpy as np

    if len(predicted) != len(target):
        raise ValueError(f"bootstrap_kendall_tau needs paired runs, got {len(predicted)} and {len(target)}")
    if not (isinstance(resamples, int) and resamples > 0) or not 0 < confidence < 1:
        raise ValueError(f"resamples must be a positive count and confidence in (0, 1), got {resamples}, {confidence}")
    sides = []
    for side in (predicted, target):
        nll = np.asarray([list(map(float, run[0])) for run in side], dtype=float)
        tokens = np.asarray([list(map(float, run[1])) for run in side], dtype=float)
        sides.append((nll, tokens))
    documents = {len(run[0]) for side in (predicted, target) for run in side} | {
        len(run[1]) for side in (predicted, target) for run in side
    }
    if len(documents) != 1:
        raise ValueError(f"the runs were scored on different numbers of documents: {sorted(documents)}")
    count = documents.pop()
    out = {
        "low": None,
        "high": None,
        "confidence": confidence,
        "resamples": resamples,
        "defined": 0,
        "seed": seed,
        "documents": count,
    }
    if len(predicted) < 2 or count < 1:
        return out
    rng = np.random.default_rng(seed)
    # How often each document is drawn in each resample: (resamples, documents).
    draws = rng.integers(0, count, size=(resamples, count))
    weights = np.zeros((resamples, count))
    np.add.at(weights, (np.arange(resamples)[:, None], draws), 1.0)
    losses = []
    for nll, tokens in sides:
        with np.errstate(invalid="ignore", divide="ignore"):
            losses.append((weights @ nll.T) / (weights @ tokens.T))  # (resamples, runs)
    taus = _tau_b_rows(*losses)
    taus = taus[np.isfinite(taus)]
    out["defined"] = int(taus.size)
    if taus.size * 2 >= resamples:
        tail = (1.0 - confidence) / 2 * 100
        out["low"], out["high"] = (float(v) for v in np.percentile(taus, [tail, 100 - tail]))
    return out
