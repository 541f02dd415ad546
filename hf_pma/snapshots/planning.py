"""What a run's snapshots are planned to be, and the lines that tell the user: pure functions.

The snapshot engine (:class:`hf_pma.snapshots.taker.SnapshotTaker`) asks these functions and
logs what they return; none of them reads a file, a model or a clock, so each is tested on its own:

* :func:`planned_snapshots`: how many snapshots the rest of a run takes, and where that figure
  comes from (the automatic interval's aim, or the planned steps in the selected phases).
* :func:`check_disk_plan` and :func:`extra_folders`: the disk budget of those snapshots
  (:class:`hf_pma.snapshots.budget.DiskBudget` does the arithmetic and the free-space reading).
* :func:`widened_interval`: the automatic interval that keeps snapshots under the cost budget.
* :func:`cost_message`, :func:`widened_message`, :func:`unmeasured_cost_message`: what the
  snapshots were measured to cost (:mod:`hf_pma.snapshots.overhead`), in one line.
* The messages: :func:`no_constant_phase_warning`, :func:`interval_choice_message`,
  :func:`announce_message`, :func:`uneven_spacing_message`, :func:`end_message`,
  :func:`small_interval_warning`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.schedule import SNAPSHOTS_PER_WINDOW, IntervalChoice, RunPlan, snapshot_spacing
from hf_pma.snapshots.budget import DiskBudget, SnapshotBudgetError
from hf_pma.snapshots.overhead import MIN_CLEAN_STEPS, OverheadEstimate
from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.text import command_line, escape

__all__ = [
    "planned_snapshots",
    "check_disk_plan",
    "extra_folders",
    "WidenedInterval",
    "widened_interval",
    "cost_record",
    "should_widen",
    "widened_message",
    "cost_message",
    "unmeasured_cost_message",
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
    plan: RunPlan,
    interval_tokens: int | None,
    tokens_per_step: int | None,
    after_step: int,
    tokens: int | None = None,
    first_step: int = 0,
) -> tuple[int | None, str]:
    """How many snapshots the run takes after optimizer step ``after_step``, and where that figure
    comes from; ``None`` when unknown (an interval given, before the first step's tokens are known).

    Exact for steps of ``tokens_per_step`` tokens: a step in a phase that snapshots takes one when
    its tokens reach the next multiple of V (:func:`hf_pma.core.schedule.crossed_boundary`), so a
    run of such steps takes as many snapshots as it crosses multiples, at most one a step.

    Args:
        plan: the planned run (the phase of every planned step).
        interval_tokens: V in use (``None``: the automatic interval, not chosen yet).
        tokens_per_step: the global tokens of one optimizer step (``None``: not known yet).
        after_step: the optimizer steps already done.
        tokens: the global tokens after ``after_step`` (default ``after_step * tokens_per_step``).
        first_step: no snapshot before this optimizer step (the steps a cost budget measures first).
    """
    if tokens_per_step is None or interval_tokens is None:
        if interval_tokens is None:
            count = plan.intended_snapshots()
            return count, f"the automatic interval aims at {count}"
        return None, "unknown before the first step"
    base = after_step * tokens_per_step if tokens is None else tokens
    count = 0
    for first, last in plan.selected_runs(after_step):
        first = max(first, first_step)
        if first > last:
            continue
        start = base + (first - 1 - after_step) * tokens_per_step
        end = base + (last - after_step) * tokens_per_step
        count += min(last - first + 1, end // interval_tokens - start // interval_tokens)
    remaining = plan.selected_steps(after_step)
    if tokens_per_step >= interval_tokens:
        return count, f"{remaining} steps snapshot, at most one snapshot a step"
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


@dataclasses.dataclass(frozen=True)
class WidenedInterval:
    """A wider automatic interval for snapshots that cost more than the budget (:func:`widened_interval`)."""

    interval_tokens: int
    steps_between: float
    needed_steps: int  # the fewest steps between snapshots that meet the budget
    max_steps: float  # the most that keeps SNAPSHOTS_PER_WINDOW snapshots in the constant phase
    constant_steps: int  # the planned constant phase (or the steps that snapshot, without one)
    budget_met: bool

    def to_record(self) -> dict[str, Any]:
        """JSON for the manifest's ``interval_choice["widened"]``."""
        return {
            "steps_between": self.steps_between,
            "needed_steps": self.needed_steps,
            "max_steps": self.max_steps,
            "constant_steps": self.constant_steps,
            "budget_met": self.budget_met,
        }


def widened_interval(
    estimate: OverheadEstimate, budget: float, interval_tokens: int, tokens_per_step: int, plan: RunPlan
) -> WidenedInterval:
    """The automatic interval that keeps snapshots under ``budget`` of the training time: a whole
    multiple of ``interval_tokens`` (the snapshots stay on one grid, whole steps apart), at most
    the one that still leaves :data:`~hf_pma.core.schedule.SNAPSHOTS_PER_WINDOW` snapshots in the
    planned constant phase (the steps that snapshot when the schedule has none): the merge window
    needs them. ``budget_met`` says whether that limit left the budget unmet."""
    steps_now = interval_tokens / tokens_per_step
    needed = estimate.steps_for(budget)
    constant = plan.stable_steps if plan.has_constant_phase else plan.selected_steps()
    most = constant / SNAPSHOTS_PER_WINDOW
    wanted = max(1, math.ceil(needed / steps_now))
    allowed = max(1, math.floor(most / steps_now))
    factor = min(wanted, allowed)
    return WidenedInterval(
        interval_tokens=factor * interval_tokens,
        steps_between=factor * steps_now,
        needed_steps=needed,
        max_steps=most,
        constant_steps=constant,
        budget_met=wanted <= allowed,
    )


def should_widen(estimate: OverheadEstimate, steps_between: float, budget: float) -> bool:
    """Whether snapshots ``steps_between`` steps apart surely cost more than ``budget``: the low
    end of the cost's interval passes it (:meth:`OverheadEstimate.share_low`). A point estimate
    above the budget by noise (steps slowed by another job) keeps the interval, so that the same
    run takes the same snapshots on a busy machine and an idle one."""
    return estimate.share_low(steps_between) > budget


def cost_record(estimate: OverheadEstimate, steps_between: float, budget: float, widened: bool) -> dict[str, Any]:
    """JSON for the manifest's ``interval_choice["cost"]``: what the review of the automatic
    interval measured (snapshots ``steps_between`` steps apart) and what it decided against
    ``budget``: widened only when the low end of the cost's interval passes it. A resumed run
    keeps it, and does not review again."""
    def finite(value: float) -> float | None:  # a step time of 0 gives no share: JSON has no inf
        return value if math.isfinite(value) else None

    return {
        "steps_between": steps_between,
        "share": finite(estimate.share(steps_between)),
        "share_low": finite(estimate.share_low(steps_between)),
        "share_high": finite(estimate.share(steps_between) + estimate.share_margin(steps_between)),
        "budget": budget,
        "decision": "widened" if widened else "kept",
        "measured": estimate.to_dict(),
    }


def _percent(share: float) -> str:
    percent = 100 * share
    return f"{percent:.1f}%" if percent < 10 else f"{percent:.0f}%"


def widened_message(widened: WidenedInterval, estimate: OverheadEstimate, budget: float, snapshots: int) -> str:
    """The one line that says the automatic interval was widened, the run's ``snapshots`` from now
    on (those taken included), and whether the budget is met."""
    before = estimate.steps_between
    after = widened.steps_between
    line = (
        f"hf-pma: the first snapshots cost {_percent(estimate.share(before))} "
        f"(± {_percent(estimate.share_margin(before))}) of training time at every {before:g} steps, above "
        f"max_overhead={_percent(budget)}: widened interval_tokens to {widened.interval_tokens:,} (every {after:g} "
        f"steps: about {_percent(estimate.share(after))} ± {_percent(estimate.share_margin(after))}; "
        f"{snapshots} snapshots in all)"
    )
    if not widened.budget_met:
        line += (
            f"; {_percent(budget)} needs every {widened.needed_steps:,} steps, but the {widened.constant_steps:,}-step "
            f"constant phase must keep at least {SNAPSHOTS_PER_WINDOW} snapshots for the merge window (every "
            f"{widened.max_steps:g} steps at most): the budget cannot be met in this run"
        )
    return line


def cost_message(
    estimate: OverheadEstimate,
    *,
    steps_between: float,
    tokens_per_step: int,
    run_steps: int,
    snapshots: int,
    setup_s: float,
    blocked_s: Sequence[float],
    write_s: float,
    num_bytes: int | None,
    budget: float | None,
    automatic: bool,
) -> tuple[str, bool]:
    """The cost line of a run, from what its first snapshots measured, and whether it is over
    ``budget`` (then a warning; with a given V it says which V would do).

    The headline is this run's training time with snapshots against without, projected from the
    measurement: the set-up at train begin, what each snapshot adds to the steps (``snapshots``
    of them, the first interval's own figure for the first), and the wait for the last write at
    the end; ``± `` the interval of about 95 %.
    """
    base = run_steps * estimate.step_s
    first = estimate.first_extra_s if estimate.first_extra_s is not None else estimate.extra_s
    known = 1 + estimate.intervals if estimate.first_extra_s is not None else estimate.intervals
    later = max(0, snapshots - known)
    added = setup_s + first + estimate.extra_s * (max(known - 1, 0) + later) + write_s
    run_share = added / base if base > 0 else math.inf
    run_margin = 2 * estimate.extra_se_s * max(1, snapshots - 1) / base if base > 0 else math.inf
    share = estimate.share(steps_between)
    blocked = statistics.median(blocked_s[1:] or blocked_s) if blocked_s else 0.0
    size = f", {format_bytes(num_bytes)}" if num_bytes else ""
    message = (
        f"hf-pma: snapshots cost {_percent(run_share)} (± {_percent(run_margin)}) of training time in this run: "
        f"each adds {estimate.extra_s:.3f}s (± {2 * estimate.extra_se_s:.3f}s) to steps of {estimate.step_s:.3f}s "
        f"({blocked:.3f}s of it blocked copying the weights, the rest the {write_s:.2f}s background write competing "
        f"for the CPU{size}), {_percent(share)} (± {_percent(estimate.share_margin(steps_between))}) at a snapshot "
        f"every {steps_between:g} steps, plus {setup_s:.2f}s of set-up; measured over {estimate.intervals} "
        f"interval(s) and {estimate.clean_steps} steps without snapshot work"
    )
    over = budget is not None and share > budget
    if over and not automatic:
        steps = estimate.steps_for(budget)
        message += (
            f"; above max_overhead={_percent(budget)}: an interval_tokens of at least {steps * tokens_per_step:,} "
            f"({steps:,} steps) keeps snapshots under it (or use keep_last/save_dtype='bfloat16' to write less)"
        )
    elif over:
        message += f"; above max_overhead={_percent(budget)}"
    return message, over


def unmeasured_cost_message(costs: Sequence[Any], num_bytes: int | None, async_write: bool) -> str:
    """The cost line of a run too short to measure its step times against (fewer than three
    snapshots, or too few steps without snapshot work): what its snapshots blocked and wrote."""
    blocked = sum(c.blocked_s for c in costs)
    written = sum(c.write_s or 0.0 for c in costs)
    size = f", {format_bytes(num_bytes)} each" if num_bytes else ""
    return (
        f"hf-pma: {len(costs)} snapshot(s) cost {blocked:.2f}s of blocked training and {written:.2f}s of "
        f"{'background ' if async_write else ''}writing{size}; too few to measure what they add to the step time "
        f"(that needs 3 snapshots and {MIN_CLEAN_STEPS} steps without snapshot work)"
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
