"""The automatic merge window (``window="auto"``): how many of the newest snapshots a merge takes,
chosen from what the run recorded at each snapshot (tokens, learning rate, phase, training loss).

Pure Python: no torch, no files. The rule, in three steps:

1. **The stretch.** Walk back from the newest snapshot while the phase is the newest's and, in a
   constant-LR phase, the learning rate is the same: a merge never mixes warmup weights, or
   weights from before an LR change, into a constant-LR window. A run whose newest snapshot is
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

Without recorded losses (Trainer checkpoints without a loss, Hub revisions) the trend test cannot
run: the window is then every snapshot of the stretch within :data:`FALLBACK_SHARE` of the tokens
trained (torchtitan's EMA uses a half-life of 5% of the elapsed steps, which weighs about the
last 14%: the same order). Without any progress the window cannot follow the run: the newest
:data:`hf_pma.core.selection.DEFAULT_WINDOW` (the paper's N), said so.

The evidence behind the constants (runs of 300 to 3,000 steps at four learning rates, each with a
matched annealed fork) is ``benchmarks/window_choice.py`` and the manual's "Choosing the window".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from hf_pma.core.selection import DEFAULT_WINDOW
from hf_pma.utils.parsing import is_int, is_number, parameter_error
from hf_pma.utils.text import shown

__all__ = [
    "AUTO",
    "MAX_SHARE",
    "FALLBACK_SHARE",
    "TREND_LIMIT",
    "RunPoint",
    "WindowChoice",
    "choose_window",
    "choose_for_snapshots",
    "check_window_count",
    "is_auto",
    "point_from_record",
]

AUTO = "auto"
# The longest window, as a share of the tokens trained at the newest snapshot.
MAX_SHARE = 0.2
# The window without recorded losses: every snapshot within this share of the tokens trained.
FALLBACK_SHARE = 0.10
# The loss may fall by at most this many noise units (its per-snapshot spread) over the window: the
# merge gives back about half the fall by lagging, and wins more than the noise by averaging.
TREND_LIMIT = 3.0
# Losses needed for the trend test (a noise estimate needs a few differences).
MIN_LOSSES = 4
# Points of the line fitted for the trend: at least this many, more when the window is longer.
MIN_FIT = 4
# Phases in which the learning rate is constant (the merge's regime); None: not recorded.
CONSTANT_PHASES = ("stable", None)


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
    alone), the ``rule`` that decided (``trend``, ``cap``, ``too-early``, ``no-loss``,
    ``no-progress``, ``single``; ``held-out`` where a check on held-out documents overruled
    it) and one sentence saying why."""

    count: int
    rule: str
    reason: str
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
        """``"auto window: the newest 8 snapshots (...): <reason>"``."""
        what = "the last snapshot alone" if self.count == 1 else f"the newest {self.count} snapshots"
        return f"auto window: {what}: {self.reason}"


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
    return RunPoint(
        tokens=tokens if is_int(tokens, 0) else None,
        step=step if is_int(step, 0) else None,
        lr=float(lr) if is_number(lr) and math.isfinite(lr) else None,
        loss=float(loss) if is_number(loss) and math.isfinite(loss) else None,
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
    """How many of the newest points share the newest's phase and (in a constant phase) LR,
    with progress increasing."""
    newest = points[-1]
    count = 1
    for i in range(len(points) - 2, -1, -1):
        p = points[i]
        if positions[i] >= positions[i + 1]:
            break
        if p.phase != newest.phase and None not in (p.phase, newest.phase):
            break
        if newest.phase in CONSTANT_PHASES and not _same_lr(p.lr, newest.lr):
            break
        count += 1
    return count


def _noise(losses: Sequence[float]) -> float:
    """The per-snapshot spread of the loss, from successive differences (robust to a trend)."""
    diffs = [b - a for a, b in zip(losses, losses[1:])]
    center = sorted(diffs)[len(diffs) // 2]
    deviations = sorted(abs(d - center) for d in diffs)
    mad = deviations[len(deviations) // 2]
    return 1.4826 * mad / math.sqrt(2)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` on ``xs`` and its standard error (0 with 2 points)."""
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


def _fall(positions: Sequence[int], losses: Sequence[float], k: int) -> tuple[float, float]:
    """How much the loss falls over the newest ``k`` points, from a line fitted to the newest
    ``max(2k, MIN_FIT)`` (as many as there are), and the standard error of that fall."""
    n = len(positions)
    m = min(n, max(2 * k, MIN_FIT))
    slope, stderr = _slope(positions[n - m :], losses[n - m :])
    span = positions[-1] - positions[n - k]
    return -slope * span, stderr * span


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
    module docstring for the rule. ``ValueError`` when there is no point."""
    if not points:
        raise ValueError("no snapshots to choose a window from")
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


def choose_for_snapshots(snapshots: Sequence[tuple[Any, Any]]) -> WindowChoice:
    """:func:`choose_window` over a run's listed snapshots: ``(record, folder)`` pairs, oldest
    first, as ``SnapshotTaker.snapshots()`` gives them (each record read by its ``to_dict()``)."""
    return choose_window([point_from_record(record.to_dict()) for record, _folder in snapshots])


def _by_trend(
    points: Sequence[RunPoint],
    positions: list[int],
    losses: list[float],
    unit: str,
    max_share: float,
    trend_limit: float,
    stretch_note: str,
) -> WindowChoice:
    """Step 3 of the rule over one stretch (every loss known)."""
    n, end = len(points), positions[-1]
    noise = _noise(losses)
    chosen, trend, trend_se, capped = 1, 0.0, 0.0, False
    for k in range(2, n + 1):
        span = end - positions[n - k]
        if span > max_share * end:
            capped = True
            break
        fall, stderr = _fall(positions, losses, k)
        if fall - stderr > trend_limit * noise:  # a fall beyond the noise, and clearly so
            break
        chosen, trend, trend_se = k, fall, stderr
    share = _share(end - positions[n - chosen], end)
    if chosen == 1:
        fall, _stderr = _fall(positions, losses, 2)
        if capped:
            reason = (
                f"even two snapshots span more than {100 * max_share:.0f}% of the {unit} trained{stretch_note}"
            )
        else:
            reason = (
                f"the training loss still falls by {fall:.3f} between the last two snapshots, more than "
                f"{trend_limit:g}x its noise ({noise:.3f}){stretch_note}: too early for a merge to help"
            )
        return WindowChoice(1, "too-early", reason, share=None, trend=fall, noise=noise)
    limit = (
        f"; a longer one would span more than {100 * max_share:.0f}% of the {unit} trained"
        if capped
        else ("; every snapshot of the stretch" if chosen == n else "")
    )
    return WindowChoice(
        chosen,
        "cap" if capped else "trend",
        f"{unit} {positions[n - chosen]:,} to {end:,} ({_percent(share)}): the training loss falls by "
        f"{trend:.3f} (± {trend_se:.3f}) over them, not clearly more than {trend_limit:g}x its noise "
        f"({noise:.3f}){stretch_note}{limit}",
        share=share,
        trend=trend,
        noise=noise,
    )
