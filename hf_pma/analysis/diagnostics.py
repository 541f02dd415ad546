"""Why a merge helps (or not): geometry of a run's snapshots, from one Gram matrix.

The PMA paper (arXiv 2505.12082) explains it: around an optimum, the merge of N snapshots beats the
average of its members when their deviations ``d_i`` are complementary (the cross terms
``d_i^T H d_j`` are mostly negative: the snapshots oscillate around the basin on different
sides). This module reports cheap proxies of that.

Everything derives from one ``K x K`` Gram matrix of the K snapshots' weights (centred on
their mean), computed once by :func:`compute_gram`, tensor by tensor, a chunk of elements at a
time (bounded memory: ``K x chunk`` float64, whatever the model size). Any window, stride or
merge weights are then pure linear algebra on that matrix, because with ``sum_j w_j = 1`` every
distance between snapshots and merges is invariant to the common reference point:

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
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from hf_pma.core.manifest import is_excluded, manifest_snapshots
from hf_pma.core.strategies import merge_coefficients
from hf_pma.io.sharded import sharded_weight_files
from hf_pma.merging.sources import (
    CheckpointSource,
    CheckpointTensors,
    find_weight_files,
    open_all,
    resolve_sources,
    run_layout,
)
from hf_pma.utils.formatting import format_bytes, format_number, text_table
from hf_pma.utils.fs import atomic_write_file
from hf_pma.utils.text import plot_text

logger = logging.get_logger(__name__)

__all__ = [
    "GramMatrix",
    "WindowDiagnostics",
    "compute_gram",
    "centered_gram",
    "cosine_matrix",
    "distances_to_merge",
    "pairwise_distance",
    "window_diagnostics",
    "training_series",
    "window_indices",
    "snapshot_rows",
    "snapshot_table",
    "diagnostics_table",
    "reading",
    "plot_diagnostics",
    "strategy_weights",
]

# Working matrix of a Gram chunk (K rows of float64): bounds the memory of compute_gram.
_DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


# ---------------------------------------------------------------- the Gram matrix (IO)


@dataclasses.dataclass
class GramMatrix:
    """Inner products of K checkpoints' floating-point weights, centred on their mean.

    ``gram[i, j] = <theta_i - c, theta_j - c>`` over every floating-point element (float64),
    with ``c`` the mean of the K checkpoints; ``names``, ``tokens`` and ``steps`` describe the
    checkpoints, oldest first.
    """

    gram: torch.Tensor
    names: list[str]
    tokens: list[int | None]
    steps: list[int | None]
    numel: int
    num_tensors: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "names": self.names,
            "tokens": self.tokens,
            "steps": self.steps,
            "numel": self.numel,
            "num_tensors": self.num_tensors,
            "gram": self.gram.tolist(),
        }


def _float_tensors(sources: Sequence[CheckpointSource], opened: Sequence[CheckpointTensors]) -> list[tuple[str, int]]:
    """(name, numel) of the floating-point tensors, after checking every checkpoint has them alike."""
    ref = opened[0].infos
    for source, tensors in zip(sources[1:], opened[1:]):
        infos = tensors.infos
        if set(infos) != set(ref):
            diff = sorted(set(infos) ^ set(ref))
            raise ValueError(
                f"{source.path} and {sources[0].path} hold different tensors (e.g. {', '.join(diff[:3])}): "
                "not snapshots of one model"
            )
        for name, info in ref.items():
            if infos[name].shape != info.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {list(infos[name].shape)} in {source.path} "
                    f"but {list(info.shape)} in {sources[0].path}"
                )
    return [(name, ref[name].numel) for name in sorted(ref) if ref[name].is_floating_point]


def compute_gram(
    sources: Sequence[str | os.PathLike[str] | CheckpointSource],
    chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
    progress: bool = True,
) -> GramMatrix:
    """The centred Gram matrix of K checkpoints (oldest first), tensor by tensor.

    For each floating-point tensor, elements are read in chunks of at most ``chunk_bytes /
    (8 K)`` from every checkpoint (:meth:`CheckpointSource.open` ``.read(name, start, stop)``),
    centred on the chunk's mean over the K checkpoints and accumulated into ``G += D D^T`` in
    float64. Memory: about ``chunk_bytes`` whatever the model size.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    srcs = list(sources) if sources and all(isinstance(s, CheckpointSource) for s in sources) else resolve_sources(sources)
    if len(srcs) < 2:
        raise ValueError(f"diagnostics need at least 2 checkpoints, got {len(srcs)}")
    k = len(srcs)
    chunk = max(1, int(chunk_bytes) // (8 * k))
    opened = open_all(srcs)
    try:
        tensors = _float_tensors(srcs, opened)
        if not tensors:
            raise ValueError(f"{srcs[0].path} holds no floating-point tensor")
        gram = torch.zeros(k, k, dtype=torch.float64)
        work = torch.empty(k, chunk, dtype=torch.float64)
        buf = torch.empty(chunk * 8, dtype=torch.uint8)
        total = sum(n for _, n in tensors)
        with tqdm(total=total, desc="Gram matrix", unit="elem", unit_scale=True, disable=not progress) as bar:
            for name, numel in tensors:
                for start in range(0, numel, chunk):
                    stop = min(numel, start + chunk)
                    rows = work[:, : stop - start]
                    for i, tensors_i in enumerate(opened):
                        rows[i].copy_(tensors_i.read(name, start, stop, buf))
                    rows.sub_(rows.mean(dim=0, keepdim=True))
                    gram.addmm_(rows, rows.T)
                    bar.update(stop - start)
    finally:
        for t in opened:
            t.close()
    if not bool(torch.isfinite(gram).all()):
        raise ValueError("the checkpoints hold non-finite weights (NaN or Inf): no geometry to report")
    gram = 0.5 * (gram + gram.T)  # exact symmetry despite rounding
    return GramMatrix(
        gram=gram,
        names=[s.name for s in srcs],
        tokens=[s.tokens for s in srcs],
        steps=[s.step for s in srcs],
        numel=total,
        num_tensors=len(tensors),
    )


# ---------------------------------------------------------------- pure math on a Gram matrix


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
    off = [float(cos[a, b]) for a in range(n) for b in range(n) if a != b and not math.isnan(float(cos[a, b]))]
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


# ---------------------------------------------------------------- snapshot listing (IO)


def _folder_bytes(folder: Path) -> int | None:
    try:
        found = find_weight_files(folder)
    except ValueError:
        return None
    files = found[1] if found else sharded_weight_files(folder)  # a sharded snapshot: its rank files
    # A size shown, never a file read: regular files only, links not followed (a link may lead
    # outside the run, or to itself), a file that vanished meanwhile not counted.
    sizes = []
    for f in files or []:
        try:
            info = os.lstat(f)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            sizes.append(info.st_size)
    return sum(sizes) if sizes else None


def snapshot_rows(run: str | os.PathLike[str], include_final: bool = False) -> list[dict[str, Any]]:
    """One row per snapshot of a run (a PMA manifest, else Trainer ``checkpoint-*`` folders, as
    :func:`hf_pma.merging.sources.resolve_sources` reads a run folder), oldest first: name,
    tokens, step, lr, phase, loss, size in bytes, and whether it is excluded from merges (with
    the reason); with ``include_final``, the final model at the run's top last."""
    run = Path(run)
    if not run.exists():
        raise FileNotFoundError(f"run folder {run} does not exist")
    manifest = run_layout(run).manifest if run.is_dir() else None
    if manifest is None:
        return [_source_row(s) for s in resolve_sources([run], include_final=include_final)]
    rows = []
    for record in manifest_snapshots(manifest.parent):
        folder = manifest.parent / record.path
        rows.append(
            {
                "name": Path(record.path).name,
                "tokens": record.tokens,
                "step": record.step,
                "lr": record.lr,
                "phase": record.phase,
                "loss": record.loss,
                "bytes": _folder_bytes(folder) if folder.is_dir() else None,
                "excluded": is_excluded(record),
                "excluded_reason": record.extra.get("excluded_reason"),
                "missing": not folder.is_dir(),
            }
        )
    if not rows:
        raise ValueError(f"the manifest {manifest} lists no snapshots yet")
    if include_final:
        rows.append(_source_row(resolve_sources([run], include_final=True)[-1]))
    return rows


def _source_row(s: CheckpointSource) -> dict[str, Any]:
    return {
        "name": s.name,
        "tokens": s.tokens,
        "step": s.step,
        "lr": s.record.get("lr"),
        "phase": s.record.get("phase"),
        "loss": s.record.get("loss"),
        "bytes": s.num_bytes(),
        "excluded": False,
        "excluded_reason": None,
        "missing": False,
    }


def snapshot_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of :func:`snapshot_rows`."""
    body = []
    for r in rows:
        note = "excluded" + (f" ({r['excluded_reason']})" if r.get("excluded_reason") else "") if r["excluded"] else ""
        if r.get("missing"):
            note = "missing folder"
        body.append(
            [r["name"], format_number(r["tokens"], ","), format_number(r["step"], ","), format_number(r["lr"], ".3g"),
             format_number(r["phase"]), format_number(r["loss"]), format_bytes(r["bytes"]), note]
        )
    return text_table(["snapshot", "tokens", "step", "lr", "phase", "loss", "size", "note"], body, align="lrrrlrrl")


def diagnostics_table(names: Sequence[str], diag: WindowDiagnostics) -> str:
    """The window's per-snapshot numbers and its cosine matrix, as plain text.

    With equal weights (SMA) the merge is the window mean, so each snapshot's distance to the
    merge equals its deviation from the mean: one column shows both.
    """
    n = len(diag.indices)
    uniform = max(diag.weights) - min(diag.weights) <= 1e-12
    distance_header = ["dist to merge (= |dev from mean|)"] if uniform else ["|dev from mean|", "dist to merge"]
    header = ["snapshot", "weight", *distance_header, *[f"cos[{j}]" for j in range(n)]]
    body = []
    for a, i in enumerate(diag.indices):
        distances = [f"{diag.distances_to_merge[a]:.4g}"]
        if not uniform:
            distances.insert(0, f"{diag.deviation_norms[a]:.4g}")
        body.append(
            [f"[{a}] {names[i]}", f"{diag.weights[a]:.3f}", *distances,
             *[format_number(diag.cosine[a][b], "+.2f") for b in range(n)]]
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
        shape = (f"the {n} snapshots oscillate around a common centre (straightness {s:.2f}, near {oscillation:.2f}): "
                 "averaging cancels their noise, the setting where a merge helps most")
    elif s < (walk + 1) / 2:
        shape = (f"the {n} snapshots wander like a random walk (straightness {s:.2f}, a random walk gives ~{walk:.2f}): "
                 "averaging smooths noise but also lags behind the newest weights")
    else:
        shape = (f"the {n} snapshots drift along a nearly straight path (straightness {s:.2f}): the merge mostly lags "
                 "behind the newest weights; a shorter window (or decay-emulating weights) may do better")
    text = f"Reading: {shape}; the merge moves the model by {diag.merge_shift:.3g}"
    if diag.spread > 0:
        text += f" ({diag.merge_shift / diag.spread:.1f}x the window's spread)"
    ref = diag.reference
    if ref is not None:
        closer = ref["merge_to_reference"] < ref["newest_to_reference"]
        text += (f", and lands {'closer to' if closer else 'farther from'} the reference than the newest snapshot "
                 f"({ref['merge_to_reference']:.3g} vs {ref['newest_to_reference']:.3g})")
    return text + "."


# ---------------------------------------------------------------- figure


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
    ax.set_title(f"cosine of deviations from the window mean\n(mean off-diag {diag.mean_cosine:+.2f}; noise: {-1 / max(1, n - 1):+.2f})", fontsize=9)
    if n <= 12:
        for a in range(n):
            for b in range(n):
                value = diag.cosine[a][b]
                if not math.isnan(value):
                    ax.text(b, a, f"{value:+.2f}", ha="center", va="center", fontsize=6,
                            color="white" if abs(value) > 0.6 else "black")
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
            ax.plot(xs, [d.reference["merge_to_reference"] for d in series], "^-", color="C3", markersize=3,
                    label="|merge - reference|")
            ax.plot(xs, [d.reference["newest_to_reference"] for d in series], "v--", color="C1", markersize=3,
                    label="|newest - reference|")
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


def strategy_weights(strategy: str, alpha: float = 0.2) -> Callable[[int], list[float]]:
    """``n -> weights`` for a strategy name (a thin wrapper over :func:`hf_pma.core.strategies.merge_coefficients`)."""
    merge_coefficients(2, strategy, alpha)  # fails now for a bad name or alpha
    return lambda n: merge_coefficients(n, strategy if n > 1 else "sma", alpha)
