"""Held-out language-modelling metrics of a causal LM: loss, perplexity and bits-per-byte on raw
texts, with a strided window for texts longer than the context, batched.

:func:`evaluate_language_modeling` is the metric loop; :func:`plan_windows` says which tokens
each window scores (every token once, with at least ``block_size - stride`` tokens of
context). Under ``accelerate launch`` / ``torchrun`` it runs once, on the main process, while
the other ranks wait and then receive the same result (:mod:`hf_pma.utils.distributed`); the
model must then be a full copy on the main process, not FSDP/ZeRO-3 shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.evaluation.corpus import check_texts
from hf_pma.evaluation.metrics.totals import language_model_totals
from hf_pma.utils.distributed import require_unsharded_model, run_on_main_process
from hf_pma.utils.logs import progress_bar

logger = logging.get_logger(__name__)

__all__ = ["LM_TASK", "LM_METRICS", "plan_windows", "context_length", "evaluate_language_modeling"]

# The "task" under which held-out LM metrics appear in flat results and in pma_eval.json.
LM_TASK = "lm"
# The metrics of that task in flat results.
LM_METRICS = ("loss", "perplexity", "bits_per_byte")
_DEFAULT_CONTEXT = 2048


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
    non-empty text in order: for paired comparisons of two models on the same texts); the totals are
    :func:`hf_pma.evaluation.metrics.totals.language_model_totals` (no ``evaluate.load``). With ``device`` the model is moved there; the
    model's train/eval mode is restored afterwards. Under several processes this runs on the
    main process only.
    """
    texts = list(texts)
    check_texts(texts)
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
            for first in progress_bar(
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
    result = language_model_totals(nll, scored, [len(t.encode("utf-8")) for t in texts])
    result.update(
        texts=len(texts), block_size=block_size, stride=stride, per_text={"nll": nll, "tokens": scored}
    )
    logger.info(
        f"Held-out LM: {len(texts)} texts, {result['tokens']} tokens, {result['bytes']} bytes: "
        f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}, bits/byte {result['bits_per_byte']:.4f}"
    )
    return result
