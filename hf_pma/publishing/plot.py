"""The training plot of a PMA run: one PNG, made with matplotlib's Agg canvas.

It shows, over tokens seen: the training loss, the evaluation loss of the live model and of the
PMA merge at each evaluation, the final evaluation of the last snapshot, the merge and an annealed
model (markers side by side, labelled: often on other text than the curves), the
snapshot positions (the merged ones solid, the run's others dotted) and the learning rate.

The data come from a merged folder's records (:mod:`hf_pma.publishing.records`). The Trainer logs by
step: steps are turned into tokens with the (step, tokens) pairs the records know (log entries
with ``num_input_tokens_seen``, snapshots, PMA evaluations), or the run's average tokens per
step. When nothing relates steps to tokens the x axis is in steps.

The figure is drawn on a ``matplotlib.figure.Figure`` with the Agg canvas, never through
``pyplot``, so plotting changes no global backend of the caller.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers.utils import logging

from hf_pma.core.manifest import PLOT_NAME
from hf_pma.publishing.records import FolderRecords, label_rank, load_records
from hf_pma.utils.fs import atomic_write_file
from hf_pma.utils.parsing import is_number
from hf_pma.utils.text import plot_text

logger = logging.get_logger(__name__)

__all__ = ["PlotData", "plot_data", "plot_training"]

_MERGED_EVAL_KEYS = ("eval_pma_loss", "eval_pma/loss", "pma_eval_loss")
# Final evaluations in the colours of their curves: last snapshot as the live model, the merge
# as the merged evaluations (ranks of hf_pma.publishing.card's model labels), each its own marker.
_FINAL_COLORS = {0: "C3", 1: "C2", 2: "C4"}
_FINAL_MARKERS = {0: "o", 1: "*", 2: "D"}
# Final evaluations at the same position are spread by this share of the x range, side by side.
_FINAL_SPREAD = 0.018


def _num(value: Any) -> float | None:
    return float(value) if is_number(value, finite=True) else None


@dataclasses.dataclass
class PlotData:
    """What the plot shows, as plain lists of (x, y) points; x in tokens when ``x_is_tokens``."""

    x_is_tokens: bool
    train_loss: list[tuple[float, float]]
    eval_live: list[tuple[float, float]]
    eval_merged: list[tuple[float, float]]
    learning_rate: list[tuple[float, float]]
    merged_snapshots: list[float]
    other_snapshots: list[float]
    final_evals: dict[str, tuple[float, float]]
    title: str
    final_note: str = ""

    def is_empty(self) -> bool:
        """True when there is no curve, no evaluation and no snapshot to draw."""
        return not (
            self.train_loss or self.eval_live or self.eval_merged or self.merged_snapshots or self.final_evals
        )


def _step_token_pairs(records: FolderRecords) -> list[tuple[float, float]]:
    pairs = {}
    for entry in records.log_history:
        step, tokens = _num(entry.get("step")), _num(entry.get("num_input_tokens_seen"))
        if step is not None and tokens is not None:
            pairs[step] = tokens
    snapshots = list(records.sources) + list((records.manifest or {}).get("snapshots") or [])
    for item in snapshots + list((records.training or {}).get("pma_evals") or []):
        step, tokens = _num(item.get("step")), _num(item.get("tokens"))
        if step is not None and tokens is not None:
            pairs[step] = tokens
    return sorted(pairs.items())


def _step_to_tokens(records: FolderRecords) -> Callable[[float], float] | None:
    """A map from optimizer step to tokens seen: piecewise linear through the known pairs
    (and (0, 0)), extended with the last pair's average tokens per step."""
    pairs = [(0.0, 0.0)] + [p for p in _step_token_pairs(records) if p[0] > 0]
    if len(pairs) == 1:
        training = records.training or {}
        total, steps = _num(training.get("total_tokens")), _num(training.get("max_steps"))
        if not total or not steps:
            return None
        pairs.append((steps, total))
    steps = [p[0] for p in pairs]

    def convert(step: float) -> float:
        i = bisect.bisect_left(steps, step)
        if i < len(pairs) and steps[i] == step:
            return pairs[i][1]
        if i >= len(pairs):
            last_step, last_tokens = pairs[-1]
            return last_tokens * step / last_step
        (s0, t0), (s1, t1) = pairs[i - 1], pairs[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)

    return convert


def plot_data(records: FolderRecords) -> PlotData:
    """Extract the curves and positions to plot from a folder's records (pure, no matplotlib)."""
    to_tokens = _step_to_tokens(records)
    x_is_tokens = to_tokens is not None

    def x_of(item: dict[str, Any], tokens_key: str) -> float | None:
        tokens = _num(item.get(tokens_key))
        if tokens is not None and x_is_tokens:
            return tokens
        step = _num(item.get("step"))
        if step is None:
            return None
        return to_tokens(step) if to_tokens is not None else step

    train, live, merged, lr = {}, {}, {}, {}
    for entry in records.log_history:
        x = x_of(entry, "num_input_tokens_seen")
        if x is None:
            continue
        if _num(entry.get("loss")) is not None:
            train[x] = entry["loss"]
        if _num(entry.get("learning_rate")) is not None:
            lr[x] = entry["learning_rate"]
        if _num(entry.get("eval_loss")) is not None:
            live[x] = entry["eval_loss"]
        for key in _MERGED_EVAL_KEYS:
            if _num(entry.get(key)) is not None:
                merged[x] = entry[key]
    for item in (records.training or {}).get("pma_evals") or []:
        x = x_of(item, "tokens")
        if x is None:
            continue
        if _num(item.get("eval_loss")) is not None:
            live.setdefault(x, item["eval_loss"])
        if _num(item.get("eval_pma_loss")) is not None:
            merged.setdefault(x, item["eval_pma_loss"])

    merged_x = [x for x in (x_of(s, "tokens") for s in records.sources) if x is not None]
    others = [x_of(s, "tokens") for s in (records.manifest or {}).get("snapshots") or []]
    other_x = sorted({x for x in others if x is not None} - set(merged_x))

    # The final evaluation (pma_eval.json): the last snapshot and the merge sit at the newest merged
    # snapshot; an annealed (or other) model at the end of training, when the run's end is known.
    finals = {}
    results = (records.eval or {}).get("results") or {}
    training = records.training or {}
    end_x = x_of({"tokens": training.get("total_tokens"), "step": training.get("global_step")}, "tokens")
    if merged_x:
        for label, by_task in results.items():
            loss = _num(((by_task or {}).get("lm") or {}).get("loss")) if isinstance(by_task, dict) else None
            if loss is not None:
                x = end_x if label_rank(str(label)) >= 2 and end_x is not None else max(merged_x)
                finals[str(label)] = (x, loss)

    final_note = ""
    if finals:
        # The final evaluation (hf-pma eval, pma_eval.json) and the Trainer's evaluations during
        # training may read different text (scripts/pretrain.py uses the same), and then their
        # levels differ: say what the markers are.
        dataset = (records.eval or {}).get("eval_dataset")
        final_note = (
            f"large markers: final evaluation, loss per token on {dataset or 'its own held-out text'} "
            "(level comparable with the eval curves only where they read the same text)"
        )
    merge = records.merge or {}
    title = records.run_name or records.name or "PMA run"
    if merge:
        title = f"{title}: PMA {merge.get('strategy', 'merge')} of {len(records.sources)} snapshots"
    return PlotData(
        x_is_tokens=x_is_tokens,
        train_loss=sorted(train.items()),
        eval_live=sorted(live.items()),
        eval_merged=sorted(merged.items()),
        learning_rate=sorted(lr.items()),
        merged_snapshots=sorted(merged_x),
        other_snapshots=other_x,
        final_evals=finals,
        title=title,
        final_note=final_note,
    )


def _loss_limits(data: PlotData) -> tuple[float, float] | None:
    # Early training losses are far above the rest: clip the top so the end stays readable.
    values = [y for _, y in data.eval_live + data.eval_merged] + [y for _, y in data.final_evals.values()]
    train = sorted(y for _, y in data.train_loss)
    if train:
        values += train[: max(1, int(len(train) * 0.95))]
    if not values:
        return None
    low, high = min(values + train[:1]), max(values)
    pad = (high - low) * 0.05 or 0.1
    return low - pad, high + pad


def _final_markers(data: PlotData) -> list[tuple[str, float, float, str, str]]:
    """(label, x, y, marker, colour) of the final evaluations, last snapshot first; those at the
    same position are spread side by side (else the merge's marker hides under the annealed one)."""
    xs = [x for curve in (data.train_loss, data.eval_live, data.eval_merged) for x, _ in curve]
    xs += data.merged_snapshots + [x for x, _ in data.final_evals.values()]
    span = (max(xs) - min(xs)) if len(xs) > 1 else 0.0
    step = _FINAL_SPREAD * span or 1.0
    ordered = sorted(data.final_evals.items(), key=lambda kv: label_rank(kv[0]))
    groups: dict[float, list[str]] = {}
    for label, (x, _) in ordered:
        groups.setdefault(x, []).append(label)
    out = []
    for label, (x, y) in ordered:
        group = groups[x]
        offset = (group.index(label) - (len(group) - 1) / 2) * step if len(group) > 1 else 0.0
        rank = label_rank(label)
        out.append((label, x + offset, y, _FINAL_MARKERS.get(rank, "P"), _FINAL_COLORS.get(rank, "C4")))
    return out


def _draw(data: PlotData, dpi: int) -> bytes:
    """The plot as PNG bytes."""
    fig = _figure(data, dpi)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def _figure(data: PlotData, dpi: int) -> Any:
    """The plot as a ``matplotlib.figure.Figure`` on the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(9, 5), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if data.train_loss:
        xs, ys = zip(*data.train_loss)
        ax.plot(xs, ys, color="C0", linewidth=1.2, alpha=0.8, label="training loss")
    if data.eval_live:
        xs, ys = zip(*data.eval_live)
        ax.plot(xs, ys, "o-", color="C3", markersize=4, linewidth=1, label="eval loss, live model")
    if data.eval_merged:
        xs, ys = zip(*data.eval_merged)
        ax.plot(xs, ys, "s-", color="C2", markersize=4, linewidth=1, label="eval loss, PMA merge")
    for label, x, y, marker, color in _final_markers(data):
        size = 13 if marker == "*" else 8
        ax.plot([x], [y], marker=marker, markersize=size, linestyle="none", color=color, markeredgecolor="black",
                markeredgewidth=0.6, zorder=5, label=f"final eval: {plot_text(label)}")
    for i, x in enumerate(data.merged_snapshots):
        ax.axvline(x, color="C1", linewidth=0.9, alpha=0.7, label="merged snapshots" if i == 0 else None)
    for i, x in enumerate(data.other_snapshots):
        ax.axvline(x, color="grey", linewidth=0.7, linestyle=":", alpha=0.6, label="other snapshots" if i == 0 else None)
    limits = _loss_limits(data)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.set_xlabel("tokens seen" if data.x_is_tokens else "optimizer step")
    ax.set_ylabel("loss")
    if data.x_is_tokens:
        ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if data.learning_rate:
        ax_lr = ax.twinx()
        xs, ys = zip(*data.learning_rate)
        (line,) = ax_lr.plot(xs, ys, "--", color="grey", linewidth=1, label="learning rate")
        ax_lr.set_ylabel("learning rate")
        ax_lr.set_ylim(bottom=0)
        handles.append(line)
        labels.append("learning rate")
    if handles:
        # Below the axes: a legend inside would hide the end of the curves, where the merge is.
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, fontsize=8, frameon=False)
    # The title and the note hold names from the records: escaped, "$" included (mathtext).
    title = plot_text(data.title) + (f"\n{plot_text(data.final_note)}" if data.final_note else "")
    ax.set_title(title, fontsize=9)
    return fig


def plot_training(
    folder_or_records: str | os.PathLike[str] | FolderRecords,
    output_path: str | os.PathLike[str] | None = None,
    *,
    dpi: int = 120,
) -> Path:
    """Draw the training plot of a merged folder (or of already loaded records) to a PNG.

    ``output_path`` defaults to ``pma_training.png`` in the folder (required when records are
    given). Raises ``ImportError`` without matplotlib and ``ValueError`` when the records hold
    nothing to plot. The file is written atomically (never half-written), readable by others like
    the folder's other files.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'hf-pma[plot]'") from err
    if isinstance(folder_or_records, FolderRecords):
        records = folder_or_records
        if output_path is None:
            raise ValueError("plot_training: output_path is required when records (not a folder) are given")
    else:
        folder = Path(folder_or_records)
        records = load_records(folder, require_merge=False)
        output_path = output_path if output_path is not None else folder / PLOT_NAME
    output_path = Path(output_path)
    data = plot_data(records)
    if data.is_empty():
        raise ValueError(
            f"nothing to plot for {records.name or 'these records'}: no training log (pma_training.json), "
            "no evaluation and no snapshot positions (pma_merge.json)"
        )
    if not output_path.parent.is_dir():
        raise FileNotFoundError(f"plot_training: the folder of {output_path.name} does not exist")
    png = _draw(data, dpi)
    atomic_write_file(output_path, lambda tmp: tmp.write_bytes(png), needed=len(png))  # readable by others, never half-written
    logger.info(f"Wrote the training plot {output_path.name}")
    return output_path
