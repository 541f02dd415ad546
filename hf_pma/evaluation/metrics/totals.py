"""Loss, perplexity and bits-per-byte from per-document sums: the arithmetic of held-out LM metrics.

Plain Python, run by ``hf-pma eval`` and the Trainer's held-out evaluation directly: no
``evaluate.load`` (which copies a module into ``HF_HOME/modules`` and imports it from there, so
code another user of a shared cache planted there would run, and a read-only ``HF_HOME`` fails).
The shipped ``evaluate`` module (:mod:`hf_pma.evaluation.metrics.bits_per_byte`) computes with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["language_model_totals"]

# exp overflows above ~709 nats per token: an infinite perplexity is reported, not a crash.
_EXP_LIMIT = 700


def language_model_totals(nll: Iterable[float], tokens: Iterable[int], bytes: Iterable[int]) -> dict[str, float | int]:  # noqa: A002 - the count is called "bytes"
    """``loss`` (sum(nll) / sum(tokens), nats per token), ``perplexity`` (``exp(loss)``),
    ``bits_per_byte`` (sum(nll) / ln 2 / sum(bytes)), ``tokens`` and ``bytes``, from one summed
    negative log-likelihood (nats), scored-token count and UTF-8 byte count per document.
    ``ValueError`` when no token or no byte is counted."""
    total_nll = math.fsum(float(v) for v in nll)
    total_tokens = int(sum(int(v) for v in tokens))
    total_bytes = int(sum(int(v) for v in bytes))
    if total_tokens <= 0 or total_bytes <= 0:
        raise ValueError(f"no scored tokens or bytes (tokens={total_tokens}, bytes={total_bytes})")
    loss = total_nll / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < _EXP_LIMIT else math.inf,
        "bits_per_byte": total_nll / math.log(2) / total_bytes,
        "tokens": total_tokens,
        "bytes": total_bytes,
    }
