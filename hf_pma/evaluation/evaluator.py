"""Evaluate live, snapshot and merged models: held-out LM metrics, lm-eval tasks, result records.

* :func:`evaluate_language_modeling`: loss, perplexity and bits-per-byte of a causal LM on raw
  texts, with a strided window for texts longer than the context, batched.
* :func:`evaluate_model`: that plus lm-eval tasks (:mod:`hf_pma.evaluation.harness`) for one in-memory
  model, flattened into ``{"lm": {...}, task: {metric: value, metric_stderr: value}}``.
* :func:`evaluate_models`: several models by path or name, one at a time (one in memory at
  once), into a report whose ``results`` / ``eval_dataset`` are the ``pma_eval.json`` record
  (:func:`write_eval_record`) that the model card reads.

Under ``accelerate launch`` / ``torchrun`` every evaluation runs once, on the main process,
while the other ranks wait and then receive the same result (:mod:`hf_pma.utils.distributed`). The
model must then be a full copy on the main process (a plain or DDP-wrapped model, or one loaded
from a folder), not FSDP/ZeRO-3 shards.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from hf_pma.core.manifest import EVAL_RECORD_NAME, check_eval_comparison, check_eval_results
from hf_pma.evaluation.harness import flatten_lm_eval_results, jsonable, load_task_manager, run_lm_eval
from hf_pma.evaluation.model_checks import (
    LOAD_KWARGS,
    check_hub_model,
    check_loadable_folder,
    custom_code_error,
    resolve_model,
)
from hf_pma.evaluation.options import EvalOptions
from hf_pma.io.guarded import read_json
from hf_pma.utils.distributed import require_unsharded_model, run_on_main_process
from hf_pma.utils.formatting import MISSING, format_metric, markdown_table, metric_label
from hf_pma.utils.fs import atomic_write_json, hold_claim
from hf_pma.utils.text import escape

logger = logging.get_logger(__name__)

__all__ = [
    "check_hub_model",
    "EVAL_RECORD_NAME",
    "LM_TASK",
    "plan_windows",
    "context_length",
    "evaluate_language_modeling",
    "evaluate_model",
    "check_tokenizer",
    "load_model_for_eval",
    "evaluate_models",
    "model_labels",
    "write_eval_record",
    "read_eval_record",
    "results_table",
]

# The "task" under which held-out LM metrics appear in flat results and in pma_eval.json.
LM_TASK = "lm"
_LM_METRICS = ("loss", "perplexity", "bits_per_byte")
_DEFAULT_CONTEXT = 2048


# ---------------------------------------------------------------- held-out LM metrics


def plan_windows(num_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows ``(start, end, num_scored)`` over a sequence of ``num_tokens`` ids whose first id
    is a prefix (BOS) that is never scored.

    The first window is ``[0, block_size)`` and scores its ``block_size - 1`` targets; each next
    window ends ``stride`` tokens later, is at most ``block_size`` long, and scores only its
    last ``end - previous_end`` targets. So every token after the prefix is scored exactly once,
    with at least ``block_size - stride`` tokens of context (or all tokens before it).
    Needs ``1 <= stride <= block_size - 1``.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    if not 1 <= stride <= block_size - 1:
        raise ValueError(f"stride must be between 1 and block_size - 1 = {block_size - 1}, got {stride}")
    if num_tokens < 2:
        return []
    end = min(block_size, num_tokens)
    windows = [(0, end, end - 1)]
    while end < num_tokens:
        new_end = min(end + stride, num_tokens)
        windows.append((max(0, new_end - block_size), new_end, new_end - end))
        end = new_end
    return windows


def context_length(model: Any, tokenizer: Any = None) -> int:
    """The longest input the model takes: its config's position limit, capped by the
    tokenizer's ``model_max_length`` when that is set; 2048 when neither says."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    limit = None
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limit = min(limit, tok_max) if limit else tok_max
    if limit is None:
        logger.warning(f"the model's context length is unknown: using {_DEFAULT_CONTEXT}")
        limit = _DEFAULT_CONTEXT
    return limit


def _prefix_token_id(tokenizer: Any) -> int | None:
    for attr in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return None


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def evaluate_language_modeling(
    model: Any,
    tokenizer: Any,
    texts: Iterable[str],
    block_size: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Held-out language-modelling metrics of a causal LM on ``texts``.

    Each text is tokenized without special tokens and preceded by the tokenizer's BOS token
    (EOS when it has none), so that every one of its tokens is scored. Texts longer than
    ``block_size`` (default: the model's context length) are scored with overlapping windows
    that advance by ``stride`` tokens (default ``block_size // 2``; see :func:`plan_windows`).
    Windows are batched ``batch_size`` at a time; log-probabilities are computed in float32.

    Returns ``loss`` (mean NLL per token, nats), ``perplexity`` (``exp(loss)``),
    ``bits_per_byte`` (total NLL / ln 2 / UTF-8 bytes of the texts: independent of the
    tokenizer), ``tokens`` (scored), ``bytes``, ``texts`` (non-empty texts scored),
    ``block_size``, ``stride`` and ``per_text`` (``{"nll": [...], "tokens": [...]}``, one entry per
    non-empty text in order: for paired comparisons of two models on the same texts); the totals go through the shipped ``evaluate`` module
    ``bits_per_byte`` (:mod:`hf_pma.evaluation.metrics`). With ``device`` the model is moved there; the
    model's train/eval mode is restored afterwards. Under several processes this runs on the
    main process only.
    """
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is a {type(text).__name__}, not a string")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not any(texts):
        raise ValueError("no text to evaluate: every text is empty")
    block_size = block_size or context_length(model, tokenizer)
    stride = stride or max(1, block_size // 2)
    plan_windows(2, block_size, stride)  # checks block_size and stride now, not after tokenizing
    return run_on_main_process(
        _evaluate_language_modeling, model, tokenizer, texts, block_size, stride, batch_size, device, progress
    )


def _evaluate_language_modeling(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    block_size: int,
    stride: int,
    batch_size: int,
    device: str | torch.device | None,
    progress: bool,
) -> dict[str, Any]:
    from hf_pma.evaluation.metrics import load_metric

    model = require_unsharded_model(model)
    prefix = _prefix_token_id(tokenizer)
    if prefix is None:
        logger.warning(
            "the tokenizer has neither a BOS nor an EOS token: the first token of each text is not scored"
        )
    texts = [t for t in texts if t]
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    sequences = [([prefix] if prefix is not None else []) + list(ids) for ids in encoded]
    windows = [(i, *w) for i, seq in enumerate(sequences) for w in plan_windows(len(seq), block_size, stride)]
    # Longest first: batches of similar lengths waste little padding.
    windows.sort(key=lambda w: w[2] - w[1], reverse=True)

    if device is not None and not hasattr(model, "hf_device_map"):
        model.to(device)
    device = _model_device(model)
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    nll = [0.0] * len(texts)
    scored = [0] * len(texts)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for first in tqdm(
                range(0, len(windows), batch_size),
                desc="Held-out LM",
                unit="batch",
                disable=not progress,
            ):
                batch = windows[first : first + batch_size]
                width = max(end - start for _, start, end, _ in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, (text, start, end, _) in enumerate(batch):
                    ids[row, : end - start] = torch.tensor(sequences[text][start:end])
                    mask[row, : end - start] = 1
                ids, mask = ids.to(device), mask.to(device)
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                token_lp = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).double().cpu()
                for row, (text, start, end, n_scored) in enumerate(batch):
                    length = end - start
                    # Logit j predicts token j + 1: the last n_scored targets sit at j = length-1-n .. length-2.
                    nll[text] -= float(token_lp[row, length - 1 - n_scored : length - 1].sum())
                    scored[text] += n_scored
    finally:
        model.train(was_training)

    # Every text counts its bytes, even one too short to score (a single token and no prefix).
    result = load_metric("bits_per_byte").compute(
        nll=nll, tokens=scored, bytes=[len(t.encode("utf-8")) for t in texts]
    )
    result.update(
        texts=len(texts), block_size=block_size, stride=stride, per_text={"nll": nll, "tokens": scored}
    )
    logger.info(
        f"Held-out LM: {len(texts)} texts, {result['tokens']} tokens, {result['bytes']} bytes: "
        f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}, bits/byte {result['bits_per_byte']:.4f}"
    )
    return result


# ---------------------------------------------------------------- one model, all evaluations


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
        flat[LM_TASK] = {name: lm[name] for name in _LM_METRICS}
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


def check_tokenizer(vocab_rows: int, tokenizer: Any, model_name: str, tokenizer_name: str) -> None:
    """``ValueError`` when ``tokenizer`` cannot belong to a model with ``vocab_rows`` embedding
    rows: it makes ids past the end of the embedding. (Fewer tokens than rows is normal: vocabularies
    are often padded; far fewer is logged as a warning.)"""
    size = len(tokenizer)
    if size > vocab_rows:
        raise ValueError(
            f"tokenizer {tokenizer_name} does not match model {model_name}: it has {size} tokens but the model's "
            f"embedding has {vocab_rows} rows (pass the model's own tokenizer with --tokenizer)"
        )
    if size < 0.9 * vocab_rows:
        logger.warning(
            f"tokenizer {tokenizer_name} has {size} tokens, model {model_name} has {vocab_rows} embedding rows: "
            "make sure it is the tokenizer the model was trained with"
        )


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    if Path(name).is_dir():
        check_loadable_folder(name)
    try:
        return AutoTokenizer.from_pretrained(name, **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise custom_code_error(name, err) or FileNotFoundError(
            f"cannot load tokenizer {name}: {err}"
        ) from None


def _config_vocab_rows(name: str) -> int | None:
    from transformers import AutoConfig

    if Path(name).is_dir():
        check_loadable_folder(name)  # no custom code; config.json read through the bounded reader first
    try:
        config = AutoConfig.from_pretrained(name, **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise custom_code_error(name, err) or FileNotFoundError(
            f"model {name} is not readable: {err}"
        ) from None
    config = getattr(config, "text_config", None) or config
    return getattr(config, "vocab_size", None)


def load_model_for_eval(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Any | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for evaluation from a model folder (snapshot, merge, Trainer
    output) or a Hub id, checked: ``FileNotFoundError`` for an unreadable folder, ``ValueError``
    for a PMA run folder or a tokenizer that does not match the model.

    ``tokenizer`` (a name, folder or tokenizer object) defaults to the model folder's own, or the
    nearest one among its two parent folders (a snapshot's run folder).
    """
    from transformers import AutoModelForCausalLM

    from hf_pma.io.sharded import sharded_weight_files
    from hf_pma.merging.consolidate import load_sharded_model

    tok_obj = None if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if tok_obj is not None:
        name, _ = resolve_model(model, None, find_tokenizer=False)
        tok, tok_name = tok_obj, type(tok_obj).__name__
    else:
        name, tok_name = resolve_model(model, tokenizer)
        tok = _load_tokenizer(tok_name)
    rows = _config_vocab_rows(name)
    if rows is not None:  # cheap check before the weights are read
        check_tokenizer(rows, tok, name, tok_name)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) or dtype == "auto" else getattr(torch, str(dtype))
    try:
        if Path(name).is_dir() and sharded_weight_files(name) is not None:
            loaded = load_sharded_model(name, dtype=torch_dtype)
        else:
            loaded = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise custom_code_error(name, err) or FileNotFoundError(
            f"model {name} is not readable: {err}"
        ) from None
    except RuntimeError as err:  # a config.json whose shapes disagree with the weights (size mismatch)
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ValueError(f"model {escape(name)} does not load: {escape(first.strip())}") from None
    check_tokenizer(loaded.get_input_embeddings().weight.shape[0], tok, name, tok_name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded.to(device).eval()
    return loaded, tok


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
    Returns ``{"results": {label: flat results}, "eval_dataset": eval_dataset, "models":
    {label: model}, "tokenizers": {label: the tokenizer's folder or name}, "lm": {label: LM
    details}, "lm_eval": {label: lm-eval results}}``: its
    ``results`` and ``eval_dataset`` form the ``pma_eval.json`` record
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
            rows = _config_vocab_rows(name)
            if rows is not None:
                check_tokenizer(rows, _load_tokenizer(tok_name), name, tok_name)

    report: dict[str, Any] = {
        "results": {},
        "eval_dataset": eval_dataset,
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


# ---------------------------------------------------------------- records and tables


def write_eval_record(
    folder: str | os.PathLike[str],
    results: Mapping[str, Mapping[str, Mapping[str, float | None]]],
    eval_dataset: str | None = None,
    update: bool = True,
) -> Path:
    """Write ``pma_eval.json`` into ``folder`` (atomically): ``{"results": {label: {task:
    {metric: value}}}, "eval_dataset": ...}``, the record the model card reads.

    ``results`` is ``evaluate_models(...)["results"]`` or ``{label: evaluate_model(...)["results"]}``,
    labels such as ``"last snapshot"``, ``"PMA merge"``, ``"annealed"``. With ``update`` the new
    results are merged into an existing record: models, tasks and metrics are added or updated,
    everything else is kept (the other models' results, the metrics not given again, the record's
    other keys such as ``comparison``, and its ``eval_dataset`` unless a new one is given).
    ``update=False`` starts afresh. Under several processes only the main process writes.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    check_eval_results(results)
    path = folder / EVAL_RECORD_NAME

    def write() -> Path:
        # Read, update and replace under the folder's claim: two jobs recording into one folder
        # both keep their results (the second waits for the first), and a merge replacing it is waited for.
        with hold_claim(folder, what="--record folder"):
            record: dict[str, Any] = {"results": {}, "eval_dataset": None}
            if update and path.is_file():
                record.update(read_eval_record(folder))  # every key kept (e.g. "comparison")
            merged = {str(k): {str(t): dict(m) for t, m in v.items()} for k, v in record["results"].items()}
            for label, tasks in results.items():
                for task, metrics in tasks.items():
                    merged.setdefault(str(label), {}).setdefault(str(task), {}).update(metrics)
            record["results"] = merged
            if eval_dataset is not None:
                record["eval_dataset"] = str(eval_dataset)
            atomic_write_json(path, record)
        logger.info(f"Wrote {path}")
        return path

    return run_on_main_process(write)


def read_eval_record(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``pma_eval.json`` record of ``folder``; ``ValueError`` naming the file when malformed."""
    path = Path(folder) / EVAL_RECORD_NAME
    data = read_json(path, folder, kind="record")
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError(
            f"{escape(path)} should hold an object with a 'results' object (label -> task -> metric)"
        )
    check_eval_results(data["results"], f"{escape(path)}: results")
    check_eval_comparison(data.get("comparison"), f"{escape(path)}: comparison")  # the card reads it
    return data


def results_table(results: Mapping[str, Mapping[str, Mapping[str, float | None]]]) -> str:
    """A markdown table of flat results: one row per ``task/metric``, one column per model
    label; a metric's stderr is shown beside it (``0.3120 ± 0.0140``)."""
    labels = list(results)
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for label in labels:
        for task, metrics in results[label].items():
            for metric, value in metrics.items():
                base, _, filt = metric.partition(",")
                if base.endswith("_stderr"):
                    continue
                stderr = metrics.get(f"{base}_stderr{',' + filt if filt else ''}")
                rows.setdefault((task, metric), {})[label] = format_metric(value, stderr)
    body = [
        [f"{task}/{metric_label(task, metric)}", *(cells.get(label, MISSING) for label in labels)]
        for (task, metric), cells in rows.items()
    ]
    return markdown_table(["metric", *labels], body)
