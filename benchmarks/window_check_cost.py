"""What the held-out window check adds to ``hf-pma compare``: wall time with and without it.

``hf-pma compare`` checks each automatic window on every 4th held-out document: it evaluates the
rule's window, its halvings and the last snapshot there, then every result on the other documents.
This benchmark runs the same comparison with the check and with ``--no-window-check``, alternating
(ABAB...) so that a drifting machine load falls on both, and prints the median wall time of each
with its range::

    python benchmarks/window_check_cost.py RUN RUN ... --eval-file heldout.jsonl [--repeats 3]

Run it on an otherwise idle machine; the numbers quoted in the docs say which runs and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders, as for hf-pma compare")
    p.add_argument("--eval-file", required=True, help="held-out documents (20 or more, for the check to run)")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each compare (default: 2)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def timed_compare(args: argparse.Namespace, extra: list[str]) -> float:
    """Seconds of one ``hf-pma compare`` of the runs (its output discarded)."""
    command = [sys.executable, "-m", "hf_pma.cli", "compare", *args.runs, "--eval-file", args.eval_file,
               "--bootstrap", "0", "-q", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"hf-pma compare failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    before = load_average()
    times: dict[str, list[float]] = {"checked (default)": [], "--no-window-check": []}
    for _ in range(args.repeats):
        times["checked (default)"].append(timed_compare(args, []))
        times["--no-window-check"].append(timed_compare(args, ["--no-window-check"]))
    base = statistics.median(times["--no-window-check"])
    print(f"hf-pma compare of {len(args.runs)} runs, {args.repeats} alternating pairs; load average {before} before, "
          f"{load_average()} after\n")  # fmt: skip
    print("| compare | median s | range s | vs unchecked |")
    print("|---|---:|---:|---:|")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"| {label} | {median:.1f} | {min(values):.1f}-{max(values):.1f} | {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
