"""Which merge window? The automatic window against a fixed N=8 and the last snapshot, at three run lengths.

PMA's merge should preview the annealed model at any run length. A fixed N that suits a 1,000-step
run reaches back into weights from before the loss settled in a 300-step run; ``window="auto"``
(:mod:`hf_pma.core.window_choice`) chooses from the run's own records. This benchmark trains, with
``scripts/pretrain.py`` (the default run's model and flags), every run of

* ``--lengths`` (300, 1,000, 3,000 and 6,000 steps) x ``--lrs`` (4 learning rates; 2 at 6,000 steps,
  ``--lrs-at``) x ``--seeds`` (2; 1 at 6,000 steps, ``--seeds-at``),
  each with an annealed fork over its last ``--anneal-share`` (20%) ending at the same tokens,
  a snapshot every 20 steps, all kept;

then, per length, runs ``hf-pma compare`` over its runs with each window: ``--last auto`` (the
default: the rule's window checked on every 4th held-out document, the *selection* split), the rule
alone (``--no-window-check``) and ``--last 8``; every result is on the other documents (the
*report* split; the last snapshot is in every report). Per window it reports:

* merge minus last snapshot (paired over documents, with its SE) in every run;
* the share of the annealing gain it recovers, where annealing gains at least 3 SE;
* Kendall's tau with the annealed ranking within each (length, seed) group (the 4 learning rates);
* the mean absolute error against the annealed loss.

It also evaluates, on the selection documents (never the report's), the merge (with the rule's weights) of the newest k
snapshots for k = 1, 2, 3, ... in every run: the curves that show where the rule lands against the
best k in hindsight (``curves.json``, ``window_choice.png``).

Writes ``results.json``, ``tables.md``, ``window_choice.png`` and the compare reports into
``--output-dir``::

    python benchmarks/window_choice.py --preset smoke     # minutes: checks the pipeline, numbers mean nothing
    python benchmarks/window_choice.py                    # --preset cpu: 26 runs, about 50 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sweep_prediction as sp  # the same runs, data and tokenizer as the sweep benchmark

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
FIXED_N = 8
# The windows k whose newest-k merge each curve evaluates (with auto's and FIXED_N).
CURVE_KS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32)

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(lengths="60,120", lrs="3e-3,6e-3", seeds="0,1", corpus_bytes=600_000, eval_docs=20),
    # 6,000 steps at two learning rates and one seed: does what suits 3,000 steps hold twice as long?
    "cpu": dict(
        lengths="300,1000,3000,6000", lrs="1.5e-3,3e-3,6e-3,1.2e-2", seeds="0,1", seeds_at="6000=0",
        lrs_at="6000=3e-3+1.2e-2", corpus_bytes=9_000_000, eval_docs=40,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--lengths", help="optimizer steps of the runs, comma-separated")
    p.add_argument("--lrs", help="learning rates, comma-separated")
    p.add_argument("--seeds", help="seeds, comma-separated")
    p.add_argument("--anneal-share", type=float, default=0.2, help="the annealed fork's share of each run")
    p.add_argument("--corpus-bytes", type=int, help="bytes of standard-library source")
    p.add_argument("--eval-docs", type=int, help="held-out documents (every 4th selects, the others report; at least 20)")
    p.add_argument("--parallel", type=int, default=2, help="runs trained at once (1 thread each)")
    p.add_argument(
        "--seeds-at",
        help="fewer seeds at some lengths, e.g. 3000=0 (when the CPU time for every seed of the longest runs is not there)",
    )
    p.add_argument("--lrs-at", help="fewer learning rates at some lengths, e.g. 6000=3e-3+1.2e-2")
    p.add_argument("--curve-lengths", help="run lengths whose selection curves are evaluated (default: every length)")
    p.add_argument("--new-curves", action="store_true", help="evaluate the selection curves again (else curves.json is reused)")
    p.add_argument("--new-compare", action="store_true", help="run hf-pma compare again (else compare-*.json are reused)")
    p.add_argument("--scratch", help="work folder (default: TMPDIR/hf-pma-window-choice-PRESET); finished runs are reused")
    p.add_argument("--output-dir", help="results (default: benchmarks/results/window_choice, smoke: .../smoke)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lengths = [int(v) for v in str(args.lengths).split(",")]
    args.lrs = [float(v) for v in str(args.lrs).split(",")]
    args.seeds = [int(v) for v in str(args.seeds).split(",")]
    args.seeds_at = {
        int(k): [int(x) for x in v.split("+")] for k, v in (item.split("=") for item in (args.seeds_at or "").split(",") if item)
    }
    args.lrs_at = {
        int(k): [float(x) for x in v.split("+")] for k, v in (item.split("=") for item in (args.lrs_at or "").split(",") if item)
    }
    args.curve_lengths = [int(v) for v in args.curve_lengths.split(",")] if args.curve_lengths else args.lengths
    results = HERE.parent / "results" / "window_choice"
    args.output_dir = Path(args.output_dir or (results / "smoke" if args.preset == "smoke" else results))
    args.scratch = Path(args.scratch or Path("/tmp") / f"hf-pma-window-choice{'' if args.preset == 'cpu' else '-' + args.preset}")
    return args


def sweep_args(args: argparse.Namespace, steps: int) -> argparse.Namespace:
    """The sweep benchmark's settings for one run length (its ``cpu`` preset's model and batch)."""
    base = sp.parse_args([
        "--preset", "cpu", "--scratch", str(args.scratch), "--output-dir", str(args.output_dir),
        "--corpus-bytes", str(args.corpus_bytes), "--eval-docs", str(args.eval_docs),
    ])
    out = copy.copy(base)
    out.steps = steps
    out.anneal_steps = max(out.snapshot_every, round(steps * args.anneal_share / out.snapshot_every) * out.snapshot_every)
    return out


def seeds_of(args: argparse.Namespace, steps: int) -> list[int]:
    """The seeds run at this length (``--seeds-at``, else ``--seeds``)."""
    return args.seeds_at.get(steps, args.seeds)


def lrs_of(args: argparse.Namespace, steps: int) -> list[float]:
    """The learning rates run at this length (``--lrs-at``, else ``--lrs``)."""
    return args.lrs_at.get(steps, args.lrs)


def run_name(steps: int, lr: float, seed: int) -> str:
    return f"n{steps}-lr{lr:g}-s{seed}"


def split_files(heldout: Path) -> tuple[Path, Path]:
    """The held-out documents split as ``hf-pma compare`` splits them for its window check
    (:func:`hf_pma.core.window_check.split_for_selection`): the selection documents (the check's,
    and the curves'), and the report documents (every result's: given to the compares that make no
    check, so that every window is reported on the same documents)."""
    from hf_pma.core.window_check import split_for_selection

    docs = [line for line in heldout.read_text().splitlines() if line.strip()]
    split = split_for_selection(len(docs))
    assert not split.skipped, split.skipped
    selection, report = heldout.with_name("split-selection.jsonl"), heldout.with_name("split-report.jsonl")
    selection.write_text("".join(docs[i] + "\n" for i in split.selection))
    report.write_text("".join(docs[i] + "\n" for i in split.report))
    return selection, report


def train_all(args: argparse.Namespace) -> tuple[list[dict], tuple]:
    data = sp.prepare_data(sweep_args(args, args.lengths[0]))
    jobs = [
        (sweep_args(args, steps), run_name(steps, lr, seed), lr, seed)
        for steps in args.lengths
        for seed in seeds_of(args, steps)
        for lr in lrs_of(args, steps)
    ]
    jobs.sort(key=lambda job: -job[0].steps)  # longest first: the two workers finish together
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(sp.train_run, a, name, lr, seed, (96, 3), data) for a, name, lr, seed in jobs]
        timings = []
        for future in futures:
            timings.append(future.result())
            print(f"  {timings[-1]['name']}: {timings[-1]['seconds']} s", flush=True)
    return timings, data


def curves(args: argparse.Namespace, selection: Path, skip: set[str] = frozenset()) -> dict[str, Any]:
    """Per run (but those in ``skip``): the held-out loss (selection documents) of the SMA of the
    newest k, for each k; the annealed model's; and the windows auto and N=8 take."""
    import torch

    from hf_pma.analysis.sweep import SweepEvaluator
    from hf_pma.core.strategies import merge_coefficients
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.merging.windows import select_auto

    torch.set_num_threads(1)
    texts = [json.loads(line)["text"] for line in selection.read_text().splitlines() if line.strip()]
    out = {}
    for steps in args.curve_lengths:
        for seed in seeds_of(args, steps):
            for lr in lrs_of(args, steps):
                name = run_name(steps, lr, seed)
                if name in skip:
                    continue
                run = args.scratch / "runs" / name
                sources = resolve_sources([run])
                choice = select_auto(sources)[1]
                evaluator = SweepEvaluator(sources[-1].path, texts, block_size=128, tokenizer=args.scratch / "data" / "tokenizer")
                ks = sorted({k for k in (*CURVE_KS, choice.count, FIXED_N) if k <= len(sources)})
                # The rule's own weights (WMA) at every k: where its window lands on its own curve.
                losses = {
                    k: evaluator.evaluate_merge(sources[-k:], weights=merge_coefficients(k, choice.strategy if k > 1 else "sma"))["lm"]["loss"]
                    for k in ks
                }
                annealed = evaluator.evaluate_merge([run / "annealed"], weights=[1.0])["lm"]["loss"]
                out[name] = {
                    "steps": steps, "lr": lr, "seed": seed, "snapshots": len(sources),
                    "losses": {str(k): v for k, v in losses.items()}, "annealed": annealed,
                    "auto": choice.to_dict(), "best_k": min(losses, key=losses.get),
                }
                print(f"  {name}: auto {choice.count}, best k {out[name]['best_k']}", flush=True)
    return out


def refresh_auto(args: argparse.Namespace, curve: dict[str, Any]) -> None:
    """Each curve's automatic window as the rule chooses it now (curves are kept across rule changes)."""
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.merging.windows import select_auto

    for name, c in curve.items():
        c["auto"] = select_auto(resolve_sources([args.scratch / "runs" / name]))[1].to_dict()


# The windows compared: (label, compare flags, whether compare gets every held-out document and splits them itself).
WINDOWS = {
    "auto": (["--last", "auto"], True),  # the default: the rule, checked on the selection documents
    "rule": (["--last", "auto", "--no-window-check"], False),  # the rule alone
    str(FIXED_N): (["--last", str(FIXED_N)], False),
}


def compare(args: argparse.Namespace, steps: int, window: str, heldout: Path, report: Path) -> dict[str, Any]:
    """``hf-pma compare`` of one length's runs with one of :data:`WINDOWS`, every result on the report documents."""
    output = args.output_dir / f"compare-{steps}-{window}.json"
    if output.is_file() and not args.new_compare:  # kept: a compare of the same runs
        return json.loads(output.read_text())
    flags, splits = WINDOWS[window]
    runs = [str(args.scratch / "runs" / run_name(steps, lr, seed)) for seed in seeds_of(args, steps) for lr in lrs_of(args, steps)]
    command = [sys.executable, "-m", "hf_pma.cli", "compare", *runs, "--eval-file", str(heldout if splits else report),
               "--block-size", "128", "--tokenizer", str(args.scratch / "data" / "tokenizer"), *flags,
               "--bootstrap", "0", "-o", str(output), "-q"]
    output.unlink(missing_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"hf-pma compare failed:\n{done.stderr[-3000:]}")
    result = json.loads(output.read_text())
    reported = {len(e["last"]["per_text"]["nll"]) for e in result["runs"]}
    expected = sp.held_out_count(report)
    assert reported == {expected}, f"{output.name}: reported on {reported} documents, not the {expected} of the report split"
    return result


def kendall(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b (ties share a rank)."""
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def separated(entries: list[dict]) -> bool:
    """Whether the group's annealed losses are separated by more than 2 SE: every two runs next to
    each other in the annealed ranking differ by more than twice the paired standard error of the
    difference (over the same report documents)."""
    import statistics

    losses = []
    for e in entries:
        nll, tokens = e["annealed"]["per_text"]["nll"], e["annealed"]["per_text"]["tokens"]
        losses.append([n / t if t else math.nan for n, t in zip(nll, tokens)])
    order = sorted(range(len(losses)), key=lambda i: statistics.fmean(x for x in losses[i] if not math.isnan(x)))
    for a, b in zip(order, order[1:]):
        diffs = [y - x for x, y in zip(losses[a], losses[b]) if not (math.isnan(x) or math.isnan(y))]
        if statistics.fmean(diffs) <= 2 * statistics.stdev(diffs) / math.sqrt(len(diffs)):
            return False
    return True


def summarize(args: argparse.Namespace, reports: dict[tuple[int, str], dict]) -> dict[str, Any]:
    """Per window: every run's merge - last (paired SE), gain share, tau per (length, seed), MAE."""
    rows, groups, summary = [], [], {}
    for window in (*WINDOWS, "last"):
        errors, taus, worse, recovered = [], [], [], []
        for steps in args.lengths:
            report = reports[(steps, "auto" if window == "last" else window)]
            by_name = {e["name"]: e for e in report["runs"]}
            for seed in seeds_of(args, steps):
                names = [run_name(steps, lr, seed) for lr in lrs_of(args, steps)]
                entries = [by_name[n] for n in names]
                pred = [e["last"]["value"] if window == "last" else e["merge"]["value"] for e in entries]
                ann = [e["annealed"]["value"] for e in entries]
                taus.append(kendall(pred, ann))
                groups.append({"window": window, "steps": steps, "seed": seed, "tau": taus[-1], "separated": separated(entries)})
                for e, p, a in zip(entries, pred, ann):
                    errors.append(abs(p - a))
                    paired = (e["merge"] or {}).get("paired") or {}
                    diff, se = (0.0, 0.0) if window == "last" else (paired.get("diff"), paired.get("stderr"))
                    gain = (e["annealed"] or {}).get("paired") or {}
                    big_gain = gain.get("diff") is not None and -gain["diff"] >= 3 * gain["stderr"]
                    share = None if window == "last" else e.get("annealing_gain_recovered")
                    rows.append({
                        "window": window, "run": e["name"], "steps": steps, "lr": e["name"].split("-")[1][2:], "seed": seed,
                        "n": 1 if window == "last" else e["merge"]["window"], "diff": diff, "se": se,
                        "strategy": None if window == "last" else e["merge"]["strategy"],
                        "worse_beyond_1se": bool(diff is not None and se is not None and diff > se),
                        "annealing_gain": gain.get("diff"), "annealing_se": gain.get("stderr"),
                        "gain_share": share, "gain_counts": big_gain,
                    })
                    worse.append(rows[-1]["worse_beyond_1se"])
                    if big_gain and share is not None:
                        recovered.append(share)
        summary[window] = {
            "runs_worse_than_last_beyond_1se": sum(worse),
            "runs": len(worse),
            "min_gain_share_where_annealing_gains_3se": min(recovered) if recovered else None,
            "runs_where_annealing_gains_3se": len(recovered),
            "runs_recovering_80pct": sum(r >= 0.8 for r in recovered),
            "runs_recovering_90pct": sum(r >= 0.9 for r in recovered),
            "groups_tau_1": sum(t >= 1 - 1e-9 for t in taus),
            "groups": len(taus),
            "separated_groups_tau_1": sum(g["tau"] >= 1 - 1e-9 for g in groups if g["window"] == window and g["separated"]),
            "separated_groups": sum(1 for g in groups if g["window"] == window and g["separated"]),
            "mae": sum(errors) / len(errors),
        }
    return {"rows": rows, "groups": groups, "summary": summary}


def plot(curve: dict[str, Any], output: Path) -> None:
    """Selection loss of the newest-k merge (the rule's weights) minus the last snapshot's, against k's share of the run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = sorted({c["steps"] for c in curve.values()})
    fig = Figure(figsize=(4 * len(lengths), 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(lengths), squeeze=False)[0]
    for ax, steps in zip(axes, lengths):
        for c in curve.values():
            if c["steps"] != steps:
                continue
            ks = sorted(int(k) for k in c["losses"])
            base = c["losses"]["1"]
            line = ax.plot([k * 20 / steps for k in ks], [c["losses"][str(k)] - base for k in ks], lw=1, alpha=0.8)[0]
            auto = c["auto"]["count"]
            if str(auto) in c["losses"]:
                ax.scatter([auto * 20 / steps], [c["losses"][str(auto)] - base], color=line.get_color(), marker="o", s=18)
            ax.axhline(c["annealed"] - base, color=line.get_color(), lw=0.6, ls=":")
        ax.axhline(0, color="black", lw=0.6)
        ax.set_title(f"{steps} steps (dots: auto; dotted: annealed)", fontsize=9)
        ax.set_xlabel("window span, share of the run")
        ax.set_ylabel("merge of newest k - last snapshot (nats)")
    fig.savefig(output)


def _g(x: float) -> str:
    return f"{x:g}"


def tables(args, summary, curve, timings, times, loads) -> str:  # noqa: ANN001
    s = summary["summary"]
    lines = [
        "# Window choice (cpu preset)" if args.preset == "cpu" else f"# Window choice ({args.preset} preset)",
        "",
        f"`{' '.join(['python', 'benchmarks/window_choice.py', *args.argv])}`: "
        f"{len(timings)} runs ({', '.join(map(str, args.lengths))} steps x LR {', '.join(f'{x:g}' for x in args.lrs)} x seeds "
        f"{', '.join(map(str, args.seeds))}"
        f"{''.join(f'; at {n} steps seed {chr(43).join(map(str, v))} only' for n, v in args.seeds_at.items())}"
        f"{''.join(f'; at {n} steps LR {chr(43).join(map(_g, v))} only' for n, v in args.lrs_at.items())}), batch 8 x 128 tokens, a snapshot every 20 steps, each with an annealed fork over "
        f"its last {100 * args.anneal_share:.0f}% (linear to 0). Of {args.eval_docs} held-out documents, every 4th is the "
        "selection split (where `hf-pma compare` checks the automatic window, and where the curves are measured); every "
        "result is on the others (the report split).",
        f"Training {times[0]:.0f} s, curves {times[1]:.0f} s, compare {times[2]:.0f} s; load average {loads[0]} at the start, "
        f"{loads[1]} at the end (other jobs ran on the machine).",
        "",
        "## Targets",
        "",
        "| window | runs worse than last by > 1 SE | share of the gain (runs where annealing gains >= 3 SE) | groups with tau = 1 (of those separated by > 2 SE) | mean abs. error vs annealed (a share of the last snapshot's) |",
        "|---|---:|---|---:|---:|",
    ]
    for w in (*WINDOWS, "last"):
        r = s[w]
        share = (
            f"min {100 * r['min_gain_share_where_annealing_gains_3se']:.0f}%, {r['runs_recovering_90pct']} of "
            f"{r['runs_where_annealing_gains_3se']} at >= 90%, {r['runs_recovering_80pct']} at >= 80%"
            if r["min_gain_share_where_annealing_gains_3se"] is not None
            else "-"
        )
        label = {"auto": "auto (the default: checked on the selection split)", "rule": "auto, the rule alone (--no-window-check)", "last": "last snapshot"}.get(w, f"fixed N={w}")
        mae = f"{r['mae']:.4f}" + ("" if w == "last" else f" (1/{s['last']['mae'] / r['mae']:.1f})")
        lines.append(
            f"| {label} | {r['runs_worse_than_last_beyond_1se']} of {r['runs']} | {share} | {r['groups_tau_1']} of {r['groups']} "
            f"({r['separated_groups_tau_1']} of {r['separated_groups']}) | {mae} |"
        )
    lines += ["", "## Every run", "", "| run | window | N | weights | merge - last (SE) | annealed - last (SE) | gain share |", "|---|---|---:|---|---:|---:|---:|"]
    for row in summary["rows"]:
        if row["window"] == "last":
            continue
        gain = f"{row['annealing_gain']:+.4f} ({row['annealing_se']:.4f})" if row["annealing_gain"] is not None else "-"
        share = f"{100 * row['gain_share']:.0f}%" if row["gain_share"] is not None and row["gain_counts"] else "-"
        lines.append(f"| {row['run']} | {row['window']} | {row['n']} | {row['strategy']} | {row['diff']:+.4f} ({row['se']:.4f}) | {gain} | {share} |")
    lines += ["", "## Kendall's tau with the annealed ranking, per (length, seed)", "", "| window | steps | seed | tau | annealed separated by > 2 SE |", "|---|---:|---:|---:|---|"]
    lines += [f"| {g['window']} | {g['steps']} | {g['seed']} | {g['tau']:+.2f} | {'yes' if g['separated'] else 'no'} |" for g in summary["groups"]]
    lines += ["", "## Selection split: where auto lands against the best k in hindsight", "",
              "| run | snapshots | auto N | best k | loss(auto) - loss(best) | loss(8) - loss(best) | auto's reason |", "|---|---:|---:|---:|---:|---:|---|"]
    for name, c in curve.items():
        best = c["losses"][str(c["best_k"])]
        auto = c["losses"].get(str(c["auto"]["count"]))
        eight = c["losses"].get(str(FIXED_N))
        lines.append(
            f"| {name} | {c['snapshots']} | {c['auto']['count']} | {c['best_k']} | "
            f"{'-' if auto is None else f'{auto - best:+.4f}'} | {'-' if eight is None else f'{eight - best:+.4f}'} | "
            f"{c['auto']['reason']} |"
        )
    lines += ["", "![curves](window_choice.png)", "", "## Runs", "", "| run | seconds |", "|---|---:|"]
    lines += [f"| {t['name']} | {t['seconds'] if t['seconds'] is not None else 'reused'} |" for t in timings]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])  # the command, in the tables
    args.output_dir.mkdir(parents=True, exist_ok=True)
    load_start, t0 = sp.load_average(), time.time()
    timings, data = train_all(args)
    t1 = time.time()
    saved = args.output_dir / "curves.json"
    curve = json.loads(saved.read_text()) if saved.is_file() and not args.new_curves else {}
    wanted = {run_name(n, lr, seed) for n in args.curve_lengths for lr in lrs_of(args, n) for seed in seeds_of(args, n)}
    curve = {name: c for name, c in curve.items() if name in wanted}
    selection, report = split_files(data[1])
    curve.update(curves(args, selection, skip=set(curve)))
    refresh_auto(args, curve)
    saved.write_text(json.dumps(curve, indent=1))
    plot(curve, args.output_dir / "window_choice.png")
    t2 = time.time()
    reports = {(steps, w): compare(args, steps, w, data[1], report) for steps in args.lengths for w in WINDOWS}
    t3 = time.time()
    summary = summarize(args, reports)
    (args.output_dir / "results.json").write_text(json.dumps(summary, indent=1))
    text = tables(args, summary, curve, timings, (t1 - t0, t2 - t1, t3 - t2), (load_start, sp.load_average()))
    (args.output_dir / "tables.md").write_text(text)
    print(text)
    return 0 if math.isfinite(summary["summary"]["auto"]["mae"]) else 1


if __name__ == "__main__":
    sys.exit(main())
