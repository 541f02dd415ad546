"""Merge weights for N snapshots, oldest first. Pure Python: no torch, no files.

Every function returns a list of N non-negative floats that sums to 1 (up to rounding), so a
merge ``sum_i w_i * M_i`` never rescales the model.

Strategies (i = 1 is the oldest snapshot, N the newest):

* ``sma``: ``w_i = 1/N`` (the paper's default).
* ``wma``: ``w_i = i / (1 + 2 + ... + N)``.
* ``ema``: the recursion ``M^(1) = M_1``, ``M^(i) = a*M_i + (1-a)*M^(i-1)``, hence
  ``w_1 = (1-a)^(N-1)`` and ``w_i = a(1-a)^(N-i)`` for ``i >= 2``.
* ``linear-decay``, ``cosine-decay``, ``1-sqrt-decay``: decay emulation after WSM
  (Tian et al. 2025, arXiv 2507.17634), see :func:`decay_emulation_weights`.
* explicit weights: any non-negative list, normalized.
* ``auto`` (the default of every merge): the weights the automatic window chose with it
  (:attr:`hf_pma.core.window_choice.WindowChoice.strategy`, see :func:`resolve_strategy`); SMA
  where the window was given.

A running average (the online average of :mod:`hf_pma.snapshots.online`) is a list of updates
``M = a_i * M_i + (1 - a_i) * M``; :func:`running_average_weights` turns the ``a_i`` into each
snapshot's weight, and :func:`ema_half_life_updates` gives the ``a_i`` of an EMA whose half-life is
a number of tokens or a share of the tokens seen so far (horizon-free, as torchtitan's
``half_life_fraction``), from the snapshots' token counts alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hf_pma.utils.parsing import check_int, is_number

__all__ = [
    "DEFAULT_ALPHA",
    "AUTO_STRATEGY",
    "STRATEGIES",
    "resolve_strategy",
    "DECAY_SHAPES",
    "sma_weights",
    "wma_weights",
    "ema_weights",
    "decay_emulation_weights",
    "normalize_weights",
    "merge_coefficients",
    "merge_weights",
    "gradient_weights",
    "running_average_weights",
    "ema_half_life_update",
    "ema_half_life_updates",
]

# The EMA factor a when none is given (every command, the callback and the online average).
DEFAULT_ALPHA = 0.2


def _check_count(n: int) -> None:
    check_int(n, "the number of snapshots")


def sma_weights(n: int) -> list[float]:
    """Simple moving average: every snapshot weighs ``1/n``."""
    _check_count(n)
    return [1.0 / n] * n


def wma_weights(n: int) -> list[float]:
    """Weighted moving average: snapshot ``i`` (1 = oldest) weighs ``i / (n(n+1)/2)``."""
    _check_count(n)
    total = n * (n + 1) / 2
    return [i / total for i in range(1, n + 1)]


def ema_weights(n: int, alpha: float = DEFAULT_ALPHA) -> list[float]:
    """Exponential moving average started from the oldest snapshot.

    ``w_1 = (1-a)^(n-1)``, ``w_i = a (1-a)^(n-i)`` for ``i >= 2``: these sum to exactly 1, unlike
    the paper's closed form ``a(1-a)^(n-i)`` for every ``i``.
    """
    _check_count(n)
    if not (is_number(alpha) and 0.0 < alpha <= 1.0):
        raise ValueError(f"EMA alpha must be in (0, 1], got {alpha!r}")
    weights = [alpha * (1.0 - alpha) ** (n - i) for i in range(1, n + 1)]
    weights[0] = (1.0 - alpha) ** (n - 1)
    return weights


def running_average_weights(update_weights: Sequence[float]) -> list[float]:
    """The weight of each snapshot in a running average whose i-th update was
    ``M = a_i * M_i + (1 - a_i) * M`` (``a_1 = 1``): ``w_i = a_i * prod_{k>i} (1 - a_k)``."""
    out, keep = [], 1.0
    for a in reversed(list(update_weights)):
        out.append(a * keep)
        keep *= 1.0 - a
    return out[::-1]


def ema_half_life_update(
    previous: int | None,
    tokens: int,
    *,
    half_life_tokens: int | None = None,
    half_life_fraction: float | None = None,
) -> float:
    """``a`` of the EMA update that folds in the snapshot at ``tokens`` after the one at
    ``previous`` (``None``: the first, ``a = 1``): the old average decays by ``2^(-dt/H)`` over the
    ``dt = tokens - previous`` tokens between them, so ``a = 1 - 2^(-dt/H)``, with the half-life
    ``H = half_life_tokens``, or ``H = half_life_fraction * tokens`` (a share of the tokens seen so
    far: the average reaches back a fixed share of the run, however long it gets). Exactly one of
    the two is given."""
    if (half_life_tokens is None) == (half_life_fraction is None):
        raise ValueError("give one of half_life_tokens and half_life_fraction")
    if previous is None:
        return 1.0
    half_life = half_life_tokens if half_life_tokens is not None else half_life_fraction * max(tokens, 1)
    return 1.0 - 0.5 ** (max(0, tokens - previous) / half_life)


def ema_half_life_updates(
    tokens: Sequence[int], *, half_life_tokens: int | None = None, half_life_fraction: float | None = None
) -> list[float]:
    """``a`` of each update of an EMA over snapshots taken at ``tokens`` (oldest first; see
    :func:`ema_half_life_update`); :func:`running_average_weights` of them are the snapshots'
    merge weights, which sum to 1."""
    out, previous = [], None
    for t in tokens:
        out.append(
            ema_half_life_update(previous, t, half_life_tokens=half_life_tokens, half_life_fraction=half_life_fraction)
        )
        previous = t
    return out


# Learning-rate decay shapes f(t) on t in [0, 1], with f(0) = 1 and f(1) = 0.
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda t: 1.0 - t,
    "cosine": lambda t: 0.5 * (1.0 + math.cos(math.pi * t)),
    "1-sqrt": lambda t: 1.0 - math.sqrt(t),
}


def decay_emulation_weights(n: int, shape: str = "linear") -> list[float]:
    """Merge weights that emulate a learning-rate decay over the window (WSM).

    With constant-LR snapshots ``M_j = M_0 + sum_{k<=j} D_k`` (``D_k`` the update made between
    snapshot ``k-1`` and ``k``), the merge ``sum_j c_j M_j`` equals ``M_0 + sum_k g_k D_k`` with
    ``g_k = sum_{j>=k} c_j``: each update is scaled by a factor ``g_k``, exactly what a decayed
    learning rate does to first order. To emulate a decay ``f`` (``f(0) = 1``, ``f(1) = 0``)
    over the window we want ``g_k = f((k-1)/n)`` for ``k = 1..n+1``, hence

        c_j = f((j-1)/n) - f(j/n)            for j = 1..n.

    The updates up to the oldest snapshot keep factor 1, the final value 0 is reached just after
    the newest snapshot, and the ``c_j`` sum to ``f(0) - f(1) = 1``. A linear decay gives
    uniform weights: SMA.
    """
    _check_count(n)
    if shape not in DECAY_SHAPES:
        raise ValueError(f"unknown decay shape {shape!r}; choose one of {sorted(DECAY_SHAPES)}")
    f = DECAY_SHAPES[shape]
    return normalize_weights([f((j - 1) / n) - f(j / n) for j in range(1, n + 1)])


def gradient_weights(merge_weights_: Sequence[float]) -> list[float]:
    """Per-update scale factors ``g_k = sum_{j>=k} c_j`` implied by merge weights ``c`` (WSM)."""
    out, running = [], 0.0
    for c in reversed(list(merge_weights_)):
        running += c
        out.append(running)
    return out[::-1]


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Scale explicit weights to sum to 1; refuse negative, non-finite or all-zero weights."""
    values = [float(w) for w in weights]
    if not values:
        raise ValueError("weights must not be empty")
    for i, w in enumerate(values):
        if not math.isfinite(w):
            raise ValueError(f"weight {i} is not finite: {weights[i]!r}")
        if w < 0:
            raise ValueError(f"weight {i} is negative ({w}); merge weights must be >= 0")
    total = math.fsum(values)
    if total <= 0:
        raise ValueError("all weights are zero; at least one must be positive")
    return [w / total for w in values]


# The default strategy: the automatic window's own weights, SMA for a window that was given.
AUTO_STRATEGY = "auto"
STRATEGIES = (AUTO_STRATEGY, "sma", "wma", "ema", "linear-decay", "cosine-decay", "1-sqrt-decay")


def resolve_strategy(strategy: str, choice: object | None = None, count: int | None = None) -> str:
    """The strategy a merge uses: ``strategy`` itself, but for ``"auto"``: the weights the
    automatic window ``choice`` chose with it (its ``strategy``), else ``"sma"`` (a window that
    was given, or none). One snapshot (``count == 1``) is itself whatever the strategy."""
    if count == 1:
        return "sma"
    if strategy != AUTO_STRATEGY:
        return strategy
    return str(getattr(choice, "strategy", None) or "sma")


def merge_coefficients(
    n: int,
    strategy: str = "sma",
    alpha: float = DEFAULT_ALPHA,
    weights: Sequence[float] | None = None,
) -> list[float]:
    """The coefficients ``w_1 .. w_n`` of a merge of ``n`` snapshots (oldest first) for a strategy
    name, or explicit ``weights`` normalized: not merged model weights, the numbers that weigh them.

    Explicit ``weights`` win over ``strategy`` (pass ``strategy="custom"`` or any name) and must
    have one entry per snapshot.
    """
    _check_count(n)
    if strategy == AUTO_STRATEGY and weights is None:
        strategy = "sma"  # no automatic choice at hand (resolve_strategy): the paper's default
    if weights is not None:
        if len(weights) != n:
            raise ValueError(f"got {len(weights)} weights for {n} snapshots; give one weight per snapshot")
        return normalize_weights(weights)
    if strategy == "sma":
        return sma_weights(n)
    if strategy == "wma":
        return wma_weights(n)
    if strategy == "ema":
        return ema_weights(n, alpha)
    if strategy.endswith("-decay") and strategy[: -len("-decay")] in DECAY_SHAPES:
        return decay_emulation_weights(n, strategy[: -len("-decay")])
    raise ValueError(f"unknown merge strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or give weights")


def validate_strategy(strategy: str, alpha: float = DEFAULT_ALPHA, weights: Sequence[float] | None = None) -> None:
    """Raise ``ValueError`` now for a bad strategy name or alpha, or bad explicit ``weights``
    (used by argument checks, before any source is read or downloaded)."""
    if weights is not None:
        normalize_weights(weights)
    else:
        merge_coefficients(2, strategy, alpha)


def merge_weights(
    n: int,
    strategy: str = "sma",
    alpha: float = DEFAULT_ALPHA,
    weights: Sequence[float] | None = None,
) -> list[float]:
    """Deprecated name of :func:`merge_coefficients` (it returns the merge's coefficients, not
    merged weights); a ``FutureWarning``, then the same result."""
    import warnings

    warnings.warn(
        "hf_pma.merge_weights is renamed merge_coefficients (it returns the merge's coefficients); "
        "the old name will be removed in a later release",
        FutureWarning,
        stacklevel=2,
    )
    return merge_coefficients(n, strategy, alpha, weights)
