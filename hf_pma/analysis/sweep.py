"""Sweep the merge of a run's snapshots over N (window), V (every k-th snapshot) and strategy.

For each combination ``(N, k, strategy)`` the merge uses the newest snapshot and the N-1 taken
every ``k``-th one before it (counting back: ``k = 2`` on snapshots taken every V tokens
emulates a run that snapshotted every 2V), weighted by the strategy.

Bounded memory, work reused where it is cheap:

* the model is loaded once (from the newest snapshot) and every merge is swapped into it with
  :func:`hf_pma.merging.swap.load_weights`: one model plus one merged state dict in memory;
* each merge is built in memory with :func:`hf_pma.merging.engine.merge_state_dict`, which streams its
  sources chunk by chunk;
* combinations that select the same snapshots with the same weights (e.g. any strategy with
  N = 1, or N = 1 for every k) are evaluated once; the others point to it (``duplicate_of``);
* the lm-eval task manager is built once and the held-out texts are read once.

:func:`plan_sweep` is the pure part (which snapshots, which weights); :func:`run_sweep`
evaluates; :func:`sweep_table`, :func:`plot_sweep` and :func:`write_best` present the result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers.utils import logging

from hf_pma.core.selection import window_by_progress
from hf_pma.core.strategies import AUTO_STRATEGY, merge_coefficients, resolve_strategy
from hf_pma.core.window_choice import is_auto
from hf_pma.evaluation.corpus import documents_fingerprint
from hf_pma.evaluation.options import EvalOptions
from hf_pma.io.guarded import reads_one_version
from hf_pma.merging.sources import CheckpointSource, resolve_sources, vanished_source_error
from hf_pma.merging.windows import apply_window
from hf_pma.utils.formatting import format_number, markdown_table
from hf_pma.utils.fs import atomic_write_file
from hf_pma.utils.parsing import check_int, folded, is_number
from hf_pma.utils.text import escape, plot_text

logger = logging.get_logger(__name__)
T = TypeVar("T")

__all__ = [
    "DEFAULT_WINDOWS",
    "DEFAULT_EVERY",
    "DEFAULT_STRATEGIES",
    "BASELINE_LABEL",
    "Combination",
    "plan_sweep",
    "parse_metric",
    "lower_is_better",
    "SweepEvaluator",
    "run_sweep",
    "sweep_table",
    "plot_sweep",
    "write_best",
]

# "auto": the window the run's records choose (hf_pma.core.window_choice), beside fixed counts.
DEFAULT_WINDOWS: tuple[int | str, ...] = ("auto", 3, 6, 10, 15)
DEFAULT_EVERY = (1, 2, 4)
DEFAULT_STRATEGIES = ("sma", "wma", "ema")
BASELINE_LABEL = "last snapshot"
# Metrics for which a smaller value is better; everything else (accuracies...) is "higher is better".
_LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte", "bpb", "error")


@dataclasses.dataclass(frozen=True)
class Combination:
    """One merge of a sweep: ``window`` snapshots taken every ``every``-th, merged by ``strategy``.

    ``indices`` are positions in the run's snapshot list (oldest first), ``weights`` the merge
    weights in the same order (they sum to 1).
    """

    window: int
    every: int
    strategy: str
    indices: tuple[int, ...]
    weights: tuple[float, ...]
    # Set for a window in tokens: the snapshots within the last ``window_tokens`` tokens.
    window_tokens: int | None = None
    # True for the automatic window (``window="auto"``): ``window`` is the count it chose.
    auto: bool = False

    @property
    def label(self) -> str:
        """``"sma N=10 k=2"``, ``"sma T=40960 k=1"`` for a window in tokens, ``"sma auto N=4 k=1"``
        for the automatic window."""
        size = f"T={self.window_tokens}" if self.window_tokens is not None else f"N={self.window}"
        return f"{self.strategy} {'auto ' if self.auto else ''}{size} k={self.every}"

    def key(self) -> tuple[tuple[int, float], ...]:
        """What the merge computes: equal keys, equal models (zero weights dropped, rounding ignored)."""
        return tuple((i, round(w, 12)) for i, w in zip(self.indices, self.weights) if w > 0)


def _positive_ints(values: Sequence[int], what: str) -> list[int]:
    out = [check_int(v, what) for v in values]
    if not out:
        raise ValueError(f"give at least one {what} value")
    return list(dict.fromkeys(out))


def plan_sweep(
    count: int,
    windows: Sequence[int | str] = DEFAULT_WINDOWS,
    every: Sequence[int] = DEFAULT_EVERY,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    alpha: float = 0.2,
    window_tokens: Sequence[int] = (),
    tokens: Sequence[int | None] | None = None,
    auto_count: int | None = None,
    auto_strategy: str = "sma",
) -> tuple[list[Combination], list[dict[str, Any]]]:
    """The combinations that ``count`` snapshots allow, and those they do not (with the reason).

    ``windows`` are counts N, or ``"auto"``: the newest ``auto_count`` snapshots (the automatic
    window's choice, from the run's records; consecutive, so with ``every=1`` only; the strategy
    ``"auto"`` merges it with ``auto_strategy``, the weights that choice chose, and any other
    window with SMA); ``window_tokens`` are windows in tokens T (every k-th snapshot
    counting back from the newest, then those within the last T tokens; see
    :func:`hf_pma.core.selection.window_by_progress`), which need ``tokens``, the snapshots'
    token counts (oldest first). Pure: no files, no torch. Raises ``ValueError`` for a bad
    window, stride, strategy or alpha.
    """
    if window_tokens:
        window_tokens = _positive_ints(window_tokens, "window_tokens")
        if tokens is None or len(tokens) != count:
            raise ValueError("windows in tokens need the token count of every snapshot")
    if not windows and not window_tokens:
        raise ValueError("give at least one window value (a count N, auto, or a number of tokens T)")
    auto = any(is_auto(n) for n in windows)
    windows = _positive_ints([n for n in windows if not is_auto(n)], "window") if len(windows) > auto else []
    every = _positive_ints(every, "every")
    if not strategies:
        raise ValueError("give at least one strategy")
    for strategy in strategies:
        merge_coefficients(2, strategy, alpha)  # ValueError naming a bad strategy or alpha
    if count < 1:
        raise ValueError("the run has no snapshot")
    combos, skipped = [], []
    if auto and auto_count is None:
        skipped.append({"window": "auto", "every": 1, "strategy": ", ".join(strategies),
                        "reason": "no count chosen from the run's records (auto_count)"})
        auto = False
    # Each name once, as the merge would use it: "auto" is the automatic window's own weights there
    # and SMA for a window given, so it may name a strategy listed beside it.
    auto_strategies = list(dict.fromkeys(auto_strategy if s == AUTO_STRATEGY else s for s in strategies))
    given_strategies = list(dict.fromkeys(resolve_strategy(s) for s in strategies))
    if auto:
        for chosen in auto_strategies:
            indices = tuple(range(count - auto_count, count))
            weights = tuple(merge_coefficients(auto_count, chosen if auto_count > 1 else "sma", alpha))
            combos.append(Combination(auto_count, 1, chosen, indices, weights, auto=True))
    for strategy in given_strategies:
        for k in every:
            for n in windows:
                first = count - 1 - k * (n - 1)
                if first < 0:
                    skipped.append(
                        {"window": n, "every": k, "strategy": strategy,
                         "reason": f"needs {k * (n - 1) + 1} snapshots, the run has {count}"}
                    )
                    continue
                indices = tuple(range(first, count, k))
                weights = tuple(merge_coefficients(n, strategy if n > 1 else "sma", alpha))
                combos.append(Combination(n, k, strategy, indices, weights))
            strided = list(range(count - 1, -1, -k))[::-1]
            for span in window_tokens:
                chosen = window_by_progress([tokens[i] for i in strided], span, "tokens")
                indices = tuple(strided[i] for i in chosen)
                weights = tuple(merge_coefficients(len(indices), strategy if len(indices) > 1 else "sma", alpha))
                combos.append(Combination(len(indices), k, strategy, indices, weights, window_tokens=span))
    return combos, skipped


def parse_metric(metric: str) -> tuple[str, str]:
    """``"lm/loss"`` -> ``("lm", "loss")``; the task is everything before the last ``/``."""
    task, sep, name = str(metric).rpartition("/")
    if not sep or not task or not name:
        raise ValueError(f"metric {metric!r} must look like TASK/METRIC, e.g. lm/loss or pma_next_line/acc")
    return task, name


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` (``task/name``) is better: losses, perplexities, bits per byte."""
    name = parse_metric(metric)[1].lower()
    return any(word in name for word in _LOWER_IS_BETTER)


def _metric_value(results: Mapping[str, Mapping[str, Any]], metric: str) -> float | None:
    task, name = parse_metric(metric)
    value = (results.get(task) or {}).get(name)
    return float(value) if is_number(value) else None


def _default_metric(results: Mapping[str, Mapping[str, Any]]) -> str:
    if "lm" in results and "loss" in results["lm"]:
        return "lm/loss"
    for task, metrics in results.items():
        for name in ("acc", "acc_norm", "exact_match"):
            if name in metrics:
                return f"{task}/{name}"
    for task, metrics in results.items():
        for name in metrics:
            if not name.endswith("_stderr"):
                return f"{task}/{name}"
    raise ValueError("the evaluation returned no metric")


class SweepEvaluator:
    """Evaluates merges of checkpoints in one live model: load once, swap weights, evaluate.

    Args:
        skeleton: a model folder to load the architecture (and default tokenizer) from,
            typically the newest snapshot.
        texts: held-out texts (loss, perplexity, bits per byte).
        options: what else to run and how (:class:`~hf_pma.evaluation.options.EvalOptions`, or
            its fields as keywords: ``tasks=``, ``include_path=``, ``block_size=``...).
        tokenizer: as :func:`hf_pma.evaluation.loading.load_model_for_eval` (default: the
            skeleton's own, or its run folder's).
        device: where the model runs (default: cuda if available, else cpu).
        progress: show progress bars while evaluating.
    """

    def __init__(
        self,
        skeleton: str | os.PathLike[str],
        texts: Sequence[str] | None = None,
        options: EvalOptions | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        device: str | torch.device | None = None,
        progress: bool = False,
        **option_fields: Any,
    ) -> None:
        from hf_pma.evaluation.loading import load_model_for_eval

        options = EvalOptions.build(options, **option_fields)
        if not texts and not options.tasks:
            raise ValueError("nothing to evaluate: give held-out texts and/or tasks")
        self.texts = list(texts) if texts else None
        self.tasks, self.task_manager = None, None
        if options.tasks:
            from hf_pma.evaluation.harness import load_task_manager

            self.tasks, self.task_manager = load_task_manager(options.tasks, options.include_path)  # checks the names now
            options = options.replace(tasks=self.tasks)
        self.model, self.tokenizer = load_model_for_eval(skeleton, tokenizer, dtype="auto", device=device)
        self.options = options
        self.progress = progress
        self.evaluations = 0
        # The whole output of the latest evaluation (``lm``: per-text losses, for paired comparisons).
        self.last_output: dict[str, Any] | None = None

    def evaluate_state(self, state: Mapping[str, torch.Tensor], origin: str = "merged weights") -> dict[str, Any]:
        """Load ``state`` into the model and evaluate it; flat results ``{task: {metric: value}}``."""
        from hf_pma.merging.swap import load_weights

        load_weights(self.model, state, origin=origin)
        self.last_output = self._evaluate_loaded(self.texts, self.options)
        return self.last_output["results"]

    def evaluate_merge(
        self,
        sources: Sequence[str | os.PathLike[str] | CheckpointSource],
        weights: Sequence[float] | None = None,
        strategy: str = "sma",
        alpha: float = 0.2,
    ) -> dict[str, Any]:
        """Merge ``sources`` in memory (explicit ``weights`` or ``strategy``) and evaluate the merge."""
        from hf_pma.merging.engine import merge_state_dict

        state = merge_state_dict(list(sources), strategy=strategy, alpha=alpha, weights=weights)
        return self.evaluate_state(state, origin=_merge_origin(sources))

    def held_out_losses(
        self, sources: Sequence[str | os.PathLike[str] | CheckpointSource], weights: Sequence[float], texts: Sequence[str]
    ) -> list[float]:
        """Each of ``texts``' mean loss per token under the merge of ``sources`` (``weights``):
        held-out text only, no task, and not kept as :attr:`last_output` (it chooses a window;
        it reports nothing: :mod:`hf_pma.core.window_check`)."""
        from hf_pma.analysis.comparison import document_losses
        from hf_pma.merging.engine import merge_state_dict
        from hf_pma.merging.swap import load_weights

        load_weights(self.model, merge_state_dict(list(sources), weights=list(weights)), origin=_merge_origin(sources))
        return document_losses(self._evaluate_loaded(list(texts), self.options.replace(tasks=None))["lm"])

    def _evaluate_loaded(self, texts: Sequence[str] | None, options: EvalOptions) -> dict[str, Any]:
        """The loaded weights evaluated on ``texts`` and ``options``' tasks: ``evaluate_model``'s output."""
        from hf_pma.evaluation.evaluator import evaluate_model

        out = evaluate_model(
            self.model,
            self.tokenizer,
            texts,
            options,
            task_manager=self.task_manager if options.tasks else None,
            progress=self.progress,
        )
        self.evaluations += 1
        return out


def _merge_origin(sources: Sequence[Any]) -> str:
    """How a merge of ``sources`` is named in a load error: ``merge of snapshot-1, snapshot-2``."""
    return "merge of " + ", ".join(Path(getattr(s, "path", s)).name for s in sources)


def _while_present(sources: Sequence[CheckpointSource], action: Callable[[], T]) -> T:
    """``action()`` (which reads ``sources``), said in one line naming the snapshot when one of them
    was deleted since the sweep began, before or while it is read."""
    gone = vanished_source_error(sources)
    if gone is not None:
        raise gone
    try:
        return action()
    except (OSError, ValueError) as err:
        gone = vanished_source_error(sources)
        if gone is None:
            raise
        raise gone from err


def _source_list(run: Any) -> list[CheckpointSource]:
    if isinstance(run, (list, tuple)):
        if run and all(isinstance(s, CheckpointSource) for s in run):
            return list(run)
        return resolve_sources(list(run))
    return resolve_sources([run])


@reads_one_version
def run_sweep(
    run: str | os.PathLike[str] | Sequence[str | os.PathLike[str] | CheckpointSource],
    windows: Sequence[int | str] = DEFAULT_WINDOWS,
    every: Sequence[int] = DEFAULT_EVERY,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    alpha: float = 0.2,
    texts: Sequence[str] | None = None,
    options: EvalOptions | None = None,
    *,
    metric: str | None = None,
    higher_is_better: bool | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    eval_dataset: str | None = None,
    progress: bool = True,
    window_tokens: Sequence[int] = (),
    **option_fields: Any,
) -> dict[str, Any]:
    """Evaluate the merges of a run's snapshots for every ``(window, every, strategy)``, the
    windows being counts N (``windows``) and numbers of tokens T (``window_tokens``, the
    snapshots within the last T tokens: the merge's duration, which WSM finds matters most).

    ``run`` is a run folder (PMA manifest or Trainer ``checkpoint-*`` folders) or a list of
    checkpoints (ordered by training progress, as :func:`hf_pma.merging.sources.resolve_sources` does).
    The newest snapshot alone is evaluated first as the baseline (``"last snapshot"``).
    ``metric`` (``task/name``, default ``lm/loss`` with texts, else the first task's accuracy)
    picks the best merge; ``higher_is_better`` defaults from its name. ``options`` (or its
    fields as keywords) say how each merge is evaluated, as for
    :func:`hf_pma.evaluation.evaluator.evaluate_model`.

    Returns a JSON-ready report: ``snapshots``, ``baseline``, ``combinations`` (each with its
    snapshots, weights, results, ``delta`` on the metric against the baseline, and
    ``duplicate_of`` when it repeats an earlier combination's merge), ``skipped``, ``metric``,
    ``higher_is_better`` and ``best`` (a combination's label).
    """
    from hf_pma.utils.logs import progress_bar

    sources = _source_list(run)
    tokens = [s.tokens for s in sources]
    if window_tokens and any(t is None for t in tokens):
        missing = [s.name for s in sources if s.tokens is None]
        raise ValueError(
            f"windows in tokens need every snapshot's token count; {len(missing)} have none: {', '.join(missing[:5])}"
        )
    choice = apply_window(sources, last="auto")[1] if any(is_auto(n) for n in windows) else None
    if choice is not None:
        logger.info(f"sweep: {choice.describe()}")
    combos, skipped = plan_sweep(
        len(sources), windows, every, strategies, alpha, window_tokens, tokens, choice.count if choice else None,
        choice.strategy if choice else "sma",
    )
    if metric is not None:
        parse_metric(metric)
    for s in skipped:  # each one for -v; the report lists them, the log says how many
        logger.debug(f"skipping {s['strategy']} N={s['window']} k={s['every']}: {s['reason']}")
    if skipped and combos:
        logger.info(f"skipping {len(skipped)} combination(s) that do not fit the run's {len(sources)} snapshot(s)")
    if not combos:
        raise ValueError(
            f"no combination fits the run's {len(sources)} snapshot(s): use smaller windows or every values "
            "(windows=, every=; --window, --every)"
        )
    evaluator = _while_present(
        [sources[-1]],
        lambda: SweepEvaluator(
            sources[-1].path.absolute(),  # a path, never taken for a Hub id
            texts,
            EvalOptions.build(options, **option_fields),
            tokenizer=tokenizer,
            device=device,
        ),
    )
    unique = {c.key() for c in combos}
    logger.info(
        f"Sweep over {len(sources)} snapshots: {len(combos)} combinations, {len(unique)} distinct merges "
        f"(+ the last snapshot alone)"
    )
    baseline = _while_present([sources[-1]], lambda: evaluator.evaluate_merge([sources[-1]], weights=[1.0]))
    metric = metric or _default_metric(baseline)
    if _metric_value(baseline, metric) is None:
        available = [f"{t}/{m}" for t, ms in baseline.items() for m in ms if not m.endswith("_stderr")]
        raise ValueError(f"metric {metric!r} is not among the results: {', '.join(available)}")
    higher = (not lower_is_better(metric)) if higher_is_better is None else bool(higher_is_better)
    base_value = _metric_value(baseline, metric)

    done: dict[tuple, tuple[str, dict[str, Any]]] = {((len(sources) - 1, 1.0),): (BASELINE_LABEL, baseline)}
    entries = []
    for combo in progress_bar(combos, desc="Sweep", unit="merge", disable=not progress):
        key = combo.key()
        duplicate_of = None
        if key in done:
            duplicate_of, results = done[key]
        else:
            merged = [sources[i] for i in combo.indices]
            results = _while_present(merged, functools.partial(evaluator.evaluate_merge, merged, list(combo.weights)))
            done[key] = (combo.label, results)
        value = _metric_value(results, metric)
        entries.append(
            {
                "label": combo.label,
                "window": combo.window,
                "window_tokens": combo.window_tokens,
                "auto": combo.auto,
                "every": combo.every,
                "strategy": combo.strategy,
                "alpha": alpha if combo.strategy == "ema" else None,
                "snapshots": [sources[i].name for i in combo.indices],
                "tokens": [sources[i].tokens for i in combo.indices],
                "weights": list(combo.weights),
                "results": results,
                "value": value,
                "delta": None if value is None or base_value is None else value - base_value,
                "duplicate_of": duplicate_of,
            }
        )
        logger.info(f"{combo.label}: {metric} = {format_number(value)}" + (f" (same merge as {duplicate_of})" if duplicate_of else ""))

    scored = [e for e in entries if e["value"] is not None and math.isfinite(e["value"])]
    best = (max if higher else min)(scored, key=lambda e: e["value"]) if scored else None
    beats_last = None
    if best is not None and base_value is not None:
        beats_last = best["value"] > base_value if higher else best["value"] < base_value
        if not beats_last:
            logger.warning(f"no merge beats the last snapshot on {metric} ({base_value:.5g})")
    return {
        "run": str(run) if isinstance(run, (str, os.PathLike)) else None,
        "snapshots": [{"name": s.name, "tokens": s.tokens, "step": s.step, "path": str(s.path)} for s in sources],
        "window_choice": choice.to_dict() if choice is not None else None,
        "interval_tokens": next((s.record.get("interval_tokens") for s in sources if s.record.get("interval_tokens")), None),
        "metric": metric,
        "higher_is_better": higher,
        "eval_dataset": eval_dataset,
        "eval_documents": documents_fingerprint(evaluator.texts) if evaluator.texts else None,
        "tasks": evaluator.tasks,
        "baseline": {"label": BASELINE_LABEL, "snapshot": sources[-1].name, "results": baseline, "value": base_value},
        "combinations": entries,
        "skipped": skipped,
        "evaluations": evaluator.evaluations,
        "best": best["label"] if best else None,
        "best_beats_last": beats_last,
    }


# ---------------------------------------------------------------- presentation


def _metric_columns(report: Mapping[str, Any]) -> list[str]:
    columns = []
    for entry in [report["baseline"], *report["combinations"]]:
        for task, metrics in entry["results"].items():
            for name in metrics:
                if not name.endswith("_stderr") and f"{task}/{name}" not in columns:
                    columns.append(f"{task}/{name}")
    # The ranking metric first; perplexity repeats the loss.
    columns = [c for c in columns if c != "lm/perplexity"]
    columns.sort(key=lambda c: c != report["metric"])
    return columns


def sweep_table(report: Mapping[str, Any]) -> str:
    """A markdown table: one row per combination (the baseline first), one column per metric,
    with the change of the ranking metric against the last snapshot; ``*`` marks the best: the
    best merge, or the last snapshot when no merge beats it. Then which is best, and the
    combinations skipped (too few snapshots), with why."""
    columns = _metric_columns(report)
    last_is_best = report.get("best_beats_last") is False
    header = ["merge", "snapshots", *columns, f"Δ {report['metric']}", "note"]
    rows = [[("* " if last_is_best else "") + BASELINE_LABEL, report["baseline"]["snapshot"],
             *(format_number(_metric_value(report["baseline"]["results"], c)) for c in columns), "",
             "best" if last_is_best else ""]]
    for e in report["combinations"]:
        span = e["snapshots"][0] if len(e["snapshots"]) == 1 else f"{e['snapshots'][0]}..{e['snapshots'][-1]}"
        best = e["label"] == report["best"]
        note = (("best merge " if last_is_best else "best ") if best else "") + (
            f"= {e['duplicate_of']}" if e["duplicate_of"] else ""
        )
        rows.append([("* " if best and not last_is_best else "") + e["label"], span,
                     *(format_number(_metric_value(e["results"], c)) for c in columns),
                     format_number(e["delta"], "+.4f"), note.strip()])
    direction = "higher" if report["higher_is_better"] else "lower"
    footer = f"{report['metric']}: {direction} is better; best merge: {report['best']}"
    if last_is_best:
        footer = (
            f"{report['metric']}: {direction} is better; best: the last snapshot (the best merge, "
            f"{report['best']}, does not beat it: keep the last snapshot)"
        )
    skipped = [f"{s['strategy']} N={s['window']} k={s['every']} ({s['reason']})" for s in report.get("skipped", [])]
    if skipped:  # a line of its own, folded: a sweep of many windows skips many
        listed = folded(skipped, 3, "; ") + (" (all in the report's 'skipped')" if len(skipped) > 4 else "")
        footer += f"\nskipped {len(skipped)}: {listed}"
    return markdown_table(header, rows, align="ll" + "r" * (len(columns) + 1) + "l") + "\n\n" + footer


def _column(entry: Mapping[str, Any]) -> tuple[bool, int]:
    """The heatmap column of a combination: its count N, else (after the counts) its tokens T."""
    tokens = entry.get("window_tokens")
    return (True, tokens) if tokens is not None else (False, entry["window"])


def plot_sweep(report: Mapping[str, Any], output_path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """A heatmap per strategy: rows ``every`` (k), columns window (N), cells the ranking metric's
    change against the last snapshot (green: better); empty cells did not fit the run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entries = report["combinations"]
    strategies = list(dict.fromkeys(e["strategy"] for e in entries + report["skipped"]))
    windows = sorted({_column(e) for e in entries + report["skipped"]})
    everies = sorted({e["every"] for e in entries + report["skipped"]})
    sign = 1.0 if report["higher_is_better"] else -1.0
    deltas = [sign * e["delta"] for e in entries if e["delta"] is not None and math.isfinite(e["delta"])]
    span = max([abs(d) for d in deltas] + [1e-12])

    fig = Figure(
        figsize=(1.5 + 1.1 * len(windows) * len(strategies) + 1.0, 1.6 + 0.8 * len(everies)), dpi=dpi, layout="constrained"
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(strategies), squeeze=False)[0]
    image = None
    for ax, strategy in zip(axes, strategies):
        grid = torch.full((len(everies), len(windows)), float("nan"))
        for e in entries:
            if e["strategy"] == strategy and e["delta"] is not None:
                r, c = everies.index(e["every"]), windows.index(_column(e))
                grid[r, c] = sign * e["delta"]
                text = f"{e['value']:.3f}\n({e['delta']:+.3f})"
                weight = "bold" if e["label"] == report["best"] else "normal"
                ax.text(c, r, text, ha="center", va="center", fontsize=7, fontweight=weight)
        for e in report["skipped"]:
            if e["strategy"] == strategy:
                r, c = everies.index(e["every"]), windows.index(_column(e))
                ax.text(c, r, "too few\nsnapshots", ha="center", va="center", fontsize=6, color="0.5")
        image = ax.imshow(grid.numpy(), cmap="RdYlGn", vmin=-span, vmax=span, aspect="auto")
        ax.set_xticks(range(len(windows)), [f"T={n:,}" if tokens else str(n) for tokens, n in windows])
        ax.set_yticks(range(len(everies)), [str(k) for k in everies])
        ax.set_xlabel("window: N snapshots, or T tokens")
        ax.set_ylabel("every k-th snapshot")
        ax.set_title(plot_text(strategy))
    if image is not None:
        fig.colorbar(image, ax=list(axes), fraction=0.03, label="better than the last snapshot by")
    base = report["baseline"]["value"]
    fig.suptitle(f"{plot_text(report['metric'])} of merges (last snapshot: {format_number(base)})", fontsize=10)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_file(output_path, lambda tmp: fig.savefig(tmp, format="png"))
    return output_path


def write_best(
    report: Mapping[str, Any],
    output_dir: str | os.PathLike[str],
    label: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write the merge ``label`` (default: the report's best) as a model folder, streaming, with
    ``pma_merge.json`` (plus the sweep's choice) and ``pma_eval.json`` (its results next to the
    last snapshot's)."""
    from hf_pma.core.manifest import MERGE_RECORD_NAME
    from hf_pma.evaluation.records import write_eval_record
    from hf_pma.io.guarded import read_json
    from hf_pma.merging.engine import merge_checkpoints
    from hf_pma.utils.fs import atomic_write_json, hold_claim

    label = label or report.get("best")
    entry = next((e for e in report["combinations"] if e["label"] == label), None)
    if entry is None:
        raise ValueError(f"no combination {label!r} in the sweep report")
    by_name = {s["name"]: s["path"] for s in report["snapshots"]}
    paths = [Path(by_name[name]) for name in entry["snapshots"]]  # folders the sweep read: never Hub ids
    gone = next((p for p in paths if not p.is_dir()), None)
    if gone is not None:
        raise FileNotFoundError(
            f"snapshot {escape(gone)} of the sweep was deleted while this command ran (keep_last rotation?); "
            "run the sweep again to use the snapshots listed now"
        )
    strategy = entry["strategy"] if len(paths) > 1 else "sma"
    out = merge_checkpoints(
        paths, output_dir, strategy=strategy, alpha=entry["alpha"] or 0.2, overwrite=overwrite, progress=progress,
        window_tokens=entry.get("window_tokens"),
    )
    with hold_claim(out, what="output folder"):  # the records completed under the folder's claim
        record = read_json(out / MERGE_RECORD_NAME)
        interval = report.get("interval_tokens")
        record["interval_tokens"] = interval * entry["every"] if interval else record.get("interval_tokens")
        record["sweep"] = {
            "window": entry["window"], "window_tokens": entry.get("window_tokens"), "every": entry["every"],
            "strategy": entry["strategy"],
            "metric": report["metric"], "value": entry["value"], "baseline_value": report["baseline"]["value"],
        }
        atomic_write_json(out / MERGE_RECORD_NAME, record)
        write_eval_record(
            out,
            {"last snapshot": report["baseline"]["results"], "PMA merge": entry["results"]},
            eval_dataset=report.get("eval_dataset"),
            update=False,
            eval_documents=report.get("eval_documents"),
        )
    logger.info(f"Wrote the merge {label} to {out}")
    return out
