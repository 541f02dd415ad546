"""The GPU check: what the CPU test suite cannot show, on one CUDA GPU, in one table.

    python benchmarks/gpu_check.py                    # ~100M-parameter Llama, bf16 (a few minutes)
    python benchmarks/gpu_check.py --hidden 256 --layers 2 --vocab 4096 --steps 30 --no-save   # a smoke run
    python benchmarks/gpu_check.py --cpu --hidden 64 --heads 4 --layers 1 --intermediate 128 --vocab 256 \
        --seq 32 --batch 2 --steps 12 --warmup 2 --interval-steps 4 --rounds 2 --no-save      # seconds, no GPU

1. **Training with and without PMACallback** (``TrainingArguments(bf16=True)``, the same model,
   seed and batches): ``--rounds`` pairs of runs, the order alternating from pair to pair (so
   that neither side always runs first, on a cooler or warmer GPU). Every step is timed on the
   GPU's own timeline with CUDA events (no synchronisation between steps); a pair's overhead is
   the relative difference of the mean step times of its two runs, and the table gives the
   median over the pairs with their range. Apart from that difference of two noisy runs, the
   part of the run the callback blocked is timed directly, with CUDA events recorded right
   before and after PMACallback in every Trainer event: its share of the run resolves well below
   1 %. Also: the callback's own per-snapshot costs (``PMACallback.snapshot_costs``: the time the
   training thread was blocked, the first snapshot apart since it allocates the host buffers,
   and the background write), and whether the pinned host staging buffers are reused (torch's
   pinned host allocator makes no new block after the first snapshot).
2. **FSDP2 through accelerate launch** (``--use_fsdp --fsdp_version 2``, ``--fsdp-procs``
   processes, 1 by default) with sharded snapshots (``sharded="auto"``): every snapshot holds one
   file per rank, and the run folder merges into a model that ``from_pretrained`` loads.
3. **Merged evaluation**: ``PMATrainer``'s ``eval_pma_loss`` (the merge of the last snapshots
   swapped into the live model on the GPU) beside ``eval_loss``, and how long it took.

It prints one table and, unless ``--no-save``, writes it with the raw numbers to
``benchmarks/results/gpu_check/`` (``results.md``, ``results.json``). Without a CUDA GPU it
stops at once with a one-line reason (exit status 1), unless ``--cpu``: parts 1 and 3 in fp32 on
the CPU, timed with the CPU's clock (a check of the script itself, in seconds; its numbers say
nothing about a GPU). The GPU test tier (``python -m pytest -m gpu``) runs a small configuration
of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
MODEL_ARGUMENTS = (
    "hidden",
    "layers",
    "heads",
    "intermediate",
    "vocab",
    "seq",
    "batch",
    "steps",
    "interval_steps",
)
PARTS = ("train", "fsdp", "eval")


# ---------------------------------------------------------------------------------------------
# Arguments and the CUDA check (no torch import before the check)
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value stops with one line (exit status 2)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hidden", type=int, default=768, help="hidden size (default 768: ~100M parameters with 12 layers)"
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (per process)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each training run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the step times")
    parser.add_argument("--interval-steps", type=int, default=10, help="a snapshot every this many steps")
    parser.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="pairs of runs of part 1, without and with PMACallback (the order alternates)",
    )
    parser.add_argument(
        "--fsdp-procs", type=int, default=1, help="processes of the FSDP2 run (world size; 1 is allowed)"
    )
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
    args = parser.parse_args(argv)
    positive = (*MODEL_ARGUMENTS, "fsdp_procs", "rounds")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps) = [0, {args.steps}), got {args.warmup}")
    if args.interval_steps >= args.steps:
        parser.error(
            f"--interval-steps ({args.interval_steps}) must be below --steps ({args.steps}): no snapshot would be taken"
        )
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
# Numbers and the table (pure functions: tested on CPU in tests/test_gpu_check.py)
# ---------------------------------------------------------------------------------------------


def overhead_percent(baseline_ms: float, with_pma_ms: float) -> float:
    """How much slower a step is with snapshots, in percent of the step without."""
    return 100 * (with_pma_ms - baseline_ms) / baseline_ms


def paired_overheads(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """From ``(baseline mean step ms, PMACallback mean step ms)`` of each pair of runs: each
    pair's overhead in percent, their median and range (what the table reports)."""
    if not pairs:
        raise ValueError("no pair of runs")
    each = [overhead_percent(base, pma) for base, pma in pairs]
    return {
        "pairs": len(each),
        "overhead_percent": statistics.median(each),
        "overhead_min_percent": min(each),
        "overhead_max_percent": max(each),
        "overhead_each_percent": [round(o, 3) for o in each],
    }


def blocked_share(blocked_ms: list[float], run_ms: float, snapshot_ms: list[float]) -> dict[str, Any]:
    """The part of a run that PMACallback blocked, from CUDA-event times: ``blocked_ms``, every
    stretch between the marks right before and right after the callback (every Trainer event);
    ``snapshot_ms``, those of the events that took a snapshot; ``run_ms``, the timed run."""
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
    """Per-snapshot costs in milliseconds: the training thread blocked by the first snapshot (it
    allocates the host buffers) and by the later ones (median: the steady state), and the
    median background write."""
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
    train = results.get("train")
    if train:
        base, pma = train["baseline"], train["pma"]
        reuse, costs = pma["staging"], pma["costs"]
        precision = train.get("precision", "bf16")
        clock = "CUDA events" if precision == "bf16" else "CPU clock"
        rows += [
            [
                f"{precision} step time, no snapshots",
                f"{format_number(base['step_ms'], '.1f')} ms",
                f"mean {format_number(base['mean_ms'], '.1f')} ms; "
                f"{train['parameters'] / 1e6:.0f}M parameters, {base['steps']} steps timed",
            ],
            [
                f"{precision} step time, PMACallback",
                f"{format_number(pma['step_ms'], '.1f')} ms",
                f"mean {format_number(pma['mean_ms'], '.1f')} ms: throughput overhead "
                f"{format_number(train['overhead_percent'], '+.1f')} % "
                f"(median of {train['pairs']} alternating pairs, range "
                f"{format_number(train['overhead_min_percent'], '+.1f')} to "
                f"{format_number(train['overhead_max_percent'], '+.1f')} %) "
                f"at a snapshot every {train['interval_steps']} steps",
            ],
            [
                f"blocked by PMACallback ({clock})",
                f"{format_number(train['blocked_share_percent'], '.2f')} % of the run",
                f"median {format_number(statistics.median(train['blocked_snapshot_ms'] or [0.0]), '.1f')} ms per snapshot, "
                f"{format_number(train['blocked_between_snapshots_ms'], '.1f')} ms in all between snapshots",
            ],
            _blocked_row("blocked per snapshot", costs),
            _write_row("background write per snapshot", costs, train["interval_ms"]),
            [
                "pinned staging reuse",
                f"{reuse['reused']}/{reuse['possible']}" if reuse else "-",
                ("every buffer pinned" if reuse["all_pinned"] else "NOT all pinned") if reuse else "no GPU",
            ],
        ]
    fsdp = results.get("fsdp")
    if fsdp:
        ok = fsdp["rank_files_ok"] and fsdp["merged_loads"]
        rows.append(
            [
                f"FSDP2 sharded snapshots (accelerate launch, world {fsdp['world_size']})",
                f"{fsdp['snapshots']} snapshots",
                "one file per rank, merge loads"
                if ok
                else "FAILED: " + fsdp.get("problem", "see results.json"),
            ]
        )
        rows.append(_blocked_row("FSDP2 blocked per snapshot", fsdp["costs"]))
        rows.append(_write_row("FSDP2 rank write per snapshot", fsdp["costs"], fsdp["interval_ms"]))
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
# The parts (CUDA only)
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


def _training_arguments(args: argparse.Namespace, out: Path, **overrides: Any):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        bf16=not args.cpu,
        use_cpu=args.cpu,
        logging_steps=10,
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


def _observers(clock: Clock, callback: Any = None) -> tuple[Any, Any, Any]:
    """Three Trainer callbacks, public events only: ``before`` and ``after`` go right before and
    right after ``callback`` (PMACallback, or nothing for the run without it) in the callback list
    and mark every event around it, noting the marks of the events that took a snapshot (its
    ``snapshot_costs`` grew) and torch's pinned host memory after them (not in
    ``on_train_begin``: the callback's one-time set-up comes before the first timed step);
    ``steps`` marks the beginning of every step and the end of training. All three are read
    after ``train()``."""
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
        return len(callback.snapshot_costs) if callback is not None else 0

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

        def on_save(self, args, state, control, **kwargs):
            self.hook()

        def on_train_end(self, args, state, control, **kwargs):
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


def _blocked(clock: Clock, after: Any) -> tuple[list[float], list[float]]:
    """(every stretch around the callback, those of the snapshots), in milliseconds."""
    every = [(clock.ms(a, b), snapshot) for a, b, snapshot in after.stretches]
    return [ms for ms, _ in every], [ms for ms, snapshot in every if snapshot]


def run_training(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Part 1: ``--rounds`` pairs of the same run without and with PMACallback, the order
    alternating from pair to pair; each step timed on the device's timeline; the callback's
    blocked part timed directly; the snapshot costs and pinned staging of the first run with
    PMACallback."""
    import torch
    from transformers import Trainer

    from hf_pma.snapshots.callback import PMACallback

    clock = Clock(cuda=not args.cpu)
    tokens_per_step = args.batch * args.seq
    dataset = _dataset(args, args.steps * args.batch)
    step_ms: dict[str, list[float]] = {"baseline": [], "pma": []}
    pairs: list[tuple[float, float]] = []
    runs: dict[str, Any] = {}
    for round_ in range(args.rounds):
        means: dict[str, float] = {}
        for name in ("baseline", "pma") if round_ % 2 == 0 else ("pma", "baseline"):
            out = workdir / f"train-{name}"
            shutil.rmtree(out, ignore_errors=True)
            pma = None
            if name == "pma":
                pma = PMACallback(
                    interval_tokens=args.interval_steps * tokens_per_step,
                    save_dtype="float32" if args.cpu else "bfloat16",
                    phases=("stable",),
                )
            before, after, steps = _observers(clock, pma)
            trainer = Trainer(
                model=_model(args),
                args=_training_arguments(args, out),
                train_dataset=dataset,
                callbacks=[before, *([pma] if pma else []), after, steps],
            )
            trainer.train()
            timed = steps.step_ms()[args.warmup :]
            step_ms[name] += timed
            means[name] = statistics.fmean(timed)
            if pma is not None and name not in runs:
                every, snapshots = _blocked(clock, after)
                costs = callback_costs(pma)
                runs[name] = {
                    "costs": costs,
                    "staging": staging_reuse(before.pinned, pma.snapshot_costs[0].num_bytes or 0)
                    if clock.cuda
                    else None,
                    **blocked_share(every, sum(steps.step_ms()), snapshots),
                }
            del trainer
            if clock.cuda:
                torch.cuda.empty_cache()
        pairs.append((means["baseline"], means["pma"]))
    for name, seconds in step_ms.items():
        runs.setdefault(name, {}).update(
            steps=len(seconds), step_ms=statistics.median(seconds), mean_ms=statistics.fmean(seconds)
        )
    pma_run = runs["pma"]
    return {
        "precision": "fp32 (CPU)" if args.cpu else "bf16",
        "parameters": llama_parameter_count(
            args.hidden, args.layers, args.intermediate, args.vocab, args.heads
        ),
        **runs,
        "interval_steps": args.interval_steps,
        "interval_ms": runs["baseline"]["mean_ms"] * args.interval_steps,
        **paired_overheads(pairs),
        **{k: pma_run.pop(k) for k in list(pma_run) if k.startswith("blocked_")},
    }


def fsdp_worker(args: argparse.Namespace, workdir: Path) -> None:
    """Part 2, one rank (under ``accelerate launch --use_fsdp --fsdp_version 2``): train with
    sharded snapshots; rank 0 writes ``fsdp-worker.json``."""
    from transformers import Trainer

    from hf_pma.snapshots.callback import PMACallback

    clock = Clock(cuda=True)
    out = workdir / "fsdp"
    callback = PMACallback(
        interval_tokens=args.interval_steps * args.batch * args.seq, phases=("stable",), sharded="auto"
    )
    before, after, steps = _observers(clock, callback)
    training_args = _training_arguments(args, out)
    trainer = Trainer(
        model=_model(args),
        args=training_args,
        train_dataset=_dataset(args, args.steps * args.batch * training_args.world_size),
        callbacks=[before, callback, after, steps],
    )
    trainer.train()
    if training_args.process_index == 0:
        report = {
            "world_size": training_args.world_size,
            "sink": type(callback.sink).__name__,
            "costs": callback_costs(callback),
            "interval_ms": statistics.fmean(steps.step_ms()[args.warmup :]) * args.interval_steps,
            "staging": staging_reuse(
                before.pinned, (callback.snapshot_costs[0].num_bytes or 0) // training_args.world_size
            ),
        }
        (workdir / "fsdp-worker.json").write_text(json.dumps(report))


def fsdp_command(args: argparse.Namespace, workdir: Path) -> list[str]:
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
    for name in MODEL_ARGUMENTS:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--warmup", str(args.warmup)]
    return command


def run_fsdp(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Part 2: launch the FSDP2 run, then check its snapshots and merge them."""
    from transformers import LlamaForCausalLM

    from hf_pma.core.manifest import manifest_snapshots
    from hf_pma.io.sharded import rank_file_name
    from hf_pma.merging.engine import merge_checkpoints

    done = subprocess.run(
        fsdp_command(args, workdir),
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the FSDP2 run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads((workdir / "fsdp-worker.json").read_text())
    pma = workdir / "fsdp" / "pma"
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


def run_eval(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Part 3: PMATrainer's merged evaluation on the GPU, beside the live evaluation."""
    from hf_pma import PMATrainer, PMATrainingArguments

    out = workdir / "eval"
    shutil.rmtree(out, ignore_errors=True)
    window = 3
    training_args = _training_arguments(
        args,
        out,
        cls=PMATrainingArguments,
        max_steps=(window + 1) * args.interval_steps,
        per_device_eval_batch_size=args.batch,
        pma_interval_tokens=args.interval_steps * args.batch * args.seq,
        pma_window=window,
        pma_merge_at_end=False,
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
    seconds = time.perf_counter() - start
    return {
        "eval_pma_loss": metrics["eval_pma_loss"],
        "eval_loss": metrics["eval_loss"],
        "seconds": seconds,
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

    results: dict[str, Any] = {
        "machine": {
            "gpu": "none (--cpu)" if args.cpu else torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "arguments": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "fsdp_worker"
        },
    }
    workdir = Path(tempfile.mkdtemp(prefix="hf-pma-gpu-check-"))
    try:
        for part, run in (("train", run_training), ("fsdp", run_fsdp), ("eval", run_eval)):
            if part in args.parts:
                print(f"gpu_check.py: {part} ...", file=sys.stderr, flush=True)
                results[part] = run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = build_table(results)
    print(table)
    if not args.no_save:
        for path in save_results(args.out, results, table):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
