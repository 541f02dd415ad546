"""What do PMA snapshots cost a training run? The same CPU training without the callback, with
PMACallback (async and sync writes), and with Trainer's own ``save_steps`` at the same interval.

    python benchmarks/bench_snapshot_overhead.py                 # 21M-parameter Llama, 120 steps
    python benchmarks/bench_snapshot_overhead.py --steps 200 --seq 128 --repeats 3
    python benchmarks/bench_snapshot_overhead.py --zero-arg --zero-arg-steps 600   # the default callback only

Each configuration trains the same model from the same seed on the same batches; the
configurations are interleaved over ``--repeats`` rounds and the fastest round is reported.
Two kinds of numbers:

* wall time of ``trainer.train()``: what a user waits, but on a machine shared with other
  work it mostly measures the neighbours;
* the time the *training thread* is blocked by snapshots: what PMACallback measures itself
  (``PMACallback.snapshot_costs``: gathering and copying the weights, waits for the writer) or
  the time in Trainer's ``_save_checkpoint``; plus the time of the background write of each
  snapshot (its wall time, off the training thread). These depend little on the load;
  ``blocked share`` is the blocked time over the training time of the run without snapshots.

``--zero-arg`` adds (or, with ``--configs`` empty, only runs) the zero-argument row: a plain
``TrainingArguments`` run (Transformers' defaults: linear schedule, lr 5e-5; ``--zero-arg-scheduler
constant`` for a constant one) with ``PMACallback()`` against the same run without it, as paired
runs (the order alternates from pair to pair), reporting the median of the per-pair overheads over
``--pairs`` pairs with their range, the 1-minute load average around them, and the cost line the
callback printed in each run with it (its "x% of training time in this run", and the ratio of
that estimate to the pair's measured slowdown: the estimate is honest when the ratio is near 1).

    python benchmarks/bench_snapshot_overhead.py --configs --zero-arg --zero-arg-steps 90 \
        --zero-arg-scheduler constant --hidden 64 --layers 2 --vocab 512 --pairs 7
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO_ROOT, Tokens, llama
from transformers import PrinterCallback, Trainer, TrainingArguments

sys.path.insert(0, str(REPO_ROOT))  # this checkout's hf_pma

from hf_pma.snapshots.callback import PMACallback

CONFIGS = (
    "no snapshots",
    "PMACallback async",
    "PMACallback sync",
    "Trainer save_steps",
    "Trainer save_steps (model only)",
)
DEFAULT_CONFIGS = CONFIGS[:4]


def make_model(args: argparse.Namespace):
    return llama(
        hidden=args.hidden,
        layers=args.layers,
        vocab=args.vocab,
        intermediate=args.hidden * 11 // 4,
        max_positions=args.seq,
    )


class TimedTrainer(Trainer):
    """Trainer that adds up the time spent writing its checkpoints."""

    blocked_s = 0.0

    def _save_checkpoint(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super()._save_checkpoint(*args, **kwargs)
        finally:
            self.blocked_s += time.perf_counter() - start


def run(config: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Train once; returns seconds of wall time, of blocked training and of background writing."""
    out = workdir / "run"
    shutil.rmtree(out, ignore_errors=True)
    save = config.startswith("Trainer")
    training_args = TrainingArguments(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        logging_steps=10,
        save_strategy="steps" if save else "no",
        save_steps=args.interval_steps,
        save_only_model="model only" in config,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
        seed=0,
    )
    callback = None
    if config.startswith("PMACallback"):
        interval = args.interval_steps * args.batch * args.seq
        callback = PMACallback(interval_tokens=interval, async_write="async" in config)
    trainer = TimedTrainer(
        model=make_model(args),
        args=training_args,
        train_dataset=Tokens(args.steps * args.batch, args.seq, args.vocab),
        callbacks=[callback] if callback else [],
    )
    trainer.remove_callback(PrinterCallback)  # keep stdout for the table
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    if callback is not None:
        assert len(callback.snapshots()) == args.steps // args.interval_steps, callback.snapshots()
    shutil.rmtree(out, ignore_errors=True)
    if callback is None:
        return {"wall": wall, "blocked": trainer.blocked_s, "write": 0.0}
    costs = callback.snapshot_costs
    return {
        "wall": wall,
        "blocked": sum(c.blocked_s for c in costs),
        "write": sum(c.write_s for c in costs if c.write_s is not None),
    }


class CostLines(logging.Handler):
    """The cost line PMACallback logs ("... x% (± y%) of training time in this run ...")."""

    PATTERN = re.compile(r"snapshots cost ([0-9.]+)% \(± ([0-9.]+)%\) of training time in this run")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "of training time" in message:
            self.lines.append(message)

    def estimate(self) -> tuple[float, float] | None:
        """(percent, ± percent) of the last cost line, ``None`` without one."""
        for line in reversed(self.lines):
            found = self.PATTERN.search(line)
            if found:
                return float(found.group(1)), float(found.group(2))
        return None


def run_plain(with_callback: bool, args: argparse.Namespace, workdir: Path) -> tuple[float, int, CostLines]:
    """A plain ``TrainingArguments`` run (defaults but the scheduler) with or without
    ``PMACallback()``: wall seconds of ``trainer.train()``, the snapshots taken, the cost lines."""
    out = workdir / "plain"
    shutil.rmtree(out, ignore_errors=True)
    training_args = TrainingArguments(
        output_dir=str(out),
        max_steps=args.zero_arg_steps,
        per_device_train_batch_size=args.batch,
        lr_scheduler_type=args.zero_arg_scheduler,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    callback = PMACallback() if with_callback else None
    lines = CostLines()
    hf_logger = logging.getLogger("hf_pma")
    hf_logger.addHandler(lines)
    trainer = Trainer(
        model=make_model(args),
        args=training_args,
        train_dataset=Tokens(args.zero_arg_steps * args.batch, args.seq, args.vocab),
        callbacks=[callback] if callback else [],
    )
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        hf_logger.removeHandler(lines)
    wall = time.perf_counter() - start
    taken = len(callback.snapshots()) if callback is not None else 0
    shutil.rmtree(out, ignore_errors=True)
    return wall, taken, lines


def zero_argument_row(args: argparse.Namespace, workdir: Path) -> None:
    """Paired runs of a plain Trainer with and without ``PMACallback()``; prints the row, each
    pair's estimate against its measured slowdown, and the load average around the pairs."""
    overheads, pairs, taken, estimates, loads, lines = [], [], 0, [], [os.getloadavg()[0]], []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        walls = {}
        for with_callback in order:
            walls[with_callback], count, cost = run_plain(with_callback, args, workdir)
            loads.append(os.getloadavg()[0])
            if with_callback:
                estimates.append(cost.estimate())
                lines = cost.lines or lines
            taken = count or taken
        pairs.append((walls[False], walls[True]))
        overheads.append((walls[True] - walls[False]) / walls[False])
        said = estimates[-1]
        print(
            f"  pair {i + 1}: without {walls[False]:.2f}s  with {walls[True]:.2f}s  measured "
            f"{100 * overheads[-1]:+.1f}%  printed {f'{said[0]:.1f}% ± {said[1]:.1f}%' if said else 'nothing'}",
            file=sys.stderr,
            flush=True,
        )
    without = statistics.median(p[0] for p in pairs)
    with_cb = statistics.median(p[1] for p in pairs)
    measured = 100 * statistics.median(overheads)
    printed = [e[0] for e in estimates if e is not None]
    print(
        f"\nZero-argument PMACallback() on a plain TrainingArguments run ({args.zero_arg_scheduler} schedule), "
        f"{args.zero_arg_steps} steps of {args.batch}x{args.seq} tokens, {args.pairs} paired runs, "
        f"{torch.get_num_threads()} torch thread(s), 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
        f"on {os.cpu_count()} cores"
    )
    print(
        "| configuration | snapshots | median wall without (s) | median wall with (s) | measured slowdown (median of pairs) "
        "| printed cost (median) | printed / measured |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ratio = statistics.median(printed) / measured if printed and measured > 0 else float("nan")
    print(
        f"| PMACallback() (zero arguments) | {taken} | {without:.2f} | {with_cb:.2f} | "
        f"{measured:+.1f}% (range {100 * min(overheads):+.1f}% to {100 * max(overheads):+.1f}%) | "
        f"{f'{statistics.median(printed):.1f}% (range {min(printed):.1f}% to {max(printed):.1f}%)' if printed else '-'} | "
        f"{ratio:.2f} |"
    )
    for line in lines:
        print(f"\n    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # Not a multiple of the interval: the last snapshot is not at the very end (where the
    # run would wait for its write), as in a long run where that wait happens once.
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument(
        "--interval-steps", type=int, default=50, help="one snapshot / checkpoint every N steps"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the second core stays free for the writer, as the CPU of a GPU run)",
    )
    parser.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS), choices=CONFIGS)
    parser.add_argument("--zero-arg", action="store_true", help="add the zero-argument PMACallback() row")
    parser.add_argument("--zero-arg-steps", type=int, default=600, help="steps of the zero-argument runs")
    parser.add_argument(
        "--zero-arg-scheduler", default="linear", help="lr_scheduler_type of the zero-argument runs (linear: the default)"
    )
    parser.add_argument("--pairs", type=int, default=5, help="paired runs for the zero-argument row")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where snapshots go (default: a temporary folder)"
    )
    args = parser.parse_args()

    from transformers.utils import logging

    logging.set_verbosity_error()
    from hf_pma.utils.logs import get_logger

    get_logger("hf_pma").setLevel(20)  # the cost lines (INFO and up) reach the handler
    torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in make_model(args).parameters())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-pma-"))
    results: dict[str, list[dict[str, float]]] = {c: [] for c in args.configs}
    run("no snapshots", argparse.Namespace(**{**vars(args), "steps": 5}), workdir)  # warm-up, not timed
    if args.zero_arg:
        zero_argument_row(args, workdir)
    if not args.configs:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    loads = []
    for _ in range(args.repeats):
        for config in args.configs:
            result = run(config, args, workdir)
            loads.append(os.getloadavg()[0])
            results[config].append(result)
            print(
                f"  {config:<32} " + "  ".join(f"{k} {v:7.2f}s" for k, v in result.items()),
                file=sys.stderr,
                flush=True,
            )

    snapshots = args.steps // args.interval_steps
    best = {c: min(r["wall"] for r in rs) for c, rs in results.items()}
    base = best.get("no snapshots")
    print(
        f"\n{params / 1e6:.1f}M-parameter Llama (fp32, {params * 4 / 2**20:.0f} MiB of weights), {args.steps} steps of "
        f"{args.batch}x{args.seq} tokens, one snapshot/checkpoint every {args.interval_steps} steps ({snapshots} in all), "
        f"best of {args.repeats} round(s)"
    )
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs "
        f"(1-min load average {min(loads):.1f}-{max(loads):.1f}), torch {torch.__version__}, {args.threads} thread(s)\n"
    )
    print(
        "| configuration | wall time (s) | wall overhead | training thread blocked per snapshot (s) "
        "| blocked share | background write per snapshot (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for config, runs in results.items():
        blocked = statistics.median(r["blocked"] for r in runs) / snapshots
        writer = statistics.median(r["write"] for r in runs) / snapshots
        wall_overhead = (
            f"{100 * (best[config] - base) / base:+.1f}%" if base and config != "no snapshots" else "-"
        )
        share = f"{100 * blocked * snapshots / base:.1f}%" if base and config != "no snapshots" else "-"
        print(
            f"| {config} | {best[config]:.1f} | {wall_overhead} | {blocked:.2f} | {share} | {writer:.2f} |"
            if config != "no snapshots"
            else f"| {config} | {best[config]:.1f} | - | - | - | - |"
        )
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
