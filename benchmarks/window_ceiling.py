"""How much of the annealing gain can any window reach? The best merge in hindsight, per run.

``benchmarks/window_choice.py`` measures the window the rule (and the held-out check) chose. This
benchmark asks what the best choice could have done: for every run of its scratch folder, it
evaluates on the *report* documents (the same 30 as every result there) the merges of the newest
snapshots spanning each share of the run in ``--shares`` (5% to 50%, within the run's constant-LR
stretch), with each of ``--strategies`` (SMA, WMA and the cosine-decay emulation of WSM), and
reports the best share of the annealing gain any of them recovers.

This is hindsight: the best window is picked on the documents that report it, so it flatters
itself, and nothing in the library is chosen from it. It tells whether a goal is within reach of
any window and weights at all: a run whose best merge in hindsight falls short of 90% of its
annealing gain cannot reach 90% by a better choice of window or weights.

    python benchmarks/window_ceiling.py --scratch /tmp/hf-pma-window-choice   # after window_choice.py

Writes ``ceiling.json`` and ``ceiling.md`` into ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sweep_prediction as sp
import window_choice as wc

HERE = Path(__file__).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scratch", required=True, help="a window_choice.py scratch folder (its runs/ and data/)")
    p.add_argument("--output-dir", default=str(HERE.parent / "results" / "window_choice"), help="where ceiling.json/md go")
    p.add_argument("--shares", default="0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.5", help="window spans, shares of the run")
    p.add_argument("--strategies", default="sma,wma,cosine-decay", help="merge weights, comma-separated")
    p.add_argument("--min-steps", type=int, default=0, help="runs of fewer steps are left out")
    args = p.parse_args(argv)
    args.scratch, args.output_dir = Path(args.scratch), Path(args.output_dir)
    args.shares = [float(x) for x in args.shares.split(",")]
    args.strategies = args.strategies.split(",")
    return args


def doc_losses(evaluator: Any) -> list[float]:
    from hf_pma.analysis.comparison import document_losses

    return document_losses(evaluator.last_output["lm"])


def token_loss(evaluator: Any) -> float:
    from hf_pma.analysis.comparison import token_loss as total

    return total(evaluator.last_output["lm"])


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-document differences ``a - b``."""
    diffs = [x - y for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))


def ceiling(args: argparse.Namespace, name: str, texts: list[str]) -> dict[str, Any]:
    """One run: the last snapshot, the annealed fork and every (share, strategy) merge on ``texts``."""
    import torch

    from hf_pma.analysis.sweep import SweepEvaluator
    from hf_pma.core.strategies import merge_coefficients
    from hf_pma.core.window_choice import widest_window
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.merging.windows import run_point

    torch.set_num_threads(1)
    run = args.scratch / "runs" / name
    sources = resolve_sources([run])
    points = [run_point(s) for s in sources]
    evaluator = SweepEvaluator(sources[-1].path, texts, block_size=128, tokenizer=args.scratch / "data" / "tokenizer")
    evaluator.evaluate_merge([sources[-1]], weights=[1.0])
    last_docs, last = doc_losses(evaluator), token_loss(evaluator)
    evaluator.evaluate_merge([run / "annealed"], weights=[1.0])
    ann_docs, annealed = doc_losses(evaluator), token_loss(evaluator)
    gain, gain_se = paired(ann_docs, last_docs)
    merges = []
    for count in sorted({widest_window(points, share) for share in args.shares} - {0, 1}):
        span = (sources[-1].tokens - sources[-count].tokens) / sources[-1].tokens
        for strategy in args.strategies:
            evaluator.evaluate_merge(sources[-count:], weights=merge_coefficients(count, strategy))
            diff, se = paired(doc_losses(evaluator), last_docs)
            loss = token_loss(evaluator)
            merges.append({
                "count": count, "share_of_run": span, "strategy": strategy, "loss": loss, "diff": diff, "se": se,
                "gain_share": (loss - last) / (annealed - last) if annealed != last else None,
            })
    best = min(merges, key=lambda m: m["loss"], default=None)  # the lowest loss on the report documents
    return {
        "run": name, "snapshots": len(sources), "last": last, "annealed": annealed,
        "annealing_gain": gain, "annealing_se": gain_se,
        # The least error against the annealed loss of any merge (or the last snapshot), in hindsight.
        "least_error": min([abs(last - annealed)] + [abs(m["loss"] - annealed) for m in merges]),
        "gain_counts": -gain >= 3 * gain_se, "merges": merges, "best": best,
    }


def table(args: argparse.Namespace, rows: list[dict[str, Any]], seconds: float, loads: tuple[str, str]) -> str:
    counted = [r for r in rows if r["gain_counts"] and r["best"]]
    short = [r for r in counted if r["best"]["gain_share"] < 0.9]
    lines = [
        "# The best window in hindsight (report documents)",
        "",
        f"`python benchmarks/window_ceiling.py {' '.join(args.argv)}`: {len(rows)} runs of `{args.scratch}` "
        f"with at least {args.min_steps:,} steps; merges of the newest snapshots spanning "
        f"{', '.join(f'{100 * s:g}%' for s in args.shares)} of the run (within its constant-LR stretch) with "
        f"{', '.join(args.strategies)}, on the 30 report documents. {seconds:.0f} s; load average {loads[0]} at the "
        f"start, {loads[1]} at the end.",
        "",
        f"Runs where annealing gains at least 3 SE: {len(counted)}; where even the best merge in hindsight "
        f"recovers less than 90% of the gain: {len(short)}"
        + (f" (lowest {100 * min(r['best']['gain_share'] for r in counted):.0f}%)" if counted else "")
        + f"; below 85%: {sum(r['best']['gain_share'] < 0.85 for r in counted)}. The least mean absolute error against "
        f"the annealed loss any choice of these merges (or the last snapshot) reaches, run by run: "
        f"{statistics.fmean(r['least_error'] for r in rows):.4f}, against {statistics.fmean(abs(r['last'] - r['annealed']) for r in rows):.4f} "
        f"for the last snapshot (1/{statistics.fmean(abs(r['last'] - r['annealed']) for r in rows) / statistics.fmean(r['least_error'] for r in rows):.1f}).",
        "",
        "| run | annealed - last (SE) | best merge | its span | its gain share | best WMA share |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        b = r["best"]
        wma = max((m["gain_share"] for m in r["merges"] if m["strategy"] == "wma" and m["gain_share"] is not None), default=None)
        lines.append(
            f"| {r['run']} | {r['annealing_gain']:+.4f} ({r['annealing_se']:.4f}) | "
            f"{b['strategy']} of {b['count']} | {100 * b['share_of_run']:.0f}% | "
            f"{100 * b['gain_share']:.0f}%{'' if r['gain_counts'] else ' (gain < 3 SE)'} | "
            f"{'-' if wma is None else f'{100 * wma:.0f}%'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.output_dir.mkdir(parents=True, exist_ok=True)
    _, report = wc.split_files(args.scratch / "data" / "heldout.jsonl")
    texts = [json.loads(line)["text"] for line in report.read_text().splitlines() if line.strip()]
    names = sorted(
        (p.name for p in (args.scratch / "runs").iterdir() if (p / "annealed").is_dir() and int(p.name.split("-")[0][1:]) >= args.min_steps),
        key=lambda n: (int(n.split("-")[0][1:]), n.split("-")[2], float(n.split("-")[1][2:])),
    )
    load_start, started = sp.load_average(), time.time()
    rows = []
    for name in names:
        rows.append(ceiling(args, name, texts))
        b = rows[-1]["best"]
        print(f"  {name}: best {b['strategy']} of {b['count']} ({100 * b['share_of_run']:.0f}%): {100 * b['gain_share']:.0f}%", flush=True)
    text = table(args, rows, time.time() - started, (load_start, sp.load_average()))
    (args.output_dir / "ceiling.json").write_text(json.dumps({"rows": rows}, indent=1))
    (args.output_dir / "ceiling.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
