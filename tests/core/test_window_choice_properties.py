"""The automatic window's rule (hf_pma.core.window_choice) over generated runs: total over every
value a point can hold, never a window beyond the snapshots present, always a reason; and on
ordinary runs, the same choice as the rule's plain definition (a fresh two-pass fit per window)."""

from __future__ import annotations

import json
import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_pma.core.window_choice import MAX_SHARE, MIN_FIT, TREND_LIMIT, RunPoint, choose_window

# Bounded and without a deadline: CI machines are loaded, and each example is cheap.
BOUNDED = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ANY_NUMBER = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([0.0, -0.0, 5e-324, 1e200, -1e200, 1.7e308, -1.7e308]),
)
ANY_VALUE = st.one_of(ANY_NUMBER, st.booleans(), st.text(max_size=3))
ANY_PHASE = st.one_of(st.none(), st.sampled_from(["stable", "warmup", "decay", "x\x1b[31m"]), st.integers())


@st.composite
def hostile_points(draw) -> list[RunPoint]:
    """Points with any value in any field (the record's types are not checked here)."""
    n = draw(st.integers(min_value=1, max_value=24))
    progress = draw(st.sampled_from(["increasing", "any"]))
    points = []
    for i in range(n):
        tokens = (i + 1) * draw(st.integers(1, 10**6)) if progress == "increasing" else draw(ANY_VALUE)
        points.append(
            RunPoint(tokens=tokens, step=draw(ANY_VALUE), lr=draw(ANY_VALUE), loss=draw(ANY_VALUE), phase=draw(ANY_PHASE))
        )
    return points


def _window_is_present(points: list[RunPoint], count: int, rule: str) -> bool:
    """The window lies within the snapshots present and, where it follows progress, within
    a stretch whose progress increases."""
    if not 1 <= count <= len(points):
        return False
    if rule == "no-progress" or count == 1:
        return True
    window = points[-count:]
    for unit in ("tokens", "step"):
        values = [getattr(p, unit) for p in points]
        if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in values):
            ends = [getattr(p, unit) for p in window]
            return all(a < b for a, b in zip(ends, ends[1:]))
    return False


@BOUNDED
@given(hostile_points())
def test_the_rule_never_raises_stays_within_the_snapshots_and_says_why(points):
    choice = choose_window(points)
    assert _window_is_present(points, choice.count, choice.rule)
    assert choice.rule in ("trend", "cap", "too-early", "no-loss", "no-progress", "single")
    assert choice.reason.strip() and "\n" not in choice.reason and "\x1b" not in choice.reason
    assert choice.describe().startswith("auto window: ")
    json.dumps(choice.to_dict(), allow_nan=False)  # every number finite: the record stays JSON


@st.composite
def ordinary_runs(draw) -> tuple[list[RunPoint], int]:
    """Runs as training records them: tokens every V, a falling then flattening loss with noise
    (sometimes rounded to 4 decimals, as the Trainer logs it), and a power of two to scale by."""
    n = draw(st.integers(min_value=4, max_value=80))
    interval = draw(st.sampled_from([1024, 20_480, 2**20]))
    start = draw(st.sampled_from([1, 5, 1000, 10**6]))
    level, drop = draw(st.floats(0.5, 10)), draw(st.floats(0, 5))
    tau, slope = draw(st.floats(1, 3 * n)), draw(st.sampled_from([0.0, 1e-3, 0.02]))
    sd, seed = draw(st.sampled_from([0.0, 0.003, 0.05, 0.2])), draw(st.integers(0, 2**32))
    noise = random.Random(seed)
    digits = draw(st.sampled_from([None, 4, 2]))
    points = []
    for i in range(n):
        loss = level + drop * math.exp(-i / tau) - slope * i + noise.gauss(0, sd)
        loss = round(loss, digits) if digits else loss
        points.append(RunPoint(tokens=(start + i) * interval, step=start + i, lr=3e-3, loss=loss, phase="stable"))
    return points, draw(st.sampled_from([-900, -40, 0, 40, 900]))


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n < 3:
        return slope, 0.0
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(residual / (n - 2) / sxx)


def _defined_count(points: list[RunPoint]) -> int:
    """The trend test's window by its definition: for k = 2, 3, ... a fresh fit to the newest
    max(2k, MIN_FIT) losses, until the cap or a clear fall (quadratic, for small runs only)."""
    xs, ys = [p.tokens for p in points], [p.loss for p in points]
    diffs = [b - a for a, b in zip(ys, ys[1:])]
    center = sorted(diffs)[len(diffs) // 2]
    noise = 1.4826 * sorted(abs(d - center) for d in diffs)[len(diffs) // 2] / math.sqrt(2)
    n, end, chosen = len(xs), xs[-1], 1
    for k in range(2, n + 1):
        span = end - xs[n - k]
        if span > MAX_SHARE * end:
            break
        m = min(n, max(2 * k, MIN_FIT))
        slope, stderr = _line(xs[n - m :], ys[n - m :])
        if -slope * span - stderr * span > TREND_LIMIT * noise:
            break
        chosen = k
    return chosen


@BOUNDED
@given(ordinary_runs())
def test_on_ordinary_runs_the_choice_is_the_definitions_at_any_scale(run):
    points, power = run
    choice = choose_window(points)
    assert choice.count == _defined_count(points)
    scaled = choose_window([RunPoint(p.tokens, p.step, p.lr, math.ldexp(p.loss, power), p.phase) for p in points])
    assert (scaled.count, scaled.rule) == (choice.count, choice.rule)
    if choice.trend is not None:
        assert scaled.trend == math.ldexp(choice.trend, power)


@BOUNDED
@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=4, max_size=40),
    st.integers(min_value=1, max_value=2**40),
)
def test_any_finite_losses_reach_the_trend_test_and_give_finite_numbers(losses, interval):
    points = [RunPoint(tokens=(i + 1) * interval, step=i + 1, lr=1e-3, loss=x, phase="stable") for i, x in enumerate(losses)]
    choice = choose_window(points)
    assert choice.rule in ("trend", "cap", "too-early") and 1 <= choice.count <= len(points)
    assert choice.reason.strip() and "\n" not in choice.reason and len(choice.reason) < 300
    json.dumps(choice.to_dict(), allow_nan=False)
