"""Disk and cost budgets of a run's snapshots, checked before the first step and as snapshots land.

* :class:`DiskBudget`: the bytes the snapshots will take (one snapshot's size in the saved dtype
  x the snapshots kept) against the free space of the snapshot folder, or against
  ``max_disk_bytes`` when the user sets one. Over budget at train begin: a
  :class:`SnapshotBudgetError` naming both numbers and the knobs, before anything is written.
  As snapshots land the check is repeated with their real size (one ``statvfs`` call): a warning
  when the rest of the run no longer fits, an error when the next snapshot does not.
* The cost budget: the share of training time snapshots may take (``max_overhead``, default
  :data:`DEFAULT_MAX_OVERHEAD`), checked by :func:`check_max_overhead`; the cost itself is
  measured from the step times (:mod:`hf_pma.snapshots.overhead`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from transformers.utils import logging

from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.fs import free_bytes
from hf_pma.utils.text import shown

logger = logging.get_logger(__name__)

__all__ = [
    "SnapshotBudgetError",
    "DEFAULT_MAX_OVERHEAD",
    "check_max_overhead",
    "human_bytes",
    "free_bytes",
    "DiskBudget",
]

# Snapshots should cost at most this share of the training time (max_overhead's default).
DEFAULT_MAX_OVERHEAD = 0.01
# Margin kept free beside the snapshots (filesystem metadata, config and tokenizer files).
_MARGIN = 0.02

_KNOBS = (
    "interval_tokens (fewer snapshots), keep_last (keep only the newest K), save_dtype='bfloat16' "
    "(half the bytes of float32), sharded (per-rank files), or max_disk_bytes (your own budget)"
)


class SnapshotBudgetError(ValueError):
    """The snapshots of a run would not fit on disk (raised before they are written)."""


def check_max_overhead(value: object, name: str = "max_overhead") -> float | None:
    """``value`` as a share of training time in (0, 1), or ``None`` (no budget); a one-line
    ``ValueError`` naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(
            f"{name} must be a share of training time between 0 and 1 (0.01 is 1%) or None, got {shown(value, 60)}"
        )
    return float(value)


# The old names of the byte formatter and the free-space probe, which live in hf_pma.utils.
human_bytes = format_bytes


@dataclasses.dataclass
class DiskBudget:
    """The disk space a run's snapshots may use, and the checks against it.

    Args:
        folder: the snapshot folder.
        max_disk_bytes: the bytes the snapshots may take; ``None``: the free space of ``folder``.
    """

    folder: Path
    max_disk_bytes: int | None = None
    _warned: bool = False

    def available(self, used_bytes: int = 0) -> tuple[int | None, str]:
        """The bytes the snapshots may still take (``used_bytes``: what theirs take now), and what
        that figure is; ``None`` when the free space cannot be read (then nothing is checked)."""
        if self.max_disk_bytes is not None:
            return max(0, self.max_disk_bytes - used_bytes), "max_disk_bytes"
        return free_bytes(self.folder), f"free space of {self.folder}"

    def check_plan(self, snapshot_bytes: int, folders: int, snapshots: int, what: str, used_bytes: int = 0) -> str:
        """Raise :class:`SnapshotBudgetError` when ``folders`` snapshots of ``snapshot_bytes`` would not fit.

        ``snapshots`` is how many will be taken and ``what`` where that count comes from (both
        for the message); ``used_bytes`` what the run's snapshots take already (a resumed run).
        Returns the plan in words (logged at DEBUG; :class:`hf_pma.PMACallback` shows it once).
        """
        projected = snapshot_bytes * folders
        available, source = self.available(used_bytes)
        needed = projected if self.max_disk_bytes is not None else math.ceil(projected * (1 + _MARGIN))
        kept = f"{folders} on disk at once" if folders < snapshots else "all kept"
        if available is None:
            plan = f"{snapshots} snapshots of {format_bytes(snapshot_bytes)} ({kept}; {what}); {source}: unknown"
            logger.debug(f"hf-pma: disk budget: {plan}")
            return plan
        if needed > available:
            raise SnapshotBudgetError(
                f"hf-pma: the snapshots of this run would take {format_bytes(projected)} ({snapshots} snapshots of "
                f"{format_bytes(snapshot_bytes)}, {kept}; {what}) but the {source} is {format_bytes(available)}. "
                f"Change {_KNOBS}. Nothing was written."
            )
        plan = (
            f"{snapshots} snapshots of {format_bytes(snapshot_bytes)} ({kept}; {what}) take "
            f"{format_bytes(projected)} of {format_bytes(available)} ({source})"
        )
        logger.debug(f"hf-pma: disk budget: {plan}")
        return plan

    def check_next(self, snapshot_bytes: int, extra_folders: int, remaining: int, used_bytes: int) -> None:
        """As snapshots land: an error when the next snapshot does not fit, a warning (once) when
        the ``remaining`` ones (``extra_folders`` more on disk) no longer do. ``used_bytes``: what
        the run's snapshots take now."""
        free = free_bytes(self.folder)
        if self.max_disk_bytes is not None:
            budget = max(0, self.max_disk_bytes - used_bytes)
            free = budget if free is None else min(free, budget)
        if free is None:  # the free space cannot be read: the write itself reports a full disk
            return
        if snapshot_bytes > free:
            raise SnapshotBudgetError(
                f"hf-pma: the next snapshot needs {format_bytes(snapshot_bytes)} but only {format_bytes(free)} is left "
                f"for snapshots in {self.folder} (checkpoints or other files share the disk). Free space, or change "
                f"{_KNOBS}."
            )
        still = snapshot_bytes * extra_folders
        if still > free and not self._warned:
            self._warned = True
            logger.warning(
                f"hf-pma: the {remaining} snapshots still to come need about {format_bytes(still)} more but "
                f"{format_bytes(free)} is left in {self.folder}; the run will stop when the next one does not fit. "
                f"Free space, or change {_KNOBS}."
            )
