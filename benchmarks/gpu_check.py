"""The GPU check: what the CPU test suite cannot show, on one CUDA GPU, in one table.

    python benchmarks/gpu_check.py                  # the H100 check: ~110M Llama, bf16, < 8 minutes
    python benchmarks/gpu_check.py --hidden 256 --layers 2 --vocab 4096 --pairs 3 --no-save   # a smoke run
    python benchmarks/gpu_check.py --cpu --hidden 64 --heads 4 --layers 1 --intermediate 128 --vocab 256 \
        --seq 16 --batch 2 --intervals 2 --pairs 2 --no-save                                   # seconds, no GPU

1. **What PMACallback costs, as an interleaved A/B within one process** (one model, one Trainer
   run per interval, ``TrainingArguments(bf16=True)``): the steps are cut into blocks of
   ``--block-snapshots`` x interval steps; after ``--warmup-blocks`` blocks with the callback
   (they pay the first snapshot's one-time costs), each pair of blocks runs one block with the
   callback and one without it, the order alternating from pair to pair (ABBA: a drift in clock
   or temperature cancels). Blocks are offset by half an interval so that every snapshot, and its
   background write, falls inside its block; a block with the callback ends by waiting for the
   write in flight, so no write leaks into a block without it. Every step is timed on the GPU's
   own timeline (CUDA events, no synchronisation between steps); a pair's overhead is the relative
   difference of its blocks' mean step times, and the table gives the mean over the pairs with a
   95 % confidence interval (Student's t, and a bootstrap one beside it). One A/B per interval of
   ``--intervals`` (default: a snapshot every 100 steps, then every 10). Beside it, the part of the
   run the callback blocked (CUDA events right before and after PMACallback in every Trainer
   event), the callback's own per-snapshot costs (``PMACallback.snapshot_costs``), and whether the
   pinned host staging buffers are reused.
2. **FSDP2 through accelerate launch** (``--use_fsdp --fsdp_version 2``, ``--fsdp-procs``
   processes, 1 by default) with sharded snapshots (``sharded="auto"``): the same A/B at a snapshot
   every ``--fsdp-interval`` steps; every snapshot holds one file per rank, and the run folder
   merges into a model that ``from_pretrained`` loads.
3. **Merged evaluation**: ``PMATrainer``'s ``eval_pma_loss`` (the merge of the last snapshots
   swapped into the live model on the GPU) beside ``eval_loss``, and how long it took.

``--time-limit`` (seconds, default 400) bounds the whole check: each A/B gets a share and stops
at the end of the pair that spends it (the pairs run are recorded). It prints one table and,
unless ``--no-save``, writes it with the raw numbers to ``benchmarks/results/gpu_check/``
(``results.md``, ``results.json``). Without a CUDA GPU it stops at once with a one-line reason
(exit status 1), unless ``--cpu``: parts 1 and 3 in fp32 on the CPU, timed with the CPU's clock (a
check of the script itself, in seconds; its numbers say nothing about a GPU). The GPU test tier
(``python -m pytest -m gpu``) runs a small configuration of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO_ROOT, Tokens, llama, llama_parameter_count

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results" / "gpu_check"
# The model and run sizes an FSDP worker is given again on its own command line.
MODEL_ARGUMENTS = ("hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch")
RUN_ARGUMENTS = ("block_snapshots", "warmup_blocks", "fsdp_interval", "fsdp_pairs", "min_ab_steps")
PARTS = ("train", "fsdp", "eval")
# Shares of --time-limit: each in-process A/B, the FSDP2 A/B (with its launch), the evaluation.
TIME_SHARES = {"train": 0.6, "fsdp": 0.3, "eval": 0.1}


# ---------------------------------------------------------------------------------------------
# Arguments and the CUDA check (no torch import before the check)
# ---------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of whole numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("at least one interval")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value stops with one line (exit status 2)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hidden", type=int, default=768, help="hidden size (default 768: ~110M parameters with 12 layers)"
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (per process)")
    parser.add_argument(
        "--intervals", type=_int_list, default=[100, 10], help="one A/B per interval: a snapshot every N steps"
    )
    parser.add_argument("--pairs", type=int, default=16, help="pairs of blocks (with, without) per A/B, at least")
    parser.add_argument(
        "--min-ab-steps", type=int, default=1600, help="steps the pairs of one A/B cover at least (more pairs of short blocks)"
    )
    parser.add_argument("--block-snapshots", type=int, default=1, help="snapshots per block (block = this x interval steps)")
    parser.add_argument("--warmup-blocks", type=int, default=1, help="blocks with the callback before the pairs")
    parser.add_argument(
        "--fsdp-procs", type=int, default=1, help="processes of the FSDP2 run (world size; 1 is allowed)"
    )
    parser.add_argument("--fsdp-interval", type=int, default=10, help="the FSDP2 A/B: a snapshot every N steps")
    parser.add_argument("--fsdp-pairs", type=int, default=12, help="the FSDP2 A/B: pairs of blocks, at least")
    parser.add_argument("--time-limit", type=float, default=400.0, help="seconds for the whole check (shared by the parts)")
    parser.add_argument(
        "--parts",
        default=None,
        help=f"comma-separated parts to run (default: {','.join(PARTS)}; with --cpu: train,eval)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where results.md and results.json go")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run parts 1 and 3 on the CPU in fp32 (a check of the script in seconds; no GPU numbers)",
    )
    parser.add_argument("--fsdp-worker", type=Path, help=argparse.SUPPRESS)  # internal: one rank of part 2
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # internal: the worker's
    args = parser.parse_args(argv)
    positive = (*MODEL_ARGUMENTS, "pairs", "block_snapshots", "fsdp_procs", "fsdp_interval", "fsdp_pairs")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.min_ab_steps < 0:
        parser.error(f"--min-ab-steps must be at least 0, got {args.min_ab_steps}")
    if args.warmup_blocks < 0:
        parser.error(f"--warmup-blocks must be at least 0, got {args.warmup_blocks}")
    if any(i < 2 for i in (*args.intervals, args.fsdp_interval)):
        parser.error("every interval must be at least 2 steps (a block is offset by half an interval)")
    if not args.time_limit > 0:
        parser.error(f"--time-limit must be positive, got {args.time_limit}")
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if args.parts is None:
        args.parts = "train,eval" if args.cpu else ",".join(PARTS)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(
            f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
    if args.cpu and "fsdp" in parts:
        parser.error("--cpu runs the train and eval parts only: add --parts train,eval")
    args.parts = parts
    return args


def cuda_missing_reason() -> str | None:
    """Why this machine cannot run the check (``None`` when a CUDA GPU is there)."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    return None


# ---------------------------------------------------------------------------------------------
# The A/B design and its numbers (pure functions: tested on CPU in tests/test_gpu_check.py)
# ---------------------------------------------------------------------------------------------


def ab_blocks(interval: int, block_snapshots: int, warmup_blocks: int, pairs: int) -> dict[str, int]:
    """The layout of one A/B: block length, offset (half an interval, so each snapshot sits inside
    its block), and the total steps (the offset, the warm-up blocks, ``pairs`` pairs)."""
    block = interval * block_snapshots
    offset = interval // 2
    return {"block": block, "offset": offset, "steps": offset + block * (warmup_blocks + 2 * pairs)}


def ab_pairs(block: int, pairs: int, min_steps: int) -> int:
    """Pairs of ``block``-step blocks for one A/B: ``pairs``, or more so that they cover at least
    ``min_steps`` steps (short blocks are noisier: more of them)."""
    return max(pairs, math.ceil(min_steps / (2 * block)))


def block_role(step: int, layout: dict[str, int], warmup_blocks: int) -> tuple[int, bool] | None:
    """Where optimizer step ``step`` (from 1) falls: ``(pair, callback on)``, or ``None`` for the
    offset and the warm-up blocks (the callback on). Pair ``p`` runs (off, on) when ``p`` is even,
    (on, off) when odd."""
    index = step - 1 - layout["offset"]
    if index < 0:
        return None
    block = index // layout["block"] - warmup_blocks
    if block < 0:
        return None
    pair, second = divmod(block, 2)
    on = bool(second) if pair % 2 == 0 else not second
    return pair, on


def t_quantile_975(df: int) -> float:
    """Student's t 97.5 % quantile for ``df`` degrees of freedom (two-sided 95 %)."""
    table = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
             2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
             2.045, 2.042]  # fmt: skip
    if df < 1:
        raise ValueError("a confidence interval needs at least two pairs")
    return table[df - 1] if df <= len(table) else 1.96 + 2.4 / df


def ab_overhead(pairs: list[tuple[float, float]], resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """From ``(mean step ms without, mean step ms with)`` of each pair of blocks: each pair's
    overhead in percent, their mean with a 95 % t interval and a bootstrap percentile interval."""
    if len(pairs) < 2:
        raise ValueError("a confidence interval needs at least two pairs")
    each = [100 * (on - off) / off for off, on in pairs]
    mean = statistics.fmean(each)
    half = t_quantile_975(len(each) - 1) * statistics.stdev(each) / math.sqrt(len(each))
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(each, k=len(each))) for _ in range(resamples))
    return {
        "pairs": len(each),
        "overhead_percent": mean,
        "ci95_low_percent": mean - half,
        "ci95_high_percent": mean + half,
        "ci95_half_width_percent": half,
        "bootstrap95_low_percent": means[int(0.025 * resamples)],
        "bootstrap95_high_percent": means[int(0.975 * resamples) - 1],
        "overhead_each_percent": [round(o, 4) for o in each],
    }


def pair_means(step_ms: list[float], layout: dict[str, int], warmup_blocks: int) -> list[tuple[float, float]]:
    """``(mean step ms without, with)`` of every complete pair, from every step's time in order."""
    blocks: dict[int, dict[bool, list[float]]] = {}
    for step, ms in enumerate(step_ms, 1):
        role = block_role(step, layout, warmup_blocks)
        if role is not None:
            blocks.setdefault(role[0], {True: [], False: []})[role[1]].append(ms)
    full = layout["block"]
    return [
        (statistics.fmean(b[False]), statistics.fmean(b[True]))
        for _, b in sorted(blocks.items())
        if len(b[False]) == full and len(b[True]) == full
    ]


def blocked_share(blocked_ms: list[float], run_ms: float, snapshot_ms: list[float]) -> dict[str, Any]:
    """The part of the time with the callback that it blocked, from CUDA-event times:
    ``blocked_ms``, every stretch between the marks right before and right after the callback;
    ``snapshot_ms``, those of the events that took a snapshot; ``run_ms``, the time it was on."""
    if run_ms <= 0:
        raise ValueError(f"the timed run must last, got {run_ms} ms")
    total = sum(blocked_ms)
    return {
        "blocked_share_percent": 100 * total / run_ms,
        "blocked_total_ms": total,
        "blocked_snapshot_ms": [round(ms, 3) for ms in snapshot_ms],
        "blocked_between_snapshots_ms": total - sum(snapshot_ms),
    }


def snapshot_costs(blocked_s: list[float], write_s: list[float]) -> dict[str, Any]:
    """Per-snapshot costs in milliseconds: the training thread blocked by the first snapshot and by
    the later ones (median: the steady state), and the median background write."""
    if not blocked_s:
        raise ValueError("no snapshot was taken")
    later = blocked_s[1:]
    return {
        "snapshots": len(blocked_s),
        "blocked_first_ms": 1000 * blocked_s[0],
        "blocked_steady_ms": 1000 * statistics.median(later) if later else None,
        "blocked_ms": [round(1000 * s, 3) for s in blocked_s],
        "write_median_ms": 1000 * statistics.median(write_s) if write_s else None,
        "write_ms": [round(1000 * s, 3) for s in write_s],
    }


def callback_costs(callback: Any) -> dict[str, Any]:
    """:func:`snapshot_costs` of a PMACallback's own read-out (``snapshot_costs``) after ``train()``."""
    rows = callback.snapshot_costs
    return snapshot_costs([r.blocked_s for r in rows], [r.write_s for r in rows if r.write_s is not None])


def staging_reuse(pinned: list[tuple[int, int]], snapshot_bytes: int) -> dict[str, Any]:
    """From torch's pinned host allocator, read before the first snapshot and after each one
    (``(blocks it made so far, bytes it holds)``): how many snapshots after the first made no new
    pinned block (the staging buffers reused), and whether the first snapshot's staging is
    pinned (the pinned pool grew by at least 90 % of ``snapshot_bytes``, this process's part of
    the snapshot's file: the file adds a header)."""
    taken = pinned[1:]
    reused = sum(1 for before, after in zip(taken, taken[1:]) if after[0] == before[0])
    return {
        "snapshots": len(taken),
        "reused": reused,
        "possible": max(0, len(taken) - 1),
        "all_pinned": bool(taken) and taken[0][1] - pinned[0][1] >= 0.9 * snapshot_bytes,
    }


def build_table(results: dict[str, Any]) -> str:
    """The one table of the check, from the results of the parts that ran."""
    from hf_pma.utils.formatting import format_number, markdown_table

    rows: list[list[str]] = []
    for ab in results.get("train", []):
        rows += _ab_rows("", ab)
    fsdp = results.get("fsdp")
    if fsdp:
        ok = fsdp["rank_files_ok"] and fsdp["merged_loads"]
        rows.append(
            [
                f"FSDP2 sharded snapshots (accelerate launch, world {fsdp['world_size']})",
                f"{fsdp['snapshots']} snapshots",
                "one file per rank, merge loads" if ok else "FAILED: " + fsdp.get("problem", "see results.json"),
            ]
        )
        if fsdp.get("ab"):
            rows += _ab_rows("FSDP2 ", fsdp["ab"])
    evaluation = results.get("eval")
    if evaluation:
        rows.append(
            [
                "merged evaluation (eval_pma_loss)",
                format_number(evaluation["eval_pma_loss"], ".4f"),
                f"live eval_loss {format_number(evaluation['eval_loss'], '.4f')}; {format_number(evaluation['seconds'], '.1f')} s",
            ]
        )
    if not rows:
        raise ValueError("no part of the check ran: nothing to put in the table")
    return markdown_table(["check", "result", "detail"], rows, align="lrl")


def _ab_rows(prefix: str, ab: dict[str, Any]) -> list[list[str]]:
    from hf_pma.utils.formatting import format_number

    every = ab["interval_steps"]
    precision = ab.get("precision", "bf16")
    clock = "CUDA events" if precision == "bf16" else "CPU clock"
    costs, reuse = ab["costs"], ab.get("staging")
    rows = [
        [
            f"{prefix}overhead, a snapshot every {every} steps ({precision})",
            f"{format_number(ab['overhead_percent'], '+.2f')} %",
            f"95% CI {format_number(ab['ci95_low_percent'], '+.2f')} to {format_number(ab['ci95_high_percent'], '+.2f')} % "
            f"(bootstrap {format_number(ab['bootstrap95_low_percent'], '+.2f')} to "
            f"{format_number(ab['bootstrap95_high_percent'], '+.2f')}); {ab['pairs']} interleaved pairs of "
            f"{ab['block_steps']}-step blocks, steps of {format_number(ab['step_ms'], '.1f')} ms without",
        ],
        [
            f"{prefix}blocked by PMACallback ({clock}), every {every}",
            f"{format_number(ab['blocked_share_percent'], '.2f')} % of the time with it",
            f"median {format_number(statistics.median(ab['blocked_snapshot_ms'] or [0.0]), '.1f')} ms per snapshot, "
            f"{format_number(ab['blocked_between_snapshots_ms'], '.1f')} ms in all between snapshots",
        ],
        _blocked_row(f"{prefix}blocked per snapshot, every {every}", costs),
        _write_row(f"{prefix}background write per snapshot, every {every}", costs, ab["step_ms"] * every),
    ]
    if prefix == "":
        rows.append(
            [
                f"pinned staging reuse, every {every}",
                f"{reuse['reused']}/{reuse['possible']}" if reuse else "-",
                ("every buffer pinned" if reuse["all_pinned"] else "NOT all pinned") if reuse else "no GPU",
            ]
        )
    return rows


def _blocked_row(label: str, costs: dict[str, Any]) -> list[str]:
    from hf_pma.utils.formatting import format_number

    steady = costs["blocked_steady_ms"]
    return [
        label,
        f"{format_number(steady if steady is not None else costs['blocked_first_ms'], '.1f')} ms",
        f"median of snapshots 2-{costs['snapshots']}; the first {format_number(costs['blocked_first_ms'], '.1f')} ms"
        if steady is not None
        else "one snapshot",
    ]


def _write_row(label: str, costs: dict[str, Any], interval_ms: float) -> list[str]:
    from hf_pma.utils.formatting import format_number

    write = costs["write_median_ms"]
    return [
        label,
        f"{format_number(write, '.1f')} ms" if write is not None else "-",
        f"median, off the training thread; snapshots {format_number(interval_ms, '.0f')} ms apart",
    ]


def save_results(out: Path, results: dict[str, Any], table: str) -> list[Path]:
    """Write ``results.md`` (the table and where it ran) and ``results.json`` into ``out``."""
    from hf_pma.utils.fs import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    machine = results.get("machine", {})
    where = ", ".join(f"{k} {v}" for k, v in machine.items())
    atomic_write_text(out / "results.md", f"# GPU check\n\n{where}\n\n{table}\n")
    atomic_write_json(out / "results.json", results)
    return [out / "results.md", out / "results.json"]


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------


def _model(args: argparse.Namespace):
    return llama(
        hidden=args.hidden,
        layers=args.layers,
        vocab=args.vocab,
        intermediate=args.intermediate,
        heads=args.heads,
        max_positions=args.seq,
    )


def _dataset(args: argparse.Namespace, n: int) -> Tokens:
    return Tokens(n, args.seq, args.vocab)


def _training_arguments(args: argparse.Namespace, out: Path, max_steps: int, **overrides: Any):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        bf16=not args.cpu,
        use_cpu=args.cpu,
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,  # the pinned host memory the check counts is the callback's own
        seed=0,
    )
    cls = overrides.pop("cls", TrainingArguments)
    kwargs.update(overrides)
    return cls(**kwargs)


class Clock:
    """Marks on the GPU's own timeline (CUDA events on the current stream: nothing waits for
    them) or, on the CPU, ``perf_counter`` readings; :meth:`ms` reads the time between two marks
    once the run is over."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.torch, self.cuda = torch, cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return 1000 * (end - start)
        end.synchronize()
        return start.elapsed_time(end)


def _switch(callback: Any, layout: dict[str, int], warmup_blocks: int, deadline: float):
    """A Trainer callback that hands every event to ``callback`` (PMACallback) in the blocks with it
    and none in the blocks without (:func:`block_role`). Switching on, the callback's loss hook is
    attached again and its schedule told the tokens seen meanwhile (the steps without it are not
    its to snapshot); switching off, the hook is detached and the write in flight waited for (no
    write runs in a block without the callback). Past ``deadline`` (``time.monotonic``), training
    stops at the end of the pair that runs (two pairs at least: an interval needs them)."""
    from transformers import TrainerCallback

    taker = callback.taker

    class Switch(TrainerCallback):
        def __init__(self) -> None:
            self.on = True

        def _role(self, step: int) -> bool:
            role = block_role(step, layout, warmup_blocks)
            return True if role is None else role[1]

        def on_init_end(self, args, state, control, **kwargs):
            return callback.on_init_end(args, state, control, **kwargs)

        def on_train_begin(self, args, state, control, **kwargs):
            return callback.on_train_begin(args, state, control, **kwargs)

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            on = self._role(state.global_step + 1)
            if on and not self.on:
                taker._losses.attach(model)
                taker.schedule.tokens = int(state.num_input_tokens_seen)
            elif self.on and not on:
                taker.wait()
                taker._losses.detach()
            self.on = on
            if on:
                return callback.on_step_begin(args, state, control, model=model, **kwargs)

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self.on:
                return callback.on_optimizer_step(args, state, control, **kwargs)

        def on_step_end(self, args, state, control, **kwargs):
            if self.on:
                callback.on_step_end(args, state, control, **kwargs)
                if not self._role(state.global_step + 1):  # the block with it ends: its write lands
                    taker.wait()
            role = block_role(state.global_step, layout, warmup_blocks)
            following = block_role(state.global_step + 1, layout, warmup_blocks)
            ends_pair = role is not None and (following is None or following[0] != role[0])
            if ends_pair and role[0] >= 1 and time.monotonic() > deadline:  # two pairs at least
                control.should_training_stop = True

        def on_log(self, args, state, control, **kwargs):
            if self.on:
                return callback.on_log(args, state, control, **kwargs)

        def on_save(self, args, state, control, **kwargs):
            if self.on:
                return callback.on_save(args, state, control, **kwargs)

        def on_epoch_end(self, args, state, control, **kwargs):
            if self.on:
                return callback.on_epoch_end(args, state, control, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            if not self.on:
                taker._losses.attach(kwargs["model"])
            return callback.on_train_end(args, state, control, **kwargs)

    return Switch()


def _observers(clock: Clock, callback: Any) -> tuple[Any, Any, Any]:
    """Three Trainer callbacks, public events only: ``before`` and ``after`` go right before and
    right after the switched PMACallback in the callback list and mark every event around it,
    noting the marks of the events that took a snapshot (its ``snapshot_costs`` grew) and torch's
    pinned host memory after them; ``steps`` (first in the list) marks the beginning of every step
    and the end of training. All three are read after ``train()``."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[Any] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.marks.append(clock.mark())

        def on_train_end(self, args, state, control, **kwargs):
            self.marks.append(clock.mark())

        def step_ms(self) -> list[float]:
            return [clock.ms(a, b) for a, b in zip(self.marks, self.marks[1:])]

    def taken() -> int:
        return len(callback.snapshot_costs)

    def pinned() -> tuple[int, int]:
        if not clock.cuda:
            return (0, 0)
        stats = clock.torch.cuda.host_memory_stats()
        return (int(stats.get("num_host_alloc", 0)), int(stats.get("allocated_bytes.current", 0)))

    class Mark(TrainerCallback):
        """Calls ``hook`` in every Trainer event in which PMACallback works."""

        def __init__(self, hook: Any) -> None:
            self.hook = hook

        def on_step_begin(self, args, state, control, **kwargs):
            self.hook()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.hook()

        def on_step_end(self, args, state, control, **kwargs):
            self.hook()

        def on_log(self, args, state, control, **kwargs):
            self.hook()

    opened: list[tuple[Any, int]] = []
    stretches: list[tuple[Any, Any, bool]] = []  # (start, end, whether a snapshot was taken)
    pool = [pinned()]

    def open_mark() -> None:
        opened.append((clock.mark(), taken()))

    def close_mark() -> None:
        start, count = opened.pop()
        snapshot = taken() > count
        stretches.append((start, clock.mark(), snapshot))
        if snapshot:
            pool.append(pinned())

    before, after = Mark(open_mark), Mark(close_mark)
    before.pinned, after.stretches = pool, stretches
    return before, after, Steps()


def run_ab(args: argparse.Namespace, workdir: Path, interval: int, pairs: int, seconds: float, world_size: int = 1) -> dict[str, Any]:
    """One interleaved A/B: a Trainer run whose blocks alternate with and without PMACallback
    (:func:`_switch`), every step timed; the pairs' overhead with its interval, the part the
    callback blocked, its snapshot costs and the reuse of its pinned staging."""
    import torch
    from transformers import Trainer

    from hf_pma.snapshots.callback import PMACallback

    clock = Clock(cuda=not args.cpu)
    layout = ab_blocks(interval, args.block_snapshots, args.warmup_blocks, pairs)
    tokens_per_step = args.batch * args.seq * world_size
    out = workdir / f"ab-{interval}"
    shutil.rmtree(out, ignore_errors=True)
    pma = PMACallback(
        interval_tokens=interval * tokens_per_step,
        save_dtype="float32" if args.cpu else "bfloat16",
        phases=("stable",),
        max_overhead=None,
        sharded="auto",
    )
    switch = _switch(pma, layout, args.warmup_blocks, time.monotonic() + seconds)
    before, after, steps = _observers(clock, pma)
    training_args = _training_arguments(args, out, layout["steps"])
    trainer = Trainer(
        model=_model(args),
        args=training_args,
        train_dataset=_dataset(args, layout["steps"] * args.batch * world_size),
        callbacks=[steps, before, switch, after],
    )
    trainer.train()
    step_ms = steps.step_ms()
    pairs_ms = pair_means(step_ms, layout, args.warmup_blocks)
    if len(pairs_ms) < 2:
        raise RuntimeError(f"the A/B at every {interval} steps completed {len(pairs_ms)} pair(s); it needs 2")
    every, snapshots = [], []
    on_ms = 0.0
    for (a, b, snapshot) in after.stretches:
        ms = clock.ms(a, b)
        every.append(ms)
        if snapshot:
            snapshots.append(ms)
    for step, ms in enumerate(step_ms, 1):
        role = block_role(step, layout, args.warmup_blocks)
        if role is None or role[1]:
            on_ms += ms
    costs = callback_costs(pma)
    result = {
        "interval_steps": interval,
        "block_steps": layout["block"],
        "precision": "fp32 (CPU)" if args.cpu else "bf16",
        "steps_run": len(step_ms),
        "step_ms": statistics.median(off for off, _ in pairs_ms) if pairs_ms else None,
        **ab_overhead(pairs_ms),
        **blocked_share(every, on_ms, snapshots),
        "costs": costs,
        "staging": staging_reuse(before.pinned, (pma.snapshot_costs[0].num_bytes or 0) // world_size)
        if clock.cuda
        else None,
        "sink": type(pma.sink).__name__,
        "world_size": training_args.world_size,
    }
    del trainer
    if clock.cuda:
        torch.cuda.empty_cache()
    return result


def run_training(args: argparse.Namespace, workdir: Path, seconds: float) -> list[dict[str, Any]]:
    """Part 1: one interleaved A/B per interval of ``--intervals`` (``seconds`` shared by them)."""
    from hf_pma.utils.formatting import format_number

    results = []
    plans = {i: ab_pairs(i * args.block_snapshots, args.pairs, args.min_ab_steps) for i in args.intervals}
    steps = {i: ab_blocks(i, args.block_snapshots, args.warmup_blocks, n)["steps"] for i, n in plans.items()}
    for interval in args.intervals:
        share = seconds * steps[interval] / sum(steps.values())  # by the steps each plans
        result = run_ab(args, workdir, interval, plans[interval], share)
        result["parameters"] = llama_parameter_count(args.hidden, args.layers, args.intermediate, args.vocab, args.heads)
        print(
            f"gpu_check.py: every {interval} steps: {format_number(result['overhead_percent'], '+.2f')} % "
            f"({result['pairs']} pairs)",
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
    return results


def fsdp_worker(args: argparse.Namespace, workdir: Path) -> None:
    """Part 2, one rank (under ``accelerate launch --use_fsdp --fsdp_version 2``): the A/B with
    sharded snapshots; rank 0 writes ``fsdp-worker.json``."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    seconds = max(1.0, (args.deadline or time.time() + 120) - time.time())
    pairs = ab_pairs(args.fsdp_interval * args.block_snapshots, args.fsdp_pairs, args.min_ab_steps)
    result = run_ab(args, workdir, args.fsdp_interval, pairs, seconds, world_size=world)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        (workdir / "fsdp-worker.json").write_text(json.dumps({"world_size": world, "ab": result}))


def fsdp_command(args: argparse.Namespace, workdir: Path, deadline: float | None = None) -> list[str]:
    """The ``accelerate launch`` command of part 2 (FSDP2, bf16, ``--fsdp-procs`` processes)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        str(args.fsdp_procs),
        "--num_machines",
        "1",
        "--main_process_port",
        "0",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        "--use_fsdp",
        "--fsdp_version",
        "2",
        "--fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer",
        "--fsdp_state_dict_type",
        "SHARDED_STATE_DICT",
        str(Path(__file__).resolve()),
        "--fsdp-worker",
        str(workdir),
    ]
    for name in (*MODEL_ARGUMENTS, *RUN_ARGUMENTS):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if deadline is not None:
        command += ["--deadline", f"{deadline:.0f}"]
    return command


def run_fsdp(args: argparse.Namespace, workdir: Path, seconds: float) -> dict[str, Any]:
    """Part 2: launch the FSDP2 A/B, then check its snapshots and merge them."""
    from transformers import LlamaForCausalLM

    from hf_pma.core.manifest import manifest_snapshots
    from hf_pma.io.sharded import rank_file_name
    from hf_pma.merging.engine import merge_checkpoints

    done = subprocess.run(
        fsdp_command(args, workdir, deadline=time.time() + max(10.0, seconds - 40.0)),  # launch and merge
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the FSDP2 run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads((workdir / "fsdp-worker.json").read_text())
    pma = workdir / f"ab-{args.fsdp_interval}" / "pma"
    records = manifest_snapshots(pma)
    expected = [rank_file_name(r) for r in range(report["world_size"])]
    problems = [
        r.path for r in records if sorted(p.name for p in (pma / r.path).glob("*.safetensors")) != expected
    ]
    merged = merge_checkpoints([pma], workdir / "fsdp-merged", progress=False)
    model = LlamaForCausalLM.from_pretrained(merged)
    report.update(
        snapshots=len(records),
        rank_files_ok=bool(records) and not problems and all(r.extra.get("sharded") for r in records),
        merged_loads=sum(p.numel() for p in model.parameters())
        == llama_parameter_count(args.hidden, args.layers, args.intermediate, args.vocab, args.heads),
    )
    if problems:
        report["problem"] = f"snapshots without one file per rank: {problems}"
    return report


def run_eval(args: argparse.Namespace, workdir: Path, seconds: float) -> dict[str, Any]:
    """Part 3: PMATrainer's merged evaluation on the GPU, beside the live evaluation."""
    from hf_pma import PMATrainer, PMATrainingArguments

    out = workdir / "eval"
    shutil.rmtree(out, ignore_errors=True)
    window, interval = 3, min(args.intervals)
    training_args = _training_arguments(
        args,
        out,
        (window + 1) * interval,
        cls=PMATrainingArguments,
        per_device_eval_batch_size=args.batch,
        pma_interval_tokens=interval * args.batch * args.seq,
        pma_window=window,
        pma_merge_at_end=False,
        pma_max_overhead=None,
    )
    trainer = PMATrainer(
        _model(args),
        training_args,
        train_dataset=_dataset(args, training_args.max_steps * args.batch),
        eval_dataset=_dataset(args, 4 * args.batch),
    )
    trainer.train()
    start = time.perf_counter()
    metrics = trainer.evaluate()
    seconds_taken = time.perf_counter() - start
    return {
        "eval_pma_loss": metrics["eval_pma_loss"],
        "eval_loss": metrics["eval_loss"],
        "seconds": seconds_taken,
        "snapshots": metrics.get("eval_pma_num_snapshots"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = None if args.cpu else cuda_missing_reason()
    if reason is not None:
        print(f"gpu_check.py: {reason}; nothing was run", file=sys.stderr)
        return 1
    if args.fsdp_worker is not None:
        fsdp_worker(args, args.fsdp_worker)
        return 0
    import torch

    started = time.monotonic()
    results: dict[str, Any] = {
        "machine": {
            "gpu": "none (--cpu)" if args.cpu else torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "arguments": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("fsdp_worker", "deadline")
        },
    }
    shares = sum(TIME_SHARES[p] for p in args.parts)
    workdir = Path(tempfile.mkdtemp(prefix="hf-pma-gpu-check-"))
    try:
        for part, run in (("train", run_training), ("fsdp", run_fsdp), ("eval", run_eval)):
            if part in args.parts:
                seconds = args.time_limit * TIME_SHARES[part] / shares
                print(f"gpu_check.py: {part} ({seconds:.0f} s) ...", file=sys.stderr, flush=True)
                results[part] = run(args, workdir, seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["seconds"] = time.monotonic() - started
    table = build_table(results)
    print(table)
    if not args.no_save:
        for path in save_results(args.out, results, table):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
