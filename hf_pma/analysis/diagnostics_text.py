"""The diagnostics of a merge window in words: plain-text tables and a one-sentence reading."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hf_pma.analysis.geometry import WindowDiagnostics
from hf_pma.utils.formatting import format_number, text_table

__all__ = ["diagnostics_table", "series_table", "reading"]


def diagnostics_table(names: Sequence[str], diag: WindowDiagnostics) -> str:
    """The window's per-snapshot numbers and its cosine matrix, as plain text.

    With equal weights (SMA) the merge is the window mean, so each snapshot's distance to the
    merge equals its deviation from the mean: one column shows both.
    """
    n = len(diag.indices)
    uniform = max(diag.weights) - min(diag.weights) <= 1e-12
    distance_header = (
        ["dist to merge (= |dev from mean|)"] if uniform else ["|dev from mean|", "dist to merge"]
    )
    header = ["snapshot", "weight", *distance_header, *[f"cos[{j}]" for j in range(n)]]
    body = []
    for a, i in enumerate(diag.indices):
        distances = [f"{diag.distances_to_merge[a]:.4g}"]
        if not uniform:
            distances.insert(0, f"{diag.deviation_norms[a]:.4g}")
        body.append(
            [
                f"[{a}] {names[i]}",
                f"{diag.weights[a]:.3f}",
                *distances,
                *[format_number(diag.cosine[a][b], "+.2f") for b in range(n)],
            ]
        )
    lines = [text_table(header, body), ""]
    lines.append(
        f"mean off-diagonal cosine {format_number(diag.mean_cosine, '+.3f')} (pure oscillation: {-1 / (n - 1) if n > 1 else math.nan:+.3f}); "
        f"straightness {format_number(diag.straightness, '.3f')} (1 = straight drift, {1 / (n - 1) if n > 1 else math.nan:.3f} ~ oscillation)"
    )
    lines.append(
        f"spread (RMS |dev|) {diag.spread:.4g}; merge shift |M - newest| {diag.merge_shift:.4g}; "
        f"path length {diag.path_length:.4g}, net displacement {diag.displacement:.4g}"
    )
    if diag.reference is not None:
        ref = diag.reference
        lines.append(
            f"reference: |M - ref| {ref['merge_to_reference']:.4g} vs |newest - ref| {ref['newest_to_reference']:.4g}; "
            f"|M - ref| / RMS |member - ref| = {format_number(ref['ratio'], '.3f')}"
        )
    return "\n".join(lines)


def series_table(names: Sequence[str], series: Sequence[WindowDiagnostics]) -> str:
    """The window ending at each snapshot over training (:func:`~hf_pma.analysis.geometry.training_series`),
    one row each: mean cosine, straightness, spread, merge shift, and with a reference the merge's
    and the newest's distances to it."""
    reference = bool(series) and series[0].reference is not None
    header = ["window end", "mean cos", "straight", "spread", "merge shift"]
    header += ["|M - ref|", "|new - ref|"] if reference else []
    body = []
    for d in series:
        row = [
            names[d.indices[-1]],
            format_number(d.mean_cosine, "+.3f"),
            format_number(d.straightness, ".3f"),
            format_number(d.spread, ".4g"),
            format_number(d.merge_shift, ".4g"),
        ]
        if d.reference is not None:
            row += [
                format_number(d.reference["merge_to_reference"], ".4g"),
                format_number(d.reference["newest_to_reference"], ".4g"),
            ]
        body.append(row)
    return text_table(header, body)


def reading(diag: WindowDiagnostics) -> str:
    """One plain-language sentence on what a window's numbers say about its merge.

    The straightness is compared with its values for oscillation around a centre
    (``1/(N-1)``), a random walk (``1/sqrt(N-1)``) and a straight drift (1); the merge shift
    with the window's spread; with a reference, the merge's distance to it with the newest's.
    """
    n = len(diag.indices)
    if n < 3 or not math.isfinite(diag.straightness):
        return f"Reading: a window of {n} snapshot(s) is too small to tell oscillation from drift."
    s = diag.straightness
    oscillation, walk = 1 / (n - 1), 1 / math.sqrt(n - 1)
    if s < (oscillation + walk) / 2:
        shape = (
            f"the {n} snapshots oscillate around a common centre (straightness {s:.2f}, near {oscillation:.2f}): "
            "averaging cancels their noise, the setting where a merge helps most"
        )
    elif s < (walk + 1) / 2:
        shape = (
            f"the {n} snapshots wander like a random walk (straightness {s:.2f}, a random walk gives ~{walk:.2f}): "
            "averaging smooths noise but also lags behind the newest weights"
        )
    else:
        shape = (
            f"the {n} snapshots drift along a nearly straight path (straightness {s:.2f}): the merge mostly lags "
            "behind the newest weights; a shorter window (or decay-emulating weights) may do better"
        )
    text = f"Reading: {shape}; the merge moves the model by {diag.merge_shift:.3g}"
    if diag.spread > 0:
        text += f" ({diag.merge_shift / diag.spread:.1f}x the window's spread)"
    ref = diag.reference
    if ref is not None:
        closer = ref["merge_to_reference"] < ref["newest_to_reference"]
        text += (
            f", and lands {'closer to' if closer else 'farther from'} the reference than the newest snapshot "
            f"({ref['merge_to_reference']:.3g} vs {ref['newest_to_reference']:.3g})"
        )
    return text + "."
