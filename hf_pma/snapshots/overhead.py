"""What snapshots cost a run, measured from its own step times: pure arithmetic on clock readings.

The cost of a snapshot is not only the time the training thread is blocked copying the weights:
the background write competes with training for cores, for the GIL and for memory bandwidth, and
the steps while it runs get slower. :class:`OverheadMeter` therefore measures what a user sees,
the change in step time:

* every optimizer step ends with a clock reading (:meth:`OverheadMeter.step_end`);
* a step is *clean* when no snapshot work touched it: it does not follow a snapshot (the copy
  and the hand-over to the writer happen at the end of the step that snapshots, so they fall in
  the next one) and no background write (:meth:`OverheadMeter.write_span`) overlaps it; the
  run's first step (start-up) is never clean. The median of the clean steps is the step time
  without snapshots;
* between two snapshots ``n`` steps apart, the time beyond ``n`` clean steps is what one
  snapshot costs: blocked copy, hand-over, waits and the slower steps under the write.

:class:`OverheadEstimate` holds the result with its uncertainty (the spread of the intervals and
of the clean steps), and turns it into the share of training time at any interval. Nothing here
reads a clock, a file or a tensor; the snapshot engine feeds it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

__all__ = ["MIN_CLEAN_STEPS", "BASELINE_STEPS", "OverheadEstimate", "OverheadMeter"]

# Clean steps needed for a step time without snapshots.
MIN_CLEAN_STEPS = 3
# Steps of a run before its first snapshot when the interval is automatic under a cost budget:
# the start-up step, then MIN_CLEAN_STEPS clean ones to compare later steps with.
BASELINE_STEPS = MIN_CLEAN_STEPS + 1
# Half-width of the interval stated with an estimate, in standard errors (about 95 %).
_Z = 2.0


@dataclasses.dataclass(frozen=True)
class OverheadEstimate:
    """The measured cost of snapshots, in seconds of training time.

    Attributes:
        step_s: the step time without snapshots (median of the clean steps).
        step_se_s: its standard error.
        clean_steps: how many clean steps it comes from.
        extra_s: seconds one snapshot adds to the training time (mean over the intervals measured).
        extra_se_s: its standard error (the spread of the intervals, at least the noise of as many
            clean steps, plus the step time's own error over an interval).
        intervals: the intervals between snapshots measured.
        steps_between: their mean length in steps.
        first_extra_s: what the run's first interval added (it may hold one-time costs), when it
            was left out of ``extra_s``; ``None`` otherwise.
    """

    step_s: float
    step_se_s: float
    clean_steps: int
    extra_s: float
    extra_se_s: float
    intervals: int
    steps_between: float
    first_extra_s: float | None = None

    def share(self, steps_between: float) -> float:
        """The share of training time snapshots ``steps_between`` steps apart take."""
        return self.extra_s / (steps_between * self.step_s) if self.step_s > 0 else math.inf

    def share_margin(self, steps_between: float) -> float:
        """The half-width of the interval (about 95 %) of :meth:`share`."""
        return _Z * self.extra_se_s / (steps_between * self.step_s) if self.step_s > 0 else math.inf

    def share_low(self, steps_between: float) -> float:
        """The lower end of the interval (about 95 %) of :meth:`share`: what snapshots
        ``steps_between`` steps apart cost at least. A budget is taken as passed only when this
        passes it, so that noisy steps (a busy machine) never widen an interval by chance."""
        if self.step_s <= 0:
            return math.inf
        return max(0.0, self.extra_s - _Z * self.extra_se_s) / (steps_between * self.step_s)

    def steps_for(self, budget: float) -> int:
        """The fewest whole steps between snapshots whose share stays under ``budget`` (at the upper
        end of the interval, so the budget holds with the uncertainty too)."""
        upper = self.extra_s + _Z * self.extra_se_s
        if self.step_s <= 0:
            return 1
        return max(1, math.ceil(upper / (budget * self.step_s)))

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)


class OverheadMeter:
    """Step times, snapshot steps and background writes of one run, and what they say snapshots cost.

    Args:
        start: the clock reading when the run began (the first step is measured from it).
    """

    def __init__(self, start: float) -> None:
        self._ends = [float(start)]  # the clock at the end of step i is _ends[i]; _ends[0] the start
        self._snapshots: list[int] = []  # the steps (indices in _ends) that took a snapshot

    @property
    def steps(self) -> int:
        """Steps measured so far."""
        return len(self._ends) - 1

    @property
    def snapshots(self) -> int:
        """Snapshots marked so far."""
        return len(self._snapshots)

    def step_end(self, now: float) -> None:
        """An optimizer step ended at ``now`` (before any snapshot of that step)."""
        self._ends.append(float(now))

    def snapshot_taken(self) -> None:
        """The step that just ended took a snapshot (its copy falls in the next step)."""
        self._snapshots.append(self.steps)

    def clean_step_seconds(self, spans: Sequence[tuple[float, float | None]] = ()) -> list[float]:
        """The durations of the clean steps (see the module doc), in order; ``spans``: the
        background work of the run, ``(start, end)`` clock readings (``end`` ``None``: running)."""
        after_snapshot = {s + 1 for s in self._snapshots}
        clean = []
        for i in range(2, len(self._ends)):
            begin, end = self._ends[i - 1], self._ends[i]
            if i in after_snapshot or any(a < end and (b is None or b > begin) for a, b in spans):
                continue
            clean.append(end - begin)
        return clean

    def estimate(self, spans: Sequence[tuple[float, float | None]] = ()) -> OverheadEstimate | None:
        """What a snapshot costs, from the complete intervals between snapshots so far (the first
        left out when there are others: it may hold one-time costs); ``None`` with fewer than
        :data:`MIN_CLEAN_STEPS` clean steps or no complete interval."""
        clean = self.clean_step_seconds(spans)
        if len(clean) < MIN_CLEAN_STEPS or len(self._snapshots) < 2:
            return None
        step = statistics.median(clean)
        spread = 1.4826 * statistics.median(abs(d - step) for d in clean)  # robust standard deviation
        if spread == 0:
            spread = statistics.pstdev(clean)
        step_se = 1.2533 * spread / math.sqrt(len(clean))  # the median's standard error
        pairs = list(zip(self._snapshots, self._snapshots[1:]))
        extras = [(self._ends[b] - self._ends[a] - (b - a) * step, b - a) for a, b in pairs]
        first = None
        if len(extras) > 1:
            first = extras[0][0]
            extras = extras[1:]
        values = [e for e, _ in extras]
        steps_between = statistics.fmean(n for _, n in extras)
        extra = statistics.fmean(values)
        noise = spread * math.sqrt(steps_between)  # one interval's natural noise
        spread_of_intervals = statistics.stdev(values) if len(values) > 1 else 0.0
        extra_se = math.hypot(max(spread_of_intervals, noise) / math.sqrt(len(values)), steps_between * step_se)
        return OverheadEstimate(
            step_s=step,
            step_se_s=step_se,
            clean_steps=len(clean),
            extra_s=extra,
            extra_se_s=extra_se,
            intervals=len(values),
            steps_between=steps_between,
            first_extra_s=first,
        )
