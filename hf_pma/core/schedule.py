"""When a snapshot is due: token intervals, the phase of the learning-rate schedule, and the
automatic choice of the interval. Pure Python: no torch, no files, no Trainer.

* Tokens are the global count over all processes. A snapshot is due at the end of the first
  optimizer step at which the count reaches the next multiple of the interval V
  (:func:`crossed_boundary`).
* The phase (``warmup``, ``stable``, ``decay``) is read from learning-rate *values*, never from
  a scheduler's class, so any schedule works (:class:`PhaseTracker`).
* With no interval given, :func:`choose_interval` picks V so that the steps that snapshot (the
  phases selected, from the planned schedule: :class:`RunPlan`) hold 4 windows of N snapshots
  (N = 10, the paper's compromise), in a whole number of steps so that the snapshots are
  equally spaced; :func:`snapshot_spacing` says in one line how a V spaces them.
* :class:`SnapshotSchedule` puts these together for a run: fed the token count and the LR of
  every optimizer step, it says when a snapshot is due, and resumes where a run stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from hf_pma.core.manifest import MAX_RECORD_INT
from hf_pma.utils.parsing import check_int, is_int, is_number
from hf_pma.utils.text import shown

__all__ = [
    "PHASES",
    "DEFAULT_RTOL",
    "SNAPSHOTS_PER_WINDOW",
    "WINDOWS_PER_STABLE_PHASE",
    "MAX_AUTO_INTERVAL_TOKENS",
    "snapshot_spacing",
    "MIN_CONSTANT_STEPS",
    "MIN_CONSTANT_SHARE",
    "crossed_boundary",
    "next_boundary",
    "lr_phase",
    "PhaseTracker",
    "planned_phases",
    "RunPlan",
    "plan_run",
    "IntervalChoice",
    "choose_interval",
    "check_phases",
    "positive_int_or_none",
    "StepTick",
    "SnapshotSchedule",
]

PHASES = ("warmup", "stable", "decay")

# Relative tolerance when comparing learning rates: schedules compute equal LRs exactly
# (base_lr * 1.0), so the tolerance only absorbs float noise, not a slow warmup.
DEFAULT_RTOL = 1e-6

# Auto interval: the stable phase should hold WINDOWS_PER_STABLE_PHASE windows of
# SNAPSHOTS_PER_WINDOW snapshots, so a merge of the last N is available early and often.
SNAPSHOTS_PER_WINDOW = 10
WINDOWS_PER_STABLE_PHASE = 4
# The largest V in the paper (MoE 10B/100B) is about 80B tokens; never go above it.
MAX_AUTO_INTERVAL_TOKENS = 80 * 10**9
# A schedule "has a constant-LR phase" when it holds the peak LR for at least this many steps
# and this share of the run (a long cosine stays within float noise of its peak for a few steps).
MIN_CONSTANT_STEPS = 2
MIN_CONSTANT_SHARE = 0.1


def check_phases(phases: str | Iterable[str]) -> tuple[str, ...]:
    """Validate a selection of phases; a single string is one phase."""
    if isinstance(phases, str):
        phases = (phases,)
    try:
        selected = tuple(phases)
    except TypeError:
        raise ValueError(f"phases must be a sequence of {PHASES}, got {phases!r}") from None
    bad = [p for p in selected if p not in PHASES]
    if bad or not selected:
        raise ValueError(f"phases must be a non-empty selection of {PHASES}, got {selected!r}")
    return tuple(dict.fromkeys(selected))


def crossed_boundary(previous_tokens: int, tokens: int, interval: int) -> int | None:
    """The multiple of ``interval`` reached by going from ``previous_tokens`` to ``tokens``.

    Returns the largest multiple of ``interval`` in ``(previous_tokens, tokens]``, or ``None``
    when the step crossed none. A step that crosses several multiples (an interval smaller than
    a step) yields one snapshot, at the largest.
    """
    if interval < 1:
        raise ValueError(f"interval must be a positive number of tokens, got {interval!r}")
    if tokens // interval > previous_tokens // interval:
        return (tokens // interval) * interval
    return None


def next_boundary(tokens: int, interval: int) -> int:
    """The first multiple of ``interval`` strictly above ``tokens``."""
    if interval < 1:
        raise ValueError(f"interval must be a positive number of tokens, got {interval!r}")
    return (tokens // interval + 1) * interval


def lr_phase(
    lr: float,
    peak_lr: float,
    previous_lr: float | None,
    peak_reached: bool,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """The phase of one optimizer step from the learning rate it used.

    * At the peak (``lr >= peak_lr`` up to ``rtol``): ``stable``.
    * Below the peak after the peak was reached: ``decay`` (annealing, step-downs, the
      minimum LR after a decay).
    * Below the peak before it was ever reached: ``warmup`` while the LR rises (or nothing
      is known yet), ``stable`` while it stays constant (a schedule that never reaches
      ``peak_lr``), ``decay`` when it falls.
    """
    if not (math.isfinite(lr) and math.isfinite(peak_lr)) or peak_lr <= 0:
        raise ValueError(
            f"learning rates must be finite and the peak positive, got lr={lr!r}, peak={peak_lr!r}"
        )
    if lr >= peak_lr * (1.0 - rtol):
        return "stable"
    if peak_reached:
        return "decay"
    if previous_lr is None:
        return "warmup"
    if abs(lr - previous_lr) <= rtol * max(abs(lr), abs(previous_lr)):
        return "stable"
    return "warmup" if lr > previous_lr else "decay"


class PhaseTracker:
    """Follows the learning rate step by step and names the phase of each step.

    Feed it the LR of every optimizer step (:meth:`update`); it remembers the previous LR and
    whether the peak was reached, which is all :func:`lr_phase` needs. Its :meth:`state` is
    JSON so a resumed run continues where it was.
    """

    def __init__(self, peak_lr: float, rtol: float = DEFAULT_RTOL) -> None:
        if not (is_number(peak_lr, finite=True) and peak_lr > 0):
            raise ValueError(f"peak_lr must be a positive finite number, got {peak_lr!r}")
        self.peak_lr = float(peak_lr)
        self.rtol = rtol
        self.previous_lr: float | None = None
        self.peak_reached = False
        self.phase: str | None = None

    def update(self, lr: float) -> str:
        """Record the LR of one optimizer step and return that step's phase."""
        phase = lr_phase(lr, self.peak_lr, self.previous_lr, self.peak_reached, self.rtol)
        if phase == "stable" and lr >= self.peak_lr * (1.0 - self.rtol):
            self.peak_reached = True
        self.previous_lr = float(lr)
        self.phase = phase
        return phase

    def state(self) -> dict[str, Any]:
        """JSON-ready state (for checkpoints)."""
        return {"peak_lr": self.peak_lr, "previous_lr": self.previous_lr, "peak_reached": self.peak_reached}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state` of an earlier run (the peak is kept from the live schedule)."""
        self.previous_lr = state.get("previous_lr")
        self.peak_reached = bool(state.get("peak_reached", False))


def planned_phases(lrs: Sequence[float], peak_lr: float, rtol: float = DEFAULT_RTOL) -> list[str]:
    """The phase of each planned step, given the LR of every step of the schedule."""
    tracker = PhaseTracker(peak_lr, rtol)
    return [tracker.update(lr) for lr in lrs]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a planned LR schedule means for snapshots: how many steps are stable and how many snapshot.

    ``phases`` holds the phase of every ``stride``-th planned step (``None`` when the schedule
    could not be probed: then every step after warmup counts as stable).
    """

    planned_steps: int
    selected: tuple[str, ...]
    phases: tuple[str, ...] | None = None
    stride: int = 1
    warmup_steps: int = 0

    def _count(self, wanted: Iterable[str], after_step: int = 0) -> int:
        wanted = set(wanted)
        if self.phases is None:
            first = max(after_step, self.warmup_steps)
            return max(0, self.planned_steps - first) if "stable" in wanted else 0
        skip = -(-after_step // self.stride)  # probed entries for steps <= after_step
        return sum(p in wanted for p in self.phases[skip:]) * self.stride

    @property
    def stable_steps(self) -> int:
        """Planned steps at the peak (constant) learning rate."""
        return self._count(("stable",))

    @property
    def has_constant_phase(self) -> bool:
        """Whether the schedule holds the peak LR for at least :data:`MIN_CONSTANT_STEPS` steps and
        :data:`MIN_CONSTANT_SHARE` of the planned steps."""
        return self.stable_steps >= max(MIN_CONSTANT_STEPS, MIN_CONSTANT_SHARE * self.planned_steps)

    def selected_runs(self, after_step: int = 0) -> list[tuple[int, int]]:
        """The planned optimizer steps in the phases that snapshot, after step ``after_step``, as
        runs of consecutive steps ``(first, last)`` (1-based, inclusive)."""
        if self.phases is None:
            first = max(after_step, self.warmup_steps) + 1
            return [(first, self.planned_steps)] if "stable" in self.selected and first <= self.planned_steps else []
        runs: list[tuple[int, int]] = []
        for k, phase in enumerate(self.phases):
            if phase not in self.selected:
                continue
            first = max(k * self.stride + 1, after_step + 1)
            last = min((k + 1) * self.stride, self.planned_steps)
            if first > last:
                continue
            if runs and runs[-1][1] == first - 1:
                runs[-1] = (runs[-1][0], last)
            else:
                runs.append((first, last))
        return runs

    def selected_steps(self, after_step: int = 0) -> int:
        """Planned steps in the phases that snapshot (after optimizer step ``after_step``)."""
        return self._count(self.selected, after_step)

    def intended_snapshots(self, target: int = SNAPSHOTS_PER_WINDOW * WINDOWS_PER_STABLE_PHASE) -> int:
        """How many snapshots the automatic interval aims at: ``target``, or one per step when fewer steps snapshot."""
        return min(target, self.selected_steps())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-step phases)."""
        return {
            "planned_steps": self.planned_steps,
            "stable_steps": self.stable_steps,
            "selected_steps": self.selected_steps(),
            "phases": list(self.selected),
            "probed_schedule": self.phases is not None,
        }


def plan_run(
    planned_steps: int,
    selected: Iterable[str],
    lrs: Sequence[float] | None,
    peak_lr: float,
    stride: int = 1,
    warmup_steps: int = 0,
) -> RunPlan:
    """The :class:`RunPlan` of a run from the LR of every ``stride``-th planned step (``None``: unknown)."""
    phases = tuple(planned_phases(lrs, peak_lr)) if lrs is not None else None
    return RunPlan(int(planned_steps), check_phases(selected), phases, int(stride), int(warmup_steps))


@dataclasses.dataclass(frozen=True)
class IntervalChoice:
    """The automatically chosen interval and what it was derived from (recorded in the manifest)."""

    interval_tokens: int
    tokens_per_step: int
    planned_steps: int
    snapshot_steps: int
    target_snapshots: int
    reason: str
    stable_steps: int | None = None

    @property
    def steps_between(self) -> float:
        """Optimizer steps between snapshots (fractional when V is not a whole number of steps)."""
        return self.interval_tokens / self.tokens_per_step

    @property
    def expected_snapshots(self) -> int:
        """About how many snapshots this interval gives over the steps that snapshot."""
        return int(self.snapshot_steps * self.tokens_per_step // self.interval_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {**dataclasses.asdict(self), "expected_snapshots": self.expected_snapshots}


def choose_interval(
    tokens_per_step: int,
    planned_steps: int,
    snapshot_steps: int,
    *,
    stable_steps: int | None = None,
    snapshots_per_window: int = SNAPSHOTS_PER_WINDOW,
    windows: int = WINDOWS_PER_STABLE_PHASE,
    max_interval_tokens: int = MAX_AUTO_INTERVAL_TOKENS,
) -> IntervalChoice:
    """Choose V so that the steps that snapshot hold ``windows`` windows of ``snapshots_per_window``.

    ``snapshot_steps`` is the planned number of optimizer steps in the phases where snapshots
    are taken (``0``: unknown, then all ``planned_steps``). V is the tokens of those steps
    divided by the target count (40 by default), so the run gets about that many snapshots
    whatever its schedule, rounded to the nearest whole number of steps (halves up): with a
    fixed number of tokens per step every snapshot is then the same number of steps after the
    one before (the paper's "equally spaced checkpoints"; a V of 2.75 steps would put them 3,
    3, 3 and 2 steps apart). The rounding moves the count by at most 10% from 5 steps apart on;
    a short run (1.5 steps apart) gets between 30 and 60. V is at least one step (the floor: at
    most one snapshot per step) and at most ``max_interval_tokens`` (the ceiling, the paper's
    largest V), in whole steps too. ``stable_steps`` is only recorded.
    """
    check_int(tokens_per_step, "tokens_per_step")
    check_int(planned_steps, "planned_steps")
    check_int(snapshot_steps, "snapshot_steps", 0)
    span = snapshot_steps if snapshot_steps > 0 else planned_steps
    target = snapshots_per_window * windows
    steps_between = span / target
    if span <= target:
        interval = tokens_per_step
        reason = f"floor: one snapshot per step ({span} steps snapshot, fewer than {target} snapshots)"
    else:
        whole = max(1, math.floor(steps_between + 0.5))
        interval = whole * tokens_per_step
        reason = (
            f"{span} steps snapshot / {target} snapshots = every {steps_between:.2f} steps: every {whole}"
        )
    if interval > max_interval_tokens:
        interval = max(tokens_per_step, (max_interval_tokens // tokens_per_step) * tokens_per_step)
        reason = f"ceiling: {max_interval_tokens:,} tokens"
    return IntervalChoice(
        interval_tokens=int(interval),
        tokens_per_step=tokens_per_step,
        planned_steps=planned_steps,
        snapshot_steps=span,
        target_snapshots=target,
        reason=reason,
        stable_steps=stable_steps,
    )


def _steps_text(steps: float) -> str:
    text = f"{steps:,.2f}".rstrip("0").rstrip(".")
    return f"{steps:,.4f}" if float(text.replace(",", "")) == int(steps) != steps else text


def snapshot_spacing(interval_tokens: int, tokens_per_step: int) -> str:
    """How snapshots every ``interval_tokens`` tokens are spaced when each optimizer step adds
    ``tokens_per_step`` tokens, in one line (pure: the callback logs it). A snapshot is due at
    the end of the first step that reaches the next multiple of V (:func:`crossed_boundary`),
    so a V that is not a whole number of steps spaces them unequally::

        interval_tokens=2,816 is 2.75 steps of 1,024 tokens: snapshots will be 2,048 or 3,072
        tokens apart; give a multiple of 1,024 for evenly spaced snapshots

    A whole number of steps, or less than one step (then one snapshot every step), spaces them
    evenly and the line says so. A V chosen automatically is always a whole number of steps
    (:func:`choose_interval`); one given by the user is kept as it is.
    """
    check_int(interval_tokens, "interval_tokens")
    check_int(tokens_per_step, "tokens_per_step")
    steps = interval_tokens / tokens_per_step
    unit = "step" if steps == 1 else "steps"
    head = f"interval_tokens={interval_tokens:,} is {_steps_text(steps)} {unit} of {tokens_per_step:,} tokens"
    if interval_tokens <= tokens_per_step:
        return f"{head}: snapshots will be {tokens_per_step:,} tokens apart (one every step)"
    if interval_tokens % tokens_per_step == 0:
        return f"{head}: snapshots will be {interval_tokens:,} tokens apart"
    fewer = (interval_tokens // tokens_per_step) * tokens_per_step
    more = fewer + tokens_per_step
    return (
        f"{head}: snapshots will be {fewer:,} or {more:,} tokens apart; "
        f"give a multiple of {tokens_per_step:,} for evenly spaced snapshots"
    )


def check_schedule_state(state: Any, what: str) -> dict[str, Any]:
    """``state`` when it is what :meth:`SnapshotSchedule.state` returns (read back from a
    checkpoint: JSON or a pickle a person may have edited); else a one-line ``ValueError`` that
    names ``what`` (where it was read) and the bad field."""

    def bad(field: str, must: str, value: Any) -> ValueError:
        return ValueError(f"{what}: {field} must be {must}, got {shown(value, 60)}")

    if not isinstance(state, dict):
        raise bad("the schedule state", "a dict", state)
    interval = state.get("interval_tokens")
    if interval is not None and not is_int(interval, 1):
        raise bad("interval_tokens", "a positive integer or None", interval)
    if state.get("interval_choice") is not None and not isinstance(state["interval_choice"], dict):
        raise bad("interval_choice", "a dict or None", state["interval_choice"])
    phase = state.get("phase")
    if phase is not None:
        if not isinstance(phase, dict):
            raise bad("phase", "a dict or None", phase)
        lr = phase.get("previous_lr")
        if lr is not None and not is_number(lr, finite=True):
            raise bad("phase.previous_lr", "a finite number or None", lr)
        if not isinstance(phase.get("peak_reached", False), bool):
            raise bad("phase.peak_reached", "True or False", phase.get("peak_reached"))
    return state


def positive_int_or_none(value: Any, name: str) -> int | None:
    """``value`` when it is a positive integer or ``None``; a ``ValueError`` naming ``name`` otherwise
    (:func:`hf_pma.utils.parsing.check_int`)."""
    return check_int(value, name, allow_none=True)


@dataclasses.dataclass(frozen=True)
class StepTick:
    """One optimizer step as the schedule saw it: token counts before and after, LR, phase."""

    previous_tokens: int
    tokens: int
    lr: float | None  # None: not read yet (an LR on the device, read at the next step that may snapshot)
    phase: str | None  # None with it: no snapshot can be due

    @property
    def step_tokens(self) -> int:
        """Tokens of this step (global over all processes)."""
        return self.tokens - self.previous_tokens


class SnapshotSchedule:
    """When snapshots are due in one run: the interval V (given or automatic), the phases, the position.

    Feed it every optimizer step (:meth:`advance`, then :meth:`due`). With no interval given,
    :meth:`choose_automatically` must be called once the first step's tokens are known. Its
    :meth:`state` (JSON) resumes a run where it stopped; every process of a distributed run
    loads the main process's state so all agree on the steps that snapshot.
    """

    def __init__(
        self, interval_tokens: int | None = None, phases: str | Iterable[str] = ("stable", "decay")
    ) -> None:
        # At most what a manifest records (10**30 was refused only once the folder was written).
        self.requested_interval_tokens = check_int(
            interval_tokens, "interval_tokens", 1, MAX_RECORD_INT, allow_none=True
        )
        self.phases = check_phases(phases)
        self.interval_tokens: int | None = self.requested_interval_tokens
        self.interval_choice: dict[str, Any] | None = None
        self.tracker: PhaseTracker | None = None
        self.tokens = 0
        self.tokens_at_begin = 0

    def begin(self, peak_lr: float, tokens: int, saved: dict[str, Any] | None = None) -> None:
        """Start at ``tokens`` (0, or the resumed run's count) under a schedule peaking at ``peak_lr``.

        ``saved``: :meth:`state` of the run being resumed (its phase, and its automatic interval
        when none is given now).
        """
        self.tracker = PhaseTracker(peak_lr)
        self.tokens = self.tokens_at_begin = int(tokens)
        if saved:
            if saved.get("phase"):
                self.tracker.load_state(saved["phase"])
            if saved.get("interval_tokens"):
                self.adopt_interval(int(saved["interval_tokens"]), saved.get("interval_choice"))

    def adopt_interval(self, interval_tokens: int, choice: dict[str, Any] | None = None) -> bool:
        """Use the interval of the run being resumed when none was given; ``True`` when adopted."""
        if self.interval_tokens is not None:
            return False
        self.interval_tokens = positive_int_or_none(interval_tokens, "interval_tokens")
        self.interval_choice = choice
        return True

    def state(self) -> dict[str, Any]:
        """JSON-ready state: the interval in use, how it was chosen, the phase tracker."""
        return {
            "interval_tokens": self.interval_tokens,
            "interval_choice": self.interval_choice,
            "phase": self.tracker.state() if self.tracker is not None else None,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over :meth:`state` of another process (the interval in use and the phase)."""
        self.interval_tokens = state.get("interval_tokens")
        self.interval_choice = state.get("interval_choice")
        if self.tracker is not None and state.get("phase"):
            self.tracker.load_state(state["phase"])

    def advance(self, tokens: int, lr: float | None, earlier_lrs: Sequence[float] = ()) -> StepTick:
        """Record one optimizer step that ended at ``tokens`` after using ``lr``.

        ``lr`` ``None``: its value is not read yet; the phase is left as it is and the tick can
        take no snapshot, so the caller must read it before a step that crosses a multiple of V
        (:func:`crossed_boundary`) and pass the values it held back, oldest first, as ``earlier_lrs``
        (they only move the phase tracker on, as if given step by step).
        """
        if self.tracker is None:
            raise RuntimeError("SnapshotSchedule.begin() must be called before advance()")
        self.catch_up(earlier_lrs)
        if lr is None:
            tick = StepTick(self.tokens, int(tokens), None, None)
        else:
            tick = StepTick(self.tokens, int(tokens), float(lr), self.tracker.update(lr))
        self.tokens = tick.tokens
        return tick

    def catch_up(self, lrs: Sequence[float]) -> None:
        """Move the phase tracker on by the LRs of steps recorded with ``lr=None``, oldest first."""
        for value in lrs:
            self.tracker.update(value)

    def choose_automatically(self, tokens_per_step: int, plan: RunPlan) -> IntervalChoice:
        """Choose V from the first step's tokens and the planned run (:class:`RunPlan`), and use it."""
        choice = choose_interval(
            tokens_per_step,
            max(1, plan.planned_steps),
            plan.selected_steps(),
            stable_steps=plan.stable_steps,
        )
        self.interval_tokens = choice.interval_tokens
        self.interval_choice = {**choice.to_dict(), "auto": True, "probed_schedule": plan.phases is not None}
        return choice

    def widen(self, interval_tokens: int, why: dict[str, Any]) -> None:
        """Use a wider automatic interval from now on (snapshots cost more than planned): a
        multiple of the one in use, so the snapshots after it stay on the same grid. ``why``
        (JSON) is recorded under ``interval_choice["widened"]``."""
        if self.interval_choice is None or self.interval_tokens is None:
            raise RuntimeError("only an automatic interval is widened")
        if interval_tokens % self.interval_tokens:
            raise ValueError(f"a widened interval must be a multiple of {self.interval_tokens}, got {interval_tokens}")
        self.interval_choice = {
            **self.interval_choice,
            "interval_tokens": int(interval_tokens),
            "widened": {"from_interval_tokens": self.interval_tokens, **why},
        }
        self.interval_tokens = int(interval_tokens)

    def due(self, tick: StepTick) -> int | None:
        """The token boundary a snapshot is due at after ``tick``, or ``None``."""
        if self.interval_tokens is None:
            raise RuntimeError("no interval yet: call choose_automatically() first")
        boundary = crossed_boundary(tick.previous_tokens, tick.tokens, self.interval_tokens)
        if boundary is not None and tick.phase is None:
            raise RuntimeError("a step that crosses a multiple of the interval was recorded without its LR")
        return boundary if boundary is not None and tick.phase in self.phases else None
