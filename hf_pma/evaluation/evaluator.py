"""Evaluate live, snapshot and merged models: held-out LM metrics and lm-eval tasks, one model
or several.

* :func:`evaluate_model`: held-out LM metrics (:func:`~hf_pma.evaluation.language_modeling.evaluate_language_modeling`)
  and lm-eval tasks (:mod:`hf_pma.evaluation.harness`) for one in-memory model, flattened into
  ``{"lm": {...}, task: {metric: value, metric_stderr: value}}``.
* :func:`evaluate_models`: several models by path or name (loaded by
  :func:`~hf_pma.evaluation.loading.load_model_for_eval`), one in memory at a time, into a
  report whose ``results`` / ``eval_dataset`` are the ``pma_eval.json`` record
  (:func:`~hf_pma.evaluation.records.write_eval_record`) that the model card reads.

Under ``accelerate launch`` / ``torchrun`` every evaluation runs once, on the main process,
while the other ranks wait and then receive the same result (:mod:`hf_pma.utils.distributed`). The
model must then be a full copy on the main process (a plain or DDP-wrapped model, or one loaded
from a folder), not FSDP/ZeRO-3 shards.

The names this module held before it was split (the metric loop, model loading, the record and
its table) are still importable from it.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.manifest import EVAL_RECORD_NAME
from hf_pma.evaluation.corpus import documents_fingerprint
from hf_pma.evaluation.harness import flatten_lm_eval_results, jsonable, load_task_manager, run_lm_eval
from hf_pma.evaluation.language_modeling import (
    LM_METRICS,
    LM_TASK,
    context_length,
    evaluate_language_modeling,
    plan_windows,
)
from hf_pma.evaluation.loading import check_tokenizer, config_vocab_rows, load_model_for_eval, load_tokenizer
from hf_pma.evaluation.model_checks import check_hub_model, resolve_model
from hf_pma.evaluation.options import EvalOptions
from hf_pma.evaluation.records import read_eval_record, results_table, write_eval_record
from hf_pma.utils.distributed import run_on_main_process
from hf_pma.utils.text import escape

logger = logging.get_logger(__name__)

__all__ = [
    "evaluate_model",
    "evaluate_models",
    "model_labels",
    # re-exported from the modules this one was split into
    "check_hub_model",
    "EVAL_RECORD_NAME",
    "LM_TASK",
    "plan_windows",
    "context_length",
    "evaluate_language_modeling",
    "check_tokenizer",
    "load_model_for_eval",
    "write_eval_record",
    "read_eval_record",
    "results_table",
]


def evaluate_model(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | None = None,
    options: EvalOptions | None = None,
    *,
    task_manager: Any = None,
    progress: bool = True,
    **option_fields: Any,
) -> dict[str, Any]:
    """Held-out LM metrics on ``texts`` and/or lm-eval tasks for one in-memory model.

    ``options`` (:class:`~hf_pma.evaluation.options.EvalOptions`; its fields may also be given
    as keywords: ``tasks=``, ``include_path=``, ``limit=``, ``batch_size=``, ``block_size=``,
    ``stride=``, ``num_fewshot=``, ``bootstrap_iters=``) says what to run. Returns
    ``{"results": {"lm": {loss, perplexity, bits_per_byte}, task: {metric: value, ...}},
    "lm": <evaluate_language_modeling's full dict> | None, "lm_eval": <lm-eval's results
    without per-sample logs> | None}``. Pass a ``task_manager`` from
    :func:`hf_pma.evaluation.harness.load_task_manager` to reuse it across models. Under several
    processes this runs on the main process only.
    """
    options = EvalOptions.build(options, **option_fields)
    if not texts and not options.tasks:
        raise ValueError("nothing to evaluate: give texts (held-out LM metrics) and/or tasks (lm-eval)")
    tasks = options.tasks
    if tasks and task_manager is None:
        tasks, task_manager = load_task_manager(tasks, options.include_path)
    return run_on_main_process(
        _evaluate_model, model, tokenizer, texts, options.replace(tasks=tasks), task_manager, progress
    )


def _evaluate_model(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | None,
    options: EvalOptions,
    task_manager: Any,
    progress: bool,
) -> dict[str, Any]:
    flat: dict[str, dict[str, float | None]] = {}
    lm = raw = None
    if texts:
        lm = evaluate_language_modeling(
            model,
            tokenizer,
            texts,
            block_size=options.block_size,
            stride=options.stride,
            batch_size=options.batch_size,
            progress=progress,
        )
        flat[LM_TASK] = {name: lm[name] for name in LM_METRICS}
    if options.tasks:
        results = run_lm_eval(
            model,
            tokenizer,
            options.tasks,
            limit=options.limit,
            batch_size=options.batch_size,
            num_fewshot=options.num_fewshot,
            bootstrap_iters=options.bootstrap_iters,
            task_manager=task_manager,
        )
        flat.update(flatten_lm_eval_results(results))
        raw = jsonable(results)
    return {"results": flat, "lm": lm, "lm_eval": raw}


# ---------------------------------------------------------------- models by path


def model_labels(models: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Column labels for models: the folder name (``merged``, ``snapshot-4096``), made unique
    with parent folders where two would be equal."""
    parts = [Path(str(m).rstrip("/")).parts or (str(m),) for m in models]
    depth = [1] * len(models)
    labels = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
    for _ in range(8):
        dupes = {label for label in labels if labels.count(label) > 1}
        if not dupes:
            return labels
        depth = [d + 1 if label in dupes and d < len(p) else d for label, d, p in zip(labels, depth, parts)]
        labels = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
    return [f"{label} ({i})" for i, label in enumerate(labels)]


def evaluate_models(
    models: Sequence[str | os.PathLike[str]],
    labels: Sequence[str] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    texts: Sequence[str] | None = None,
    eval_dataset: str | None = None,
    options: EvalOptions | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    progress: bool = True,
    **option_fields: Any,
) -> dict[str, Any]:
    """Evaluate several models (folders or Hub ids) one after the other, one in memory at a time.

    ``options`` (or its fields as keywords) as :func:`evaluate_model`. Everything is checked
    before the first model is evaluated: the task names, every model folder and its tokenizer.
    Returns ``{"results": {label: flat results}, "eval_dataset": eval_dataset, "eval_documents":
    the fingerprint of ``texts`` (:func:`~hf_pma.evaluation.corpus.documents_fingerprint`), "models":
    {label: model}, "tokenizers": {label: the tokenizer's folder or name}, "lm": {label: LM
    details}, "lm_eval": {label: lm-eval results}}``: its
    ``results``, ``eval_dataset`` and ``eval_documents`` form the ``pma_eval.json`` record
    (:func:`write_eval_record`). Under several processes this runs on the main process only.
    """
    options = EvalOptions.build(options, **option_fields)
    models = [str(m) for m in models]
    if not models:
        raise ValueError("no model to evaluate")
    labels = list(labels) if labels else model_labels(models)
    if len(labels) != len(models) or len(set(labels)) != len(labels):
        raise ValueError(f"need one distinct label per model: {len(models)} models, labels {labels}")
    if not texts and not options.tasks:
        raise ValueError("nothing to evaluate: give texts (held-out LM metrics) and/or tasks (lm-eval)")
    return run_on_main_process(
        _evaluate_models, models, labels, tokenizer, texts, eval_dataset, options, dtype, device, progress
    )


def _evaluate_models(
    models: list[str],
    labels: list[str],
    tokenizer: Any,
    texts: Sequence[str] | None,
    eval_dataset: str | None,
    options: EvalOptions,
    dtype: Any,
    device: Any,
    progress: bool,
) -> dict[str, Any]:
    task_manager = None
    if options.tasks:
        tasks, task_manager = load_task_manager(options.tasks, options.include_path)
        options = options.replace(tasks=tasks)
    tokenizers: dict[str, str | None] = {}  # model -> its tokenizer's folder or name, in the results
    for model in models:  # fail on a bad folder or tokenizer now, not after hours of evaluation
        name, tok_name = resolve_model(model, tokenizer)
        tokenizers[model] = tok_name if isinstance(tok_name, str) else None
        if tokenizer is None and tok_name is not None and Path(tok_name) != Path(name):
            logger.info(f"{escape(model)}: evaluated with the tokenizer of its run folder {escape(tok_name)}")
        if Path(name).exists():
            rows = config_vocab_rows(name)
            if rows is not None:
                check_tokenizer(rows, load_tokenizer(tok_name), name, tok_name)

    report: dict[str, Any] = {
        "results": {},
        "eval_dataset": eval_dataset,
        "eval_documents": documents_fingerprint(texts) if texts else None,
        "models": {},
        "tokenizers": {},
        "lm": {},
        "lm_eval": {},
    }
    for index, (model, label) in enumerate(zip(models, labels), start=1):
        logger.info(f"[{index}/{len(models)}] evaluating {label} ({model})")
        loaded, tok = load_model_for_eval(model, tokenizer, dtype=dtype, device=device)
        try:
            out = evaluate_model(loaded, tok, texts, options, task_manager=task_manager, progress=progress)
        finally:
            del loaded
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        report["results"][label] = out["results"]
        report["models"][label] = model
        report["tokenizers"][label] = tokenizers.get(model)
        if out["lm"] is not None:
            report["lm"][label] = out["lm"]
        if out["lm_eval"] is not None:
            report["lm_eval"][label] = out["lm_eval"]
    return report
