"""Why a merge helps (or not): geometry of a run's snapshots, from one Gram matrix.

The PMA paper (arXiv 2505.12082) explains it: around an optimum, the merge of N snapshots beats the
average of its members when their deviations ``d_i`` are complementary (the cross terms
``d_i^T H d_j`` are mostly negative: the snapshots oscillate around the basin on different
sides). This module reports cheap proxies of that, as pure linear algebra.

Everything derives from one ``K x K`` Gram matrix of the K snapshots' weights (centred on
their mean), computed once by :func:`hf_pma.analysis.gram.compute_gram`, tensor by tensor, a
chunk of elements at a time (bounded memory: ``K x chunk`` float64, whatever the model size).
Any window, stride or merge weights are then pure linear algebra on that matrix, because with
``sum_j w_j = 1`` every distance between snapshots and merges is invariant to the common
reference point:

* ``||theta_i - M||^2 = G_ii - 2 (G w)_i + w^T G w`` for a merge ``M = sum_j w_j theta_j``;
* the Gram matrix of the deviations from a window's own mean is ``C G_SS C`` with the centring
  matrix ``C = I - 11^T / n``.

Reported for a window (:func:`window_diagnostics`):

* ``cosine``: cosine similarity of each snapshot's deviation from the window mean. With N
  equal-norm deviations the mean off-diagonal value is always ``-1/(N-1)`` (they sum to zero),
  so the *pattern* is what tells: pure oscillation gives every off-diagonal entry near
  ``-1/(N-1)``; a steady drift gives ``+1`` near the diagonal and ``-1`` in the far corners.
* ``deviation_norms`` (``||theta_i - mean||``) and ``distances_to_merge`` (``||theta_i - M||``).
* ``merge_shift``: ``||M - theta_newest||``, the norm of the mean of the window's deviations
  from the newest (live) weights: how far the merge moves the model.
* ``straightness``: net displacement over path length, ``||theta_N - theta_1|| / sum_i
  ||theta_i - theta_{i-1}||``: about 1 for a straight drift (the merge then only lags behind),
  ``~1/sqrt(N-1)`` for a random walk, ``~1/(N-1)`` for oscillation around a fixed centre.
* with a reference model (e.g. the annealed one standing for ``theta*``): the norm of the mean
  deviation from it, ``||M - theta_ref||``, against each member's ``||theta_i - theta_ref||``
  (their ratio ``< 1`` is exactly "the merge beats its members" for ``H = I``).

:func:`training_series` slides the window over the run: the same numbers over training.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_pma.core.strategies import merge_coefficients

__all__ = [
    "WindowDiagnostics",
    "centered_gram",
    "cosine_matrix",
    "distances_to_merge",
    "pairwise_distance",
    "window_diagnostics",
    "training_series",
    "window_indices",
    "strategy_weights",
]


def _as_gram(gram: torch.Tensor | Sequence[Sequence[float]]) -> torch.Tensor:
    g = torch.as_tensor(gram, dtype=torch.float64)
    if g.ndim != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"a Gram matrix must be square, got shape {list(g.shape)}")
    return g


def _sqrt(x: float) -> float:
    return math.sqrt(max(0.0, x))  # rounding can leave a tiny negative for a zero distance


def centered_gram(gram: torch.Tensor, indices: Sequence[int] | None = None) -> torch.Tensor:
    """Gram matrix of the deviations of the ``indices`` checkpoints from their own mean."""
    g = _as_gram(gram)
    idx = list(range(g.shape[0])) if indices is None else list(indices)
    sub = g[idx][:, idx]
    n = len(idx)
    c = torch.eye(n, dtype=torch.float64) - 1.0 / n
    return c @ sub @ c


def cosine_matrix(gram: torch.Tensor) -> torch.Tensor:
    """Cosine similarities ``G_ij / sqrt(G_ii G_jj)``; ``nan`` where a vector is zero."""
    g = _as_gram(gram)
    norms = torch.sqrt(torch.clamp(torch.diagonal(g), min=0.0))
    denom = torch.outer(norms, norms)
    cos = torch.where(denom > 0, g / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.nan)
    return torch.clamp(cos, -1.0, 1.0)


def pairwise_distance(gram: torch.Tensor, i: int, j: int) -> float:
    """``||theta_i - theta_j||``."""
    g = _as_gram(gram)
    return _sqrt(float(g[i, i] + g[j, j] - 2 * g[i, j]))


def distances_to_merge(gram: torch.Tensor, indices: Sequence[int], weights: Sequence[float]) -> list[float]:
    """``||theta_i - M||`` for each ``i`` in ``indices``, with ``M = sum_j w_j theta_j`` over ``indices``.

    ``weights`` must sum to 1 (as every merge's do): the result then does not depend on the
    point the Gram matrix is centred on.
    """
    g = _as_gram(gram)
    idx = list(indices)
    if len(weights) != len(idx):
        raise ValueError(f"got {len(weights)} weights for {len(idx)} checkpoints")
    w = torch.tensor(list(weights), dtype=torch.float64)
    if abs(float(w.sum()) - 1.0) > 1e-6:
        raise ValueError(f"merge weights must sum to 1, got {float(w.sum())}")
    sub = g[idx][:, idx]
    gw = sub @ w
    wgw = float(w @ gw)
    return [_sqrt(float(sub[i, i] - 2 * gw[i] + wgw)) for i in range(len(idx))]


def _merge_to_point(g: torch.Tensor, idx: list[int], w: torch.Tensor, point: int) -> float:
    """``||sum_j w_j theta_j - theta_point||``."""
    sub = g[idx][:, idx]
    cross = g[idx, point]
    return _sqrt(float(w @ sub @ w - 2 * (w @ cross) + g[point, point]))


@dataclasses.dataclass
class WindowDiagnostics:
    """Geometry of one window of snapshots and its merge (see the module docstring)."""

    indices: list[int]
    weights: list[float]
    cosine: list[list[float]]
    deviation_norms: list[float]
    distances_to_merge: list[float]
    mean_cosine: float
    spread: float
    merge_shift: float
    path_length: float
    displacement: float
    straightness: float
    reference: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``nan`` becomes ``None``)."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def window_diagnostics(
    gram: torch.Tensor,
    indices: Sequence[int],
    weights: Sequence[float] | None = None,
    reference: int | None = None,
) -> WindowDiagnostics:
    """Diagnostics of the window ``indices`` (oldest first) merged with ``weights`` (default SMA).

    ``reference`` is the index (in the Gram matrix) of a model standing for the optimum, e.g.
    the annealed one; it must not be in the window.
    """
    g = _as_gram(gram)
    idx = list(indices)
    n = len(idx)
    if n < 1:
        raise ValueError("a window needs at least one checkpoint")
    if any(i < 0 or i >= g.shape[0] for i in idx):
        raise ValueError(f"window indices {idx} out of range for {g.shape[0]} checkpoints")
    weights = list(weights) if weights is not None else [1.0 / n] * n
    w = torch.tensor(weights, dtype=torch.float64)
    centred = centered_gram(g, idx)
    cos = cosine_matrix(centred)
    off = [
        float(cos[a, b]) for a in range(n) for b in range(n) if a != b and not math.isnan(float(cos[a, b]))
    ]
    dev = [_sqrt(float(centred[a, a])) for a in range(n)]
    steps = [pairwise_distance(g, idx[a - 1], idx[a]) for a in range(1, n)]
    path = sum(steps)
    displacement = pairwise_distance(g, idx[0], idx[-1])
    ref = None
    if reference is not None:
        if reference in idx:
            raise ValueError(f"the reference (index {reference}) must not be one of the merged checkpoints")
        members = [pairwise_distance(g, i, reference) for i in idx]
        merge_to_ref = _merge_to_point(g, idx, w, reference)
        rms_members = math.sqrt(sum(d * d for d in members) / n)
        ref = {
            "index": reference,
            "merge_to_reference": merge_to_ref,
            "members_to_reference": members,
            "newest_to_reference": members[-1],
            # ||mean deviation|| / RMS member deviation: < 1 when the deviations cancel out.
            "ratio": merge_to_ref / rms_members if rms_members > 0 else math.nan,
        }
    return WindowDiagnostics(
        indices=idx,
        weights=[float(x) for x in weights],
        cosine=cos.tolist(),
        deviation_norms=dev,
        distances_to_merge=distances_to_merge(g, idx, weights),
        mean_cosine=sum(off) / len(off) if off else math.nan,
        spread=math.sqrt(sum(d * d for d in dev) / n),
        merge_shift=_merge_to_point(g, idx, w, idx[-1]),
        path_length=path,
        displacement=displacement,
        straightness=displacement / path if path > 0 else math.nan,
        reference=ref,
    )


def window_indices(count: int, window: int, every: int = 1, end: int | None = None) -> list[int] | None:
    """Indices (oldest first) of ``window`` checkpoints taken every ``every``-th one counting
    back from ``end`` (default: the newest of ``count``); ``None`` if there are too few."""
    if window < 1 or every < 1:
        raise ValueError(f"window and every must be positive, got {window} and {every}")
    end = count - 1 if end is None else end
    first = end - every * (window - 1)
    if first < 0 or end >= count:
        return None
    return list(range(first, end + 1, every))


def training_series(
    gram: torch.Tensor,
    window: int,
    every: int = 1,
    weights_fn: Callable[[int], Sequence[float]] | None = None,
    count: int | None = None,
    reference: int | None = None,
) -> list[WindowDiagnostics]:
    """:func:`window_diagnostics` of the window ending at each snapshot, oldest first.

    ``count``: how many of the Gram matrix's entries are snapshots (the first ``count``; a
    reference model may follow them). ``weights_fn(n)`` gives the merge weights (default SMA).
    """
    g = _as_gram(gram)
    count = g.shape[0] if count is None else count
    weights_fn = weights_fn or (lambda n: [1.0 / n] * n)
    out = []
    for end in range(count):
        idx = window_indices(count, window, every, end)
        if idx is not None:
            out.append(window_diagnostics(g, idx, weights_fn(len(idx)), reference))
    return out


def strategy_weights(strategy: str, alpha: float = 0.2) -> Callable[[int], list[float]]:
    """``n -> weights`` for a strategy name (a thin wrapper over :func:`hf_pma.core.strategies.merge_coefficients`)."""
    merge_coefficients(2, strategy, alpha)  # fails now for a bad name or alpha
    return lambda n: merge_coefficients(n, strategy if n > 1 else "sma", alpha)
