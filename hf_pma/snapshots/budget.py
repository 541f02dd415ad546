"""Disk and time budgets of a run's snapshots, checked before the first step and as snapshots land.

* :class:`DiskBudget`: the bytes the snapshots will take (one snapshot's size in the saved dtype
  x the snapshots kept) against the free space of the snapshot folder, or against
  ``max_disk_bytes`` when the user sets one. Over budget at train begin: a
  :class:`SnapshotBudgetError` naming both numbers and the knobs, before anything is written.
  As snapshots land the check is repeated with their real size (one ``statvfs`` call): a warning
  when the rest of the run no longer fits, an error when the next snapshot does not.
* :class:`TimeBudget`: the cost of a snapshot (seconds the training thread was blocked,
  seconds of writing, bytes; the second snapshot's, since the first also allocates the host
  buffers) against the training time between snapshots; a warning, with the interval that
  would do, when snapshots take more than :data:`TIME_SHARE_LIMIT` of it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from transformers.utils import logging

from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.fs import free_bytes
from hf_pma.utils.logs import notice

logger = logging.get_logger(__name__)

__all__ = [
    "SnapshotBudgetError",
    "TIME_SHARE_LIMIT",
    "human_bytes",
    "free_bytes",
    "DiskBudget",
    "SnapshotCost",
    "TimeBudget",
]

# Snapshots should cost at most this share of the training time.
TIME_SHARE_LIMIT = 0.05
# Margin kept free beside the snapshots (filesystem metadata, config and tokenizer files).
_MARGIN = 0.02

_KNOBS = (
    "interval_tokens (fewer snapshots), keep_last (keep only the newest K), save_dtype='bfloat16' "
    "(half the bytes of float32), sharded (per-rank files), or max_disk_bytes (your own budget)"
)


class SnapshotBudgetError(ValueError):
    """The snapshots of a run would not fit on disk (raised before they are written)."""


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


@dataclasses.dataclass
class SnapshotCost:
    """What one snapshot cost: training-thread seconds blocked, writer seconds, bytes written.

    ``first_blocked_s``: the first snapshot's blocked seconds when this cost is a later
    snapshot's (the first pays one-time costs: host buffers are allocated then); ``None`` when
    this is the run's only snapshot.
    """

    blocked_s: float
    write_s: float
    num_bytes: int
    first_blocked_s: float | None = None


class TimeBudget:
    """Training time between snapshots vs what a snapshot costs; warns past :data:`TIME_SHARE_LIMIT`."""

    def __init__(self, limit: float = TIME_SHARE_LIMIT) -> None:
        self.limit = limit
        self.blocked_s = 0.0
        self.reported = False
        self._start = time.perf_counter()
        self._steps = 0

    def step_done(self) -> None:
        """Count one optimizer step."""
        self._steps += 1

    def add_blocked(self, seconds: float) -> None:
        """Add seconds the training thread spent on snapshots."""
        self.blocked_s += seconds

    def step_seconds(self) -> float | None:
        """Mean training seconds per step so far, snapshot time excluded."""
        if self._steps == 0:
            return None
        return max(0.0, time.perf_counter() - self._start - self.blocked_s) / self._steps

    def report(self, cost: SnapshotCost, steps_between: float, tokens_per_step: int, async_write: bool) -> str:
        """Log what a snapshot costs against the steps between snapshots; warn when too costly.

        Returns the message logged.
        """
        self.reported = True
        step_s = self.step_seconds() or 0.0
        interval_s = step_s * steps_between
        # What the training thread loses per snapshot: its own copy, plus the write when
        # synchronous, or the part of an asynchronous write that outlasts the interval.
        lost = cost.blocked_s + (cost.write_s if not async_write else max(0.0, cost.write_s - interval_s))
        share = lost / interval_s if interval_s > 0 else math.inf
        blocked = f"{cost.blocked_s:.2f}s of blocked training"
        if cost.first_blocked_s is None:
            what = f"the only snapshot cost {blocked}"
        else:
            what = f"a snapshot costs {blocked} (the first {cost.first_blocked_s:.2f}s, with one-time set-up)"
        message = (
            f"hf-pma: {what}, {cost.write_s:.2f}s of "
            f"{'background ' if async_write else ''}writing, {format_bytes(cost.num_bytes)}; snapshots come every "
            f"{steps_between:.1f} steps of {step_s:.3f}s ({interval_s:.1f}s): {100 * share:.1f}% of training time"
        )
        if share <= self.limit:
            notice(logger, message)  # what a user must know, shown to a plain script too
            return message
        steps_needed = max(lost / (self.limit * step_s) if step_s > 0 else math.inf, cost.write_s / step_s if step_s > 0 else 0)
        if math.isfinite(steps_needed):
            advice = (
                f"; an interval_tokens of at least {math.ceil(steps_needed) * tokens_per_step:,} "
                f"({math.ceil(steps_needed)} steps) keeps snapshots under {100 * self.limit:.0f}%"
            )
        else:
            advice = ""
        message = f"{message}, above {100 * self.limit:.0f}%{advice} (or use keep_last/save_dtype='bfloat16' to write less)"
        logger.warning(message)
        return message
