"""The automatic merge window (``window="auto"``): how many of the newest snapshots a merge takes,
chosen from what the run recorded at each snapshot (tokens, learning rate, phase, training loss).

Pure Python: no torch, no files. The rule, in three steps:

1. **The stretch.** Walk back from the newest snapshot while the phase is the newest's and, in a
   constant-LR phase, the learning rate is the same (where the newest's is not recorded, the
   nearest recorded one's): a merge never mixes warmup weights, or weights from before an LR
   change, into a constant-LR window. A run whose newest snapshot is
   still in warmup is too early for a merge: the last snapshot is the answer.
2. **The cap.** The window spans at most :data:`MAX_SHARE` of the tokens trained at the newest
   snapshot (steps when tokens are unknown). Averaging a span that long lags the run by half of it.
3. **The trend test.** The SMA of the newest ``k`` snapshots sits, in loss, about where the run
   was at the window's middle, less what averaging removes. The training loss recorded at each
   snapshot (the mean since the previous one) measures both sides: its trend over the window
   (a line fitted to the newest ``max(2k, 4)`` losses, times the window's span) is what the
   merge gives back by lagging; its own noise (the spread of successive differences, robust to
   the trend: ``1.4826 * MAD / sqrt(2)``) is the scale on which the run no longer moves. The
   window is the longest run of ``k = 2, 3, ...`` over which the loss does not fall by more than
   :data:`TREND_LIMIT` times that noise (beyond the fitted fall's own standard error, so that a
   noisy fit does not end the window). ``k = 1`` means the loss still falls faster than its
   noise: too early for a merge to help, and the last snapshot is the answer.
4. **The weights.** The window the trend test chose is merged with :data:`TREND_STRATEGY` (WMA):
   snapshot ``i`` of ``N`` weighs ``i / (1 + ... + N)``, so the merge sits a third of the window
   behind the newest snapshot instead of half, and a longer window averages more noise away for
   the same lag. ``strategy="auto"`` (every merge's default) merges with these weights; a
   strategy given by name wins.

The rule is total and near-linear: a value it cannot use (NaN, an infinity, a number that no
float holds, a count beyond :data:`MAX_PROGRESS`, a value of the wrong type) is unknown, as if
not recorded; losses are fitted on an exact power-of-two scale, so that finite but huge ones
(1e200) cannot overflow; and the fit grows one snapshot at a time (``O(n log n)`` in all).

Without recorded losses (Trainer checkpoints without a loss, Hub revisions) the trend test cannot
run: the window is then every snapshot of the stretch within :data:`FALLBACK_SHARE` of the tokens
trained (torchtitan's EMA uses a half-life of 5% of the elapsed steps, which weighs about the
last 14%: the same order). Without any progress the window cannot follow the run: the newest
:data:`hf_pma.core.selection.DEFAULT_WINDOW` (the paper's N), said so.

The evidence behind the constants (runs of 300 to 6,000 steps at four learning rates, each with a
matched annealed fork) is ``benchmarks/window_choice.py`` and the manual's "Choosing the window".
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Sequence
from typing import Any

from hf_pma.core.selection import DEFAULT_WINDOW
from hf_pma.utils.parsing import is_int, parameter_error
from hf_pma.utils.text import shown

__all__ = [
    "AUTO",
    "MAX_SHARE",
    "FALLBACK_SHARE",
    "TREND_LIMIT",
    "TREND_STRATEGY",
    "RunPoint",
    "WindowChoice",
    "choose_window",
    "check_window_count",
    "is_auto",
    "merge_strategy",
    "point_from_record",
    "widest_window",
]

AUTO = "auto"
# The longest window, as a share of the tokens trained at the newest snapshot.
MAX_SHARE = 0.25
# The window without recorded losses: every snapshot within this share of the tokens trained.
FALLBACK_SHARE = 0.10
# The loss may fall by at most this many noise units (its per-snapshot spread) over the window: a
# WMA merge gives back about a third of the fall by lagging (an SMA half), and wins more than the
# noise by averaging.
TREND_LIMIT = 5.0
# The weights of a window the trend test chose: WMA (snapshot i of N weighs i / (1 + ... + N)) lags
# the run by a third of the window, not half, so it averages a longer window for the same lag.
TREND_STRATEGY = "wma"
# Losses needed for the trend test (a noise estimate needs a few differences).
MIN_LOSSES = 4
# Points of the line fitted for the trend: at least this many, more when the window is longer.
MIN_FIT = 4
# Phases in which the learning rate is constant (the merge's regime); None: not recorded.
CONSTANT_PHASES = ("stable", None)
# The largest token or step count the rule takes (an int64, as checkpoints store counts); a
# larger one is unknown, like a missing one.
MAX_PROGRESS = 2**63 - 1
# Why the rule's weights, in a few words (the one line says which and why).
_STRATEGY_WHY = {"wma": "the newest weigh most: lags less than SMA", "sma": "every snapshot alike"}
# Losses this large or larger are shown in short scientific form (ordinary ones with 3 decimals).
_SHORT_FROM = 1e6
# A trend test this close to its limit (in scaled losses) is decided again by the two-pass fit,
# at most this many times in one choice.
_CLOSE = 1e-9
_EXACT_CHECKS = 64


@dataclasses.dataclass(frozen=True)
class RunPoint:
    """What a run recorded at one snapshot: progress, learning rate, phase, training loss (the
    mean since the previous snapshot). Unknown values are ``None``."""

    tokens: int | None = None
    step: int | None = None
    lr: float | None = None
    loss: float | None = None
    phase: str | None = None


@dataclasses.dataclass(frozen=True)
class WindowChoice:
    """The window ``window="auto"`` chose: the newest ``count`` snapshots (1: the last snapshot
    alone), the weights it merges them with (``strategy``: what ``strategy="auto"``, every
    merge's default, uses), the ``rule`` that decided (``trend``, ``cap``, ``too-early``,
    ``no-loss``, ``no-progress``, ``single``; ``held-out`` where a check on held-out documents
    overruled it) and one sentence saying why."""

    count: int
    rule: str
    reason: str
    strategy: str = "sma"
    # True when the merge uses a strategy the caller named, not the rule's own (merge_strategy).
    strategy_named: bool = False
    share: float | None = None
    trend: float | None = None
    noise: float | None = None
    # The held-out check (:mod:`hf_pma.core.window_check`), where one was made: selection
    # documents, the rule's own window, each candidate's loss against the last snapshot.
    checked: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the merge record's ``window_choice``)."""
        return {"mode": AUTO, **dataclasses.asdict(self)}

    def describe(self) -> str:
        """``"auto window: the newest 8 snapshots, WMA (lags less than SMA): <reason>"``."""
        if self.count == 1:
            what = "the last snapshot alone"
        else:
            why = "as asked" if self.strategy_named else _STRATEGY_WHY.get(self.strategy, "")
            what = f"the newest {self.count} snapshots, {self.strategy.upper()}{f' ({why})' if why else ''}"
        return f"auto window: {what}: {self.reason}"


def merge_strategy(
    requested: str, choice: WindowChoice | None, count: int | None = None
) -> tuple[str, WindowChoice | None]:
    """The strategy a merge of ``count`` sources uses for the ``requested`` one (``"auto"``: the
    automatic ``choice``'s own weights, else SMA; a name: that name; one source: itself), and the
    choice as merged with it, so that its line and record say the weights really used
    (``strategy_named`` when the caller named them, even the rule's own)."""
    from hf_pma.core.strategies import AUTO_STRATEGY, resolve_strategy

    strategy = resolve_strategy(requested, choice, count)
    if choice is None:
        return strategy, None
    named = requested != AUTO_STRATEGY
    if not named and strategy == choice.strategy:
        return strategy, choice
    return strategy, dataclasses.replace(choice, strategy=strategy, strategy_named=named)


def is_auto(value: Any) -> bool:
    """True for ``"auto"`` (any case, surrounding spaces ignored)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def check_window_count(
    value: Any, name: str = "window", allow_none: bool = False, text: bool = False
) -> int | str | None:
    """``"auto"``, or a positive number of snapshots; else a one-line ``ValueError`` naming
    ``name``. With ``text`` (a value parsed from a command line or a config file), ``"8"`` reads
    as 8; from Python a string other than ``"auto"`` is refused (``"10"`` is no count)."""
    if value is None and allow_none:
        return None
    if is_auto(value):
        return AUTO
    if text and isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if is_int(value, 1):
        return int(value)
    raise parameter_error(name, f"must be 'auto' or a positive number of snapshots, got {shown(value, 60)}")


def point_from_record(record: dict[str, Any] | None, tokens: int | None = None, step: int | None = None) -> RunPoint:
    """A :class:`RunPoint` from a snapshot record (a manifest entry, ``pma.json``) or a
    checkpoint's record; values of the wrong type are taken as unknown (records are untrusted)."""
    record = record if isinstance(record, dict) else {}
    lr = record.get("lr", record.get("learning_rate"))
    loss = record.get("loss")
    phase = record.get("phase")
    tokens = tokens if tokens is not None else record.get("tokens")
    step = step if step is not None else record.get("step")
    return _usable(RunPoint(tokens=tokens, step=step, lr=lr, loss=loss, phase=phase))


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (not a real number, a bool, NaN, an infinity, or
    an integer too large for a float)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) else None


def _count(value: Any) -> int | None:
    """``value`` as a count in ``[0, MAX_PROGRESS]``, or ``None``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        return None
    number = int(value)
    return number if 0 <= number <= MAX_PROGRESS else None


def _usable(point: Any) -> RunPoint:
    """``point`` with every value the rule cannot use made unknown: the one gate through which
    every point reaches the rule, so that no value can make it raise."""
    phase = getattr(point, "phase", None)
    return RunPoint(
        tokens=_count(getattr(point, "tokens", None)),
        step=_count(getattr(point, "step", None)),
        lr=_finite(getattr(point, "lr", None)),
        loss=_finite(getattr(point, "loss", None)),
        phase=phase if isinstance(phase, str) else None,
    )


def _progress(points: Sequence[RunPoint]) -> tuple[str, list[int]] | None:
    """Tokens when every point knows them, else steps, else ``None``."""
    for unit in ("tokens", "step"):
        values = [getattr(p, unit) for p in points]
        if all(v is not None for v in values):
            return ("tokens" if unit == "tokens" else "steps"), values
    return None


def _same_lr(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return True
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def _stretch(points: Sequence[RunPoint], positions: list[int]) -> int:
    """How many of the newest points share the newest's phase and (in a constant phase) learning
    rate, with progress increasing. Where the newest's phase or rate is unknown, the nearest
    known one stands for it, and a point in warmup ends a stretch that is not: an unknown value
    never joins weights from before a change."""
    phase = next((p.phase for p in reversed(points) if p.phase is not None), None)
    if points[-1].phase is None and phase == "warmup":  # unknown after warmup: not warmup itself
        phase = None
    lr = None
    count = 0
    for i in range(len(points) - 1, -1, -1):
        p = points[i]
        if count and positions[i] >= positions[i + 1]:
            break
        if p.phase is not None and p.phase != phase:
            break
        if phase in CONSTANT_PHASES and p.lr is not None:
            if lr is not None and not _same_lr(p.lr, lr):
                break
            lr = p.lr
        count += 1
    return count


def _noise(losses: Sequence[float]) -> float:
    """The per-snapshot spread of the loss, from successive differences (robust to a trend)."""
    diffs = [b - a for a, b in zip(losses, losses[1:])]
    center = sorted(diffs)[len(diffs) // 2]
    deviations = sorted(abs(d - center) for d in diffs)
    mad = deviations[len(deviations) // 2]
    return 1.4826 * mad / math.sqrt(2)


def _exponent(losses: Sequence[float]) -> int:
    """The power of two that brings every loss within ``[-1, 1]``: dividing by it is exact, so a
    fit on the scaled losses decides as the unscaled one would, and cannot overflow."""
    largest = max((abs(x) for x in losses), default=0.0)
    return math.frexp(largest)[1] if largest > 0 else 0


def _unscaled(value: float, exponent: int) -> float:
    """``value * 2**exponent``, held at the largest float where that overflows."""
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return math.copysign(sys.float_info.max, value)


class _NewestFit:
    """A least-squares line over the newest points, grown one older point at a time (Welford's
    updates: each point costs O(1), and the sums stay as accurate as a second pass would)."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self._xs, self._ys = xs, ys
        self.count = 0
        self._mx = self._my = self._sxx = self._sxy = self._syy = 0.0

    def grow_to(self, m: int) -> None:
        """Take in the newest ``m`` points (those not yet in)."""
        while self.count < m:
            self.count += 1
            x, y = self._xs[-self.count], self._ys[-self.count]
            dx, dy = x - self._mx, y - self._my
            self._mx += dx / self.count
            self._my += dy / self.count
            self._sxx += dx * (x - self._mx)
            self._sxy += dx * (y - self._my)
            self._syy += dy * (y - self._my)

    def line(self) -> tuple[float, float]:
        """The slope and its standard error (0 with 2 points)."""
        if self._sxx <= 0:
            return 0.0, 0.0
        slope = self._sxy / self._sxx
        if self.count < 3:
            return slope, 0.0
        residual = max(0.0, self._syy - slope * self._sxy)  # rounding may take it below 0
        return slope, math.sqrt(residual / (self.count - 2) / self._sxx)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` on ``xs`` and its standard error (0 with 2 points), in two
    passes: the exact numbers a reason shows, and the judge of a test too close to call."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return 0.0, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n < 3:
        return slope, 0.0
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(residual / (n - 2) / sxx)


def _fitted(k: int, n: int) -> int:
    """How many of the newest points the line for a window of ``k`` is fitted to."""
    return min(n, max(2 * k, MIN_FIT))


def _fall(positions: Sequence[int], losses: Sequence[float], k: int) -> tuple[float, float]:
    """How much the loss falls over the newest ``k`` points, from a line fitted to the newest
    ``max(2k, MIN_FIT)`` (as many as there are), and the standard error of that fall."""
    n = len(positions)
    m = _fitted(k, n)
    slope, stderr = _slope(positions[n - m :], losses[n - m :])
    span = positions[-1] - positions[n - k]
    return -slope * span, stderr * span


def _fast_fall(fit: _NewestFit, positions: Sequence[int], k: int) -> tuple[float, float]:
    """:func:`_fall` from the grown fit, in O(1) for each next ``k`` (equal but for rounding)."""
    n = len(positions)
    fit.grow_to(_fitted(k, n))
    slope, stderr = fit.line()
    span = positions[-1] - positions[n - k]
    return -slope * span, stderr * span


class _TrendTest:
    """Whether the loss falls clearly more than ``limit`` noise units over the newest ``k``:
    decided from the grown fit, and by the two-pass fit where rounding could tip it (at most
    :data:`_EXACT_CHECKS` times, so a run of ties stays linear)."""

    def __init__(self, positions: Sequence[int], losses: Sequence[float], limit: float) -> None:
        self._positions, self._losses, self._limit = positions, losses, limit
        self._fit = _NewestFit([float(p - positions[-1]) for p in positions], losses)  # x near 0
        self._checks = _EXACT_CHECKS

    def falls(self, k: int) -> bool:
        """True when the loss falls beyond the limit over the newest ``k`` points."""
        fall, stderr = _fast_fall(self._fit, self._positions, k)
        margin = fall - stderr - self._limit
        # The losses are scaled within [-1, 1]: rounding moves the margin by far less than this.
        if abs(margin) <= _CLOSE * (1.0 + self._limit) and self._checks > 0:
            self._checks -= 1
            fall, stderr = _fall(self._positions, self._losses, k)
            margin = fall - stderr - self._limit
        return margin > 0


def _loss_text(value: float) -> str:
    """A loss difference for a reason: 3 decimals, or 3 digits where it is huge."""
    return f"{value:.3f}" if abs(value) < _SHORT_FROM else f"{value:.3g}"


def _moves_text(fall: float) -> str:
    """How the training loss moves, said as it went: a fall as a fall, a rise as a rise."""
    if fall < 0:
        return f"rises by {_loss_text(-fall)}"
    return f"falls by {_loss_text(fall)}"


def _share(span: int, newest: int) -> float | None:
    return span / newest if newest > 0 else None


def _percent(share: float | None) -> str:
    return f"{100 * share:.0f}% of the run" if share is not None else "share of the run unknown"


def choose_window(
    points: Sequence[RunPoint],
    *,
    max_share: float = MAX_SHARE,
    trend_limit: float = TREND_LIMIT,
    fallback_share: float = FALLBACK_SHARE,
) -> WindowChoice:
    """The automatic window over ``points`` (the candidate snapshots, oldest first): see the
    module docstring for the rule; any value of a point the rule cannot use is unknown. A one-line
    ``ValueError`` when there is no point or a setting is out of its range."""
    if not points:
        raise ValueError("no snapshots to choose a window from")
    _check_settings(max_share, trend_limit, fallback_share)
    points = [_usable(p) for p in points]
    if len(points) == 1:
        return WindowChoice(1, "single", "only one snapshot")
    newest = points[-1]
    if newest.phase == "warmup":
        return WindowChoice(
            1, "too-early", "the newest snapshot is still in warmup: too early for a merge to help"
        )
    progress = _progress(points)
    if progress is None:
        count = min(DEFAULT_WINDOW, len(points))
        return WindowChoice(
            count,
            "no-progress",
            f"the snapshots record no token or step counts, so the window cannot follow the run: the newest "
            f"{count} (the paper's N={DEFAULT_WINDOW})",
        )
    unit, positions = progress
    stretch = _stretch(points, positions)
    stretch_note = (
        f" (the {stretch} newest share one phase and learning rate)" if stretch < len(points) else ""
    )
    end = positions[-1]
    losses = [p.loss for p in points[-stretch:]]
    if stretch >= MIN_LOSSES and all(x is not None for x in losses):
        return _by_trend(points[-stretch:], positions[-stretch:], losses, unit, max_share, trend_limit, stretch_note)  # type: ignore[arg-type]
    capped = [i for i in range(len(points) - stretch, len(points)) if end - positions[i] <= fallback_share * end]
    count = max(1, len(capped))
    share = _share(end - positions[-count], end)
    why = "no training loss is recorded" if any(x is None for x in losses) else f"only {stretch} snapshots"
    return WindowChoice(
        count,
        "no-loss",
        f"{why}{stretch_note}, so the loss trend cannot be tested: every snapshot within the last "
        f"{100 * fallback_share:.0f}% of the {unit} trained ({_percent(share)})",
        share=share,
    )


def widest_window(points: Sequence[RunPoint], max_share: float) -> int:
    """The most of the newest ``points`` a window may take: those of the newest's stretch (one
    phase and, in a constant phase, one learning rate, as the rule's step 1 takes them) within
    ``max_share`` of the tokens (else steps) trained; 1 when the points record no progress (a
    window cannot be measured against the run) or the newest is in warmup (too early to merge)."""
    _check_settings(max_share, 0.0, max_share)
    if points is None or isinstance(points, (str, bytes)):
        raise ValueError(f"points must be a sequence of run points, got {shown(points, 60)}")
    points = [_usable(p) for p in points]
    progress = _progress(points) if points else None
    if progress is None or points[-1].phase == "warmup":  # no share to measure; too early to merge
        return 1 if points else 0
    positions = progress[1]
    stretch, end = _stretch(points, positions), positions[-1]
    count = 1
    while count < stretch and end - positions[-count - 1] <= max_share * end:
        count += 1
    return count


def _check_settings(max_share: Any, trend_limit: Any, fallback_share: Any) -> None:
    """Refuse a share outside ``(0, 1]`` or a negative or non-finite trend limit, in one line."""
    for name, value in (("max_share", max_share), ("fallback_share", fallback_share)):
        number = _finite(value)
        if number is None or not 0 < number <= 1:
            raise parameter_error(name, f"must be a number in (0, 1], got {shown(value, 60)}")
    number = _finite(trend_limit)
    if number is None or number < 0:
        raise parameter_error("trend_limit", f"must be a finite number >= 0, got {shown(trend_limit, 60)}")


def _by_trend(
    points: Sequence[RunPoint],
    positions: list[int],
    losses: list[float],
    unit: str,
    max_share: float,
    trend_limit: float,
    stretch_note: str,
) -> WindowChoice:
    """Step 3 of the rule over one stretch (every loss known). The test runs on the losses
    scaled by a power of two (exactly), and the numbers it reports are scaled back."""
    n, end = len(points), positions[-1]
    exponent = _exponent(losses)
    scaled = [math.ldexp(x, -exponent) for x in losses]
    noise = _noise(scaled)
    falls = _TrendTest(positions, scaled, trend_limit * noise)
    chosen, capped = 1, False
    for k in range(2, n + 1):
        span = end - positions[n - k]
        if span > max_share * end:
            capped = True
            break
        if falls.falls(k):  # a fall beyond the noise, and clearly so
            break
        chosen = k
    share = _share(end - positions[n - chosen], end)
    noise = _unscaled(noise, exponent)
    if chosen == 1:
        fall = _unscaled(_fall(positions, scaled, 2)[0], exponent)
        if capped:
            reason = (
                f"even two snapshots span more than {100 * max_share:.0f}% of the {unit} trained{stretch_note}"
            )
        else:
            reason = (
                f"the training loss still {_moves_text(fall)} between the last two snapshots, more "
                f"than {trend_limit:g}x its noise ({_loss_text(noise)}){stretch_note}: too early for a merge "
                "to help"
            )
        return WindowChoice(1, "too-early", reason, share=None, trend=fall, noise=noise)
    trend, trend_se = (_unscaled(v, exponent) for v in _fall(positions, scaled, chosen))
    limit = (
        f"; a longer one would span more than {100 * max_share:.0f}% of the {unit} trained"
        if capped
        else ("; every snapshot of the stretch" if chosen == n else "")
    )
    return WindowChoice(
        chosen,
        "cap" if capped else "trend",
        f"{unit} {positions[n - chosen]:,} to {end:,} ({_percent(share)}): the training loss {_moves_text(trend)} "
        f"(± {_loss_text(trend_se)}) over them, not clearly more than {trend_limit:g}x "
        f"its noise ({_loss_text(noise)}){stretch_note}{limit}",
        strategy=TREND_STRATEGY,
        share=share,
        trend=trend,
        noise=noise,
    )
