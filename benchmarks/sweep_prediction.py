"""Does the merge pick what annealing would pick? An LR sweep and a model-size ladder, compared.

Teams run PMA to skip the decay phase of sweeps and scaling ladders: the merge of a constant-LR
run's last snapshots should rank the runs as their annealed versions would. This benchmark
trains, with ``scripts/pretrain.py`` (the default run's model, data and flags), every run of

* an **LR sweep**: ``--lrs`` (at least 4) x ``--seeds`` (at least 2), at the default model size;
* a **ladder**: ``--sizes`` (at least 3 model sizes) at ``--ladder-lr`` (seed 0; the sweep's run
  of that LR and size is reused),

each with an annealed fork over its last ``--anneal-steps`` (``--anneal_steps``: it ends at the
same tokens as the run's last snapshot), then runs ``hf-pma compare`` over the sweep and over the
ladder (``--fit params``) on the same held-out documents. Every run uses one tokenizer (trained
once on the train split) and one held-out file that no run trains on.

Writes ``sweep.json``, ``ladder.json`` (the compare reports), ``ladder.png`` (the fit),
``sweep_prediction.png`` (held-out loss against LR: last, merge, annealed) and ``tables.md``
(the compare tables, the command, the load average, the times) into ``--output-dir``::

    python benchmarks/sweep_prediction.py --preset smoke    # ~2 minutes: checks the pipeline, numbers mean nothing
    python benchmarks/sweep_prediction.py                   # --preset cpu: 10 runs of 400 steps, ~20-30 min on 2 idle cores
    python benchmarks/sweep_prediction.py --preset gpu      # larger models, more tokens: one GPU

Presets (``--preset``) set the defaults; any flag overrides them. ``cpu``: the default run's
model (hidden 96, 3 layers, 0.59M parameters), batch 8 x 128 tokens, a snapshot every 20 steps,
the automatic merge window (the default run's settings) but 400 steps instead of 1000 (anneal 80
instead of 200), so that 10 runs fit in about 20-30 minutes two at a time on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

PRESETS: dict[str, dict[str, Any]] = {
    # Checks the pipeline end to end; the numbers mean nothing.
    "smoke": dict(
        lrs="1e-3,3e-3,6e-3,1e-2",
        seeds="0",
        sizes="48x2,96x3,128x3",
        ladder_lr=3e-3,
        steps=60,
        anneal_steps=20,
        snapshot_every=10,
        window="auto",
        batch=8,
        block=128,
        vocab=1024,
        corpus_bytes=400_000,
        eval_docs=8,
        eval_chars=1500,
        parallel=2,
        device_flags="",
    ),
    # The default run's model and data, shorter: ~20-30 minutes on 2 idle CPU cores.
    "cpu": dict(
        lrs="1e-3,2e-3,3e-3,6e-3",
        seeds="0,1",
        sizes="64x2,96x3,160x4",
        ladder_lr=3e-3,
        steps=400,
        anneal_steps=80,
        snapshot_every=20,
        window="auto",
        batch=8,
        block=128,
        vocab=2048,
        corpus_bytes=9_000_000,  # 47 held-out documents: 40 compared (20 or more: the window check runs)
        eval_docs=40,
        eval_chars=4000,
        parallel=2,
        device_flags="",
    ),
    # One GPU: larger models, more tokens (runs one at a time).
    "gpu": dict(
        lrs="5e-4,1e-3,2e-3,4e-3",
        seeds="0,1",
        sizes="256x4,512x8,768x12",
        ladder_lr=1e-3,
        steps=3000,
        anneal_steps=600,
        snapshot_every=100,
        window="auto",
        batch=32,
        block=256,
        vocab=8192,
        corpus_bytes=8_000_000,
        eval_docs=100,
        eval_chars=8000,
        parallel=1,
        device_flags="--use_cpu false --bf16 true --dataloader_num_workers 2",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--lrs", help="learning rates of the sweep (at least 4 for the benchmark)")
    p.add_argument("--seeds", help="seeds of the sweep (at least 2 for the benchmark)")
    p.add_argument(
        "--sizes", help="ladder sizes HIDDENxLAYERS (4 heads, MLP 3x hidden); the second is the sweep's"
    )
    p.add_argument("--ladder-lr", type=float, help="learning rate of the ladder (one of --lrs)")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--anneal-steps", type=int, help="steps of each run's annealed fork (its last ones)")
    p.add_argument("--snapshot-every", type=int, help="steps between snapshots (V = batch x block x this)")
    p.add_argument(
        "--window", help="snapshots merged, N or auto (each run's pma_window; default: auto, the run chooses)"
    )
    p.add_argument(
        "--also-last",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="also compare the runs with the merge of the last N snapshots, for each N of this list (e.g. 2,4): "
        "the same runs, only the merge window differs",
    )
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--block", type=int, help="tokens per sequence")
    p.add_argument("--vocab", type=int, help="BPE vocabulary trained once on the train split")
    p.add_argument("--corpus-bytes", type=int, help="bytes of standard-library source")
    p.add_argument("--eval-docs", type=int, help="held-out documents compared")
    p.add_argument("--eval-chars", type=int, help="characters of each held-out document (its start)")
    p.add_argument("--parallel", type=int, help="runs trained at once (1 thread each on CPU)")
    p.add_argument("--device-flags", help="extra scripts/pretrain.py flags (the GPU preset's bf16, ...)")
    p.add_argument(
        "--scratch",
        help="work folder (default: TMPDIR/hf-pma-sweep-prediction-PRESET); finished runs found there are reused",
    )
    p.add_argument(
        "--output-dir", help="results (default: benchmarks/results/sweep_prediction, smoke: .../smoke)"
    )
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from hf_pma.core.window_choice import check_window_count

    try:
        args.window = check_window_count(args.window, "--window", text=True)
    except ValueError as e:
        p.error(str(e))
    args.lrs = [float(v) for v in str(args.lrs).split(",") if v.strip()]
    args.seeds = [int(v) for v in str(args.seeds).split(",") if v.strip()]
    args.sizes = [
        tuple(int(x) for x in s.lower().split("x")) for s in str(args.sizes).split(",") if s.strip()
    ]
    if args.ladder_lr not in args.lrs:
        p.error(f"--ladder-lr {args.ladder_lr} must be one of --lrs {args.lrs}")
    if len(args.sizes) < 3 or len(args.lrs) * len(args.seeds) < 3:
        p.error("compare needs at least 3 runs in the sweep and 3 sizes in the ladder")
    if (
        args.steps % args.snapshot_every
        or args.anneal_steps % args.snapshot_every
        or args.anneal_steps >= args.steps
    ):
        p.error(
            "--steps and --anneal-steps must be multiples of --snapshot-every, and --anneal-steps < --steps"
        )
    results = HERE.parent / "results" / "sweep_prediction"
    args.output_dir = Path(args.output_dir or (results / "smoke" if args.preset == "smoke" else results))
    args.scratch = Path(
        args.scratch or Path(tempfile.gettempdir()) / f"hf-pma-sweep-prediction-{args.preset}"
    )
    return args


def held_out_count(heldout: Path) -> int:
    """The documents in the held-out file (fewer than ``--eval-docs`` when the corpus holds fewer)."""
    return sum(1 for line in heldout.read_text().splitlines() if line.strip())


def window_text(window: int | str) -> str:
    """How the runs' merge window is set, in words."""
    return "the automatic merge window" if window == "auto" else f"merge of the last {window}"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


# ---------------------------------------------------------------- data, tokenizer (once)


def prepare_data(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The train documents (a JSONL file every run reads), the held-out documents (never trained
    on), and one tokenizer trained on the train split: every run tokenizes alike."""
    from hf_pma.evaluation.corpus import split_documents
    from hf_pma.training.pretrain_data import stdlib_documents, train_bpe_tokenizer

    data = args.scratch / "data"
    train, heldout, tokenizer = data / "train.jsonl", data / "heldout.jsonl", data / "tokenizer"
    if train.is_file() and heldout.is_file() and tokenizer.is_dir():
        return train, heldout, tokenizer
    data.mkdir(parents=True, exist_ok=True)
    docs = stdlib_documents(max_bytes=args.corpus_bytes)
    train_docs, held = split_documents(docs, eval_fraction=0.1, seed=0)
    cache = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hf_pma" / "tokenizers"
    train_bpe_tokenizer(train_docs, vocab_size=args.vocab, cache_dir=cache).save_pretrained(tokenizer)
    train.write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs))
    kept = [d[: args.eval_chars] for d in held[: args.eval_docs]]
    heldout.write_text("".join(json.dumps({"text": d}) + "\n" for d in kept))
    return train, heldout, tokenizer


# ---------------------------------------------------------------- runs


def run_name(lr: float, seed: int, size: tuple[int, int]) -> str:
    return f"h{size[0]}x{size[1]}-lr{lr:g}-s{seed}"


def train_run(
    args: argparse.Namespace, name: str, lr: float, seed: int, size: tuple[int, int], data: tuple
) -> dict:
    """One run of ``scripts/pretrain.py`` with its annealed fork; kept when it finished before."""
    train, _, tokenizer = data
    out = args.scratch / "runs" / name
    log = args.scratch / "logs" / f"{name}.log"
    done = out / "annealed" / "model.safetensors"
    if done.is_file() and (out / "pma" / "manifest.json").is_file():
        return {"name": name, "seconds": None, "reused": True}
    hidden, layers = size
    command = [
        sys.executable,
        str(REPO / "scripts" / "pretrain.py"),
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "true",
        "--seed",
        str(seed),
        "--learning_rate",
        str(lr),
        "--max_steps",
        str(args.steps),
        "--anneal_steps",
        str(args.anneal_steps),
        "--warmup_steps",
        str(max(1, args.steps // 30)),
        "--per_device_train_batch_size",
        str(args.batch),
        "--block_size",
        str(args.block),
        "--config_overrides",
        f"hidden_size={hidden},intermediate_size={3 * hidden},num_hidden_layers={layers},num_attention_heads=4,num_key_value_heads=4",
        "--tokenizer_name",
        str(tokenizer),
        "--train_files",
        str(train),
        "--eval_fraction",
        "0.01",
        "--pma_interval_tokens",
        str(args.batch * args.block * args.snapshot_every),
        "--pma_window",
        str(args.window),
        "--pma_keep_last",
        str(args.steps // args.snapshot_every + 1),
        "--eval_strategy",
        "no",
        "--make_tasks",
        "false",
        "--max_eval_texts",
        "4",
        "--max_eval_chars",
        "1000",
        "--logging_steps",
        str(max(1, args.steps // 20)),
        *args.device_flags.split(),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with log.open("w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"run {name} failed (exit {code}); the end of {log}:\n{tail}")
    return {"name": name, "seconds": round(time.time() - started, 1), "reused": False}


def compare(args: argparse.Namespace, runs: list[Path], heldout: Path, output: Path, extra: list[str]) -> str:
    """``hf-pma compare RUNS --eval-file HELDOUT -o OUTPUT ...``; returns what it printed."""
    if output.exists():
        output.unlink()
    if output.with_suffix(".png").exists():
        output.with_suffix(".png").unlink()
    command = [
        sys.executable,
        "-m",
        "hf_pma.cli",
        "compare",
        *map(str, runs),
        "--eval-file",
        str(heldout),
        "--block-size",
        str(args.block),
        "-o",
        str(output),
        "-q",
        *extra,
    ]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"hf-pma compare failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def plot_sweep(report: dict, lrs: dict[str, float], output: Path) -> None:
    """Held-out loss against learning rate: each run's last snapshot, merge and annealed model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for kind, color, marker in (
        ("last", "tab:gray", "o"),
        ("merge", "tab:blue", "s"),
        ("annealed", "tab:orange", "^"),
    ):
        pts = sorted((lrs[e["name"]], (e[kind] or {}).get("value")) for e in report["runs"])
        pts = [(x, y) for x, y in pts if y is not None]
        ax.scatter(
            [p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=kind, alpha=0.8
        )
        means: dict[float, list[float]] = {}
        for x, y in pts:
            means.setdefault(x, []).append(y)
        xs = sorted(means)
        ax.plot(xs, [sum(means[x]) / len(means[x]) for x in xs], color=color, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(report["metric"])
    ax.set_title(f"LR sweep at {report['at_tokens']:,} tokens (lines: mean over seeds)", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(output)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_start = time.time(), load_average()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args)
    base = args.sizes[1]
    sweep = {run_name(lr, seed, base): (lr, seed, base) for seed in args.seeds for lr in args.lrs}
    ladder = {
        run_name(args.ladder_lr, args.seeds[0], size): (args.ladder_lr, args.seeds[0], size)
        for size in args.sizes
    }
    jobs = {**sweep, **ladder}
    print(
        f"{len(jobs)} runs of {args.steps} steps (+{args.anneal_steps} annealed), {args.parallel} at a time; "
        f"load average {load_start}",
        flush=True,
    )
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(train_run, args, name, *spec, data) for name, spec in jobs.items()]
        timings = []
        for future in futures:
            timings.append(future.result())
            print(
                f"  {timings[-1]['name']}: {timings[-1]['seconds']} s"
                + (" (reused)" if timings[-1]["reused"] else ""),
                flush=True,
            )
    trained = time.time()
    runs = args.scratch / "runs"
    sweep_out = compare(args, [runs / n for n in sweep], data[1], args.output_dir / "sweep.json", [])
    ladder_out = compare(
        args, [runs / n for n in ladder], data[1], args.output_dir / "ladder.json", ["--fit", "params"]
    )
    also = {
        n: (
            compare(
                args,
                [runs / r for r in sweep],
                data[1],
                args.output_dir / f"sweep-last{n}.json",
                ["--last", str(n)],
            ),
            compare(
                args,
                [runs / r for r in ladder],
                data[1],
                args.output_dir / f"ladder-last{n}.json",
                ["--last", str(n)],
            ),
        )
        for n in args.also_last
    }
    sweep_report = json.loads((args.output_dir / "sweep.json").read_text())
    plot_sweep(
        sweep_report, {n: spec[0] for n, spec in sweep.items()}, args.output_dir / "sweep_prediction.png"
    )
    finished, load_end = time.time(), load_average()
    command = " ".join(
        ["python", "benchmarks/sweep_prediction.py", *(argv if argv is not None else sys.argv[1:])]
    )
    lines = [
        f"# Sweep prediction ({args.preset} preset)",
        "",
        f"`{command}`: {len(jobs)} runs of {args.steps} steps, batch {args.batch} x {args.block} tokens, a snapshot "
        f"every {args.snapshot_every} steps, {window_text(args.window)}, annealed fork over the last "
        f"{args.anneal_steps} steps (linear to 0); held-out: {held_out_count(data[1])} documents of at most {args.eval_chars} "
        "characters.",
        f"Training {trained - started:.0f} s, compare {finished - trained:.0f} s; load average {load_start} at the "
        f"start, {load_end} at the end.",
        "",
        f"## LR sweep ({', '.join(f'{lr:g}' for lr in args.lrs)} x seeds {', '.join(map(str, args.seeds))}; "
        f"hidden {base[0]}, {base[1]} layers)",
        "",
        sweep_out.strip(),
        "",
        "![LR sweep](sweep_prediction.png)",
        "",
        f"## Ladder ({', '.join(f'{h}x{n}' for h, n in args.sizes)} at LR {args.ladder_lr:g}, seed {args.seeds[0]})",
        "",
        ladder_out.strip(),
        "",
        "![ladder fit](ladder.png)",
        "",
        *(
            line
            for n, (sweep_n, ladder_n) in also.items()
            for line in (
                f"## The same runs, merging the last {n} snapshots",
                "",
                "LR sweep:",
                "",
                sweep_n.strip(),
                "",
                "Ladder:",
                "",
                ladder_n.strip(),
                "",
            )
        ),
        "## Runs",
        "",
        "| run | seconds |",
        "|---|---:|",
        *(f"| {t['name']} | {t['seconds'] if t['seconds'] is not None else 'reused'} |" for t in timings),
    ]
    (args.output_dir / "tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nresults in {args.output_dir}; runs in {args.scratch} (delete it to train again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
