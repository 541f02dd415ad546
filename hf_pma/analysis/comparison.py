"""The paired comparison of a merge with the last snapshot and an annealed model.

Every model is evaluated on the same held-out documents (the ``per_text`` details of
:func:`hf_pma.evaluation.language_modeling.evaluate_language_modeling`), so each document gives one
paired difference per model: the mean of those differences and its standard error say whether
a model beats the reference (the last constant-LR snapshot) by more than the noise of the
evaluation text. With an annealed model at the same tokens, the share of the annealing gain the
merge recovers is ``(last - merge) / (last - annealed)``.

Pure arithmetic on plain values (no torch, no model), plus :func:`write_comparison`, which adds
the record to a merged folder's ``pma_eval.json`` (key ``comparison``) where the model card
reads it. The record::

    {"reference": "last snapshot", "merge": "PMA merge", "annealed": "annealed" | None,
     "documents": 40, "tokens": 61440,
     "models": {label: {"loss": per-document mean, "per_token_loss": ..., "tokens": ...,
                        "loss_diff": mean paired difference from the reference,
                        "paired_stderr": its standard error}},
     "annealing_gain_recovered": 0.96 | None,
     "anneal": {"steps": ..., "tokens": ..., "decay_type": ...}}   # when an annealed fork exists
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import is_int
from hf_pma.utils.text import escape, shown

__all__ = [
    "COMPARISON_KEY",
    "PairedDifference",
    "annealing_gain_recovered",
    "document_losses",
    "paired_comparison",
    "paired_difference",
    "per_text",
    "read_anneal_record",
    "token_loss",
    "write_comparison",
]

logger = get_logger(__name__)

COMPARISON_KEY = "comparison"  # its key in pma_eval.json
_MAX_COUNT = 2**63  # a count of steps or tokens past this cannot come from a run


@dataclass(frozen=True)
class PairedDifference:
    """The mean per-document difference ``model - reference`` over ``documents`` documents and its
    standard error (``None`` with fewer than 2 documents)."""

    mean: float
    stderr: float | None
    documents: int

    @property
    def z(self) -> float | None:
        """The difference in standard errors (``None`` without a positive standard error)."""
        return self.mean / self.stderr if self.stderr else None


def per_text(lm: Mapping[str, Any], label: str = "model") -> tuple[list[float], list[int]]:
    """Each held-out document's summed NLL and scored tokens from one model's LM details (their
    ``per_text``): what the paired comparison pairs and ``hf-pma compare``'s bootstrap resamples.
    ``ValueError`` naming ``label`` when they are missing or not paired lists."""
    found = lm.get("per_text") if isinstance(lm, Mapping) else None
    if not isinstance(found, Mapping):
        raise ValueError(f"{shown(label)}: no per-document results ('per_text') to pair")
    nll, tokens = found.get("nll"), found.get("tokens")
    if not isinstance(nll, Sequence) or not isinstance(tokens, Sequence) or len(nll) != len(tokens):
        raise ValueError(f"{shown(label)}: 'per_text' needs lists 'nll' and 'tokens' of the same length")
    return [float(x) for x in nll], [int(t) for t in tokens]


def document_losses(lm: Mapping[str, Any], label: str = "model") -> list[float]:
    """The mean loss per token of each held-out document (``nll / tokens``) of one model's LM
    details (``evaluate_models(...)["lm"][label]``), ``nan`` for a document with no scored token."""
    nll, tokens = per_text(lm, label)
    return [n / t if t else math.nan for n, t in zip(nll, tokens)]


def token_loss(lm: Mapping[str, Any], label: str = "model") -> float:
    """The loss per token over all documents together (total NLL / total scored tokens)."""
    nll, tokens = per_text(lm, label)
    total = sum(tokens)
    if not total:
        raise ValueError(f"{shown(label)}: no scored token")
    return sum(nll) / total


def paired_difference(losses: Sequence[float], reference: Sequence[float]) -> PairedDifference:
    """Mean of ``losses[i] - reference[i]`` over the documents where both are numbers, and its
    paired standard error (sample standard deviation of the differences / sqrt(n)).

    ``ValueError`` when the two lists differ in length (not the same documents) or share no document.
    """
    if len(losses) != len(reference):
        raise ValueError(
            f"cannot pair {len(losses)} documents with {len(reference)}: not the same held-out documents"
        )
    diffs = [a - b for a, b in zip(losses, reference) if not (math.isnan(a) or math.isnan(b))]
    if not diffs:
        raise ValueError("no document with scored tokens in both models")
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return PairedDifference(statistics.fmean(diffs), stderr, len(diffs))


def annealing_gain_recovered(last: float, merge: float, annealed: float) -> float | None:
    """The share of the annealing gain that the merge recovers, ``(last - merge) / (last -
    annealed)`` (1.0: as good as annealing, above 1: better, below 0: worse than the last
    snapshot); ``None`` when annealing did not help (``annealed >= last``)."""
    gain = last - annealed
    if not gain > 0:
        return None
    return (last - merge) / gain


def paired_comparison(
    lm: Mapping[str, Mapping[str, Any]],
    reference: str = "last snapshot",
    merge: str = "PMA merge",
    annealed: str = "annealed",
    *,
    tokens: int | None = None,
    model_tokens: Mapping[str, int | None] | None = None,
    anneal: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The comparison record of models evaluated on the same held-out documents.

    ``lm``: label -> LM details with ``per_text`` (``evaluate_models(...)["lm"]``); ``reference``
    (the last snapshot) must be among them, ``merge`` and ``annealed`` may be. Per model: its
    per-document mean loss (``loss``: every document weighs the same, the unit of the paired
    test), its per-token loss (``per_token_loss``), and for every model but the reference the
    mean paired difference from the reference (``loss_diff``, negative: better) with its standard
    error (``paired_stderr``). ``annealing_gain_recovered`` as :func:`annealing_gain_recovered`
    of the per-document means (``None`` without an annealed model, or when annealing did not help).
    ``tokens``: the training tokens at which the models are compared; ``model_tokens``: each
    model's own (added to its row); ``anneal``: what the annealed model is (``steps``,
    ``tokens``, ``decay_type``, ...), which the card shows.

    Documents without a scored token in some model are left out of every model's numbers, so
    that all of them cover the same documents. ``ValueError`` naming the model when the details
    are missing or cover other documents.
    """
    if reference not in lm:
        raise ValueError(
            f"the reference model {shown(reference)} is not among the evaluated models {shown(sorted(lm))}"
        )
    losses = {label: document_losses(details, label) for label, details in lm.items()}
    count = len(losses[reference])
    for label, values in losses.items():
        if len(values) != count:
            raise ValueError(
                f"{shown(label)} was evaluated on {len(values)} documents, {shown(reference)} on {count}: "
                "not the same documents"
            )
    keep = [i for i in range(count) if not any(math.isnan(values[i]) for values in losses.values())]
    if not keep:
        raise ValueError("no held-out document has scored tokens in every model")
    kept = {label: [values[i] for i in keep] for label, values in losses.items()}
    models: dict[str, dict[str, Any]] = {}
    for label in lm:
        row: dict[str, Any] = {
            "loss": statistics.fmean(kept[label]),
            "per_token_loss": token_loss(lm[label], label),
        }
        if label != reference:
            diff = paired_difference(kept[label], kept[reference])
            row["loss_diff"], row["paired_stderr"] = diff.mean, diff.stderr
        if model_tokens and model_tokens.get(label) is not None:
            row["tokens"] = int(model_tokens[label])  # type: ignore[arg-type]
        models[label] = row
    record: dict[str, Any] = {
        "reference": reference,
        "merge": merge if merge in lm else None,
        "annealed": annealed if annealed in lm else None,
        "documents": len(keep),
        "tokens": int(tokens) if tokens is not None else None,
        "models": models,
        "annealing_gain_recovered": None,
    }
    if annealed in lm and merge in lm:
        record["annealing_gain_recovered"] = annealing_gain_recovered(
            models[reference]["loss"], models[merge]["loss"], models[annealed]["loss"]
        )
    if anneal is not None:
        record["anneal"] = dict(anneal)
    return record


def read_anneal_record(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``pma_anneal.json`` of an annealed folder (``<run>/annealed``: where the fork started and
    ended, ``start_step``, ``start_tokens``, ``end_step``, ``end_tokens``, the decay's ``steps``,
    ``tokens`` and ``decay_type``, the peak ``learning_rate``, the ``checkpoint`` it forked from and
    the run's ``snapshot`` at its end), or ``None`` when it has none; a record whose
    counts are not counts, or whose decay is not one of linear, cosine or 1-sqrt, is a one-line
    ``ValueError`` naming the file (it may come from anywhere)."""
    from hf_pma.core.manifest import ANNEAL_IN_PROGRESS, ANNEAL_RECORD_NAME
    from hf_pma.core.strategies import DECAY_SHAPES
    from hf_pma.io.guarded import read_json

    path = Path(folder) / ANNEAL_RECORD_NAME
    if not os.path.lexists(path):  # a link, a FIFO or a folder there is read (and refused) by the one way in
        return None
    record = read_json(path, folder, kind="record")
    if not isinstance(record, dict):
        raise ValueError(f"{escape(path)}: expected an object")
    if record.get(ANNEAL_IN_PROGRESS) is True:
        raise ValueError(
            f"{escape(path)}: the annealed fork in {escape(folder)} did not finish (stopped before its record was "
            "written): fork again (anneal_from_checkpoint, or resume the training), which redoes it"
        )
    for key in ("start_step", "start_tokens", "end_step", "end_tokens", "steps", "tokens"):
        value = record.get(key)
        if value is not None and not is_int(value, 0, _MAX_COUNT - 1):
            raise ValueError(f"{escape(path)}: {key} should be a count, got {shown(value)}")
    if record.get("decay_type") is not None and record["decay_type"] not in DECAY_SHAPES:
        raise ValueError(f"{escape(path)}: decay_type should be one of {', '.join(DECAY_SHAPES)}")
    return record


def write_comparison(merged_dir: str | os.PathLike[str], comparison: Mapping[str, Any]) -> Path:
    """Add ``comparison`` (a :func:`paired_comparison` record) to the evaluation record
    ``pma_eval.json`` of ``merged_dir`` (key ``comparison``, replacing an earlier one), where the
    model card reads it; the record must exist (``hf_pma.evaluation.records.write_eval_record``).
    Read, update and replace under the folder's claim. Returns the record's path. Under several
    processes only the main process writes."""
    from hf_pma.core.manifest import EVAL_RECORD_NAME
    from hf_pma.io.guarded import read_json
    from hf_pma.utils.distributed import run_on_main_process
    from hf_pma.utils.fs import atomic_write_json, hold_claim

    folder = Path(merged_dir)
    path = folder / EVAL_RECORD_NAME
    if not isinstance(comparison, Mapping) or not isinstance(comparison.get("models"), Mapping):
        raise ValueError("comparison: expected a paired_comparison record (with 'models')")

    def write() -> Path:
        with hold_claim(folder, what="record folder"):
            record = read_json(path, folder, kind="record")
            if not isinstance(record, dict):
                raise ValueError(f"{escape(path)}: expected an object")
            record[COMPARISON_KEY] = dict(comparison)
            atomic_write_json(path, record)
        logger.info(f"Wrote the comparison into {escape(path)}")
        return path

    return run_on_main_process(write)
