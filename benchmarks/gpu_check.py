"""The GPU check: what the CPU test suite cannot show, on one CUDA GPU, in one table.

    python benchmarks/gpu_check.py                    # ~100M-parameter Llama, bf16 (a few minutes)
    python benchmarks/gpu_check.py --hidden 256 --layers 2 --vocab 4096 --steps 30 --no-save   # a smoke run

1. **bf16 training with and without PMACallback** (``TrainingArguments(bf16=True)``, the same
   model, seed and batches, ``--rounds`` runs of each, alternating): median and mean step time of
   each (the mean counts the steps that take a snapshot: the throughput overhead in percent),
   the time the training thread is blocked per snapshot (inside PMACallback's events; the first
   snapshot apart, since it allocates the host buffers), the background write per snapshot, and
   whether the pinned host staging buffers are reused from one snapshot to the next (every
   buffer pinned, the same buffers every time).
2. **FSDP2 through accelerate launch** (``--use_fsdp --fsdp_version 2``, ``--fsdp-procs``
   processes, 1 by default) with sharded snapshots (``sharded="auto"``): every snapshot holds one
   file per rank, and the run folder merges into a model that ``from_pretrained`` loads.
3. **Merged evaluation**: ``PMATrainer``'s ``eval_pma_loss`` (the merge of the last snapshots
   swapped into the live model on the GPU) beside ``eval_loss``, and how long it took.

It prints one table and, unless ``--no-save``, writes it with the raw numbers to
``benchmarks/results/gpu_check/`` (``results.md``, ``results.json``). Without a CUDA GPU it
stops at once with a one-line reason (exit status 1). The GPU test tier
(``python -m pytest -m gpu``) runs a small configuration of it.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
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
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each training run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the step times")
    parser.add_argument("--interval-steps", type=int, default=10, help="a snapshot every this many steps")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of part 1 with and without PMACallback, alternating"
    )
    parser.add_argument(
        "--fsdp-procs", type=int, default=1, help="processes of the FSDP2 run (world size; 1 is allowed)"
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated parts to run (default: {','.join(PARTS)})"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where results.md and results.json go")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
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
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(
            f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
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


def llama_parameter_count(
    hidden: int,
    layers: int,
    intermediate: int,
    vocab: int,
    heads: int,
    kv_heads: int | None = None,
    tie: bool = True,
) -> int:
    """Parameters of a ``LlamaForCausalLM`` (no biases, RMSNorm weights, tied head by default)."""
    kv = (kv_heads or heads) * (hidden // heads)
    attention = 2 * hidden * hidden + 2 * hidden * kv
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tie else 2)
    return embeddings + layers * per_layer + hidden


def median_step_ms(step_seconds: list[float], warmup: int) -> float:
    """The median step time in milliseconds, the first ``warmup`` steps left out (a typical
    step: the steps that take a snapshot do not move it)."""
    return 1000 * statistics.median(_timed(step_seconds, warmup))


def mean_step_ms(step_seconds: list[float], warmup: int) -> float:
    """The mean step time in milliseconds, the first ``warmup`` steps left out: the steps that
    take a snapshot count, so this is what throughput sees."""
    return 1000 * statistics.fmean(_timed(step_seconds, warmup))


def _timed(step_seconds: list[float], warmup: int) -> list[float]:
    timed = step_seconds[warmup:]
    if not timed:
        raise ValueError(f"no step left after {warmup} warm-up steps (of {len(step_seconds)})")
    return timed


def overhead_percent(baseline_ms: float, with_pma_ms: float) -> float:
    """How much slower a step is with snapshots, in percent of the step without."""
    return 100 * (with_pma_ms - baseline_ms) / baseline_ms


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


def staging_reuse(history: list[tuple[frozenset[int], bool]]) -> dict[str, Any]:
    """From the host buffers seen after each snapshot (their data pointers, whether all are
    pinned): how many snapshots reused the previous snapshot's buffers."""
    reused = sum(1 for before, after in zip(history, history[1:]) if after[0] == before[0])
    return {
        "snapshots": len(history),
        "reused": reused,
        "possible": max(0, len(history) - 1),
        "all_pinned": all(p for _, p in history),
    }


def build_table(results: dict[str, Any]) -> str:
    """The one table of the check, from the results of the parts that ran."""
    from hf_pma.utils.formatting import format_number, markdown_table

    rows: list[list[str]] = []
    train = results.get("train")
    if train:
        base, pma = train["baseline"], train["pma"]
        reuse, costs = pma["staging"], pma["costs"]
        rows += [
            [
                "bf16 step time, no snapshots",
                f"{format_number(base['step_ms'], '.1f')} ms",
                f"mean {format_number(base['mean_ms'], '.1f')} ms; "
                f"{train['parameters'] / 1e6:.0f}M parameters, {base['steps']} steps timed",
            ],
            [
                "bf16 step time, PMACallback",
                f"{format_number(pma['step_ms'], '.1f')} ms",
                f"mean {format_number(pma['mean_ms'], '.1f')} ms: throughput overhead "
                f"{format_number(train['overhead_percent'], '+.1f')} % at a snapshot every {train['interval_steps']} steps",
            ],
            _blocked_row("blocked per snapshot", costs),
            _write_row("background write per snapshot", costs, train["interval_ms"]),
            [
                "pinned staging reuse",
                f"{reuse['reused']}/{reuse['possible']}",
                "every buffer pinned" if reuse["all_pinned"] else "NOT all pinned",
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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _dataset(args: argparse.Namespace, n: int):
    import torch

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, args.vocab, (n, args.seq), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Tokens()


def _training_arguments(args: argparse.Namespace, out: Path, **overrides: Any):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        bf16=True,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
        dataloader_num_workers=0,
        seed=0,
    )
    cls = overrides.pop("cls", TrainingArguments)
    kwargs.update(overrides)
    return cls(**kwargs)


def _timing_callbacks():
    """(StepTimer, TimedPMACallback class): step times, and the time spent in PMACallback's events."""
    import torch
    from transformers import TrainerCallback

    from hf_pma.snapshots.callback import PMACallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    class TimedPMACallback(PMACallback):
        """PMACallback that adds up the time the training thread spends in its events, notes
        the time of each event call that took a snapshot, and, at every snapshot, which host
        buffers the copy went to."""

        blocked_s = 0.0

        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.staging_history: list[tuple[frozenset[int], bool]] = []
            self.snapshot_blocked_s: list[float] = []

        def on_train_begin(self, *a: Any, **k: Any):
            result = super().on_train_begin(*a, **k)
            take = self._sink.take

            def take_and_record(model, record):
                take(model, record)
                self._record_staging()

            self._sink.take = take_and_record
            return result

        def _record_staging(self) -> None:
            sink = self._sink
            buffers = (
                getattr(sink, "_buffers", None)
                or getattr(getattr(sink, "staging", None), "_buffers", None)
                or {}
            )
            tensors = [b for b in buffers.values() if isinstance(b, torch.Tensor)]
            if tensors:
                self.staging_history.append(
                    (frozenset(t.data_ptr() for t in tensors), all(t.is_pinned() for t in tensors))
                )

        def costs(self) -> dict[str, Any]:
            """Per-snapshot costs (:func:`snapshot_costs`) of this run's snapshots."""
            return snapshot_costs(self.snapshot_blocked_s, list(self._sink.worker.task_seconds))

    for event in ("on_step_begin", "on_optimizer_step", "on_step_end", "on_log", "on_save", "on_train_end"):
        original = getattr(PMACallback, event)

        def timed(self, *a: Any, _original=original, **k: Any):
            taken = len(self.staging_history)
            start = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                seconds = time.perf_counter() - start
                self.blocked_s += seconds
                if len(self.staging_history) > taken:
                    self.snapshot_blocked_s.append(seconds)

        setattr(TimedPMACallback, event, timed)
    return StepTimer, TimedPMACallback


def run_training(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Part 1: the same bf16 run without and with PMACallback, ``--rounds`` times each,
    alternating (so that a slow start of the GPU or the process weighs on neither): the step
    times of all rounds, the snapshot costs and staging of the first round with PMACallback."""
    import torch
    from transformers import Trainer

    StepTimer, TimedPMACallback = _timing_callbacks()
    tokens_per_step = args.batch * args.seq
    dataset = _dataset(args, args.steps * args.batch)
    step_seconds: dict[str, list[float]] = {"baseline": [], "pma": []}
    runs: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name in ("baseline", "pma"):
            out = workdir / f"train-{name}"
            shutil.rmtree(out, ignore_errors=True)
            timer = StepTimer()
            callbacks: list[Any] = [timer]
            pma = None
            if name == "pma":
                pma = TimedPMACallback(
                    interval_tokens=args.interval_steps * tokens_per_step,
                    save_dtype="bfloat16",
                    phases=("stable",),
                )
                callbacks.insert(0, pma)
            trainer = Trainer(
                model=_model(args),
                args=_training_arguments(args, out),
                train_dataset=dataset,
                callbacks=callbacks,
            )
            trainer.train()
            step_seconds[name] += timer.seconds[args.warmup :]
            if pma is not None and name not in runs:
                runs[name] = {"costs": pma.costs(), "staging": staging_reuse(pma.staging_history)}
            del trainer
            torch.cuda.empty_cache()
    for name, seconds in step_seconds.items():
        runs.setdefault(name, {}).update(
            steps=len(seconds), step_ms=median_step_ms(seconds, 0), mean_ms=mean_step_ms(seconds, 0)
        )
    return {
        "parameters": llama_parameter_count(
            args.hidden, args.layers, args.intermediate, args.vocab, args.heads
        ),
        **runs,
        "interval_steps": args.interval_steps,
        "interval_ms": runs["baseline"]["mean_ms"] * args.interval_steps,
        "overhead_percent": overhead_percent(runs["baseline"]["mean_ms"], runs["pma"]["mean_ms"]),
    }


def fsdp_worker(args: argparse.Namespace, workdir: Path) -> None:
    """Part 2, one rank (under ``accelerate launch --use_fsdp --fsdp_version 2``): train with
    sharded snapshots; rank 0 writes ``fsdp-worker.json``."""
    from transformers import Trainer

    StepTimer, TimedPMACallback = _timing_callbacks()
    timer = StepTimer()
    out = workdir / "fsdp"
    callback = TimedPMACallback(
        interval_tokens=args.interval_steps * args.batch * args.seq, phases=("stable",), sharded="auto"
    )
    training_args = _training_arguments(args, out)
    trainer = Trainer(
        model=_model(args),
        args=training_args,
        train_dataset=_dataset(args, args.steps * args.batch * training_args.world_size),
        callbacks=[callback, timer],
    )
    trainer.train()
    if training_args.process_index == 0:
        report = {
            "world_size": training_args.world_size,
            "sink": type(callback._sink).__name__,
            "costs": callback.costs(),
            "interval_ms": mean_step_ms(timer.seconds, args.warmup) * args.interval_steps,
            "staging": staging_reuse(callback.staging_history),
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
    reason = cuda_missing_reason()
    if reason is not None:
        print(f"gpu_check.py: {reason}; nothing was run", file=sys.stderr)
        return 1
    if args.fsdp_worker is not None:
        fsdp_worker(args, args.fsdp_worker)
        return 0
    import torch

    results: dict[str, Any] = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
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
