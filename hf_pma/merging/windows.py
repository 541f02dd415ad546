"""Which sources a merge takes: ordered by training progress, every k-th, the newest N, or those
within a window of tokens or steps, and a one-line description of the choice.

These work alike on local sources, on Hub revisions not yet downloaded (so a window is drawn
before anything is downloaded) and on the ``(record, folder)`` pairs a training run lists its
snapshots as: :func:`apply_window` is the one way every merge of this library takes its window
(the CLI's, ``PMATrainer``'s evaluation and card, PMA-init, loss-spike recovery, ``swapped()``,
``compare``, ``sweep``, ``inspect``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.selection import WindowSpan, check_window, window_by_progress, window_span
from hf_pma.core.window_choice import (
    RunPoint,
    WindowChoice,
    check_window_count,
    choose_window,
    is_auto,
    point_from_record,
)
from hf_pma.merging.checkpoint_source import CheckpointSource
from hf_pma.merging.hub_revisions import HubRevision
from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import check_int
from hf_pma.utils.text import escape

logger = get_logger(__name__)

__all__ = [
    "order_by_progress",
    "select_newest",
    "too_few_sources",
    "select_window",
    "select_auto",
    "apply_window",
    "run_point",
    "sources_span",
    "describe_sources",
]


def order_by_progress(sources: list[CheckpointSource]) -> list[CheckpointSource]:
    """Sort by tokens when every source knows them, else by step, else keep the given order
    (training stages, like OLMo's, first: their token and step counts restart)."""
    if all(s.tokens is not None for s in sources):
        return sorted(sources, key=lambda s: (s.record.get("stage") or 0, s.tokens, s.step or 0))
    if all(s.step is not None for s in sources):
        return sorted(sources, key=lambda s: (s.record.get("stage") or 0, s.step))
    if len(sources) > 1:
        logger.info(
            "Training progress is unknown for some sources: merging them in the order given (oldest first)."
        )
    return sources


def select_newest(items: list[Any], last: int | None = None, every: int | None = None) -> list[Any]:
    """Every ``every``-th item counting back from the newest, then the newest ``last`` of those."""
    if every is not None and every > 1:
        items = items[::-1][::every][::-1]
    if last is not None:
        if len(items) < last:
            raise too_few_sources(last, items)
        items = items[-last:]
    return items


def too_few_sources(last: int, items: Sequence[Any]) -> ValueError:
    """The error of ``last`` newer than the ``items`` found: one short line naming how many there
    are, the first and the newest (not every path), and the ``last`` that takes them all."""
    names = [escape(_item_name(x)) for x in items]
    span = f" ({names[0]} .. {names[-1]})" if len(names) > 1 else f" ({names[0]})" if names else ""
    return ValueError(
        f"found {len(items)} sources{span}, fewer than last={last}: pass last={len(items)} to merge them all"
    )


def _is_pair(item: Any) -> bool:
    """Whether ``item`` is a training run's ``(record, folder)`` pair (``SnapshotTaker.snapshots()``)."""
    return isinstance(item, tuple) and len(item) == 2


def run_point(item: Any) -> RunPoint:
    """What ``item`` recorded (tokens, step, learning rate, phase, training loss) as the window
    rule reads it: a source or Hub revision (``record``, ``tokens``, ``step``), or a ``(record,
    folder)`` pair of a training run's snapshots (the record a dict or a snapshot record)."""
    if _is_pair(item):
        record = item[0]
        return point_from_record(record.to_dict() if hasattr(record, "to_dict") else record)
    return point_from_record(getattr(item, "record", None), getattr(item, "tokens", None), getattr(item, "step", None))


def select_auto(items: list[Any]) -> tuple[list[Any], WindowChoice]:
    """The newest items the automatic window takes (``window="auto"``), from what each item
    recorded (:func:`run_point`), and the choice with its reason (see
    :mod:`hf_pma.core.window_choice`). ``items`` are ordered oldest first."""
    choice = choose_window([run_point(x) for x in items])
    return items[-choice.count :], choice


def apply_window(
    items: list[Any],
    *,
    last: int | str | None = None,
    every: int | None = None,
    window_tokens: int | None = None,
    window_steps: int | None = None,
    fewer: bool = False,
) -> tuple[list[Any], WindowChoice | None]:
    """The window of a merge, the one path every merge takes it by: every ``every``-th item, then
    those within ``window_tokens`` / ``window_steps`` of the newest when either is given (they win
    over ``last="auto"``), else the newest ``last`` (``"auto"``: :func:`select_auto`; ``None``:
    all). Returns the items and the automatic choice (``None`` when the window was given).

    ``items`` (oldest first) are sources, Hub revisions or a run's ``(record, folder)`` pairs
    (:func:`run_point`). With ``fewer`` a run that has fewer items than ``last`` merges them all (a
    training run early on); else that is a ``ValueError`` (:func:`too_few_sources`). A ``last``
    or ``every`` that is not ``"auto"`` or a positive count is a one-line ``ValueError``."""
    last = check_window_count(last, "last", allow_none=True)
    check_int(every, "every", allow_none=True)
    if window_tokens is not None or window_steps is not None:
        return select_window(select_newest(items, None if is_auto(last) else last, every), window_tokens, window_steps), None
    strided = select_newest(items, None, every)
    if is_auto(last):
        return select_auto(strided) if strided else ([], None)
    if fewer and last is not None:
        last = min(last, len(strided))
    return (select_newest(strided, last) if last else strided), None


def _item_name(item: Any) -> str:
    """How an item is named in a message: a Hub revision's spec, a folder's name."""
    if _is_pair(item):
        return Path(item[1]).name
    if isinstance(item, HubRevision):
        return item.spec
    if isinstance(item, CheckpointSource):
        return item.name  # a downloaded revision is named by its revision
    return Path(getattr(item, "path", item)).name


def select_window(
    items: list[Any], window_tokens: int | None = None, window_steps: int | None = None
) -> list[Any]:
    """The items (oldest first) whose progress lies within the last ``window_tokens`` tokens or
    ``window_steps`` optimizer steps of the newest (see :func:`hf_pma.core.selection.window_by_progress`);
    every item unchanged when neither is given. ``ValueError`` naming the items without a count
    in that unit."""
    if window_tokens is None and window_steps is None:
        return items
    check_window(window_tokens, window_steps)
    unit, span = ("tokens", window_tokens) if window_tokens is not None else ("steps", window_steps)
    points = [run_point(x) for x in items]
    positions = [p.tokens if unit == "tokens" else p.step for p in points]
    try:
        chosen = window_by_progress(positions, span, unit)
    except ValueError:
        missing = [_item_name(x) for x, pos in zip(items, positions) if pos is None]
        hint = (
            " (Trainer checkpoints record tokens only with include_num_input_tokens_seen=True): "
            "give the window in steps (--window-steps, window_steps=)"
            if unit == "tokens"
            else ""
        )
        raise ValueError(
            f"a window of {span:,} {unit} needs every source's {unit[:-1]} count; {len(missing)} have none: "
            f"{', '.join(missing[:5])}{hint}"
        ) from None
    return [items[i] for i in chosen]


def sources_span(
    sources: Sequence[Any], requested: int | None = None, unit: str | None = None
) -> WindowSpan | None:
    """The progress the sources span (tokens when all know them, else steps), or ``None``."""
    return window_span([s.tokens for s in sources], [s.step for s in sources], requested, unit)


def describe_sources(sources: Sequence[Any], requested: int | None = None, unit: str | None = None) -> str:
    """One line saying which sources a merge takes: count, first and last name, progress span
    (in ``unit``, with the ``requested`` window when the window was asked in tokens or steps)."""
    if not sources:
        return "no sources"
    names = (
        _item_name(sources[0])
        if len(sources) == 1
        else f"{_item_name(sources[0])} ... {_item_name(sources[-1])}"
    )
    span = sources_span(sources, requested, unit)
    where = f", {span.describe()}" if span is not None else ", training progress unknown"
    return f"{len(sources)} source(s): {names}{where}"
