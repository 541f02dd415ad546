"""The diagnostics of a merge window as a figure (matplotlib, imported when drawing)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_pma.analysis.geometry import WindowDiagnostics
from hf_pma.utils.fs import atomic_write_file
from hf_pma.utils.text import plot_text

__all__ = ["plot_diagnostics"]


def plot_diagnostics(
    output_path: str | os.PathLike[str],
    names: Sequence[str],
    diag: WindowDiagnostics,
    series: Sequence[WindowDiagnostics] = (),
    series_x: Sequence[float] = (),
    x_label: str = "tokens",
    title: str = "PMA window diagnostics",
    dpi: int = 110,
) -> Path:
    """A PNG: the window's cosine matrix, each snapshot's distance to the merge, and the series
    over training (spread, merge shift, reference distances; straightness)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    output_path = Path(output_path)
    fig = Figure(figsize=(15, 4.6), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    n = len(diag.indices)
    labels = [plot_text(names[i].removeprefix("snapshot-")) for i in diag.indices]  # names from folders

    ax = axes[0]
    image = ax.imshow(torch.tensor(diag.cosine).nan_to_num(0.0).numpy(), vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(n), labels, fontsize=7)
    ax.set_title(
        f"cosine of deviations from the window mean\n(mean off-diag {diag.mean_cosine:+.2f}; noise: {-1 / max(1, n - 1):+.2f})",
        fontsize=9,
    )
    if n <= 12:
        for a in range(n):
            for b in range(n):
                value = diag.cosine[a][b]
                if not math.isnan(value):
                    ax.text(
                        b,
                        a,
                        f"{value:+.2f}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if abs(value) > 0.6 else "black",
                    )
    fig.colorbar(image, ax=ax, fraction=0.046)

    ax = axes[1]
    ax.bar(range(n), diag.distances_to_merge, color="C2", label="|snapshot - merge|")
    ax.plot(range(n), diag.deviation_norms, "k.", label="|snapshot - window mean|")
    ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
    ax.set_ylabel("L2 distance")
    ax.set_title(f"distance to the merge (merge shift {diag.merge_shift:.3g})", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[2]
    if series:
        xs = list(series_x) or list(range(len(series)))
        ax.plot(xs, [d.spread for d in series], "o-", color="C0", markersize=3, label="spread (RMS |dev|)")
        ax.plot(xs, [d.merge_shift for d in series], "s-", color="C2", markersize=3, label="|merge - newest|")
        if series[0].reference is not None:
            ax.plot(
                xs,
                [d.reference["merge_to_reference"] for d in series],
                "^-",
                color="C3",
                markersize=3,
                label="|merge - reference|",
            )
            ax.plot(
                xs,
                [d.reference["newest_to_reference"] for d in series],
                "v--",
                color="C1",
                markersize=3,
                label="|newest - reference|",
            )
        ax.set_xlabel(x_label)
        ax.set_ylabel("L2 distance")
        twin = ax.twinx()
        twin.plot(xs, [d.straightness for d in series], ":", color="C7", label="straightness (right)")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("straightness")
        handles, lbls = ax.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        ax.legend(handles + h2, lbls + l2, fontsize=7)
        ax.set_title(f"over training (window of {n})", fontsize=9)
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "one window only:\nno series over training", ha="center", va="center")
    fig.suptitle(plot_text(title), fontsize=10)
    fig.tight_layout()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_file(output_path, lambda tmp: fig.savefig(tmp, format="png"))
    return output_path
