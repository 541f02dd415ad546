"""Which snapshots a merge takes: the newest N, every k-th, or all within the last T tokens (or S steps).

Pure Python: no torch, no files. Positions are training progress (tokens or optimizer steps) of
the candidates, oldest first.

A window by progress takes every candidate whose position lies in ``(newest - T, newest]``:
the half-open interval makes ``T = N * V`` take exactly N snapshots taken every V tokens.
WSM (Tian et al., arXiv 2507.17634) finds that the merge *duration*, the tokens the merged
checkpoints span, matters more than their interval or count: a window in tokens keeps that
duration when the snapshot interval changes (Trainer checkpoints every ``save_steps``, PMA
snapshots every V tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hf_pma.utils.parsing import check_int, is_int
from hf_pma.utils.text import shown

__all__ = [
    "DEFAULT_WINDOW",
    "WINDOW_UNITS",
    "WindowSpan",
    "window_by_progress",
    "window_span",
    "check_window",
    "snapshot_intervals",
]

WINDOW_UNITS = ("tokens", "steps")
# The merge window, in snapshots, of a run that records none (PMATrainingArguments.pma_window's
# default): what ``hf-pma inspect`` and ``hf-pma compare`` take then.
DEFAULT_WINDOW = 10


def check_window(
    window_tokens: int | None = None, window_steps: int | None = None, last: int | None = None
) -> None:
    """``ValueError`` for a non-positive window, or for more than one of ``window_tokens``,
    ``window_steps`` and ``last`` (each says on its own how many snapshots to take)."""
    given = [
        (n, v)
        for n, v in (("window_tokens", window_tokens), ("window_steps", window_steps), ("last", last))
        if v is not None
    ]
    for name, value in given:
        check_int(value, name)
    if len(given) > 1:
        raise ValueError(
            f"give one of {' and '.join(n for n, _ in given)}: each chooses the merge window on its own"
        )


def window_by_progress(positions: Sequence[int | None], span: int, unit: str = "tokens") -> list[int]:
    """Indices (oldest first) of the candidates whose position lies within the last ``span``
    of progress: ``newest - span < position <= newest``.

    Walks back from the newest and stops at the first candidate outside the window, or at a
    position larger than its successor's (a training stage whose counts restart). Raises
    ``ValueError`` when a position within reach is unknown (``None``): the window cannot be
    drawn in that unit.
    """
    if unit not in WINDOW_UNITS:
        raise ValueError(f"unknown window unit {unit!r}; choose one of {', '.join(WINDOW_UNITS)}")
    if not is_int(span, 1):
        raise ValueError(f"the window must be a positive number of {unit}, got {shown(span, 60)}")
    if not positions:
        return []
    if positions[-1] is None:
        raise ValueError(f"the newest candidate has no {unit[:-1]} count: cannot choose a window in {unit}")
    newest = positions[-1]
    chosen = [len(positions) - 1]
    for i in range(len(positions) - 2, -1, -1):
        position = positions[i]
        if position is None:
            raise ValueError(f"candidate {i} has no {unit[:-1]} count: cannot choose a window in {unit}")
        if position > positions[chosen[-1]] or position <= newest - span:
            break
        chosen.append(i)
    return chosen[::-1]


@dataclasses.dataclass(frozen=True)
class WindowSpan:
    """What a merge window covers: its first and last position in ``unit``, and how it was asked for."""

    unit: str
    first: int
    last: int
    requested: int | None = None

    @property
    def span(self) -> int:
        """Progress from the oldest to the newest member (``last - first``)."""
        return self.last - self.first

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the merge record's ``window``)."""
        return {
            "unit": self.unit,
            "first": self.first,
            "last": self.last,
            "span": self.span,
            "requested": self.requested,
        }

    def describe(self) -> str:
        """``"tokens 20,480 to 163,840 (span 143,360)"``."""
        text = f"{self.unit} {self.first:,} to {self.last:,} (span {self.span:,})"
        if self.requested is not None:
            text += f", window of {self.requested:,} {self.unit}"
        return text


def window_span(
    tokens: Sequence[int | None],
    steps: Sequence[int | None],
    requested: int | None = None,
    unit: str | None = None,
) -> WindowSpan | None:
    """The span of merged members (oldest first) in ``unit`` (default: tokens when every member
    knows them, else steps), or ``None`` when neither is known for every member."""
    for name, values in (("tokens", tokens), ("steps", steps)):
        if unit not in (None, name):
            continue
        if values and all(is_int(v) for v in values):
            return WindowSpan(name, min(values), max(values), requested)
    return None


def _runs(values: Sequence[int]) -> list[int]:
    """Each value once per run of equal neighbours, in order: ``[1, 1, 2, 2, 1] -> [1, 2, 1]``."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def snapshot_intervals(
    recorded: Sequence[int | None], tokens: Sequence[int | None]
) -> tuple[list[int], str | None]:
    """The snapshot intervals V (tokens) the merged members (oldest first) were taken at, each
    once per stretch, and what they come from: ``(the intervals, "recorded")`` when every member
    records its interval (a snapshot's ``extra.interval_tokens``), else ``(the token gaps
    between consecutive members, "gaps")`` when every member knows its tokens, else ``([],
    None)``. More than one interval means that V changed within the merge (a run resumed with
    another ``interval_tokens``), or that the members are unevenly spaced.
    """
    if recorded and all(is_int(v, 1) for v in recorded):
        return _runs(list(recorded)), "recorded"  # type: ignore[arg-type]
    if len(tokens) >= 2 and all(is_int(t) for t in tokens):
        gaps = [b - a for a, b in zip(tokens, tokens[1:])]  # type: ignore[operator]
        if all(g > 0 for g in gaps):
            return _runs(gaps), "gaps"
    return [], None
