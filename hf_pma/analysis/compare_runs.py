"""Compare runs at matched tokens: does the merge rank runs as annealing would?

For a learning-rate sweep or a scaling ladder, every run is evaluated at the same token count
``T`` (the largest at which every run has a snapshot, or one chosen) on the same held-out text:

* **last**: the run's snapshot at ``T`` (its constant-LR weights);
* **merge**: the merge of its snapshots up to ``T`` (the run's own window, from its records, or
  one given), built in memory and swapped into the loaded model, as ``hf-pma sweep`` does
  (:class:`hf_pma.analysis.sweep.SweepEvaluator`: nothing is written);
* **annealed**: the run's annealed fork (``RUN/annealed/``) when it ends at ``T``.

The report ranks the runs by each (tied values share a rank), gives the rank agreement of merge
and of last with annealed (Kendall's tau-b with its caveat over few runs and a bootstrap
interval over the held-out documents: :mod:`hf_pma.analysis.rank_stats`) and their mean absolute
error against the annealed value, all within the groups of runs that share recorded settings
(``group``: :mod:`hf_pma.analysis.run_settings`) and across all runs; optionally fits
``L(x) = E + A * x**(-alpha)`` across runs (:func:`scipy.optimize.curve_fit`; fewer parameters
with few distinct x, flagged on a bound) for each kind of model, and explains every merge that is
worse than its last snapshot (with the window a small sweep picks instead).

:func:`plan_comparison` reads the runs and checks everything that can be checked (one line per
problem, before any model is loaded); :func:`compare_runs` evaluates; :func:`compare_table`,
:func:`plot_fit` present. The pure parts (:func:`matched_tokens`, :func:`rank_runs`,
:func:`kendall_tau`, :func:`mean_absolute_error`, :func:`fit_power_law`) need no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import math
import os
import statistics
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_pma.analysis.comparison import per_text, read_anneal_record
from hf_pma.analysis.rank_stats import (
    BOOTSTRAP_RESAMPLES,
    bootstrap_kendall_tau,
    kendall_tau,
    rank_tiers,
    shared_ranks,
)
from hf_pma.analysis.run_settings import group_runs, parse_group_keys, recorded_settings
from hf_pma.core.manifest import ANNEALED_DIR
from hf_pma.core.selection import DEFAULT_WINDOW, check_window, window_by_progress
from hf_pma.core.strategies import AUTO_STRATEGY, merge_coefficients, resolve_strategy
from hf_pma.core.window_check import (
    MIN_SELECTION_DOCUMENTS,
    WIDEST_SHARE,
    DocumentSplit,
    candidate_windows,
    checked_choice,
    describe_split,
    split_for_selection,
)
from hf_pma.core.window_choice import WindowChoice, check_window_count, is_auto, merge_strategy, widest_window
from hf_pma.io.guarded import JSON_LIMITS, check_folder, read_bytes
from hf_pma.merging.sources import (
    CheckpointSource,
    check_same_model,
    model_source,
    resolve_sources,
    run_layout,
    tokenizer_folder,
)
from hf_pma.merging.windows import apply_window, run_point
from hf_pma.utils.formatting import format_number, markdown_table
from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import is_number, parameter_error
from hf_pma.utils.text import escape, plot_text, shown

logger = get_logger(__name__)

__all__ = [
    "DEFAULT_WINDOW",
    "FIT_AXES",
    "KINDS",
    "RunPlan",
    "matched_tokens",
    "rank_runs",
    "kendall_tau",
    "mean_absolute_error",
    "fit_power_law",
    "parse_x_values",
    "plan_comparison",
    "compare_runs",
    "compare_table",
    "plot_fit",
]

# What --fit may put on the x axis.
FIT_AXES = ("params", "tokens", "compute")
# The models compared per run, in table order, and their labels in the paired comparison record
# (hf_pma.analysis.comparison.paired_comparison).
KINDS = ("last", "merge", "annealed")
LAST_LABEL, MERGE_LABEL, ANNEALED_LABEL = "last snapshot", "PMA merge", "annealed"
# The files that say which vocabulary a tokenizer has (two runs with the same ones tokenize alike).
_VOCABULARY_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


# ---------------------------------------------------------------- pure parts


def matched_tokens(token_counts: Mapping[str, Sequence[int]], at_tokens: int | None = None) -> int:
    """The token count every run has a snapshot at: ``at_tokens`` when given (``ValueError``
    naming the runs without one there, with their nearest), else the largest common one
    (``ValueError`` showing each run's range when there is none)."""
    if at_tokens is not None:
        lacking = [name for name, counts in token_counts.items() if at_tokens not in counts]
        if lacking:
            near = "; ".join(
                f"{escape(name)}: nearest {min(token_counts[name], key=lambda t: abs(t - at_tokens)):,}"
                for name in lacking[:5]
            )
            raise parameter_error("at_tokens", f"{at_tokens:,}: no snapshot at that token count in {near}")
        return at_tokens
    common = set.intersection(*(set(c) for c in token_counts.values())) if token_counts else set()
    if not common:
        ranges = "; ".join(
            f"{escape(name)}: {len(c)} from {min(c):,} to {max(c):,}"
            for name, c in list(token_counts.items())[:5]
        )
        raise ValueError(
            f"no token count at which every run has a snapshot ({ranges}): snapshots must be taken at the same "
            "token counts (same pma_interval_tokens and tokens per step), or give at_tokens (--at-tokens)"
        )
    return max(common)


def rank_runs(values: Mapping[str, float | None], higher_is_better: bool = False) -> list[str]:
    """The runs from best to worst by ``values`` (runs without a finite value left out)."""
    scored = [(v, name) for name, v in values.items() if v is not None and math.isfinite(v)]
    return [name for v, name in sorted(scored, key=lambda p: -p[0] if higher_is_better else p[0])]


def mean_absolute_error(predicted: Sequence[float], target: Sequence[float]) -> float | None:
    """``mean(|predicted - target|)``; ``None`` for no pairs."""
    if len(predicted) != len(target):
        raise ValueError(f"mean_absolute_error needs paired values, got {len(predicted)} and {len(target)}")
    return statistics.fmean(abs(p - t) for p, t in zip(predicted, target)) if predicted else None


def _fit_flags(searched: Mapping[str, float], bounds: Mapping[str, tuple[float, float]], r_squared: float) -> list[str]:
    """A parameter on a bound of the search (the least-squares optimum lies beyond what was
    searched, so the law does not describe the points), or a curve that explains less than half
    the spread of the points (one line each)."""
    flags = []
    if r_squared < 0.5:
        flags.append(f"the law explains only {max(r_squared, 0.0):.0%} of the spread of the points")
    for name, value in searched.items():
        low, high = bounds[name]
        for bound, side in ((low, "lower"), (high, "upper")):
            if math.isfinite(bound) and abs(value - bound) <= 1e-6 * max(1.0, abs(bound)):
                flags.append(f"{name} sits on its {side} bound {format_number(bound, '.4g')}: the law does not fit the points")
    return flags


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Fit ``y = E + A * x**(-alpha)`` by least squares (:func:`scipy.optimize.curve_fit`, ``A >= 0``,
    ``0 < alpha <= 4``, ``E <= min(y)``, and ``E >= 0`` when every y is positive: a loss).

    A fit needs more distinct x values than it has parameters (with as many, the curve passes
    through every point by construction and tests nothing): from 4 distinct x, ``E``, ``A`` and
    ``alpha``; with 3, the pure power law ``A * x**(-alpha)`` (``E`` fixed at 0, ``"fixed":
    ["E"]``); with fewer, none. Returns ``{"E", "A", "alpha", "points", "distinct_x",
    "parameters", "fixed", "degrees_of_freedom", "rmse", "r_squared", "flags"}``: ``flags`` has
    one line per parameter sitting on a bound of the search, and one when the curve explains less
    than half the spread of the points (``r_squared < 0.5``). ``{"error": one line, "points"}`` when the points do not allow a fit (too few
    distinct x, not finite, or no convergence)."""
    import numpy as np

    points = len(x)
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xs) != len(ys):
        raise ValueError(f"fit_power_law needs paired values, got {len(xs)} and {len(ys)}")
    if not (np.isfinite(xs).all() and np.isfinite(ys).all()) or (xs <= 0).any():
        return {"error": "the values are not all finite, or an x is not positive", "points": points}
    distinct = len(set(xs.tolist()))
    if distinct < 3:
        return {
            "error": f"a fit needs more distinct x values than parameters (A and alpha: 3 distinct x values), got {distinct}",
            "points": points,
        }
    from scipy.optimize import OptimizeWarning, curve_fit

    free_e = distinct >= 4
    x0 = float(xs.min())
    u = xs / x0  # conditioned: A is fitted at x0, then rescaled

    def law(u: Any, e: float, a: float, alpha: float) -> Any:
        return e + a * u ** (-alpha)

    span = float(ys.max() - ys.min()) or 1e-3
    e_max = float(ys.min())
    e_min = 0.0 if e_max > 0 else -np.inf  # a loss is never negative: no E below 0 for positive losses
    bounds = {"E": (e_min, e_max), "A": (0.0, np.inf), "alpha": (1e-6, 4.0)}
    guess_e = max(e_max - 0.5 * span, e_min if e_min > -np.inf else e_max - 0.5 * span)
    if free_e:
        model, guess = law, (guess_e, 1.5 * span, 0.5)
        low, high = [bounds[k][0] for k in ("E", "A", "alpha")], [bounds[k][1] for k in ("E", "A", "alpha")]
    else:  # E = 0: the pure power law, 2 parameters for 3 points
        model, guess = (lambda u, a, alpha: law(u, 0.0, a, alpha)), (float(ys.max()) or 1.0, 0.5)
        low, high = [bounds[k][0] for k in ("A", "alpha")], [bounds[k][1] for k in ("A", "alpha")]
        if not (ys > 0).all():
            return {"error": "3 distinct x fit only A * x^(-alpha), which needs positive values", "points": points}
    try:
        with warnings.catch_warnings():  # few points: no covariance, as expected
            warnings.simplefilter("ignore", OptimizeWarning)
            found, _ = curve_fit(model, u, ys, p0=guess, bounds=(low, high), maxfev=20000)
    except (RuntimeError, ValueError) as err:  # no convergence, or a degenerate problem
        return {"error": f"the fit did not converge: {str(err).splitlines()[0]}", "points": points}
    e, a_u, alpha = (float(v) for v in found) if free_e else (0.0, *(float(v) for v in found))
    a = a_u * x0**alpha
    rmse = float(np.sqrt(np.mean((law(u, e, a_u, alpha) - ys) ** 2)))
    spread = float(np.mean((ys - ys.mean()) ** 2))
    r_squared = 1.0 - rmse**2 / spread if spread > 0 else 1.0
    fitted = {"E": e, "A": a, "alpha": alpha} if free_e else {"A": a, "alpha": alpha}
    return {
        "E": e,
        "A": a,
        "alpha": alpha,
        "points": points,
        "distinct_x": distinct,
        "parameters": len(fitted),
        "fixed": [] if free_e else ["E"],
        "rmse": rmse,
        "r_squared": r_squared,
        "degrees_of_freedom": distinct - len(fitted),
        "flags": _fit_flags({**fitted, "A": a_u}, bounds, r_squared),
    }


def parse_x_values(text: str) -> dict[str, float]:
    """``"run1=1e6,run2=3e6"`` -> ``{"run1": 1e6, "run2": 3e6}`` (``ValueError`` naming a bad item)."""
    out: dict[str, float] = {}
    for item in (t.strip() for t in str(text).split(",")):
        if not item:
            continue
        name, sep, value = item.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or not name or not math.isfinite(number) or number <= 0:
            raise parameter_error("x_values", f"{shown(item)}: expected RUN=VALUE with a positive number, e.g. run1=1e6")
        out[name] = number
    if not out:
        raise parameter_error("x_values", "holds no RUN=VALUE item")
    return out


# ---------------------------------------------------------------- planning (reads records, no weights)


@dataclasses.dataclass
class RunPlan:
    """One run of a comparison, as planned: its snapshots up to the matched tokens, the merge's
    snapshots and weights, its annealed model (if one ends there) and its x values."""

    name: str
    path: Path
    sources: list[CheckpointSource]
    merge_indices: list[int]
    merge_weights: list[float]
    window_origin: str
    annealed: CheckpointSource | None = None
    annealed_note: str | None = None
    params: int | None = None
    x: float | None = None
    group: dict[str, Any] | None = None  # with ``group``: {"label": "seed=1", "values": {"seed": 1}}
    # The automatic window's choice (``None`` when the window was given or recorded).
    window_choice: WindowChoice | None = None

    @property
    def last(self) -> CheckpointSource:
        """The snapshot at the matched tokens."""
        return self.sources[-1]

    @property
    def merge_sources(self) -> list[CheckpointSource]:
        """The snapshots the merge takes, oldest first."""
        return [self.sources[i] for i in self.merge_indices]


def _run_names(runs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Each run's name: its folder's name, or the path as given where two names clash."""
    names = [Path(r).name or str(r) for r in runs]
    return [str(r) if names.count(n) > 1 else n for r, n in zip(runs, names)]


def _snapshots(run: Path, name: str) -> list[CheckpointSource]:
    if not run.is_dir():
        raise FileNotFoundError(f"run {escape(run)} is not a folder")
    layout = run_layout(run)
    if not layout.is_run:
        raise ValueError(
            f"run {escape(name)} holds no snapshots (no PMA manifest, no checkpoint-* folders; it holds "
            f"{layout.found()}): give run folders"
        )
    sources = resolve_sources([run])
    unknown = [s.name for s in sources if s.tokens is None]
    if unknown:
        raise ValueError(
            f"run {escape(name)}: {len(unknown)} snapshot(s) without a token count ({escape(', '.join(unknown[:3]))}): "
            "runs are matched by tokens (Trainer checkpoints record them with include_num_input_tokens_seen=True)"
        )
    return sources


def _vocabulary(folder: Path | None) -> str | None:
    """A fingerprint of the tokenizer in ``folder`` (its vocabulary files' bytes), ``None`` when none."""
    if folder is None:
        return None
    digest = hashlib.sha256()
    found = False
    for name in _VOCABULARY_FILES:
        path = folder / name
        if path.is_file() or path.is_symlink():
            digest.update(
                name.encode() + b"\0" + read_bytes(path, folder, max_bytes=JSON_LIMITS["config"]) + b"\0"
            )
            found = True
    return digest.hexdigest() if found else None


def _anneal_tokens(folder: Path, source: CheckpointSource) -> int | None:
    """Where the annealed fork ends: its record (``pma_anneal.json``: ``end_tokens``), else its snapshot record or trainer state (as the sources read them), else ``None``."""
    record = read_anneal_record(folder)
    if record is not None and record.get("end_tokens") is not None:  # ("tokens" is the decay's length)
        return record["end_tokens"]
    return source.tokens


def _plan_annealed(
    run: Path, name: str, last: CheckpointSource, at_tokens: int, is_end: bool
) -> tuple[CheckpointSource | None, str | None]:
    folder = run / ANNEALED_DIR
    if not (folder.is_dir() or folder.is_symlink()):
        return None, None
    check_folder(folder, run)  # a link out of the run: another folder's model and record
    source = model_source(folder)
    check_same_model([source, last])  # another architecture: one line now, not a failed load later
    tokens = _anneal_tokens(folder, source)
    if tokens == at_tokens:
        return source, None
    if tokens is None:
        if is_end:
            return (
                source,
                f"{ANNEALED_DIR}/ records no tokens: taken to end at the run's last snapshot ({at_tokens:,})",
            )
        return (
            None,
            f"{ANNEALED_DIR}/ records no tokens, and {at_tokens:,} is not the run's last snapshot: left out",
        )
    return None, f"{ANNEALED_DIR}/ ends at {tokens:,} tokens, not at {at_tokens:,}: left out"


def _window_weights(count: int, strategy: str, alpha: float, choice: WindowChoice | None = None) -> list[float]:
    """The merge weights of the newest ``count`` snapshots (one snapshot: weight 1, whatever the
    strategy; ``"auto"``: those the automatic window ``choice`` chose with it)."""
    return list(merge_coefficients(count, resolve_strategy(strategy, choice, count), alpha))


def _plan_window(
    sources: list[CheckpointSource],
    strategy: str,
    alpha: float,
    last: int | str | None,
    window_tokens: int | None,
    recorded: tuple[int | str | None, int | None, str | None] | None,
    name: str,
) -> tuple[list[int], list[float], str, WindowChoice | None]:
    count, tokens, where = recorded or (None, None, None)
    if is_auto(last) or (last is None and window_tokens is None and not tokens and (count is None or is_auto(count))):
        chosen, choice = apply_window(sources, last="auto")
        assert choice is not None  # a plan has sources
        choice = merge_strategy(strategy, choice, len(chosen))[1]
        indices = list(range(len(sources) - len(chosen), len(sources)))
        weights = _window_weights(len(indices), strategy, alpha, choice)
        how = "--last auto" if is_auto(last) else ("the run's own" if count else "the default")
        return indices, weights, f"{escape(choice.describe())} ({how})", choice
    if last is not None:
        if last > len(sources):
            raise parameter_error(
                "last", f"{last}: run {escape(name)} has only {len(sources)} snapshot(s) up to {sources[-1].tokens:,} tokens"
            )
        indices, origin = list(range(len(sources) - last, len(sources))), f"last={last} (--last)"
    elif window_tokens is not None or tokens:
        span = window_tokens or tokens
        indices = window_by_progress([s.tokens for s in sources], span, "tokens")
        origin = (
            f"window_tokens={span:,} (--window-tokens)"
            if window_tokens
            else f"the run's own last {span:,} tokens, {escape(where)}"
        )
    else:
        n = count or DEFAULT_WINDOW
        origin = (
            f"the run's own N={n}, {escape(where)}"
            if count
            else f"the default N={n}: the run records no window"
        )
        if n > len(sources):
            origin += f"; only {len(sources)} snapshot(s) up to {sources[-1].tokens:,} tokens"
        indices = list(range(max(0, len(sources) - n), len(sources)))
    return indices, _window_weights(len(indices), strategy, alpha), origin, None


def _parameter_count(source: CheckpointSource) -> int:
    """Parameters stored in a snapshot: the elements of its weight files' tensors (from their
    headers; a tied embedding counted once)."""
    tensors = source.open_raw()
    try:
        return sum(info.numel for info in tensors.infos.values())
    finally:
        tensors.close()


def plan_comparison(
    runs: Sequence[str | os.PathLike[str]],
    *,
    at_tokens: int | None = None,
    last: int | str | None = None,
    window_tokens: int | None = None,
    strategy: str = AUTO_STRATEGY,
    alpha: float = 0.2,
    recorded_windows: Sequence[tuple[int | None, int | None, str | None]] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    fit: str | None = None,
    x_values: Mapping[str, float] | None = None,
    group: str | Sequence[str] | None = None,
) -> tuple[int, list[RunPlan]]:
    """Read the runs and plan the comparison: ``(matched tokens, one plan per run)``.

    ``last`` / ``window_tokens`` choose every run's merge; else each run's own window
    (``recorded_windows``: per run ``(N, T, where)``, as ``hf-pma inspect`` reads it from the
    run's records), else N = :data:`DEFAULT_WINDOW`. ``fit`` (one of :data:`FIT_AXES`) sets each
    plan's ``x`` (``x_values``, by run name or path, override it). ``group`` (``"seed"``, or
    ``"seed,max_steps"``): runs are ranked within the groups of equal recorded values of these
    keys (:mod:`hf_pma.analysis.run_settings`), set as each plan's ``group``. Every problem is one-line
    ``ValueError`` / ``FileNotFoundError`` raised here, before any model is loaded: fewer than
    two runs, a run given twice or without snapshots, no common tokens, different tokenizers,
    an annealed model of another architecture, a fit without 3 distinct x values, a run that
    records no value of a ``group`` key.
    """
    if len(runs) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(runs)}: for one run use hf-pma sweep")
    resolved = [Path(r).resolve() for r in runs]
    twice = next((r for i, r in enumerate(runs) if resolved[i] in resolved[:i]), None)
    if twice is not None:
        raise ValueError(f"run {escape(twice)} is given twice")
    merge_coefficients(2, strategy, alpha)  # a bad strategy or alpha: one line now
    try:
        import scipy  # noqa: F401  (Kendall's tau, the fit)
    except ImportError:
        raise ValueError("hf-pma compare needs scipy: pip install 'hf-pma[eval]'") from None
    last = check_window_count(last, "last", allow_none=True)
    check_window(window_tokens=window_tokens, last=None if is_auto(last) else last)
    group_keys = parse_group_keys(group)
    if fit is not None and fit not in FIT_AXES:
        raise parameter_error("fit", f"{shown(fit)}: choose one of {', '.join(FIT_AXES)}")
    names = _run_names(runs)
    snapshots = {name: _snapshots(Path(run), name) for name, run in zip(names, runs)}
    tokens = matched_tokens({n: [s.tokens for s in ss] for n, ss in snapshots.items()}, at_tokens)

    fingerprints: dict[str, str | None] = {}
    plans = []
    for i, (name, run) in enumerate(zip(names, runs)):
        sources = [s for s in snapshots[name] if s.tokens <= tokens]
        is_end = sources[-1] is snapshots[name][-1]
        if tokenizer is None:
            fingerprints[name] = _vocabulary(tokenizer_folder(sources))
        indices, weights, origin, choice = _plan_window(
            sources,
            strategy,
            alpha,
            last,
            window_tokens,
            recorded_windows[i] if recorded_windows else None,
            name,
        )
        check_same_model([sources[i] for i in indices])
        annealed, note = _plan_annealed(Path(run), name, sources[-1], tokens, is_end)
        plans.append(RunPlan(name, Path(run), sources, indices, weights, origin, annealed, note, window_choice=choice))
    if tokenizer is None:
        missing = [n for n, f in fingerprints.items() if f is None]
        if missing:
            raise ValueError(
                f"run {escape(missing[0])} holds no tokenizer (in its snapshot or run folder): give one (tokenizer=, --tokenizer)"
            )
        groups: dict[str, list[str]] = {}
        for n, f in fingerprints.items():
            groups.setdefault(f, []).append(n)
        if len(groups) > 1:
            first, second = (g[0] for g in list(groups.values())[:2])
            raise ValueError(
                f"runs {escape(first)} and {escape(second)} have different tokenizers: their losses are not comparable "
                "(compare runs of one tokenizer; bits per byte would be, but the ranking uses the loss)"
            )
    if group_keys:
        settings = {plan.name: recorded_settings(plan.path, plan.last) for plan in plans}
        for found in group_runs(settings, group_keys):
            for plan in plans:
                if plan.name in found["runs"]:
                    plan.group = {"label": found["label"], "values": found["values"]}
    if fit is not None:
        x_values = dict(x_values or {})
        for plan, run in zip(plans, runs):
            plan.params = _parameter_count(plan.last)
            given = x_values.pop(plan.name, x_values.pop(str(run), None))
            plan.x = (
                given
                if given is not None
                else {
                    "params": float(plan.params),
                    "tokens": float(tokens),
                    "compute": 6.0 * plan.params * tokens,
                }[fit]
            )
        if x_values:
            raise parameter_error(
                "x_values", f"names {escape(', '.join(x_values))}, which is not one of the runs ({escape(', '.join(names))})"
            )
        distinct = len({p.x for p in plans})
        if distinct < 3:
            hint = (
                " (at matched tokens every run has the same tokens: fit params or compute, or give x_values, --x)"
                if fit == "tokens"
                else ""
            )
            raise parameter_error("fit", f"{fit} needs at least 3 runs with distinct x values, got {distinct}{hint}")
    return tokens, plans


# ---------------------------------------------------------------- evaluation


def _metric_value(results: Mapping[str, Mapping[str, Any]], metric: str) -> float | None:
    from hf_pma.analysis.sweep import _metric_value as value_of  # one reader of a metric from flat results

    return value_of(results, metric)


def _span(sources: Sequence[CheckpointSource]) -> int:
    """Tokens a merge reaches back over: from its oldest snapshot to its newest, the span the
    automatic window's share is of (one share per window, wherever it is said)."""
    return sources[-1].tokens - sources[0].tokens if len(sources) > 1 else 0


def _why_worse(plan: RunPlan, at_tokens: int) -> str:
    """Why a merge may lose to its last snapshot: how far back it reaches, and the training loss then."""
    merged = plan.merge_sources
    span = _span(merged)
    share = span / at_tokens if at_tokens else 0.0
    text = (
        f"the merge of the last {len(merged)} snapshots ({plan.window_origin}) reaches back {span:,} tokens, "
        f"{share:.0%} of the {at_tokens:,} tokens at which the runs are matched"
    )
    first, newest = merged[0].record.get("loss"), merged[-1].record.get("loss")
    if is_number(first) and is_number(newest) and first > newest:
        text += (
            f"; the training loss was {first:.3f} at its oldest snapshot ({merged[0].tokens:,} tokens) and "
            f"{newest:.3f} at its newest: it averages in weights from before the loss had settled"
        )
    elif share >= 0.25:
        text += ": it averages in weights from early in training, before the loss had settled"
    return text


def _smaller_windows(n: int) -> list[int]:
    """The windows a small sweep tries below N: N/2, N/4, ... down to 2."""
    out, w = [], n // 2
    while w >= 2:
        out.append(w)
        w //= 2
    return sorted(set(out))


def _evaluate(
    evaluator: Any, sources: Sequence[CheckpointSource], weights: Sequence[float]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One model (a merge of ``sources``, or one source with weight 1) evaluated in the
    evaluator's live model: its flat results, and its held-out LM details (with ``per_text``;
    ``None`` without texts)."""
    results = evaluator.evaluate_merge(list(sources), weights=list(weights))
    return results, (evaluator.last_output or {}).get("lm")


def _needs_check(plan: RunPlan) -> bool:
    """Whether the plan's window is an automatic one of more than one snapshot (what the held-out check checks)."""
    return plan.window_choice is not None and plan.window_choice.count > 1


def _check_window(
    plan: RunPlan, evaluator: Any, texts: Sequence[str], strategy: str, alpha: float
) -> None:
    """The held-out check of the plan's automatic window (:mod:`hf_pma.core.window_check`): every
    candidate evaluated on the selection ``texts``, the plan's merge and choice set to the one taken."""
    choice = plan.window_choice
    assert choice is not None
    n = len(plan.sources)
    widest = widest_window([run_point(s) for s in plan.sources], WIDEST_SHARE)
    weights = {k: _window_weights(k, strategy, alpha, choice) for k in candidate_windows(choice.count, widest)}
    losses = {k: evaluator.held_out_losses(plan.sources[n - k :], w, texts) for k, w in weights.items()}
    try:
        checked = checked_choice(choice, losses, [s.tokens for s in plan.sources])
    except ValueError as err:  # e.g. no selection document with a scored token: the rule's window stands
        logger.warning(f"{escape(plan.name)}: the automatic window stands unchecked: {err}")
        return
    described = escape(choice.describe())
    how = plan.window_origin[len(described) :] if plan.window_origin.startswith(described) else ""
    if checked.count != choice.count:  # what chose it is the check now, not the run's records
        how = " (compare's held-out check)"
    plan.window_choice = checked
    plan.window_origin = escape(checked.describe()) + how
    if checked.count != choice.count:
        plan.merge_indices = list(range(n - checked.count, n))
        plan.merge_weights = weights[checked.count]
        logger.info(f"{plan.name}: {checked.describe()}")


def _selection_split(plans: Sequence[RunPlan], texts: Sequence[str] | None, window_check: bool) -> DocumentSplit | None:
    """The held-out documents' split into selection and report, when some plan's automatic window is to be checked
    (none, said so, when fewer than :data:`MIN_SELECTION_DOCUMENTS` selection documents hold text, or no
    report document does: an empty one has no loss)."""
    if not texts or not window_check or not any(_needs_check(p) for p in plans):
        return None
    split = split_for_selection(len(texts))
    if split.skipped:
        return split
    with_text = sum(1 for i in split.selection if texts[i].strip())
    if not any(texts[i].strip() for i in split.report):
        skipped = "every report document (all but every 4th) is empty"
    elif with_text >= MIN_SELECTION_DOCUMENTS:
        return split
    else:
        skipped = (
            f"only {with_text} of the {len(split.selection)} selection documents (every 4th) with text; "
            f"a check needs at least {MIN_SELECTION_DOCUMENTS}"
            if with_text
            else "every selection document (every 4th) is empty"
        )
    return DocumentSplit((), tuple(range(len(texts))), skipped)


def compare_runs(
    at_tokens: int,
    plans: Sequence[RunPlan],
    texts: Sequence[str] | None = None,
    options: Any = None,
    *,
    strategy: str = AUTO_STRATEGY,
    alpha: float = 0.2,
    metric: str | None = None,
    higher_is_better: bool | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    device: Any = None,
    fit: str | None = None,
    eval_dataset: str | None = None,
    progress: bool = False,
    bootstrap: int = BOOTSTRAP_RESAMPLES,
    bootstrap_seed: int = 0,
    window_check: bool = True,
    **option_fields: Any,
) -> dict[str, Any]:
    """Evaluate every planned run's last snapshot, merge and annealed model on the same texts
    and tasks (``options``, or its fields as keywords, as for
    :func:`hf_pma.evaluation.evaluator.evaluate_model`), one run's model in memory at a time.

    ``metric`` (``task/name``; default ``lm/loss`` with texts, else the first task's accuracy)
    ranks the runs. A merge worse than its last snapshot is explained, and its smaller windows
    (N/2, N/4, ... 2) are evaluated too: the best of them, or the last snapshot, is the window
    ``hf-pma sweep`` would pick among those. Runs are ranked, and their rankings compared with
    annealed, within each group of the plans (all together without groups); with held-out text
    and ``lm/loss``, tau gets a percentile interval from ``bootstrap`` resamples of the documents
    (seeded by ``bootstrap_seed``; 0: none, :func:`hf_pma.analysis.rank_stats.bootstrap_kendall_tau`).
    With ``window_check`` (the default), held-out texts and some run's automatic window of more
    than one snapshot, every 4th document is a *selection* document on which each such window and
    its smaller candidates are checked (:mod:`hf_pma.core.window_check`); every result is then
    reported on the other documents only (the report's ``window_check`` says how many).
    Returns the JSON-ready report (see :func:`compare_table`). Under several processes the
    evaluations run on the main process.
    """
    from hf_pma.analysis.comparison import paired_comparison
    from hf_pma.analysis.sweep import SweepEvaluator, _default_metric, lower_is_better, parse_metric
    from hf_pma.evaluation.corpus import check_texts
    from hf_pma.evaluation.options import EvalOptions

    options = EvalOptions.build(options, **option_fields)
    for name, value in (("bootstrap", bootstrap), ("bootstrap_seed", bootstrap_seed)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise parameter_error(name, f"must be a non-negative integer, got {shown(value)}")
    if metric is not None:
        parse_metric(metric)
    check_texts(texts or ())  # one line now, before the split reads them or a model loads
    split = _selection_split(plans, texts, window_check)
    selection: list[str] = []
    if split is not None and not split.skipped:
        assert texts is not None
        selection = [texts[i] for i in split.selection]
        texts = [texts[i] for i in split.report]
    if split is not None:
        logger.info(split.describe())
    entries: list[dict[str, Any]] = []
    tasks = None
    for plan in plans:
        evaluator = SweepEvaluator(
            plan.last.path.absolute(), texts, options, tokenizer=tokenizer, device=device, progress=progress
        )
        tasks = evaluator.tasks
        if selection and _needs_check(plan):
            _check_window(plan, evaluator, selection, strategy, alpha)

        evaluate = functools.partial(_evaluate, evaluator)
        logger.info(
            f"{plan.name}: evaluating the last snapshot, the merge and the annealed model at {at_tokens:,} tokens"
        )
        last_results, last_lm = evaluate([plan.last], [1.0])
        metric = metric or _default_metric(last_results)
        higher = (not lower_is_better(metric)) if higher_is_better is None else bool(higher_is_better)
        merge_results, merge_lm = evaluate(plan.merge_sources, plan.merge_weights)
        entry: dict[str, Any] = {
            "name": plan.name,
            "path": str(plan.path),
            "params": plan.params,
            "x": plan.x,
            "group": plan.group,
            "last": {
                "snapshot": plan.last.name,
                "tokens": plan.last.tokens,
                "results": last_results,
                "value": _metric_value(last_results, metric),
            },
            "merge": {
                "snapshots": [s.name for s in plan.merge_sources],
                "tokens": [s.tokens for s in plan.merge_sources],
                "weights": plan.merge_weights,
                "strategy": resolve_strategy(strategy, plan.window_choice, len(plan.merge_indices)),
                "window": len(plan.merge_indices),
                "window_origin": plan.window_origin,
                "window_choice": plan.window_choice.to_dict() if plan.window_choice else None,
                "span_tokens": _span(plan.merge_sources),
                "results": merge_results,
                "value": _metric_value(merge_results, metric),
                "paired": None,
            },
            "annealed": None,
            "annealed_note": plan.annealed_note,
            "merge_worse": None,
        }
        lm = {LAST_LABEL: last_lm, MERGE_LABEL: merge_lm}
        if plan.annealed is not None:
            results, lm[ANNEALED_LABEL] = evaluate([plan.annealed], [1.0])
            entry["annealed"] = {
                "path": str(plan.annealed.path),
                "results": results,
                "value": _metric_value(results, metric),
                "paired": None,
            }
        for kind, label in zip(KINDS, (LAST_LABEL, MERGE_LABEL, ANNEALED_LABEL)):
            if entry[kind] is not None:  # each document's NLL and tokens: what the bootstrap resamples
                entry[kind]["per_text"] = _document_nll(lm.get(label), label)
        entry["comparison"] = None
        if all(details is not None for details in lm.values()):  # held-out text: the paired comparison
            record = paired_comparison(lm, LAST_LABEL, MERGE_LABEL, ANNEALED_LABEL, tokens=at_tokens)
            entry["comparison"] = record
            for kind, label in (("merge", MERGE_LABEL), ("annealed", ANNEALED_LABEL)):
                row = record["models"].get(label)
                if row is not None and entry[kind] is not None:
                    entry[kind]["paired"] = {
                        "diff": row["loss_diff"],
                        "stderr": row["paired_stderr"],
                        "documents": record["documents"],
                    }
            entry["annealing_gain_recovered"] = record["annealing_gain_recovered"]
        m, b = entry["merge"]["value"], entry["last"]["value"]
        if m is not None and b is not None and (m < b if higher else m > b):
            entry["merge_worse"] = _sweep_pick(plan, evaluate, metric, higher, b, strategy, alpha, at_tokens)
        entries.append(entry)
        del evaluator, evaluate
        gc.collect()
    report = _report(at_tokens, entries, metric, higher, fit, eval_dataset, tasks, (bootstrap, bootstrap_seed))
    report["window_check"] = split.to_dict() if split is not None else None
    return report


def _sweep_pick(
    plan: RunPlan,
    evaluate: Any,
    metric: str,
    higher: bool,
    last_value: float | None,
    strategy: str,
    alpha: float,
    at_tokens: int,
) -> dict[str, Any]:
    """For a merge worse than its last snapshot: why, and the best of its smaller windows (N/2,
    N/4, ... 2, planned by :func:`hf_pma.analysis.sweep.plan_sweep`) or the last snapshot."""
    from hf_pma.analysis.sweep import BASELINE_LABEL, plan_sweep
    from hf_pma.utils.text import command_line

    n = len(plan.merge_indices)
    windows = _smaller_windows(n)
    strategy = merge_strategy(strategy, plan.window_choice, n)[0]  # the merge's own weights, named
    combos = (
        plan_sweep(len(plan.sources), windows=windows, every=[1], strategies=[strategy], alpha=alpha)[0]
        if windows
        else []
    )
    tried = []
    for combo in combos:
        results, _ = evaluate([plan.sources[i] for i in combo.indices], combo.weights)
        tried.append({"label": combo.label, "window": combo.window, "value": _metric_value(results, metric)})
    candidates = [{"label": BASELINE_LABEL, "window": 1, "value": last_value}, *tried]
    scored = [t for t in candidates if t["value"] is not None]
    pick = (max if higher else min)(scored, key=lambda t: t["value"]) if scored else None
    command = command_line(
        [
            "hf-pma",
            "sweep",
            plan.path,
            "--window",
            ",".join(map(str, [*windows, n])),
            "--every",
            "1,2",
            "--strategy",
            strategy,
            "--eval-file",
            "FILE",
            "-o",
            "sweep.json",
        ]
    )
    return {
        "explanation": _why_worse(plan, at_tokens),
        "smaller_windows": tried,
        "pick": pick,
        "sweep_command": command,
    }


def _document_nll(details: Mapping[str, Any] | None, label: str) -> dict[str, list[Any]] | None:
    """Each document's ``nll`` and ``tokens`` of one model's held-out LM details
    (:func:`hf_pma.analysis.comparison.per_text`), ``None`` without held-out text."""
    if details is None:
        return None
    nll, tokens = per_text(details, label)
    return {"nll": nll, "tokens": tokens}


def _tau_interval(
    with_annealed: Sequence[Mapping[str, Any]], kind: str, metric: str, bootstrap: tuple[int, int]
) -> dict[str, Any] | None:
    """The bootstrap interval of tau(kind, annealed) over these runs, or ``{"error": why}``."""
    resamples, seed = bootstrap
    if not resamples:
        return None
    if metric != "lm/loss":
        return {"error": f"the interval resamples held-out documents: it needs the metric lm/loss, not {metric}"}
    texts = [(e[kind].get("per_text"), e["annealed"].get("per_text")) for e in with_annealed]
    if any(a is None or b is None for a, b in texts):
        return {"error": "a run has no per-document losses"}
    try:
        return bootstrap_kendall_tau(
            [(a["nll"], a["tokens"]) for a, _ in texts],
            [(b["nll"], b["tokens"]) for _, b in texts],
            resamples=resamples,
            seed=seed,
        )
    except ValueError as err:  # not the same documents
        return {"error": str(err)}


def _rank_and_agree(
    entries: Sequence[Mapping[str, Any]], higher: bool, metric: str, bootstrap: tuple[int, int]
) -> dict[str, Any]:
    """The rankings of these runs by each kind (tied values share a rank) and the agreement of
    merge and last with annealed: tau-b with its caveat and bootstrap interval, and the MAE."""
    values = {kind: {e["name"]: (e[kind] or {}).get("value") for e in entries} for kind in KINDS}
    out: dict[str, Any] = {
        "runs": [e["name"] for e in entries],
        "rankings": {kind: rank_runs(v, higher) for kind, v in values.items()},
        "tiers": {kind: rank_tiers(v, higher) for kind, v in values.items()},
        "ranks": {kind: shared_ranks(v, higher) for kind, v in values.items()},
        "agreement": None,
    }
    with_annealed = [e for e in entries if e["annealed"] is not None and e["annealed"]["value"] is not None]
    if with_annealed:
        ann = [e["annealed"]["value"] for e in with_annealed]
        agreement: dict[str, Any] = {"runs": [e["name"] for e in with_annealed]}
        for kind in ("merge", "last"):
            pred = [e[kind]["value"] for e in with_annealed]
            if any(p is None for p in pred):
                agreement[kind] = None
                continue
            kendall = kendall_tau(pred, ann)
            kendall["interval"] = _tau_interval(with_annealed, kind, metric, bootstrap) if kendall["tau"] is not None else None
            agreement[kind] = {"kendall": kendall, "mae": mean_absolute_error(pred, ann)}
        out["agreement"] = agreement
    return out


def _report(at_tokens, entries, metric, higher, fit, eval_dataset, tasks, bootstrap) -> dict[str, Any]:  # noqa: ANN001
    values = {kind: {e["name"]: (e[kind] or {}).get("value") for e in entries} for kind in KINDS}
    everything = _rank_and_agree(entries, higher, metric, bootstrap)
    groups = None
    if any(e.get("group") for e in entries):
        labels = list(dict.fromkeys(e["group"]["label"] for e in entries))
        groups = []
        for label in labels:
            members = [e for e in entries if e["group"]["label"] == label]
            groups.append({"label": label, "values": members[0]["group"]["values"], **_rank_and_agree(members, higher, metric, bootstrap)})
    fits = None
    if fit is not None:
        fits = {"x": fit, "law": "L(x) = E + A * x^(-alpha)"}
        for kind in KINDS:
            pts = [
                (e["x"], values[kind][e["name"]])
                for e in entries
                if e["x"] is not None and values[kind][e["name"]] is not None
            ]
            fits[kind] = (
                fit_power_law([p[0] for p in pts], [p[1] for p in pts])
                if pts
                else {"error": "no values", "points": 0}
            )
    return {
        "at_tokens": at_tokens,
        "metric": metric,
        "higher_is_better": higher,
        "eval_dataset": eval_dataset,
        "tasks": tasks,
        "runs": entries,
        "rankings": everything["rankings"],
        "tiers": everything["tiers"],
        "ranks": everything["ranks"],
        "agreement": everything["agreement"],
        "groups": groups,
        "bootstrap": {"resamples": bootstrap[0], "seed": bootstrap[1]},
        "fit": fits,
    }


# ---------------------------------------------------------------- presentation


def _signed(value: float | None, stderr: float | None = None) -> str:
    if value is None:
        return "-"
    text = format_number(value, "+.4f")
    if stderr is not None:
        text += f" ± {format_number(stderr, '.4f')}"
    return text


def _tau(agreement: Mapping[str, Any] | None, kind: str) -> str:
    found = (agreement or {}).get(kind)
    if not found:
        return "-"
    kendall = found["kendall"]
    text = f"Kendall's tau {format_number(kendall['tau'], '+.2f')}"
    interval = kendall.get("interval") or {}
    if interval.get("low") is not None:
        share = f"{interval['confidence']:.0%}"
        text += (
            f" ({share} bootstrap interval {format_number(interval['low'], '+.2f')} to "
            f"{format_number(interval['high'], '+.2f')} over {interval['documents']} documents)"
        )
    return f"{text}, mean absolute error {format_number(found['mae'], '.4f')}"


def _ranking_lines(ranked: Mapping[str, Any], indent: str = "") -> list[str]:
    """``Ranking by last: a > b = c`` per kind (tied runs joined by ``=``), and the agreement with
    annealed with tau's caveat over few runs."""
    lines = []
    for kind in KINDS:
        tiers = ranked["tiers"][kind]
        if tiers:
            order = " > ".join(" = ".join(escape(n) for n in tier) for tier in tiers)
            lines.append(f"{indent}Ranking by {kind}: {order}")
    agreement = ranked.get("agreement")
    if agreement:
        runs = len(agreement["runs"])
        lines.append(
            f"{indent}Against annealed ({runs} runs): merge {_tau(agreement, 'merge')}; last {_tau(agreement, 'last')}"
        )
        found = next((agreement[k]["kendall"] for k in ("merge", "last") if agreement.get(k)), None)
        if found and found.get("caveat"):
            lines.append(f"{indent}  Caveat: {found['caveat']}.")
    else:
        lines.append(f"{indent}No run has an annealed model at these tokens: no rank agreement to report.")
    return lines


def _fit_line(kind: str, f: Mapping[str, Any]) -> str:
    if "error" in f:
        return f"  {kind}: no fit ({escape(f['error'])})"
    fitted = "A, alpha (E fixed at 0: 3 distinct x are too few for E, A and alpha)" if f.get("fixed") else "E, A, alpha"
    text = (
        f"  {kind}: E = {f['E']:.4f}, A = {f['A']:.4g}, alpha = {f['alpha']:.4f} "
        f"({f['points']} runs, {f.get('distinct_x', f['points'])} distinct x; fitted {fitted}; rmse {f['rmse']:.2g})"
    )
    for flag in f.get("flags") or []:
        text += f"\n    FLAG: {escape(flag)}"
    return text


def compare_table(report: Mapping[str, Any]) -> str:
    """The comparison as text: a markdown table (one row per run: last, merge, the merge's paired
    difference from last with its standard error, annealed, the share of the annealing gain the
    merge recovers, the rank by each: within its group with ``group``, tied values sharing a
    rank), then the rankings (ties joined by ``=``), the agreement with annealed (tau with its
    bootstrap interval and caveat), per group with ``group``, the fits with their flags, and one
    paragraph per merge worse than its last snapshot, and, when lm-eval tasks were evaluated, every
    metric of every model (:func:`all_metrics_table`). Every name is escaped."""
    metric = report["metric"]
    groups = report.get("groups") or []
    ranks = {kind: dict(report["ranks"][kind]) for kind in KINDS}
    for group in groups:  # the rank that means something: within the run's group
        for kind in KINDS:
            ranks[kind].update(group["ranks"][kind])
    header = [
        "run",
        f"last {metric}",
        "merge",
        "window",
        "merge - last (paired ± SE)",
        "annealed",
        "gain recovered",
        "rank last / merge / annealed" + (" (in group)" if groups else ""),
    ]
    rows = []
    for e in report["runs"]:
        paired = e["merge"].get("paired") or {}
        gain = e.get("annealing_gain_recovered")
        rows.append(
            [
                e["name"],
                format_number(e["last"]["value"]),
                format_number(e["merge"]["value"]) + (" (worse)" if e["merge_worse"] else ""),
                f"{e['merge']['strategy']} N={e['merge']['window']}",
                _signed(paired.get("diff"), paired.get("stderr")),
                format_number((e["annealed"] or {}).get("value")),
                "-" if gain is None else f"{gain:.0%}",
                " / ".join(str(ranks[k].get(e["name"], "-")) for k in KINDS),
            ]
        )
    lines = [markdown_table(header, rows, align="lrrlrrrr"), ""]
    direction = "higher" if report["higher_is_better"] else "lower"
    lines.append(f"At {report['at_tokens']:,} tokens; {metric}: {direction} is better; tied values share a rank.")
    check = report.get("window_check")
    if check:
        lines.append(escape(describe_split(check)))
    for e in report["runs"]:  # every automatic window, and why
        if e["merge"].get("window_choice"):
            lines.append(f"{escape(e['name'])}: {escape(e['merge']['window_origin'])}")
    for group in groups:
        lines.append(f"Group {escape(group['label'])} ({len(group['runs'])} runs):")
        lines += _ranking_lines(group, indent="  ")
    if groups:
        lines.append(f"All {len(report['runs'])} runs together, across groups:")
    lines += _ranking_lines(report, indent="  " if groups else "")
    for e in report["runs"]:
        if e.get("annealed_note"):
            lines.append(f"{escape(e['name'])}: {escape(e['annealed_note'])}")
    fits = report.get("fit")
    if fits:
        lines.append(f"Fit of {fits['law']} across runs, x = {fits['x']}:")
        lines += [_fit_line(kind, fits[kind]) for kind in KINDS]
    for e in report["runs"]:
        worse = e["merge_worse"]
        if not worse:
            continue
        pick = worse["pick"]
        text = (
            f"{escape(e['name'])}: the merge is worse than the last snapshot: {escape(worse['explanation'])}."
        )
        if pick is not None:
            text += (
                f" Of the smaller windows, {pick['label']} is best ({format_number(pick['value'])}); "
                f"to sweep the run: {escape(worse['sweep_command'])}"
            )
        lines.append(text)
    if report.get("tasks"):
        lines += ["", f"Every metric at {report['at_tokens']:,} tokens (held-out text and tasks):", ""]
        lines.append(all_metrics_table(report))
    return "\n".join(lines)


def all_metrics_table(report: Mapping[str, Any]) -> str:
    """Every metric (held-out text and lm-eval tasks) of each run's last snapshot, merge and
    annealed model, as a markdown table (one row per ``task/metric``, one column per model;
    names escaped)."""
    from hf_pma.evaluation.records import results_table

    results = {}
    for e in report["runs"]:
        for kind in KINDS:
            if e.get(kind) is not None and e[kind].get("results") is not None:
                results[f"{escape(e['name'])} {kind}"] = e[kind]["results"]
    return results_table(results)


def plot_fit(report: Mapping[str, Any], output_path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """The values of last, merge and annealed against x (log scale), with their fitted curves."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from hf_pma.utils.fs import atomic_write_file

    fits = report.get("fit") or {}
    fig = Figure(figsize=(6.4, 4.2), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs_all = [e["x"] for e in report["runs"] if e.get("x")]
    grid = np.geomspace(min(xs_all), max(xs_all), 100) if xs_all else None
    for kind, color, marker in zip(KINDS, ("tab:gray", "tab:blue", "tab:orange"), ("o", "s", "^")):
        pts = [(e["x"], (e[kind] or {}).get("value")) for e in report["runs"]]
        pts = [(x, y) for x, y in pts if x and y is not None]
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=kind, zorder=3)
        f = fits.get(kind) or {}
        if "error" not in f and f and grid is not None:
            ax.plot(
                grid,
                f["E"] + f["A"] * grid ** (-f["alpha"]),
                color=color,
                lw=1,
                label=f"{kind} fit: E={f['E']:.3f}, alpha={f['alpha']:.3f}",
            )
    for e in report["runs"]:
        if e.get("x") and e["last"]["value"] is not None:
            ax.annotate(
                plot_text(e["name"]),
                (e["x"], e["last"]["value"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.set_xlabel(plot_text(fits.get("x", "x")))
    ax.set_ylabel(plot_text(report["metric"]))
    ax.set_title(f"runs at {report['at_tokens']:,} tokens", fontsize=10)
    ax.legend(fontsize=7)
    output_path = Path(output_path)
    atomic_write_file(output_path, lambda tmp: fig.savefig(tmp, format="png"))
    return output_path
