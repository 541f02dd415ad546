"""hf_pma.snapshots.overhead: what snapshots cost, from step times and writer spans (a synthetic
clock: exact arithmetic, no training)."""

from __future__ import annotations

import pytest

from hf_pma.snapshots.overhead import MIN_CLEAN_STEPS, OverheadMeter


def run(steps: int, every: int, blocked: float, slower: float, first_extra: float = 0.0, step: float = 1.0):
    """A meter fed a run of ``steps`` steps of ``step`` seconds with a snapshot every ``every``
    steps (from step 4): the step after each snapshot takes ``blocked`` more (the copy), and the
    write runs through the next two steps, each ``slower`` seconds slower. The first snapshot's
    interval adds ``first_extra`` (one-time costs). Returns the meter and the writer's spans."""
    now = 0.0
    meter = OverheadMeter(now)
    spans = []
    extra_next: list[float] = []
    snapshots = 0
    for i in range(1, steps + 1):
        duration = step + (extra_next.pop(0) if extra_next else 0.0)
        if i == 1:
            duration += 5.0  # start-up
        now += duration
        meter.step_end(now)
        if i >= 4 and i % every == 0:
            meter.snapshot_taken()
            snapshots += 1
            once = first_extra if snapshots == 1 else 0.0
            extra_next = [once + blocked + slower, slower]
            # The write starts once the copy (and the one-time set-up) is done and lasts two steps.
            spans.append((now + once + blocked, now + once + blocked + 2 * step + 2 * slower))
    return meter, spans


def test_the_cost_of_a_snapshot_is_the_time_beyond_clean_steps_between_snapshots():
    meter, spans = run(steps=28, every=4, blocked=0.25, slower=0.125, first_extra=3.0)
    clean = meter.clean_step_seconds(spans)
    assert clean and all(d == pytest.approx(1.0) for d in clean)
    estimate = meter.estimate(spans)
    # Copy 0.25 s + two steps 0.125 s slower: 0.5 s per snapshot; the first interval (3.5 s) apart.
    assert estimate.extra_s == pytest.approx(0.5) and estimate.first_extra_s == pytest.approx(3.5)
    assert estimate.step_s == pytest.approx(1.0) and estimate.steps_between == 4
    assert estimate.share(4) == pytest.approx(0.125) and estimate.share(50) == pytest.approx(0.01)
    assert estimate.steps_for(0.01) == 50  # no spread on this clock: the estimate itself


def test_steps_under_a_write_are_not_clean_and_the_start_up_step_never_is():
    meter, spans = run(steps=12, every=4, blocked=0.25, slower=0.125)
    # Steps 2-4 before the first snapshot, 7-8 and 11-12 once each write is done: the others
    # follow a snapshot (5, 9) or run under its write (6, 10).
    assert len(meter.clean_step_seconds(spans)) == 7
    # Without the spans, the slower steps under the write would count as clean.
    assert len(meter.clean_step_seconds()) == 9


def test_no_estimate_without_clean_steps_or_a_complete_interval():
    meter = OverheadMeter(0.0)
    for i in range(1, MIN_CLEAN_STEPS + 1):  # the start-up step and too few clean ones
        meter.step_end(float(i))
    meter.snapshot_taken()
    assert meter.estimate() is None
    meter.step_end(10.0)
    meter.snapshot_taken()
    assert meter.estimate() is None  # one interval, but only MIN_CLEAN_STEPS - 1 clean steps
    meter.step_end(11.0)
    meter.step_end(12.0)
    estimate = meter.estimate()
    assert estimate is not None and estimate.intervals == 1 and estimate.first_extra_s is None


def test_noisy_steps_widen_the_interval():
    quiet, spans = run(steps=28, every=4, blocked=0.25, slower=0.125)
    meter = OverheadMeter(0.0)
    now, jitter = 0.0, [0.9, 1.1, 1.0, 1.2, 0.8]
    for i, end in enumerate(quiet._ends[1:]):
        start = quiet._ends[i]
        now += (end - start) * jitter[i % len(jitter)]
        meter.step_end(now)
        if i + 1 in quiet._snapshots:
            meter.snapshot_taken()
    noisy = meter.estimate()
    assert noisy is not None and noisy.extra_se_s > quiet.estimate(spans).extra_se_s
    assert noisy.share_margin(4) > 0
