"""What a run's snapshots are planned to be, and the lines that tell the user: pure functions.

The snapshot engine (:class:`hf_pma.snapshots.taker.SnapshotTaker`) asks these functions and
logs what they return; none of them reads a file, a model or a clock, so each is tested on its own:

* :func:`planned_snapshots`: how many snapshots the rest of a run takes, and where that figure
  comes from (the automatic interval's aim, or the planned steps in the selected phases).
* :func:`check_disk_plan` and :func:`extra_folders`: the disk budget of those snapshots
  (:class:`hf_pma.snapshots.budget.DiskBudget` does the arithmetic and the free-space reading).
* :func:`cost_to_report`: which snapshot's cost says what every snapshot costs (the second: the
  first also allocates the host buffers).
* The messages: :func:`no_constant_phase_warning`, :func:`interval_choice_message`,
  :func:`announce_message`, :func:`uneven_spacing_message`, :func:`end_message`,
  :func:`small_interval_warning`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hf_pma.core.schedule import IntervalChoice, RunPlan, snapshot_spacing
from hf_pma.snapshots.budget import DiskBudget, SnapshotBudgetError, SnapshotCost
from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.text import command_line, escape

__all__ = [
    "planned_snapshots",
    "check_disk_plan",
    "extra_folders",
    "cost_to_report",
    "no_constant_phase_warning",
    "interval_choice_message",
    "destination",
    "announce_message",
    "end_message",
    "small_interval_warning",
    "uneven_spacing_message",
    "varying_steps_message",
]


def planned_snapshots(
    plan: RunPlan, interval_tokens: int | None, tokens_per_step: int | None, after_step: int
) -> tuple[int | None, str]:
    """How many snapshots the run takes after optimizer step ``after_step``, and where that figure
    comes from; ``None`` when unknown (an interval given, before the first step's tokens are known).

    Args:
        plan: the planned run (the phase of every planned step).
        interval_tokens: V in use (``None``: the automatic interval, not chosen yet).
        tokens_per_step: the global tokens of one optimizer step (``None``: not known yet).
        after_step: the optimizer steps already done.
    """
    if tokens_per_step is None or interval_tokens is None:
        if interval_tokens is None:
            count = plan.intended_snapshots()
            return count, f"the automatic interval aims at {count}"
        return None, "unknown before the first step"
    remaining = plan.selected_steps(after_step)
    if tokens_per_step >= interval_tokens:
        return remaining, f"{remaining} steps snapshot, at most one snapshot a step"
    count = remaining * tokens_per_step // interval_tokens
    return (
        count,
        f"{remaining} steps snapshot, {interval_tokens:,} tokens apart at {tokens_per_step:,} a step",
    )


def check_disk_plan(
    disk: DiskBudget,
    snapshot_bytes: int,
    folders: int,
    listed: int,
    used_bytes: int,
    count: int | None,
    what: str,
) -> tuple[str | None, str | None]:
    """The disk budget for the rest of a run: the error message (``None`` when it fits) and the
    plan in words (``None`` when over budget).

    Args:
        disk: the budget.
        snapshot_bytes: the bytes of one snapshot.
        folders: snapshot-sized folders on disk at the peak, those of the run listed already included.
        listed: the run's snapshots listed already (a resumed run).
        used_bytes: what those take.
        count: the snapshots still to take (:func:`planned_snapshots`); ``None`` when unknown.
        what: where ``count`` comes from.
    """
    try:
        plan = disk.check_plan(snapshot_bytes, max(0, folders - listed), count or folders, what, used_bytes)
    except SnapshotBudgetError as err:
        return str(err), None
    return None, plan


def extra_folders(kept_on_disk: int | None, listed: int) -> int:
    """Snapshot-sized folders still to come on disk beyond the next snapshot, with ``listed`` on disk
    and ``kept_on_disk`` at the peak (``None``: unknown, counted as none)."""
    return max(0, (kept_on_disk or 0) - listed - 1)


def cost_to_report(
    blocked_s: Sequence[float], write_s: Sequence[float], num_bytes: int, at_end: bool = False
) -> SnapshotCost | None:
    """The cost that says what every snapshot costs, or ``None`` when it is not known yet.

    The second snapshot's once it is written (the first also pays one-time costs: pinned host
    buffers are allocated then); at the end of a run with a single snapshot, that one's.

    Args:
        blocked_s: per snapshot taken, the seconds the training thread was blocked.
        write_s: per completed write (or online fold), its seconds, in order.
        num_bytes: the bytes of the last snapshot written.
        at_end: whether training has ended (a single snapshot is then reported).
    """
    if not blocked_s or not write_s:
        return None
    which = 1 if len(blocked_s) > 1 and len(write_s) > 1 else 0
    if which == 0 and not at_end:
        return None
    return SnapshotCost(
        blocked_s[which], write_s[which], num_bytes, first_blocked_s=blocked_s[0] if which else None
    )


def no_constant_phase_warning(plan: RunPlan, phases: Sequence[str], scheduler_name: str | None) -> str | None:
    """The one warning of a planned schedule that never holds the LR constant (PMA's premise);
    ``None`` when it does. ``scheduler_name`` is a Trainer's ``lr_scheduler_type`` (``"cosine"``)
    or, from a loop of one's own, the scheduler's class (``"LambdaLR"``: the advice is then in
    ``transformers.get_scheduler`` words)."""
    if plan.has_constant_phase:
        return None
    trainer = scheduler_name is None or scheduler_name.islower()  # SchedulerType values are lower case
    what = (
        f"lr_scheduler_type={scheduler_name!r}" if trainer else f"the lr_scheduler ({escape(scheduler_name)})"
    )
    advice = (
        "lr_scheduler_type='warmup_stable_decay' (lr_scheduler_kwargs={'num_decay_steps': ...}) or 'constant'"
        if trainer
        else "get_scheduler('warmup_stable_decay', optimizer, num_warmup_steps=..., num_training_steps=..., "
        "scheduler_specific_kwargs={'num_decay_steps': ...}) or a constant LR"
    )
    return (
        f"hf-pma: {what} has no constant-LR phase "
        f"({plan.stable_steps} of {plan.planned_steps} planned steps at the peak LR). PMA merges "
        f"snapshots taken at a constant LR to preview what annealing would give; for that, train with {advice}. "
        f"If you keep this schedule, snapshots are taken in the {'/'.join(phases)} phases (about "
        f"{plan.intended_snapshots()} of them) and a merge of the last ones averages weights along the "
        "decay: close to the final weights, rarely better."
    )


def interval_choice_message(choice: IntervalChoice, tokens_per_step: int, phases: Sequence[str]) -> str:
    """What the automatic interval is and why (logged at INFO once it is chosen)."""
    return (
        f"hf-pma: interval_tokens not given: chose {choice.interval_tokens:,} tokens (every "
        f"{choice.steps_between:.2f} steps of {tokens_per_step:,} tokens; {choice.reason}): about "
        f"{choice.expected_snapshots} snapshots in the {'/'.join(phases)} phases "
        f"({choice.snapshot_steps} of {choice.planned_steps} planned steps; {choice.stable_steps} at the peak LR)"
    )


def destination(pma_dir: str | os.PathLike[str], online: str | None) -> str:
    """Where the snapshots go, in words: the folder, or the online average and its folder."""
    if online is not None:
        return f"into an online {online} average, saved at the end to {escape(Path(pma_dir) / f'online-{online}')}"
    return f"into {escape(pma_dir)}"


def announce_message(
    interval_tokens: int,
    tokens_per_step: int,
    automatic: bool,
    phases: Sequence[str],
    where: str,
    disk_plan: str | None,
) -> str:
    """The line shown once per run at its first step: where the snapshots go, how often, what
    they take on disk (``where``: :func:`destination`; ``disk_plan``: :func:`check_disk_plan`'s)."""
    steps = interval_tokens / tokens_per_step
    chosen = "; chosen automatically, see Choosing V in the docs" if automatic else ""
    disk = f"; disk: {disk_plan}" if disk_plan else ""
    return (
        f"hf-pma: a snapshot every {interval_tokens:,} tokens ({steps:.1f} steps{chosen}) in the "
        f"{'/'.join(phases)} phases {where}{disk}"
    )


def end_message(count: int, total_bytes: int, pma_dir: str | os.PathLike[str]) -> str:
    """The line shown at the end of a run: how many snapshots there are and how to merge them
    (the command shell-quoted, to paste)."""
    return (
        f"hf-pma: {count} snapshots ({format_bytes(total_bytes)}) in {escape(pma_dir)}; "
        f"`{command_line(['hf-pma', 'merge', pma_dir])} --last N -o MERGED` averages the last N"
    )


def small_interval_warning(interval_tokens: int, step_tokens: int) -> str | None:
    """The warning of an interval smaller than one optimizer step; ``None`` when it is not."""
    if step_tokens <= interval_tokens:
        return None
    return (
        f"hf-pma: interval_tokens={interval_tokens:,} is smaller than one step ({step_tokens:,} tokens): "
        "at most one snapshot per step is taken"
    )


def uneven_spacing_message(interval_tokens: int, tokens_per_step: int, automatic: bool) -> str | None:
    """The line shown once at the first step when a V given by the user is not a whole number of
    steps of ``tokens_per_step`` tokens (the snapshots then come unequally spaced, where SMA assumes
    equal spacing; the V is kept): :func:`hf_pma.core.schedule.snapshot_spacing`. ``None`` for an
    automatic V (always whole steps), a whole number of steps, or less than one step."""
    if automatic or interval_tokens <= tokens_per_step or interval_tokens % tokens_per_step == 0:
        return None
    return f"hf-pma: {snapshot_spacing(interval_tokens, tokens_per_step)}"


def varying_steps_message(
    interval_tokens: int, first_tokens: int, step_tokens: int, step: int, automatic: bool
) -> str:
    """The line shown once when optimizer step ``step`` counts ``step_tokens`` tokens where the
    run's first step counted ``first_tokens`` (padding counted out, batches of varying length or
    size, a short last batch): snapshots come every ``interval_tokens`` tokens, evenly spaced in
    tokens, but no longer the same number of steps apart (an automatic V is a whole number of the
    first step's tokens only)."""
    how = "chosen as" if automatic else "given:"
    return (
        f"hf-pma: optimizer steps vary in tokens (step {step:,}: {step_tokens:,}; the first: {first_tokens:,}): "
        f"snapshots stay every {interval_tokens:,} tokens ({how} {interval_tokens / first_tokens:.2f} steps of "
        f"the first step's tokens), so the number of steps between them varies"
    )
