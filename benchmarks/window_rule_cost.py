"""What the automatic window's rule (``hf_pma.core.window_choice``) costs as a run's snapshots grow.

The rule runs once per merge, ``inspect``, ``compare`` and end of training, over every snapshot a
run lists. Its worst layout is a flat loss far from the run's start: the cap (a fifth of the tokens
trained) never ends the window, so the trend test runs for every window length. This prints the
median seconds of one choice over ``--repeats`` runs (with their range) for each layout and number
of snapshots, as a Markdown table::

    python benchmarks/window_rule_cost.py [--snapshots 1000 3000 10000] [--repeats 5]

Pure Python and single-threaded: seconds on any machine, load included. The rule before it was made
near-linear runs with the same command from a checkout of commit 1bf79bb
(``git worktree add /tmp/old 1bf79bb && PYTHONPATH=/tmp/old python benchmarks/window_rule_cost.py``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from hf_pma.core.window_choice import RunPoint, choose_window

V = 20_480  # tokens between snapshots, as the default run


def _points(n: int, start: int, loss: Callable[[int, random.Random], float]) -> list[RunPoint]:
    rng = random.Random(0)
    return [
        RunPoint(tokens=(start + i) * V, step=start + i, lr=3e-3, loss=loss(i, rng), phase="stable")
        for i in range(n)
    ]


# name: (first snapshot, in intervals from the run's start; the loss at snapshot i)
LAYOUTS: dict[str, tuple[int, Callable[[int, random.Random], float]]] = {
    "flat, far from the start (worst)": (10**8, lambda i, rng: 4.0 + rng.gauss(0, 0.05)),
    "constant loss, far from the start": (10**8, lambda i, rng: 4.1),
    "losses 0 and 1e200, far from the start": (10**8, lambda i, rng: 0.0 if i % 2 else 1e200),
    "flat, from the start (the cap ends it)": (1, lambda i, rng: 4.0 + rng.gauss(0, 0.05)),
}


def timed(points: list[RunPoint], repeats: int) -> str:
    """The median wall time of one choice over ``points``, with the range of the ``repeats``."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        choose_window(points)
        times.append(time.perf_counter() - started)
    return f"{statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--snapshots", type=int, nargs="+", default=[1000, 3000, 10000], help="run lengths")
    p.add_argument("--repeats", type=int, default=5, help="choices timed per cell (default: 5)")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.snapshots) < 1:
        p.error("--repeats and --snapshots must be at least 1")
    print("| layout | " + " | ".join(f"{n:,} snapshots" for n in args.snapshots) + " |")
    print("|---|" + "---:|" * len(args.snapshots))
    for name, (start, loss) in LAYOUTS.items():
        cells = [timed(_points(n, start, loss), args.repeats) for n in args.snapshots]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
