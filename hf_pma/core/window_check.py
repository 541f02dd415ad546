"""The held-out check of an automatic window: where held-out documents are at hand, the window
that the rule chose from the run's records (:mod:`hf_pma.core.window_choice`) is checked on them.

The training loss cannot tell how much averaging will gain: a run at a low learning rate, early on,
falls as fast as one at a high rate, but its weights carry little noise to average away, so a
window that lags the run costs more than it gains. Held-out text measures it. The documents are
split once: every :data:`SELECTION_EVERY`-th document is a *selection* document, on which the
candidates are evaluated; the others are the *report* documents, the only ones any result is
reported on (a window chosen on the documents that report it would flatter itself).

The candidates are the rule's window ``k``, its halvings down to 2 (``k, ceil(k/2), ...``), the last
snapshot alone, and two wider windows, ``ceil(1.5 k)`` and ``2 k``, where the run's stretch (one
phase, one learning rate) holds them within :data:`WIDEST_SHARE` of the run: the rule's cap is a
share of the run that suits most runs, but a run whose weights carry more noise (a high learning
rate, late in a long run) gains from a longer window, and only held-out text can tell. The one
with the lowest mean loss over the selection documents is taken (another than the rule's only
when strictly lower). With fewer than :data:`MIN_SELECTION_DOCUMENTS`
selection documents the rule's window stands unchecked, said so.

Pure Python: no torch, no files.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from hf_pma.core.window_choice import WindowChoice
from hf_pma.utils.text import shown

__all__ = [
    "SELECTION_EVERY",
    "MIN_SELECTION_DOCUMENTS",
    "WIDEST_SHARE",
    "WIDER",
    "DocumentSplit",
    "describe_split",
    "split_for_selection",
    "candidate_windows",
    "pick_window",
    "checked_choice",
]

# Every this-many-th held-out document selects; the others report.
SELECTION_EVERY = 4
# Fewer selection documents than this: the check is not made (too noisy to overrule the rule).
MIN_SELECTION_DOCUMENTS = 5
# The widest window the check tries, as a share of the tokens trained (the rule's cap is a quarter).
WIDEST_SHARE = 0.5
# The wider windows the check tries, as fractions of the rule's (rounded up): 1.5x and 2x.
WIDER = ((3, 2), (2, 1))


@dataclasses.dataclass(frozen=True)
class DocumentSplit:
    """Which held-out documents select the window (``selection``) and which report the results
    (``report``), by index; ``skipped`` says why there is no selection split (then every document
    reports)."""

    selection: tuple[int, ...]
    report: tuple[int, ...]
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (counts, not indices)."""
        return {
            "selection_documents": len(self.selection),
            "report_documents": len(self.report),
            "every": SELECTION_EVERY,
            "skipped": self.skipped,
        }

    def describe(self) -> str:
        """One line for the person reading a comparison (:func:`describe_split`)."""
        return describe_split(self.to_dict())


def describe_split(record: Mapping[str, Any]) -> str:
    """The line that says how held-out documents were split, from :meth:`DocumentSplit.to_dict`
    (as a comparison's report records it)."""
    if record.get("skipped"):
        return f"Automatic windows unchecked: {record['skipped']}."
    selection, report = record["selection_documents"], record["report_documents"]
    return (
        f"Automatic windows checked on {selection} of the {selection + report} held-out documents (every "
        f"{record['every']}th, the selection split); every result is on the other {report}."
    )


def split_for_selection(documents: int) -> DocumentSplit:
    """The selection and report documents of ``documents`` held-out documents: every
    :data:`SELECTION_EVERY`-th (index ``SELECTION_EVERY - 1``, ``2 * SELECTION_EVERY - 1``, ...)
    selects; none does when that leaves fewer than :data:`MIN_SELECTION_DOCUMENTS`."""
    if not isinstance(documents, int) or isinstance(documents, bool) or documents < 0:
        raise ValueError(f"documents must be a non-negative integer, got {documents!r}")
    selection = tuple(i for i in range(documents) if i % SELECTION_EVERY == SELECTION_EVERY - 1)
    if len(selection) < MIN_SELECTION_DOCUMENTS:
        need = SELECTION_EVERY * MIN_SELECTION_DOCUMENTS
        return DocumentSplit(
            (), tuple(range(documents)), f"{documents} held-out document(s); a selection split needs at least {need}"
        )
    return DocumentSplit(selection, tuple(i for i in range(documents) if i not in selection))


def candidate_windows(count: int, widest: int | None = None) -> list[int]:
    """The windows checked for a rule's window of ``count``: ``count``, its halvings (rounded up)
    down to 2, 1 (the last snapshot alone), and, when ``count`` is 2 or more, its multiples
    :data:`WIDER` (rounded up) no wider than ``widest`` (the most snapshots a window may take:
    :func:`hf_pma.core.window_choice.widest_window`; ``None``: none wider); largest first."""
    for name, value in (("count", count), ("widest", widest)):
        if value is None and name == "widest":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {shown(value, 60)}")
    out, k = [count], count
    while k > 2:
        k = -(-k // 2)  # integer arithmetic: exact for any count
        out.append(k)
    if out[-1] != 1:
        out.append(1)
    if widest is not None and count >= 2:
        out += [w for w in (-(-count * num // den) for num, den in WIDER) if count < w <= widest]
    return sorted(set(out), reverse=True)


def _mean(values: Sequence[float]) -> float:
    """The mean of the documents' losses, NaN (a document without a scored token) left out; a
    value that is no real number is a one-line ``ValueError``."""
    if any(not isinstance(v, numbers.Real) or isinstance(v, bool) for v in values):
        raise ValueError("a selection document's loss is not a number")
    kept = [float(v) for v in values if not math.isnan(v)]
    if not kept:
        raise ValueError("no selection document with scored tokens")
    return math.fsum(v / len(kept) for v in kept)  # divided first: no overflow for huge losses


def pick_window(losses: Mapping[int, Sequence[float]], prefer: int | None = None) -> int:
    """The candidate with the lowest mean loss over the selection documents: ``losses`` maps each
    window (1: the last snapshot) to its per-document losses. Another window than ``prefer`` (the
    rule's; default the largest) is taken only when strictly lower, and of two equal others the
    larger; ``ValueError`` when the lists differ in length."""
    if not losses:
        raise ValueError("no candidate window")
    lengths = {len(v) for v in losses.values()}
    if len(lengths) != 1:
        raise ValueError("the candidates were not evaluated on the same selection documents")
    if prefer is not None and (not isinstance(prefer, int) or isinstance(prefer, bool)):
        raise ValueError(f"prefer must be a window (an integer) or None, got {shown(prefer, 60)}")
    order = sorted(losses, reverse=True)
    if prefer in losses:
        order.remove(prefer)
        order.insert(0, prefer)
    means = {k: _mean(losses[k]) for k in order}
    best = order[0]
    for k in order[1:]:
        if means[k] < means[best]:  # strictly lower (an infinite or NaN mean never wins)
            best = k
    return best


def _progress_known(tokens: Sequence[int] | None, picked: int) -> bool:
    """Whether ``tokens`` give the span of the newest ``picked``: counts, not decreasing, the newest
    positive."""
    if not tokens or picked > len(tokens) or picked < 1:
        return False
    first, newest = tokens[-picked], tokens[-1]
    counts = all(isinstance(t, int) and not isinstance(t, bool) for t in (first, newest))
    return counts and 0 <= first <= newest and newest > 0


def checked_choice(
    choice: WindowChoice, losses: Mapping[int, Sequence[float]], tokens: Sequence[int] | None = None
) -> WindowChoice:
    """``choice`` after the check over ``losses`` (:func:`pick_window`): the window taken, a
    reason that says what the selection documents showed (and, where the check changed the
    window, what the rule had chosen and why), and ``checked`` (the rule's window and each
    candidate's mean loss minus the last snapshot's). ``tokens`` (the snapshots' token counts,
    oldest first) give the span and share of the run of a window the check changed; ``trend``
    and ``noise`` stay the rule's."""
    picked = pick_window(losses, prefer=choice.count)
    last = _mean(losses[1]) if 1 in losses else None
    against = {k: _mean(v) - last for k, v in sorted(losses.items(), reverse=True) if k != 1 and last is not None}
    documents = len(next(iter(losses.values())))
    where = f"{documents} selection documents of the held-out text (never reported)"
    measured = "; ".join(f"newest {k}: {d:+.4f}" for k, d in against.items())
    measured = f"mean loss against the last snapshot: {measured}" if measured else "no merge to measure"
    share = choice.share
    if picked == choice.count:
        reason = f"{choice.reason}; checked on {where}: the rule's window does best ({measured})"
    else:
        share, span = None, ""
        if _progress_known(tokens, picked):
            share = (tokens[-1] - tokens[-picked]) / tokens[-1]
            span = f"tokens {tokens[-picked]:,} to {tokens[-1]:,} ({100 * share:.0f}% of the run): " if picked > 1 else ""
        verdict = (
            f"the last snapshot does best on {where}: too early for a merge to help"
            if picked == 1
            else f"{span}the best on {where}"
        )
        reason = f"{verdict} ({measured}); the rule had chosen the newest {choice.count}: {choice.reason}"
    record = {
        "documents": documents,
        "rule_count": choice.count,
        "rule": choice.rule,
        "against_last": {str(k): d for k, d in against.items()},
    }
    return dataclasses.replace(
        choice,
        count=picked,
        rule=choice.rule if picked == choice.count else "held-out",
        reason=reason,
        share=share,
        checked=record,
    )
