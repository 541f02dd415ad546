"""PMA vs annealing, the paper's central experiment at small scale, and loss-spike recovery.

Li et al. (arXiv 2505.12082) fork a constant-LR run and compare (A) continuing at constant LR
and merging its last snapshots with (B) annealing the LR for the same number of tokens. This
script does the same with a small Llama on the Python standard library's source:

1. **Trunk**: warmup, then constant LR for ``--fork-step + --decay-steps`` steps, with a PMA
   snapshot every ``--snapshot-every`` steps (``PMACallback``), and a Trainer checkpoint
   (weights, optimizer, scheduler, data position) at the fork.
2. **Annealed branches**: from the fork checkpoint, the same data for ``--decay-steps``
   steps with a WSD schedule decaying to 0 (cosine, linear, 1-sqrt); their weights are
   snapshotted at the same token counts (``PMACallback`` in the decay phase).
3. **Evaluation** at ``--points`` points after the fork: the last constant-LR weights, the
   PMA merges of the constant branch (every strategy, window N and stride k at the last point;
   SMA for each N at the earlier ones) and the annealed branches (partially annealed before the
   last point, as in the paper), on held-out documents (loss, bits per byte) and on
   multiple-choice tasks generated from them (next line, cloze; ``hf_pma.evaluation.generated_tasks``). Merges are
   evaluated with :class:`hf_pma.analysis.sweep.SweepEvaluator` (one model, merges swapped in).
4. **Loss spike**: from the fork, a constant-LR run whose LR is multiplied by
   ``--spike-lr-mult`` for ``--spike-steps`` steps, with and without ``PMATrainer``'s
   ``pma_spike_recovery`` (restore the SMA of the 3 snapshots before the spike, reset Adam).

Prints markdown tables, writes ``results.json``, ``pma_vs_annealing.png`` and ``tables.md``
into ``--output-dir``. The default size takes 5.5 to 8 minutes on 2 shared CPU cores::

    python benchmarks/pma_vs_annealing.py                                  # CPU default
    python benchmarks/pma_vs_annealing.py --fork-step 80 --decay-steps 40 --snapshot-every 10 \\
        --points 2 --task-items 20 --eval-chars 8000 --no-spike              # a 2-minute smoke run
    python benchmarks/pma_vs_annealing.py --hidden 512 --layers 8 --heads 8 --intermediate 1536 \\
        --batch 64 --corpus-bytes 8000000 --fork-step 2000 --decay-steps 1000 --snapshot-every 100 \\
        --points 5 --threads 0 --bf16                                      # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import logging as std_logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
LM_METRICS = ("loss", "bits_per_byte")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--intermediate", type=int, default=384)
    g.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary trained on the train split")
    g.add_argument("--block", type=int, default=128, help="tokens per sequence")
    g.add_argument("--batch", type=int, default=8, help="sequences per step")
    g.add_argument("--corpus-bytes", type=int, default=3_000_000, help="bytes of standard-library source")
    g.add_argument("--eval-fraction", type=float, default=0.1, help="share of documents held out")
    g = p.add_argument_group("schedule")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--fork-step", type=int, default=240, help="step at which the annealed branches fork")
    g.add_argument("--decay-steps", type=int, default=120, help="steps after the fork (branch length)")
    g.add_argument("--snapshot-every", type=int, default=10, help="steps between PMA snapshots (V)")
    g.add_argument("--anneal", default="cosine,linear,1-sqrt", help="decay shapes of the annealed branches")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("merges and evaluation")
    g.add_argument("--points", type=int, default=4, help="evaluation points after the fork (evenly spaced)")
    g.add_argument("--windows", default="3,6,10", help="merge sizes N")
    g.add_argument("--every", default="1,2", help="strides k (every k-th snapshot: V' = k V)")
    g.add_argument("--strategies", default="sma,wma,ema")
    g.add_argument("--alpha", type=float, default=0.2, help="EMA alpha")
    g.add_argument("--full-grid-at-all-points", action="store_true", help="every merge at every point (slower)")
    g.add_argument("--eval-chars", type=int, default=40_000, help="characters of held-out text for loss / bits per byte")
    g.add_argument("--task-items", type=int, default=100, help="items per generated task (0: no tasks)")
    g.add_argument("--tasks-at", choices=["final", "all"], default="final", help="points where tasks are evaluated")
    g = p.add_argument_group("loss spike")
    g.add_argument("--no-spike", action="store_true", help="skip the loss-spike experiment")
    g.add_argument("--spike-offset", type=int, default=40, help="steps after the fork before the LR burst")
    g.add_argument("--spike-steps", type=int, default=3, help="steps at the too-high LR")
    g.add_argument("--spike-lr-mult", type=float, default=50.0, help="LR multiplier during the burst")
    g.add_argument("--spike-length", type=int, default=None, help="steps of the spike runs after the fork (default: --decay-steps)")
    g.add_argument("--spike-factor", type=float, default=1.3, help="pma_spike_factor of the detector")
    g = p.add_argument_group("machine and output")
    g.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); 1 is fastest on busy shared cores")
    g.add_argument("--bf16", action="store_true", help="train in bfloat16 mixed precision (GPU)")
    g.add_argument("--eval-batch", type=int, default=32)
    g.add_argument("--scratch", help="work folder (default: a temporary folder, deleted unless --keep)")
    g.add_argument("--keep", action="store_true", help="keep the work folder")
    g.add_argument("--output-dir", default=str(HERE.parent / "results" / "pma_vs_annealing"))
    args = p.parse_args(argv)
    args.windows = [int(v) for v in args.windows.split(",")]
    args.every = [int(v) for v in args.every.split(",")]
    args.strategies = [v.strip() for v in args.strategies.split(",")]
    args.anneal = [v.strip() for v in args.anneal.split(",") if v.strip()]
    args.spike_length = args.spike_length or args.decay_steps
    for name in ("fork_step", "decay_steps", "snapshot_every", "points"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    step = args.decay_steps // args.points
    if args.decay_steps % args.points or step % args.snapshot_every or args.fork_step % args.snapshot_every:
        p.error("--fork-step and --decay-steps / --points must be multiples of --snapshot-every")
    if args.warmup >= args.fork_step:
        p.error("--warmup must end before --fork-step")
    bad = [s for s in args.anneal if s not in ("cosine", "linear", "1-sqrt")]
    if bad:
        p.error(f"unknown decay shape(s) {bad}; choose cosine, linear, 1-sqrt")
    if not args.no_spike and args.spike_offset + args.spike_steps >= args.spike_length:
        p.error("the LR burst must end before --spike-length")
    return args


# ---------------------------------------------------------------- data and model


def prepare_data(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from hf_pma.evaluation.corpus import split_documents
    from hf_pma.training.pretrain_data import pack_dataset, stdlib_documents, train_bpe_tokenizer

    docs = stdlib_documents(max_bytes=args.corpus_bytes)
    train_docs, heldout = split_documents(docs, eval_fraction=args.eval_fraction, seed=args.seed)
    cache = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hf_pma" / "tokenizers"
    tokenizer = train_bpe_tokenizer(train_docs, vocab_size=args.vocab, cache_dir=cache)
    train_ds = pack_dataset(train_docs, tokenizer, args.block)
    # A fixed budget of held-out text, spread over every held-out document (the start of each).
    per_doc = max(1, args.eval_chars // len(heldout))
    texts = [doc[:per_doc] for doc in heldout]
    tasks_dir = None
    if args.task_items:
        from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks_from_split

        tasks_dir = scratch / "tasks"
        make_tasks_from_split(train_docs, heldout, tasks_dir, seed=args.seed, options=TaskOptions(num_items=args.task_items),
                              overwrite=True)
    return {"tokenizer": tokenizer, "train": train_ds, "texts": texts, "tasks_dir": tasks_dir,
            "num_train_docs": len(train_docs), "num_heldout_docs": len(heldout)}


def build_model(args: argparse.Namespace, tokenizer: Any) -> Any:
    from common import llama

    return llama(
        seed=args.seed,
        hidden=args.hidden,
        layers=args.layers,
        vocab=len(tokenizer),
        intermediate=args.intermediate,
        heads=args.heads,
        max_positions=args.block,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tokens_per_step(args: argparse.Namespace) -> int:
    return args.batch * args.block


def training_arguments(args: argparse.Namespace, output_dir: Path, cls: Any = None, **overrides: Any) -> Any:
    import torch
    from transformers import TrainingArguments

    cls = cls or TrainingArguments
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        weight_decay=0.01,
        max_grad_norm=1.0,
        adam_beta2=0.95,
        max_steps=args.fork_step + args.decay_steps,
        warmup_steps=args.warmup,
        lr_scheduler_type="constant_with_warmup",
        logging_steps=1,  # a resumed run keeps its checkpoint's logging_steps: the spike runs need 1
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        include_num_input_tokens_seen="all",
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def _trainer(args: argparse.Namespace, data: dict[str, Any], targs: Any, callbacks: list[Any], cls: Any = None) -> Any:
    from transformers import DataCollatorForLanguageModeling, Trainer
    from transformers.trainer_callback import PrinterCallback

    cls = cls or Trainer
    trainer = cls(
        model=build_model(args, data["tokenizer"]),
        args=targs,
        train_dataset=data["train"],
        data_collator=DataCollatorForLanguageModeling(data["tokenizer"], mlm=False),
        processing_class=data["tokenizer"],
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # a dict per logged step; the tables say what matters
    return trainer


# ---------------------------------------------------------------- runs


def train_trunk(args: argparse.Namespace, data: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Warmup + constant LR to the end of the branch, snapshots in the stable phase, a checkpoint at the fork."""
    from hf_pma import PMACallback

    out = scratch / "constant"
    targs = training_arguments(args, out, save_strategy="steps", save_steps=args.fork_step, save_only_model=False)
    callback = PMACallback(interval_tokens=args.snapshot_every * tokens_per_step(args), phases=["stable"])
    trainer = _trainer(args, data, targs, [callback])
    start = time.time()
    trainer.train()
    callback.wait()
    return {"dir": out, "checkpoint": out / f"checkpoint-{args.fork_step}", "log_history": trainer.state.log_history,
            "seconds": time.time() - start, "steps": trainer.state.global_step, "trainer": trainer}


def train_annealed(args: argparse.Namespace, scratch: Path, trunk: dict[str, Any], shape: str) -> dict[str, Any]:
    """From the fork checkpoint: the library's annealed fork (``anneal_from_checkpoint``: WSD decaying
    to 0 over --decay-steps, same data), with snapshots in the decay phase."""
    from hf_pma import PMACallback
    from hf_pma.training.annealing import anneal_from_checkpoint

    out = scratch / f"annealed-{shape}"
    callback = PMACallback(interval_tokens=args.snapshot_every * tokens_per_step(args), phases=["decay"])
    start = time.time()
    anneal_from_checkpoint(trunk["trainer"], trunk["checkpoint"], steps=args.decay_steps, decay_type=shape,
                           output_dir=out, callbacks=[callback])
    callback.wait()
    return {"dir": out, "seconds": time.time() - start, "steps": args.decay_steps}


def lr_burst(start: int, steps: int, factor: float) -> Any:
    """A TrainerCallback that multiplies the LR of ``steps`` optimizer steps after step ``start``."""
    from transformers import TrainerCallback

    class LRBurst(TrainerCallback):
        def on_step_begin(self, targs, state, control, optimizer=None, **kwargs):
            if start <= state.global_step < start + steps and optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * factor  # the scheduler sets it back after the step

    return LRBurst()


def train_spike(args: argparse.Namespace, data: dict[str, Any], scratch: Path, checkpoint: Path, recovery: bool) -> dict[str, Any]:
    """From the fork: constant LR with a burst of too-high LR, with or without PMA spike recovery."""
    from hf_pma import PMATrainer, PMATrainingArguments
    from hf_pma.training.trainer import LossSpikeError

    out = scratch / ("spike-recovery" if recovery else "spike-no-recovery")
    targs = training_arguments(
        args, out, cls=PMATrainingArguments, max_steps=args.fork_step + args.spike_length,
        pma_interval_tokens=args.snapshot_every * tokens_per_step(args), pma_phases=["stable"], pma_window=3,
        pma_eval=False, pma_merge_at_end=False, pma_spike_recovery=recovery, pma_spike_factor=args.spike_factor,
        pma_recovery_snapshots=3, pma_max_recoveries=2 * args.spike_steps + 2,
    )
    burst = lr_burst(args.fork_step + args.spike_offset, args.spike_steps, args.spike_lr_mult)
    trainer = _trainer(args, data, targs, [burst], cls=PMATrainer)
    start = time.time()
    error = None
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    except LossSpikeError as err:
        error = str(err)
    trainer.pma_callback.wait()
    return {"dir": out, "log_history": trainer.state.log_history, "recoveries": trainer.pma_recoveries,
            "seconds": time.time() - start, "error": error, "steps": trainer.state.global_step - args.fork_step}


# ---------------------------------------------------------------- evaluation


def snapshot_sources(run_dir: Path) -> list[Any]:
    from hf_pma.merging.sources import resolve_sources

    return resolve_sources([run_dir])


def _quiet_lm_eval_env_info() -> None:
    # lm-eval's simple_evaluate collects environment info (torch.utils.collect_env runs `pip list`
    # and other subprocesses) on every call: about 1 s per evaluated model here. It cannot change
    # within one process, so compute it once.
    import torch.utils.collect_env as collect_env

    if not hasattr(collect_env.get_pretty_env_info, "cache_info"):
        collect_env.get_pretty_env_info = functools.cache(collect_env.get_pretty_env_info)


class Evaluations:
    """Evaluates (merges of) checkpoints once each, with and without tasks."""

    def __init__(self, args: argparse.Namespace, data: dict[str, Any], skeleton: Path) -> None:
        from hf_pma.analysis.sweep import SweepEvaluator

        _quiet_lm_eval_env_info()
        common = dict(texts=data["texts"], block_size=args.block, batch_size=args.eval_batch, progress=False)
        self.lm = SweepEvaluator(skeleton, **common)
        self.full = None
        if data["tasks_dir"] is not None:
            self.full = SweepEvaluator(skeleton, tasks="pma_next_line,pma_cloze", include_path=data["tasks_dir"], **common)
        self.cache: dict[tuple, dict[str, Any]] = {}
        self.seconds = 0.0

    def __call__(self, sources: list[Any], weights: list[float], with_tasks: bool) -> dict[str, Any]:
        key = (tuple(str(s.path) for s in sources), tuple(round(w, 12) for w in weights))
        cached = self.cache.get(key)
        if cached is not None and (not with_tasks or self.full is None or "pma_cloze" in cached):
            return cached
        start = time.time()
        evaluator = self.full if with_tasks and self.full is not None else self.lm
        results = evaluator.evaluate_merge(sources, weights=weights)
        self.seconds += time.time() - start
        self.cache[key] = results
        return results


def _flat(results: dict[str, Any]) -> dict[str, float]:
    out = {f"lm/{m}": results["lm"][m] for m in LM_METRICS}
    for task in ("pma_next_line", "pma_cloze"):
        if task in results:
            out[f"{task}/acc"] = results[task]["acc"]
            out[f"{task}/acc_stderr"] = results[task].get("acc_stderr")
    return out


def evaluate_points(args: argparse.Namespace, evals: Evaluations, constant: list[Any], annealed: dict[str, list[Any]],
                    spikes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    from hf_pma.analysis.sweep import plan_sweep

    points = []
    step_of = {s.step: s for s in constant}
    for j in range(0, args.points + 1):  # j = 0: the fork, where every branch starts from the same weights
        step = args.fork_step + j * args.decay_steps // args.points
        final = j == args.points
        with_tasks = (args.tasks_at == "all" and j > 0) or final
        upto = [s for s in constant if s.step <= step]
        rows: dict[str, dict[str, Any]] = {}
        rows["constant LR (last weights)"] = {"kind": "constant", **_flat(evals([step_of[step]], [1.0], with_tasks))}
        grid = final or args.full_grid_at_all_points
        combos, _ = plan_sweep(
            len(upto), args.windows, args.every if grid else [1], args.strategies if grid else ["sma"], args.alpha
        )
        for c in combos:
            if c.window == 1:
                continue
            label = f"PMA {c.strategy.upper()} N={c.window}" + (f" V={c.every}x" if c.every > 1 else "")
            rows[label] = {"kind": "merge", "strategy": c.strategy, "window": c.window, "every": c.every,
                           **_flat(evals([upto[i] for i in c.indices], list(c.weights), with_tasks))}
        for shape, sources in annealed.items():
            if j == 0:
                rows[f"annealed ({shape})"] = {**rows["constant LR (last weights)"], "kind": "annealed"}
                continue
            src = next(s for s in sources if s.step == step)
            rows[f"annealed ({shape})"] = {"kind": "annealed", **_flat(evals([src], [1.0], with_tasks))}
        for name, sources in spikes.items():
            src = next((s for s in sources if s.step == step), None)
            if src is not None:
                try:
                    rows[name] = {"kind": "spike", **_flat(evals([src], [1.0], False))}
                except ValueError as err:  # a diverged run's weights hold NaN
                    rows[name] = {"kind": "spike", "lm/loss": float("nan"), "lm/bits_per_byte": float("nan"), "error": str(err)}
        points.append({"step": step, "after_fork": step - args.fork_step, "tokens": step * tokens_per_step(args),
                       "final": final, "rows": rows})
        print(f"  evaluated point {j}/{args.points} (step {step}, +{step - args.fork_step}): {len(rows)} models", flush=True)
    return points


# ---------------------------------------------------------------- reporting


def _best(rows: dict[str, Any], kind: str) -> tuple[str, dict[str, Any]] | None:
    found = [(k, v) for k, v in rows.items() if v["kind"] == kind]
    return min(found, key=lambda kv: kv[1]["lm/loss"]) if found else None


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def final_table(point: dict[str, Any]) -> str:
    from hf_pma.analysis.comparison import annealing_gain_recovered

    rows = point["rows"]
    base = rows["constant LR (last weights)"]["lm/loss"]
    best_anneal = _best(rows, "annealed")
    has_tasks = any("pma_cloze/acc" in r for r in rows.values())
    head = "| model | held-out loss | bits/byte | Δ loss vs constant | share of annealing gain |"
    head += " next-line acc | cloze acc |" if has_tasks else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    order = sorted(rows, key=lambda k: ({"constant": 0, "merge": 1, "annealed": 2, "spike": 3}[rows[k]["kind"]], rows[k]["lm/loss"]))
    for label in order:
        r = rows[label]
        if r["kind"] == "spike":
            continue
        delta = r["lm/loss"] - base
        recovered = annealing_gain_recovered(base, r["lm/loss"], best_anneal[1]["lm/loss"]) if best_anneal else None
        share = "" if recovered is None or r["kind"] == "constant" else f"{recovered:.0%}"
        line = f"| {label} | {r['lm/loss']:.4f} | {r['lm/bits_per_byte']:.4f} | {delta:+.4f} | {share} |"
        if has_tasks:
            line += "".join(
                f" {_fmt(r.get(t + '/acc'), '.3f')} ± {_fmt(r.get(t + '/acc_stderr'), '.3f')} |" if r.get(t + "/acc") is not None else " - |"
                for t in ("pma_next_line", "pma_cloze")
            )
        lines.append(line)
    return "\n".join(lines)


def points_table(points: list[dict[str, Any]], args: argparse.Namespace) -> str:
    labels = ["constant LR (last weights)"]
    for n in args.windows:
        labels.append(f"PMA SMA N={n}")
    labels += [f"annealed ({s})" for s in args.anneal]
    head = "| model | " + " | ".join(f"+{p['after_fork']} steps" for p in points) + " |"
    lines = [head, "|" + "---|" * (len(points) + 1)]
    for label in labels:
        cells = [_fmt(p["rows"].get(label, {}).get("lm/loss")) for p in points]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    best = []
    for p in points:
        b = _best(p["rows"], "merge")
        best.append(f"{b[1]['lm/loss']:.4f} ({b[0].removeprefix('PMA ')})" if b else "-")
    lines.append("| best merge evaluated there | " + " | ".join(best) + " |")
    return "\n".join(lines)


def spike_table(spike: dict[str, Any], points: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["| run | recoveries | peak training loss | held-out loss at " +
             " / ".join(f"+{p['after_fork']}" for p in points if p["after_fork"] > args.spike_offset and p["after_fork"] <= args.spike_length) + " |",
             "|---|---|---|---|"]
    burst_end = args.fork_step + args.spike_offset + args.spike_steps
    for name, run in [("reference (no burst)", None), *spike.items()]:
        key = name if run is not None else "constant LR (last weights)"
        losses = []
        for p in points:
            if args.spike_offset < p["after_fork"] <= args.spike_length:
                losses.append(_fmt(p["rows"].get(key, {}).get("lm/loss")))
        if run is None:
            peak, rec = "-", "-"
        else:
            after = [e["loss"] for e in run["log_history"] if "loss" in e and burst_end - args.spike_steps < e.get("step", 0) <= burst_end + 2]
            peak = _fmt(max(after) if after else None)
            rec = str(len(run["recoveries"])) + (f" (stopped: {run['error'][:60]}...)" if run["error"] else "")
        lines.append(f"| {name} | {rec} | {peak} | " + " / ".join(losses) + " |")
    return "\n".join(lines)


def draw_figure(path: Path, args: argparse.Namespace, points: list[dict[str, Any]], trunk: dict[str, Any],
                spike: dict[str, Any]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = 3 if spike else 2
    fig = Figure(figsize=(5.2 * panels, 4.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels)
    xs = [p["after_fork"] * tokens_per_step(args) / 1e6 for p in points]
    ax = axes[0]

    def series(label: str, metric: str = "lm/loss") -> list[float]:
        return [p["rows"].get(label, {}).get(metric, float("nan")) for p in points]

    ax.plot(xs, series("constant LR (last weights)"), "o-", color="C3", label="constant LR (last weights)")
    default_n = sorted(args.windows)[len(args.windows) // 2]
    ax.plot(xs, series(f"PMA SMA N={default_n}"), "s-", color="C2", label=f"constant LR + PMA (SMA, N={default_n})")
    best = [(_best(p["rows"], "merge") or (None, {"lm/loss": float("nan")}))[1]["lm/loss"] for p in points]
    ax.plot(xs, best, "s:", color="C2", alpha=0.6, label="constant LR + best merge there")
    for i, shape in enumerate(args.anneal):
        ax.plot(xs, series(f"annealed ({shape})"), "^--", color=f"C{i}" if i < 2 else "C4", alpha=0.9, label=f"annealed ({shape})")
    ax.set_xlabel("tokens after the fork (M)")
    ax.set_ylabel("held-out loss")
    ax.set_title("PMA vs annealing: held-out loss", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[1]
    final = points[-1]["rows"]
    keys = [k for k in final if final[k]["kind"] in ("constant", "annealed")]
    keys += [k for k in final if final[k]["kind"] == "merge" and final[k].get("every") == 1 and final[k]["strategy"] == "sma"]
    tasks = [t for t in ("pma_next_line", "pma_cloze") if f"{t}/acc" in final["constant LR (last weights)"]]
    if tasks:
        width = 0.8 / len(tasks)
        for t_i, task in enumerate(tasks):
            vals = [final[k].get(f"{task}/acc", float("nan")) for k in keys]
            errs = [final[k].get(f"{task}/acc_stderr") or 0.0 for k in keys]
            ax.bar([i + t_i * width for i in range(len(keys))], vals, width, yerr=errs, label=task.removeprefix("pma_"))
        ax.set_xticks([i + width * (len(tasks) - 1) / 2 for i in range(len(keys))], keys, rotation=60, ha="right", fontsize=7)
        lo = min(final[k].get(f"{t}/acc", 1) for k in keys for t in tasks)
        ax.set_ylim(max(0.0, lo - 0.1), None)
        ax.set_ylabel("accuracy (4 choices)")
        ax.legend(fontsize=7)
        ax.set_title(f"generated tasks at +{points[-1]['after_fork']} steps", fontsize=10)
    else:
        vals = [final[k]["lm/bits_per_byte"] for k in keys]
        ax.bar(range(len(keys)), vals)
        ax.set_xticks(range(len(keys)), keys, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("bits per byte")

    if spike:
        ax = axes[2]
        first, last = args.fork_step, args.fork_step + args.spike_length

        def curve(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
            # A resumed run's history starts with the trunk's: keep the branch's own steps.
            return [(e["step"], e["loss"]) for e in history if "loss" in e and first < e["step"] <= last
                    and math.isfinite(e["loss"])]

        for i, (name, run) in enumerate(spike.items()):
            pts = curve(run["log_history"])
            if pts:
                ax.plot(*zip(*pts), color=f"C{i + 3}", linewidth=1, alpha=0.85, label=name)
            for r in run["recoveries"]:
                ax.axvline(r["step"], color=f"C{i + 3}", linestyle=":", linewidth=1)
        ref = curve(trunk["log_history"])
        if ref:
            ax.plot(*zip(*ref), color="k", linewidth=1, alpha=0.7, label="reference (no burst)", zorder=3)
        start = args.fork_step + args.spike_offset
        ax.axvspan(start, start + args.spike_steps, color="0.85", label=f"LR x{args.spike_lr_mult:g}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("loss spike: with and without PMA recovery", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.hidden}x{args.layers} Llama, {tokens_per_step(args):,} tokens/step, fork at step {args.fork_step}, "
                 f"snapshot every {args.snapshot_every} steps", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.set_verbosity_error()
    for name in ("lm_eval", "lm_eval.models.huggingface"):  # per-request truncation warnings
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    t0 = time.time()
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="pma_vs_annealing-"))
    if scratch.exists() and any(scratch.iterdir()):
        sys.exit(f"--scratch {scratch} is not empty")
    scratch.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    try:
        start = time.time()
        data = prepare_data(args, scratch)
        timings["data, tokenizer, tasks"] = time.time() - start
        print(f"data: {len(data['train'])} blocks of {args.block} tokens; {data['num_heldout_docs']} held-out documents, "
              f"{sum(map(len, data['texts'])):,} characters evaluated ({timings['data, tokenizer, tasks']:.0f}s)", flush=True)
        trunk = train_trunk(args, data, scratch)
        timings["constant-LR trunk"] = trunk["seconds"]
        print(f"constant-LR run: {trunk['steps']} steps in {trunk['seconds']:.0f}s", flush=True)
        annealed = {}
        for shape in args.anneal:
            run = train_annealed(args, scratch, trunk, shape)
            annealed[shape] = run
            timings[f"annealed ({shape})"] = run["seconds"]
            print(f"annealed branch ({shape}): {args.decay_steps} steps in {run['seconds']:.0f}s", flush=True)
        spike = {}
        if not args.no_spike:
            for recovery in (False, True):
                name = "burst + PMA recovery" if recovery else "burst, no recovery"
                run = train_spike(args, data, scratch, trunk["checkpoint"], recovery)
                spike[name] = run
                timings[name] = run["seconds"]
                print(f"{name}: {run['steps']} steps in {run['seconds']:.0f}s, {len(run['recoveries'])} recoveries"
                      + (f" ({run['error']})" if run["error"] else ""), flush=True)

        start = time.time()
        constant = snapshot_sources(trunk["dir"])
        evals = Evaluations(args, data, constant[-1].path)
        points = evaluate_points(
            args, evals, constant, {s: snapshot_sources(r["dir"]) for s, r in annealed.items()},
            {name: snapshot_sources(r["dir"]) for name, r in spike.items()},
        )
        timings["evaluation"] = time.time() - start
        timings["total"] = time.time() - t0

        final = points[-1]
        md = [f"### At the end of the branches (+{final['after_fork']} steps, {final['tokens']:,} tokens in total)", "",
              final_table(final), "", "### Held-out loss along the branches", "", points_table(points, args)]
        if spike:
            md += ["", "### Loss spike", "", spike_table(spike, points, args)]
        md += ["", "### Time (s)", "", "| stage | seconds |", "|---|---|",
               *(f"| {k} | {v:.0f} |" for k, v in timings.items())]
        text = "\n".join(md)
        print("\n" + text, flush=True)
        (out_dir / "tables.md").write_text(text + "\n")
        draw_figure(out_dir / "pma_vs_annealing.png", args, points, trunk, spike)
        record = {
            "args": {k: v for k, v in vars(args).items()},
            "points": points,
            "timings_s": timings,
            "spike": {k: {"recoveries": v["recoveries"], "error": v["error"],
                          "train_loss": [(e["step"], e["loss"]) for e in v["log_history"] if "loss" in e]}
                      for k, v in spike.items()},
            "trunk_train_loss": [(e["step"], e["loss"]) for e in trunk["log_history"] if "loss" in e],
            "evaluations": len(evals.cache),
            "torch_threads": torch.get_num_threads(),
        }
        (out_dir / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nwrote {out_dir / 'tables.md'}, {out_dir / 'results.json'}, {out_dir / 'pma_vs_annealing.png'}")
    finally:
        if args.keep or args.scratch:
            print(f"work folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
