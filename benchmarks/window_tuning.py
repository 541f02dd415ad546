"""How the automatic window's constants were chosen: every run's merges on the tuning documents,
and the rule over a grid of caps and trend limits.

The *tuning documents* are those no result of ``window_choice.py`` reports: its selection split
(every 4th of the 40 held-out documents) and the corpus's further held-out files (beyond the
first 40, cut like them at 4,000 characters). For every run of a ``window_choice.py`` scratch
folder this benchmark evaluates there the last snapshot, the annealed fork, and the SMA and WMA
merges of the newest k snapshots (k = 1 to 12, and every 5% of the run up to half), into
``tuning.json``. From those it reports, in ``tuning.md``:

* the rule (its windows from each run's records, with the library's own ``choose_window``) at
  every cap and trend limit of the grid, with SMA and with WMA: the lowest share of the annealing
  gain (runs where annealing gains at least 3 SE on these documents), the runs worse than the
  last snapshot beyond 1 SE, and the mean absolute error against the annealed loss;
* the held-out check, simulated: the window picked on the selection documents among the rule's
  window, its halvings and the last snapshot, with and without the wider candidates, and scored
  on the further files.

A window's loss is that of the measured k nearest to it. ::

    python benchmarks/window_tuning.py --scratch /tmp/hf-pma-window-choice   # after window_choice.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from window_ceiling import paired  # the paired difference over documents, as the ceiling takes it

HERE = Path(__file__).resolve()
CAPS = (0.15, 0.2, 0.25, 0.3, 0.35, 0.4)
LIMITS = (2.0, 3.0, 4.0, 5.0, 6.0)
DOC_CHARS = 4000  # as the benchmark cuts its held-out documents


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scratch", required=True, help="a window_choice.py scratch folder (its runs/ and data/)")
    p.add_argument("--output-dir", default=str(HERE.parent / "results" / "window_choice"), help="where tuning.json/md go")
    p.add_argument("--corpus-bytes", type=int, default=9_000_000, help="as window_choice.py's cpu preset")
    p.add_argument("--parallel", type=int, default=2, help="runs evaluated at once (1 thread each)")
    p.add_argument("--new", action="store_true", help="evaluate again (else tuning.json is reused)")
    args = p.parse_args(argv)
    args.scratch, args.output_dir = Path(args.scratch), Path(args.output_dir)
    return args


def tuning_documents(args: argparse.Namespace) -> tuple[list[str], int]:
    """The selection documents, then the corpus's further held-out files; and how many select."""
    from hf_pma.core.window_check import split_for_selection
    from hf_pma.evaluation.corpus import split_documents
    from hf_pma.training.pretrain_data import stdlib_documents

    heldout = [json.loads(line)["text"] for line in (args.scratch / "data" / "heldout.jsonl").read_text().splitlines() if line.strip()]
    _, held = split_documents(stdlib_documents(max_bytes=args.corpus_bytes), eval_fraction=0.1, seed=0)
    assert [d[:DOC_CHARS] for d in held[: len(heldout)]] == heldout, "the corpus's held-out split is not the scratch's"
    selection = [heldout[i] for i in split_for_selection(len(heldout)).selection]
    return selection + [d[:DOC_CHARS] for d in held[len(heldout) :]], len(selection)


def measured_counts(n: int) -> list[int]:
    """The k measured in a run of n snapshots: 1 to 12, and every 5% of the run up to half."""
    return sorted({*range(1, min(n, 12) + 1), *(round(n * s / 100) for s in range(10, 51, 5))} - {0})


def evaluate_run(job: tuple[Path, str, list[str]]) -> dict[str, Any]:
    """One run: per-document losses of the last snapshot, the annealed fork and each merge."""
    import torch

    from hf_pma.analysis.comparison import document_losses
    from hf_pma.analysis.sweep import SweepEvaluator
    from hf_pma.core.strategies import merge_coefficients
    from hf_pma.merging.sources import resolve_sources

    torch.set_num_threads(1)
    scratch, name, texts = job
    run = scratch / "runs" / name
    sources = resolve_sources([run])
    evaluator = SweepEvaluator(sources[-1].path, texts, block_size=128, tokenizer=scratch / "data" / "tokenizer")

    def losses(models: list[Any], weights: list[float]) -> list[float]:
        evaluator.evaluate_merge(models, weights=weights)
        return document_losses(evaluator.last_output["lm"])

    merges = {}
    for strategy in ("sma", "wma"):
        for k in measured_counts(len(sources)):
            merges[f"{strategy}:{k}"] = losses(sources[-k:], merge_coefficients(k, strategy if k > 1 else "sma"))
    return {
        "run": name,
        "records": [{"tokens": s.tokens, "step": s.step, **{key: s.record.get(key) for key in ("loss", "lr", "phase")}} for s in sources],
        "annealed": losses([run / "annealed"], [1.0]),
        "merges": merges,
    }


def mean(values: list[float]) -> float:
    return statistics.fmean(v for v in values if not math.isnan(v))


def nearest(run: dict[str, Any], strategy: str, k: int) -> list[float]:
    """The per-document losses of the measured merge nearest to k snapshots (the last snapshot for 1)."""
    if k == 1:
        return run["merges"]["sma:1"]
    counts = [int(key.split(":")[1]) for key in run["merges"] if key.startswith(strategy + ":")]
    return run["merges"][f"{strategy}:{min(counts, key=lambda c: (abs(c - k), c))}"]


def score(runs: list[dict[str, Any]], pick: Any, documents: slice) -> dict[str, Any]:
    """The targets on ``documents`` of the windows ``pick(run) -> (strategy, k)`` takes."""
    shares, worse, errors = [], 0, []
    for run in runs:
        strategy, k = pick(run)
        merged, last, annealed = (x[documents] for x in (nearest(run, strategy, k), run["merges"]["sma:1"], run["annealed"]))
        diff, se = paired(merged, last)
        gain, gain_se = paired(annealed, last)
        worse += diff > se
        if -gain >= 3 * gain_se:
            shares.append(diff / gain)
        errors.append(abs(mean(merged) - mean(annealed)))
    return {
        "min_share": min(shares) if shares else None, "runs_counted": len(shares), "runs_90pct": sum(s >= 0.9 for s in shares),
        "worse": worse, "mae": statistics.fmean(errors),
    }


def points(run: dict[str, Any]) -> list[Any]:
    from hf_pma.core.window_choice import point_from_record

    return [point_from_record(r) for r in run["records"]]


def simulate(runs: list[dict[str, Any]], selecting: int) -> dict[str, Any]:
    """The rule over the grid, and the check with and without its wider candidates."""
    from hf_pma.core.window_check import WIDEST_SHARE, candidate_windows, pick_window
    from hf_pma.core.window_choice import choose_window, widest_window

    everything = slice(None)
    grid = []
    for strategy, cap, limit in itertools.product(("sma", "wma"), CAPS, LIMITS):
        counts = {r["run"]: choose_window(points(r), max_share=cap, trend_limit=limit).count for r in runs}
        grid.append({"strategy": strategy, "cap": cap, "limit": limit,
                     **score(runs, lambda r, s=strategy, c=counts: (s, c[r["run"]]), everything)})

    def checked(wider: bool) -> Any:
        def pick(run: dict[str, Any]) -> tuple[str, int]:
            rule = choose_window(points(run))
            if rule.count == 1:
                return rule.strategy, 1
            widest = widest_window(points(run), WIDEST_SHARE) if wider else None
            losses = {k: nearest(run, rule.strategy, k)[:selecting] for k in candidate_windows(rule.count, widest)}
            return rule.strategy, pick_window(losses, prefer=rule.count)
        return pick

    further = slice(selecting, None)
    check = {
        "rule": score(runs, lambda r: (choose_window(points(r)).strategy, choose_window(points(r)).count), further),
        "halvings": score(runs, checked(False), further),
        "wider": score(runs, checked(True), further),
        "changed_by_wider": [r["run"] for r in runs if checked(True)(r) != checked(False)(r)],
    }
    return {"grid": grid, "check": check}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(args: argparse.Namespace, result: dict[str, Any], documents: int, selecting: int, seconds: float) -> str:
    from hf_pma.core.window_choice import MAX_SHARE, TREND_LIMIT, TREND_STRATEGY

    lines = [
        "# Tuning the automatic window (tuning documents)",
        "",
        f"`python benchmarks/window_tuning.py {' '.join(args.argv)}`: {len(result['runs'])} runs; {documents} tuning "
        f"documents ({selecting} of the selection split, {documents - selecting} further held-out files), none of them "
        f"a report document. Evaluation {seconds:.0f} s. The library's constants: {TREND_STRATEGY.upper()}, cap "
        f"{MAX_SHARE:g}, trend limit {TREND_LIMIT:g} (marked).",
        "",
        "## The rule over caps and trend limits (every tuning document)",
        "",
        "| weights | cap | trend limit | lowest gain share | runs at >= 90% | worse than last > 1 SE | mean abs. error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for g in result["grid"]:
        mark = " (library)" if (g["strategy"], g["cap"], g["limit"]) == (TREND_STRATEGY, MAX_SHARE, TREND_LIMIT) else ""
        lines.append(
            f"| {g['strategy']}{mark} | {g['cap']:g} | {g['limit']:g} | {_pct(g['min_share'])} | "
            f"{g['runs_90pct']} of {g['runs_counted']} | {g['worse']} | {g['mae']:.4f} |"
        )
    check = result["check"]
    lines += [
        "",
        f"## The held-out check, simulated (picked on the {selecting} selection documents, scored on the {documents - selecting} further files)",
        "",
        "| window | lowest gain share | runs at >= 90% | worse than last > 1 SE | mean abs. error |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key in (("the rule alone", "rule"), ("checked: halvings", "halvings"), ("checked: halvings and wider", "wider")):
        c = check[key]
        lines.append(f"| {label} | {_pct(c['min_share'])} | {c['runs_90pct']} of {c['runs_counted']} | {c['worse']} | {c['mae']:.4f} |")
    lines += ["", f"Runs whose checked window the wider candidates change: {', '.join(check['changed_by_wider']) or 'none'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.output_dir.mkdir(parents=True, exist_ok=True)
    texts, selecting = tuning_documents(args)
    saved = args.output_dir / "tuning.json"
    started = time.time()
    if saved.is_file() and not args.new:
        runs = json.loads(saved.read_text())["runs"]
    else:
        names = sorted(p.name for p in (args.scratch / "runs").iterdir() if (p / "annealed").is_dir())
        names.sort(key=lambda n: -int(n.split("-")[0][1:]))  # longest first: the workers finish together
        with ProcessPoolExecutor(max_workers=args.parallel) as pool:
            runs = list(pool.map(evaluate_run, [(args.scratch, n, texts) for n in names]))
        runs.sort(key=lambda r: r["run"])
    seconds = time.time() - started
    result = {"runs": runs, **simulate(runs, selecting)}
    saved.write_text(json.dumps(result, indent=1))
    text = table(args, result, len(texts), selecting, seconds)
    (args.output_dir / "tuning.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
