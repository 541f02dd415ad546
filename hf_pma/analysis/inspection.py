"""Inspect a run: list its snapshots, then diagnose its merge window (what ``hf-pma inspect`` does).

:func:`list_snapshots` gives the rows of a run's snapshots (reading no weights, except a Hub
repo's selected revisions, which are downloaded); :func:`diagnose_window` computes the Gram
matrix of the run's snapshots (:func:`~hf_pma.analysis.gram.compute_gram`) and the
diagnostics of its merge window and of the window ending at each snapshot over training
(:mod:`hf_pma.analysis.geometry`), into a :class:`WindowReport` that renders itself as text
(:meth:`WindowReport.text`), a figure (:meth:`WindowReport.plot`) and JSON
(:meth:`WindowReport.to_dict`). The window is the one asked for, else the one the run merged
(:func:`run_window`: its merge or training record), else the automatic window of a merge.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.analysis.diagnostics_plot import plot_diagnostics
from hf_pma.analysis.diagnostics_text import diagnostics_table, reading, series_table
from hf_pma.analysis.geometry import (
    WindowDiagnostics,
    strategy_weights,
    training_series,
    window_diagnostics,
    window_indices,
)
from hf_pma.analysis.gram import GramMatrix, compute_gram
from hf_pma.analysis.snapshot_listing import snapshot_rows, source_row
from hf_pma.core.manifest import MERGE_RECORD_NAME, PMA_SUBDIR, TRAINING_RECORD_NAME
from hf_pma.core.selection import DEFAULT_WINDOW, window_by_progress
from hf_pma.core.strategies import AUTO_STRATEGY, resolve_strategy
from hf_pma.core.window_choice import AUTO, WindowChoice, is_auto, merge_strategy
from hf_pma.io.guarded import read_json
from hf_pma.merging.hub_revisions import parse_hub_spec
from hf_pma.merging.sources import CheckpointSource, model_source, resolve_sources, run_layout
from hf_pma.merging.windows import apply_window
from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import check_int, is_int

logger = get_logger(__name__)

__all__ = [
    "DEFAULT_WINDOW",
    "WindowReport",
    "run_window",
    "window_size",
    "list_snapshots",
    "diagnose_window",
]


def run_window(run: str | os.PathLike[str]) -> tuple[int | str | None, int | None, str | None]:
    """The window a run merged: ``(N, T, where)`` from its merge record (``pma/merged/pma_merge.json``),
    else its training record (``pma_training.json``: ``pma_window`` / ``pma_window_tokens``);
    N is ``"auto"`` when the run's window was chosen automatically; ``(None, None, None)`` when
    the run records none (or is not a local folder)."""
    run = Path(run)
    if not run.is_dir():
        return None, None, None
    try:
        layout = run_layout(run)
    except (ValueError, OSError):
        return None, None, None
    merged = (layout.manifest.parent if layout.manifest is not None else run / PMA_SUBDIR) / "merged"
    for name in (MERGE_RECORD_NAME, TRAINING_RECORD_NAME):
        path = merged / name
        try:
            record: Any = read_json(path) if path.is_file() else None
        except (ValueError, OSError):
            continue
        if not isinstance(record, dict):
            continue
        where = str(path.relative_to(run)) if path.is_relative_to(run) else str(path)
        if name == MERGE_RECORD_NAME:
            window = record.get("window") if isinstance(record.get("window"), dict) else {}
            tokens = window.get("requested") if window.get("unit") == "tokens" else None
            count = record.get("num_sources") or (
                len(record["sources"]) if isinstance(record.get("sources"), list) else None
            )
            if isinstance(window.get("auto"), dict):  # chosen automatically: choose again at other tokens
                count = AUTO
        else:
            tokens, count = record.get("pma_window_tokens"), record.get("pma_window")
        tokens = tokens if is_int(tokens, 1) else None
        count = count if is_int(count, 1) or is_auto(count) else None
        if tokens or count:
            return count, tokens, where
    return None, None, None


def window_size(
    run: str | os.PathLike[str],
    sources: Sequence[CheckpointSource],
    window: int | None = None,
    window_tokens: int | None = None,
    every: int = 1,
    strategy: str = AUTO_STRATEGY,
) -> tuple[int, str, WindowChoice | None]:
    """N, the snapshots in the merge window, where it comes from in words, and the automatic
    window's choice where it chose: ``window``, else the snapshots within the last
    ``window_tokens`` tokens of ``sources`` (every ``every``-th), else the run's own window
    (:func:`run_window`), else the automatic window (from the records of every ``every``-th
    snapshot, as ``hf-pma merge --every`` takes it)."""
    count, tokens, where = (None, None, None) if window or window_tokens else run_window(run)
    tokens = window_tokens or tokens
    if window:
        return window, "--window", None
    if tokens:
        strided = list(range(len(sources) - 1, -1, -every))[::-1]
        try:
            n = len(window_by_progress([sources[i].tokens for i in strided], tokens, "tokens"))
        except ValueError as err:
            raise ValueError(f"a window of {tokens:,} tokens: {err}") from None
        origin = "--window-tokens" if window_tokens else f"the run's own, {where}"
        return n, f"the last {tokens:,} tokens; {origin}", None
    if count and not is_auto(count):
        return count, f"the run's own, {where}", None
    if len(sources) > 1:  # chosen from the (strided) snapshots' records, as a merge does
        choice = apply_window(list(sources), last="auto", every=every)[1]
        assert choice is not None
        choice = merge_strategy(strategy, choice, choice.count)[1]
        return choice.count, choice.describe() + (f" (the run's own, {where})" if count else ""), choice
    return DEFAULT_WINDOW, "the default: the run records no merge window", None


def _is_hub(run: str | os.PathLike[str], revisions: str | None) -> bool:
    return revisions is not None or (not Path(run).exists() and parse_hub_spec(str(run)) is not None)


def list_snapshots(
    run: str | os.PathLike[str],
    *,
    include_final: bool = False,
    revisions: str | None = None,
    last: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[list[dict[str, Any]], list[CheckpointSource] | None]:
    """The rows of a run's snapshots (:func:`~hf_pma.analysis.snapshot_listing.snapshot_rows`),
    and, for a Hub repo (``org/model``, its revisions matching ``revisions``), the sources it
    resolved to (the ``last`` newest, downloaded into ``cache_dir``: their weights are read to
    list their sizes); ``None`` for a local run."""
    if not _is_hub(run, revisions):
        return snapshot_rows(run, include_final=include_final), None
    hub = resolve_sources([run], last=last, revisions=revisions, cache_dir=cache_dir)
    return [source_row(s) for s in hub], hub


@dataclasses.dataclass
class WindowReport:
    """The diagnostics of a run's merge window (``window``) and of the window ending at each
    snapshot over training (``series``, at ``series_x`` in ``x_label``), from one Gram matrix."""

    gram: GramMatrix
    window: WindowDiagnostics
    series: list[WindowDiagnostics]
    series_x: list[int]
    x_label: str
    origin: str
    strategy: str
    every: int

    @property
    def reading(self) -> str:
        """One plain-language sentence on the window's numbers (:func:`~hf_pma.analysis.diagnostics_text.reading`)."""
        return reading(self.window)

    def text(self) -> str:
        """The window's line, its table and the table over training, as plain text (names escaped)."""
        n = len(self.window.indices)
        lines = [
            f"Window: {n} snapshots ({self.origin}), every {self.every}, {self.strategy} weights "
            f"({self.gram.numel:,} weights in {self.gram.num_tensors} tensors)",
            diagnostics_table(self.gram.names, self.window),
        ]
        if len(self.series) > 1:
            lines += ["", "Over training (window ending at each snapshot):"]
            lines.append(series_table(self.gram.names, self.series))
        return "\n".join(lines)

    def plot(self, output_path: str | os.PathLike[str], title: str) -> Path:
        """Draw the diagnostics into a PNG (:func:`~hf_pma.analysis.diagnostics_plot.plot_diagnostics`)."""
        return plot_diagnostics(
            output_path, self.gram.names, self.window, self.series, self.series_x, self.x_label, title
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: ``window``, ``series``, ``gram`` and ``reading``."""
        names = self.gram.names
        return {
            "window": self.window.to_dict()
            | {
                "names": [names[i] for i in self.window.indices],
                "strategy": self.strategy,
                "every": self.every,
                "origin": self.origin,
            },
            "series": [
                d.to_dict() | {"end": names[d.indices[-1]], "x": x}
                for d, x in zip(self.series, self.series_x)
            ],
            "gram": self.gram.to_dict(),
            "reading": self.reading,
        }


def diagnose_window(
    run: str | os.PathLike[str],
    sources: Sequence[CheckpointSource] | None = None,
    *,
    window: int | None = None,
    window_tokens: int | None = None,
    every: int = 1,
    strategy: str = AUTO_STRATEGY,
    alpha: float = 0.2,
    last: int | None = None,
    reference: str | os.PathLike[str] | None = None,
    include_final: bool = False,
    chunk_bytes: int = 64 * 1024 * 1024,
    progress: bool = True,
) -> WindowReport:
    """The diagnostics of ``run``'s merge window: the newest ``window`` snapshots (or those
    within the last ``window_tokens`` tokens; default: the run's own window, see
    :func:`window_size`), every ``every``-th, merged with ``strategy``'s coefficients, and the same
    window ending at each snapshot over training.

    ``sources``: the run's sources when resolved already (a Hub repo's, from
    :func:`list_snapshots`); ``last``: only the newest ``last`` of them; ``reference``: a model
    folder standing for the optimum (e.g. the annealed model), whose distances are reported too.
    The window shrinks, with a warning, when the run has fewer snapshots. Weights are read a
    chunk of at most ``chunk_bytes`` at a time.
    """
    strategy_weights(strategy, alpha)  # a bad strategy or alpha: one line now
    check_int(every, "every")
    if reference is not None and not Path(reference).exists():
        raise FileNotFoundError(f"reference model {reference} does not exist")
    sources = list(sources) if sources is not None else resolve_sources([run], include_final=include_final)
    if last:
        sources = sources[-last:]
    if len(sources) < 2:
        raise ValueError(f"{run} has {len(sources)} usable snapshot(s): the diagnostics need at least 2")
    count = len(sources)
    size, origin, choice = window_size(run, sources, window, window_tokens, every, strategy)
    strategy = resolve_strategy(strategy, choice)  # "auto": the automatic window's own weights
    weights_fn = strategy_weights(strategy, alpha)
    if window_indices(count, size, every) is None:
        shrunk = (count - 1) // every + 1
        logger.warning(f"only {count} snapshots: the window shrinks from {size} to {shrunk}")
        size = shrunk
    ref_index = None
    if reference is not None:
        sources = [*sources, model_source(reference)]
        ref_index = count
    gram = compute_gram(sources, chunk_bytes=chunk_bytes, progress=progress)
    indices = window_indices(count, size, every)
    diag = window_diagnostics(gram.gram, indices, weights_fn(len(indices)), ref_index)
    series = training_series(gram.gram, size, every, weights_fn, count=count, reference=ref_index)
    ends = [d.indices[-1] for d in series]
    use_tokens = all(gram.tokens[i] is not None for i in ends)
    xs = [gram.tokens[i] if use_tokens else (gram.steps[i] or i) for i in ends]
    return WindowReport(gram, diag, series, xs, "tokens" if use_tokens else "step", origin, strategy, every)
