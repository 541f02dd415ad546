"""The model card of a merged folder: records in, ``huggingface_hub.ModelCard`` out.

The card is rendered from the Jinja template ``model_cards/pma_model_card.md`` (shipped as
``hf_pma.model_cards``) with ``ModelCard.from_template`` and a ``ModelCardData`` whose
``model-index`` holds the merge's evaluation results. The body says what the model is and how
it was made: the merge and its snapshots, the training run, the evaluation (last snapshot vs
merge, and annealed when known), the plot, how to load it, how to reproduce it.

The values shown come from the folder's records (see :mod:`hf_pma.publishing.records`), which are
sanitized when read, and the rendered text is sanitized once more: a card never holds an
access token or an absolute local path.

A record or a folder name may be an attacker's: every string taken from them is data, never a
template (only the card's own template is rendered, with the values as Jinja variables), is
escaped (:func:`hf_pma.utils.text.escape`: no control, bidi or line-breaking character reaches
the card, and ``|`` cannot split a table cell), and is quoted with ``repr`` where it lands in
the card's Python snippets. A code block's fence is longer than any run of backticks it holds.
"""

from __future__ import annotations

import datetime
import importlib.resources
import os
import posixpath
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.utils import logging

from hf_pma.core.manifest import CARD_MARK, CARD_NAME, PLOT_NAME, PMA_SUBDIR
from hf_pma.core.outputs import bears_mark
from hf_pma.io.guarded import UnsafeFileError, read_bytes
from hf_pma.publishing.records import FolderRecords, label_rank, load_records, sanitize_text
from hf_pma.utils.formatting import format_metric, format_number, metric_label
from hf_pma.utils.fs import atomic_write_text, check_output_file, hold_claim
from hf_pma.utils.names import is_hub_id
from hf_pma.utils.parsing import is_number
from hf_pma.utils.text import escape, markdown_text
from hf_pma.utils.version import __version__

if TYPE_CHECKING:
    from huggingface_hub import EvalResult, ModelCard

logger = logging.get_logger(__name__)

__all__ = [
    "TEMPLATE_NAME",
    "PAPER_URL",
    "template_path",
    "template_text",
    "MAX_TEMPLATE_BYTES",
    "eval_table",
    "eval_results_for",
    "comparison_table",
    "build_model_card",
    "write_model_card",
]

TEMPLATE_NAME = "pma_model_card.md"
PAPER_URL = "https://arxiv.org/abs/2505.12082"
# The largest card template read (the packaged one is a few KB).
MAX_TEMPLATE_BYTES = 1 << 20
_MISSING = "–"

# How the card names a strategy; the EMA's alpha is appended (a record value is never a template).
_STRATEGY_TEXT = {
    "sma": "SMA: simple moving average, every snapshot weighs 1/N",
    "wma": "WMA: weighted moving average, snapshot i of N weighs i / (1 + ... + N)",
    "ema": "EMA: exponential moving average with alpha =",
    "linear-decay": "linear-decay emulation (WSM, arXiv:2507.17634)",
    "cosine-decay": "cosine-decay emulation (WSM, arXiv:2507.17634)",
    "1-sqrt-decay": "1-sqrt-decay emulation (WSM, arXiv:2507.17634)",
}


# ---------------------------------------------------------------- template


def template_path(name: str = TEMPLATE_NAME) -> Path:
    """The template ``name``: the source checkout's ``model_cards/`` beside the running
    ``hf_pma`` when there is one (so a checkout renders its own templates, whichever checkout is
    installed), else the installed package ``hf_pma.model_cards``."""
    source = Path(__file__).resolve().parents[2] / "model_cards" / name
    if source.is_file():
        return source
    try:
        candidate = importlib.resources.files("hf_pma.model_cards") / name
        if candidate.is_file():
            return Path(str(candidate))
    except (ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError(
        f"model card template {name!r} not found in {source.parent} nor in the hf_pma.model_cards package: "
        "reinstall hf-pma"
    )


# ---------------------------------------------------------------- formatting


def _md(value: Any) -> str:
    """A value from a record or a name as the card's markdown shows it
    (:func:`hf_pma.utils.text.markdown_text`): escaped (no control, bidi or line-breaking
    character), no link, HTML or table cell of its own."""
    return markdown_text(value)


def _md_values(obj: Any) -> Any:
    """``obj`` (a template variable: a string, a list or dict of them, a number) with every string
    through :func:`_md`."""
    if isinstance(obj, str):
        return _md(obj)
    if isinstance(obj, dict):
        return {k: _md_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_md_values(v) for v in obj]
    return obj


def _fence(code: str) -> str:
    """The backticks that open and close a fenced code block holding ``code``: three, or one more
    than the longest run of backticks in it (so the code cannot close the block)."""
    longest = max((len(run) for run in re.findall(r"`+", code)), default=0)
    return "`" * max(3, longest + 1)


def _strategy_text(strategy: str, merge: dict[str, Any]) -> str:
    """How the card names the merge's strategy: a known one in words (EMA with its alpha, or its
    half-life in tokens or as a share of the tokens seen), any other by its name (escaped) with
    "explicit weights"."""
    text = _STRATEGY_TEXT.get(strategy)
    if text is None:
        return f"{_md(strategy)}: explicit weights"
    auto = ((merge.get("window") or {}).get("auto") or {}) if isinstance(merge.get("window"), dict) else {}
    if isinstance(auto, dict) and auto.get("strategy") == strategy == "wma" and not auto.get("strategy_named"):
        return f"{text}, chosen with the automatic window (the newest weigh most: the merge lags the run less than SMA's)"
    if strategy != "ema":
        return text
    fraction, tokens = merge.get("half_life_fraction"), merge.get("half_life_tokens")
    if is_number(fraction, finite=True):
        return (
            f"EMA: exponential moving average whose half-life is {_fmt_float(fraction, '.3g')} of the tokens seen "
            "at each snapshot (horizon-free)"
        )
    if is_number(tokens, finite=True):
        return f"EMA: exponential moving average with a half-life of {_fmt_int(tokens)} tokens"
    return f"{text} {_fmt_float(merge.get('alpha'), 'g')}"


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def _fmt_tokens(n: Any) -> str:
    if not is_number(n, finite=True):
        return _MISSING
    return f"{int(n):,} ({_human(n)})" if n >= 1000 else f"{int(n):,}"


def _fmt_int(n: Any) -> str:
    return f"{int(n):,}" if is_number(n, finite=True) else _MISSING


def _fmt_float(x: Any, spec: str) -> str:
    return format(x, spec) if is_number(x, finite=True) else _MISSING


def _fmt_duration(seconds: Any) -> str:
    if not is_number(seconds, finite=True):
        return _MISSING
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


# ---------------------------------------------------------------- evaluation


def merge_label(labels: Sequence[str]) -> str | None:
    """The label of the PMA merge among evaluated models ("PMA merge", "merged", ...), if any."""
    for label in labels:
        if label_rank(label) == 1:
            return label
    return None


def _split_metric(key: str) -> tuple[str, str | None]:
    # lm-eval keys carry a filter: "acc,none", "exact_match,strict-match".
    base, _, filt = key.partition(",")
    return base, (filt or None)


def _metric_display(base: str, filt: str | None) -> str:
    return base if filt in (None, "none") else f"{base} ({filt})"


def _task_metrics(results: dict[str, Any]) -> list[tuple[str, str, float, float | None]]:
    """(task, metric key, value, stderr) of one model's results, numbers only, stderr paired."""
    out = []
    for task, metrics in results.items():
        if not isinstance(metrics, dict):
            continue
        for key, value in metrics.items():
            base, filt = _split_metric(str(key))
            if base.endswith("_stderr") or not is_number(value, finite=True):
                continue
            suffix = f",{filt}" if filt else ""
            stderr = metrics.get(f"{base}_stderr{suffix}")
            out.append((str(task), str(key), float(value), float(stderr) if is_number(stderr, finite=True) else None))
    return out


def eval_table(eval_record: dict[str, Any] | None) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns (model labels, last snapshot first, then merge, annealed, others; plus
    "merge − last" when both are known) and rows ``{"task", "metric", "values"}`` of formatted
    cells, from a ``pma_eval.json`` record."""
    results = (eval_record or {}).get("results") or {}
    labels = sorted((str(k) for k, v in results.items() if isinstance(v, dict)), key=label_rank)
    cells: dict[tuple[str, str], dict[str, tuple[float, float | None]]] = {}
    for label in labels:
        for task, key, value, stderr in _task_metrics(results[label]):
            cells.setdefault((task, key), {})[label] = (value, stderr)
    last = next((label for label in labels if label_rank(label) == 0), None)
    merged = merge_label(labels)
    columns = list(labels)
    with_delta = last is not None and merged is not None
    if with_delta:
        columns.append("merge − last")
    rows = []
    for (task, key), by_label in cells.items():
        values = []
        for label in labels:
            if label not in by_label:
                values.append(_MISSING)
                continue
            value, stderr = by_label[label]
            values.append(format_metric(value, stderr))
        if with_delta:
            if last in by_label and merged in by_label:
                values.append(format_number(by_label[merged][0] - by_label[last][0], "+.4f"))
            else:
                values.append(_MISSING)
        base, filt = _split_metric(key)
        rows.append({"task": task, "metric": _metric_display(metric_label(task, base), filt), "values": values})
    return columns, rows


def _fmt_diff(row: dict[str, Any]) -> str:
    diff, stderr = row.get("loss_diff"), row.get("paired_stderr")
    if not is_number(diff, finite=True):
        return ""
    text = f"{diff:+.4f}"
    if is_number(stderr, finite=True) and stderr > 0:
        text += f" ± {stderr:.4f} ({abs(diff) / stderr:.1f} SE)"
    return text


def comparison_table(comparison: dict[str, Any] | None) -> str:
    """The matched comparison of an evaluation record (its ``comparison``: per-document held-out
    losses of the last snapshot, the merge and an annealed model on the same documents) as a
    markdown table: mean loss, mean paired difference from the last snapshot ± its standard
    error, and the share of the annealing gain; ``""`` when there is none."""
    if not isinstance(comparison, dict) or not isinstance(comparison.get("models"), dict):
        return ""
    models, reference = comparison["models"], comparison.get("reference")
    annealed, merge = comparison.get("annealed"), comparison.get("merge")
    anneal = comparison.get("anneal") if isinstance(comparison.get("anneal"), dict) else {}
    share = comparison.get("annealing_gain_recovered")
    tokens = _fmt_int(comparison.get("tokens")) if is_number(comparison.get("tokens"), finite=True) else None
    docs = comparison.get("documents")
    lines = [
        f"| model{f' (all at {tokens} tokens)' if tokens and anneal else ''} | held-out loss per document "
        f"(mean of {_md(docs)} documents) | difference from the {_md(reference)} (± paired SE) | share of the annealing gain |",
        "|---|---:|---:|---:|",
    ]
    names = {reference: f"{_md(reference)} (constant LR)" if anneal else _md(reference)}
    if annealed and anneal:
        names[annealed] = (
            f"{_md(annealed)} ({_md(anneal.get('decay_type', ''))} decay to 0 over the last "
            f"{_fmt_int(anneal.get('tokens'))} tokens)"
        )
    order = sorted(models, key=label_rank)
    for label in order:
        row = models[label] if isinstance(models[label], dict) else {}
        if not is_number(row.get("loss"), finite=True):
            continue
        if label == merge and is_number(share, finite=True):
            cell = f"{share:.0%}"
        elif label == annealed and is_number(share, finite=True):
            cell = "100%"
        else:
            cell = ""
        lines.append(f"| {names.get(label, _md(label))} | {row['loss']:.4f} | {_fmt_diff(row)} | {cell} |")
    return "\n".join(lines)


def eval_results_for(eval_record: dict[str, Any] | None, label: str | None = None) -> list[EvalResult]:
    """``EvalResult`` entries (for the card's ``model-index``) of the model ``label``, by default
    the merge."""
    from huggingface_hub import EvalResult

    results = (eval_record or {}).get("results") or {}
    label = label if label is not None else merge_label(list(results))
    if label is None or not isinstance(results.get(label), dict):
        return []
    dataset = (eval_record or {}).get("eval_dataset")
    out = []
    for task, key, value, _stderr in _task_metrics(results[label]):
        base, filt = _split_metric(key)
        if task == "lm":
            # The held-out language-modelling evaluation: named after its data when known.
            dataset_type = dataset if is_hub_id(dataset, bare=True) else "held-out-text"
            dataset_name = escape(dataset) if dataset else "held-out text"
        else:
            dataset_type, dataset_name = escape(task), escape(task)
        out.append(
            EvalResult(
                task_type="text-generation",
                task_name="Text Generation",
                dataset_type=dataset_type,
                dataset_name=dataset_name,
                metric_type=escape(base),
                metric_name=escape(_metric_display(base, filt)),
                metric_value=round(value, 6),
            )
        )
    return out


# ---------------------------------------------------------------- merge and training


def _interval_text(merge: dict[str, Any], sources: list[dict[str, Any]]) -> str:
    intervals = merge.get("intervals_tokens")  # every V within the merge, as the snapshots recorded it
    if (
        merge.get("intervals_from") == "recorded"
        and isinstance(intervals, list)
        and 1 < len(intervals) <= 50
        and all(is_number(v, finite=True) and v > 0 for v in intervals)
    ):
        return "changed within the merge: " + ", then ".join(f"{_fmt_tokens(v)} tokens" for v in intervals)
    interval = merge.get("interval_tokens")
    if is_number(interval, finite=True) and interval > 0:
        return f"{_fmt_tokens(interval)} tokens"
    tokens = [s.get("tokens") for s in sources]
    if len(tokens) < 2 or not all(is_number(t, finite=True) for t in tokens):
        return _MISSING
    gaps = [b - a for a, b in zip(tokens, tokens[1:])]
    if len(set(gaps)) == 1:
        return f"{_fmt_tokens(gaps[0])} tokens"
    return f"about {_fmt_tokens(statistics.median(gaps))} tokens (median gap; the gaps vary)"


def _window_text(merge: dict[str, Any]) -> str | None:
    """How the merge window was chosen and the progress it spans (the record's ``window``)."""
    window = merge.get("window")
    if not isinstance(window, dict) or window.get("unit") not in ("tokens", "steps"):
        return None
    unit, requested = window["unit"], window.get("requested")
    first, last = window.get("first"), window.get("last")
    if not (is_number(first, finite=True) and is_number(last, finite=True)):
        return None
    span = f"{_fmt_int(first)} to {_fmt_int(last)} {unit}, a span of {_fmt_int(last - first)}"
    if is_number(requested, finite=True):
        return f"the snapshots within the last {_fmt_int(requested)} {unit} ({span})"
    text = f"the newest {merge.get('num_sources') or len(merge.get('sources') or [])} snapshots ({span})"
    auto = window.get("auto")
    if isinstance(auto, dict) and isinstance(auto.get("reason"), str):
        text += f", chosen automatically from the run's records: {markdown_text(auto['reason'][:400])}"
    return text


def _snapshot_rows(sources: list[dict[str, Any]], weights: list[Any]) -> list[dict[str, str]]:
    rows = []
    for i, src in enumerate(sources):
        weight = src.get("weight", weights[i] if i < len(weights) else None)
        rows.append(
            {
                "name": str(src.get("name") or Path(str(src.get("path") or f"snapshot {i + 1}")).name),
                "tokens": _fmt_int(src.get("tokens")),
                "step": _fmt_int(src.get("step")),
                "lr": _fmt_float(src.get("lr"), ".3g"),
                "phase": str(src.get("phase") or _MISSING),
                "loss": _fmt_float(src.get("loss"), ".4f"),
                "weight": _fmt_float(weight, ".4f"),
            }
        )
    return rows


def _snapshot_warnings(sources: list[dict[str, Any]], weights: list[Any]) -> list[str]:
    warnings = []
    outside = sorted({str(s["phase"]) for s in sources if s.get("phase") not in (None, "stable")})
    if outside:
        count = sum(1 for s in sources if s.get("phase") not in (None, "stable"))
        warnings.append(
            f"{count} of the {len(sources)} snapshots were taken outside the constant-LR (stable) phase "
            f"({', '.join(outside)}); PMA assumes a constant learning rate."
        )
    numbers = [w for w in weights if is_number(w, finite=True)]
    if numbers and abs(sum(numbers) - 1.0) > 1e-4:
        warnings.append(f"the merge weights sum to {sum(numbers):.6f}, not 1: the merged weights are rescaled.")
    return warnings


def _training_view(training: dict[str, Any] | None) -> dict[str, str] | None:
    if not training:
        return None
    schedule = str(training.get("lr_scheduler_type") or _MISSING)
    kwargs = training.get("lr_scheduler_kwargs") or {}
    if isinstance(kwargs, dict) and kwargs:
        schedule += " (" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
    datasets = training.get("datasets") or []
    if isinstance(datasets, str):
        datasets = [datasets]
    return {
        "tokens": _fmt_tokens(training.get("total_tokens")),
        "steps": _fmt_int(training.get("max_steps")),
        "schedule": schedule,
        "learning_rate": _fmt_float(training.get("learning_rate"), ".3g"),
        "hardware": str(training.get("hardware") or _MISSING),
        "world_size": _fmt_int(training.get("world_size")),
        "runtime": _fmt_duration(training.get("train_runtime_s")),
        "datasets": ", ".join(str(d) for d in datasets) or _MISSING,
    }


def _merge_code(records: FolderRecords) -> str:
    """The ``merge_checkpoints`` call that remakes this merge, with the sources' recorded paths
    (relative to the merged folder) rewritten relative to where the call runs."""
    from hf_pma.core.strategies import STRATEGIES

    merge = records.merge or {}
    # A run's merge lives in <output_dir>/pma/<name>: the call runs from <output_dir>.
    base = f"{PMA_SUBDIR}/{records.name}" if records.run_name else (records.name or "merged")
    where = "the training output_dir" if records.run_name else f"the folder that holds {escape(base)}"
    paths = []
    for src in records.sources:
        path = str(src.get("path") or src.get("name") or "?")
        if src.get("repo_id"):  # a Hub revision: org/model@REV reads the same from anywhere
            paths.append(path)
            continue
        paths.append(posixpath.normpath(posixpath.join(base, path)) if not path.startswith("...") else path)
    lines = [
        "from hf_pma import merge_checkpoints",
        "",
        f"# run from {where}",
        "merge_checkpoints(",
        "    [",
        *(f"        {path!r}," for path in paths),  # names from folders and records: Python literals
        "    ],",
        f"    {base!r},",
    ]
    strategy = str(merge.get("strategy") or "sma")
    by_alpha = strategy != "ema" or is_number(merge.get("alpha"), finite=True)
    if strategy in STRATEGIES and by_alpha:  # an EMA by half-life: its recorded weights say it
        lines.append(f"    strategy={strategy!r},")
        if strategy == "ema" and is_number(merge.get("alpha"), finite=True):
            lines.append(f"    alpha={merge['alpha']},")
    else:
        weights = [w for w in merge.get("weights") or [] if is_number(w, finite=True)]
        lines.append("    weights=[" + ", ".join(f"{w:.6g}" for w in weights) + "],")
    lines.append(")")
    return "\n".join(lines)


def _hub_revisions(sources: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The Hub revisions a merge was made of: repo, revision and commit, oldest first."""
    return [
        {"repo_id": _md(s["repo_id"]), "revision": _md(s.get("revision") or _MISSING), "commit": _md(s.get("commit") or _MISSING)}
        for s in sources
        if is_hub_id(s.get("repo_id"), bare=True)
    ]


def _default_model_name(records: FolderRecords, repo_id: str | None) -> str:
    if repo_id:
        return repo_id.split("/")[-1]
    # "<output_dir>/pma/merged" says more by the run's name than by "merged".
    if records.run_name and records.name in (None, "merged", "merge"):
        return f"{records.run_name}-pma-{(records.merge or {}).get('strategy', 'merged')}"
    return records.name or "pma-merged-model"


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _plot_description(records: FolderRecords) -> str:
    """One sentence saying what the plot shows (it only draws what the records hold)."""
    from hf_pma.publishing.plot import plot_data

    data = plot_data(records)
    x = "tokens seen" if data.x_is_tokens else "optimizer steps"
    parts = []
    if data.train_loss:
        parts.append("the training loss (blue)")
    if data.eval_live or data.eval_merged:
        parts.append("the evaluation loss of the live model (red) and of the PMA merge (green) at each evaluation")
    if data.final_evals:
        labels = [f'"{label}"' for label in sorted(data.final_evals, key=label_rank)]
        parts.append(
            f"the final evaluation of {' / '.join(labels)} (large markers, side by side; loss per token on the "
            "final evaluation's text, comparable with the curves where the Trainer evaluated the same text)"
        )
    if data.merged_snapshots:
        parts.append("the merged snapshots (orange lines)")
    if data.other_snapshots:
        parts.append("the run's other snapshots (dotted lines)")
    if data.learning_rate:
        parts.append("the learning rate (dashed, right axis)")
    if not parts:
        return ""
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"Over {x}: {listed}."


def _small_run_note(training: dict[str, Any] | None) -> str | None:
    tokens = (training or {}).get("total_tokens")
    if is_number(tokens, finite=True) and tokens < 1e9:
        return (
            f"This model saw only {_human(tokens)} tokens: it demonstrates the method and is not a useful "
            "language model."
        )
    return None


# ---------------------------------------------------------------- the card


def build_model_card(
    folder: str | os.PathLike[str],
    repo_id: str | None = None,
    *,
    model_name: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = None,
    template: str | os.PathLike[str] | None = None,
    records: FolderRecords | None = None,
) -> ModelCard:
    """Render the model card of the merged ``folder`` from its records.

    ``repo_id`` is where the model is (or will be) on the Hub: it appears in the loading
    snippet. ``records`` defaults to :func:`hf_pma.publishing.records.load_records` of ``folder``;
    ``template`` to the packaged ``pma_model_card.md``. Raises ``FileNotFoundError`` when the
    folder has no ``pma_merge.json``.
    """
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    records = records if records is not None else load_records(folder)
    if records.merge is None:
        raise FileNotFoundError(f"{folder} has no pma_merge.json: a PMA card describes a merged folder")
    merge, sources, training = records.merge, records.sources, records.training or {}
    weights = list(merge.get("weights") or [])
    model_name = escape(sanitize_text(model_name or _default_model_name(records, repo_id)))

    datasets = training.get("datasets") or []
    datasets = [datasets] if isinstance(datasets, str) else list(datasets)
    base_model = training.get("base_model") or merge.get("base_model")
    base_model = base_model if is_hub_id(base_model, bare=True) else None
    strategy = str(merge.get("strategy") or "custom")
    eval_results = eval_results_for(records.eval)

    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        language=language,
        base_model=base_model,
        datasets=[d for d in datasets if is_hub_id(d, bare=True)] or None,
        tags=["pma", "model-merging", "checkpoint-averaging", "hf-pma", f"pma-{strategy if strategy in _STRATEGY_TEXT else 'custom'}"],
        model_name=model_name,
        eval_results=eval_results or None,
    )
    columns, rows = eval_table(records.eval)
    created = merge.get("created")
    tokens = [s.get("tokens") for s in sources if is_number(s.get("tokens"), finite=True)]
    plot_file = PLOT_NAME if (folder / PLOT_NAME).is_file() else None
    load_id = repo_id or f"./{records.name or 'merged'}"
    # Every value from a record or a name is escaped for markdown (_md_values); the code blocks
    # are built from repr-quoted or escaped values and added after.
    template_vars = {
        # With eval_results, ModelCardData moves model_name into the model-index: pass it again.
        "model_name": model_name,
        "hf_pma_version": __version__,
        "merge_version": merge.get("hf_pma_version") or _MISSING,
        "created_text": datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d")
        if is_number(created, finite=True)
        else None,
        "base_model": base_model,
        "n_snapshots": len(sources),
        "strategy_text": _strategy_text(strategy, merge),
        "interval_text": _interval_text(merge, sources),
        "window_text": _window_text(merge),
        "tokens_span_text": f"{_fmt_int(min(tokens))} to {_fmt_int(max(tokens))}" if tokens else _MISSING,
        "dtype_text": f"{merge.get('dtype') or _MISSING} / {merge.get('accumulate_dtype') or _MISSING}",
        "snapshot_rows": _snapshot_rows(sources, weights),
        "snapshot_warnings": _snapshot_warnings(sources, weights),
        "training": _training_view(records.training),
        "eval_columns": columns,
        "eval_rows": rows,
        "eval_dataset": (records.eval or {}).get("eval_dataset"),
        "plot_file": plot_file,
        "plot_description": _plot_description(records) if plot_file else "",
        "load_id": load_id,
        "has_tokenizer": _has_tokenizer(folder),
        "small_model_note": _small_run_note(records.training),
        "paper_url": PAPER_URL,
    }
    template_vars = _md_values(template_vars)
    command = escape(training["command"]) if training.get("command") else None
    merge_code = _merge_code(records)
    template_vars |= {
        "strategy_text": _strategy_text(strategy, merge),  # escaped within
        "comparison_table": comparison_table((records.eval or {}).get("comparison")),  # escaped cells
        "hub_revisions": _hub_revisions(sources),  # escaped cells
        "load_id_code": repr(load_id),  # a Python literal in the snippet
        "training_command": command,
        "command_fence": _fence(command or ""),
        "merge_code": merge_code,
        "merge_code_fence": _fence(merge_code),
    }
    card = ModelCard.from_template(card_data, template_str=template_text(template), **template_vars)
    # Tidy the blank lines that Jinja blocks leave behind, and sanitize the whole text once more;
    # no line holds a control character (each value was escaped: this keeps a custom template's too).
    content = re.sub(r"\n{3,}", "\n\n", sanitize_text(card.content)).rstrip() + "\n"
    content = "\n".join(escape(line) for line in content.split("\n"))
    return ModelCard(content)


def template_text(template: str | os.PathLike[str] | None = None) -> str:
    """The text of a card template (``None``: the packaged one), read the guarded way: a regular
    file after its links (never a FIFO or a device, which would hang or act), at most
    :data:`MAX_TEMPLATE_BYTES`, UTF-8; else a one-line error naming it."""
    path = Path(template) if template is not None else template_path()
    # A template the user names is theirs to place: its links are followed (the filesystem root
    # confines nothing); it must still be a regular file, small, and UTF-8.
    try:
        data = read_bytes(path, Path(path.absolute().anchor), max_bytes=MAX_TEMPLATE_BYTES)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"card template {err}") from None
    except (UnsafeFileError, PermissionError) as err:
        raise type(err)(f"card template {err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"card template {escape(path)} is not UTF-8 text") from None


def write_model_card(
    folder: str | os.PathLike[str],
    repo_id: str | None = None,
    *,
    plot: bool = True,
    **kwargs: Any,
) -> Path:
    """(Re)write ``README.md`` (the model card) in the merged ``folder``, and the plot first
    when ``plot`` and matplotlib is installed; returns the card's path. ``kwargs`` go to
    :func:`build_model_card`.

    Under the folder's claim, from the first record read to the card written (a ``merge
    --overwrite`` replacing the folder is waited for, and the card describes the merge it stands
    beside). Every check comes before the first byte: the records, the card rendered from them,
    and the places of the card and the plot (:func:`hf_pma.utils.fs.check_output_file`)."""
    folder = Path(folder)
    with hold_claim(folder, what="merged folder"):
        records = load_records(folder)
        build_model_card(folder, repo_id, records=records, **kwargs)  # raises on what it cannot render
        check_output_file(folder / CARD_NAME, "the model card", record=True)
        if (folder / CARD_NAME).exists() and not bears_mark(folder / CARD_NAME):  # a card the user wrote
            raise FileExistsError(
                f"refusing to replace {escape(folder / CARD_NAME)}: hf-pma did not generate it (no '{CARD_MARK.strip()}' "
                "comment in it); move it aside, then run hf-pma card again"
            )
        if plot:
            check_output_file(folder / PLOT_NAME, "the training plot", record=True)
            _try_plot(folder, records)
        # Rendered again: the card shows the plot only when one was drawn.
        card = build_model_card(folder, repo_id, records=records, **kwargs)
        path = folder / CARD_NAME
        atomic_write_text(path, str(card))  # a crash never leaves half a card
    logger.info(f"Wrote the model card {path.name} in {folder.name}")
    return path


def _try_plot(folder: Path, records: FolderRecords) -> Path | None:
    try:
        from hf_pma.publishing.plot import plot_training

        return plot_training(records, folder / PLOT_NAME)
    except ImportError as err:
        logger.warning(f"No training plot in the card: {err}")
    except ValueError as err:
        logger.info(f"No training plot in the card: {err}")
    return None
