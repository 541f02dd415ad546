"""``hf-pma sweep``: evaluate the merges of a run's snapshots over window, stride and strategy."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

from hf_pma.commands import (
    add_heldout_arguments,
    add_revision_arguments,
    load_heldout,
    positive_int,
    set_verbosity,
)
from hf_pma.core.strategies import DEFAULT_ALPHA, STRATEGIES
from hf_pma.evaluation.options import EvalOptions
from hf_pma.io.guarded import reads_one_version


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from err
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _window_list(text: str) -> list[int | str]:
    """``--window``: comma-separated positive counts N and ``auto``."""
    parts = [v.strip() for v in text.split(",") if v.strip()]
    autos = [v for v in parts if v.lower() == "auto"]
    try:
        values = _int_list(",".join(v for v in parts if v.lower() != "auto")) if len(parts) > len(autos) else []
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers and auto, got {text!r}") from None
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers and auto, got {text!r}")
    return (["auto"] if autos else []) + values


def _count_list(text: str) -> list[int]:
    from hf_pma.utils.argtypes import parse_count

    try:
        return [parse_count(v) for v in text.split(",") if v.strip()] or [parse_count("")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _strategy_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in STRATEGIES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"unknown strategy {', '.join(unknown) or text!r}; choose from {', '.join(STRATEGIES)}")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma sweep``."""
    p = subparsers.add_parser(
        "sweep",
        help="evaluate merges of a run's snapshots over N, V and strategy",
        description=(
            "For each window N (--window) or duration in tokens T (--window-tokens), stride k (--every: take every k-th snapshot counting back from the "
            "newest, which emulates snapshots every k*V tokens) and strategy, merge the run's snapshots in memory "
            "and evaluate the merge (held-out text with --eval-file, lm-eval tasks with --tasks). The model is "
            "loaded once and each merge is swapped into it; merges that select the same snapshots with the same "
            "weights are evaluated once. Prints a table, writes the results as JSON and a heatmap, and with "
            "--best writes the best merge as a model folder."
        ),
    )
    p.add_argument(
        "run", nargs="+", metavar="RUN",
        help="run folder (pma/manifest.json or checkpoint-* folders), checkpoints, or a Hub repo with --revisions",
    )
    add_revision_arguments(p, every=False)  # --every is the sweep's own stride
    p.add_argument("--last", type=positive_int, help="sweep over the newest N snapshots or revisions only")
    p.add_argument(
        "--window",
        type=_window_list,
        help="merge sizes N, and auto: the window chosen from the run's records (default: auto,3,6,10,15 unless "
        "--window-tokens is given)",
    )
    p.add_argument(
        "--window-tokens",
        type=_count_list,
        metavar="T,...",
        help="merge durations in tokens: the snapshots within the last T tokens (e.g. 20k,40k,80k); swept with --window",
    )
    p.add_argument(
        "--include-final",
        action="store_true",
        help="with a run folder: also take the final model saved at its top, as the newest source",
    )
    p.add_argument("--every", type=_int_list, default=[1, 2, 4], help="take every k-th snapshot (default: 1,2,4)")
    p.add_argument("--strategy", type=_strategy_list, default=["sma", "wma", "ema"], help="strategies (default: sma,wma,ema)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="EMA smoothing factor (default: %(default)s)")
    EvalOptions.add_arguments(p)
    add_heldout_arguments(p)
    p.add_argument("--metric", help="TASK/METRIC that picks the best merge (default: lm/loss, else the first task's acc)")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--higher-is-better", dest="higher_is_better", action="store_true", default=None)
    direction.add_argument("--lower-is-better", dest="higher_is_better", action="store_false")
    p.add_argument("--tokenizer", help="tokenizer (default: the newest snapshot's, or its run folder's)")
    p.add_argument("--device", help="device (default: cuda if available, else cpu)")
    p.add_argument("-o", "--output", metavar="FILE", help="results as JSON (default: RUN/sweep.json)")
    p.add_argument("--plot", metavar="FILE", help="heatmap PNG (default: the --output path with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the heatmap")
    p.add_argument("--best", metavar="DIR", help="write the best merge as a model folder here")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --best folder")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    p.set_defaults(func=run)


@reads_one_version
def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma sweep``: every merge it evaluates, and the best one it writes, from one
    version of each snapshot (:func:`hf_pma.io.guarded.one_version`)."""
    from hf_pma.analysis.sweep import (
        DEFAULT_WINDOWS,
        parse_metric,
        plot_sweep,
        run_sweep,
        sweep_table,
        write_best,
    )
    from hf_pma.core.strategies import merge_coefficients
    from hf_pma.merging.hub_revisions import parse_hub_spec
    from hf_pma.merging.sources import describe_sources, resolve_sources
    from hf_pma.utils.fs import atomic_write_json, check_output_file, check_output_folder

    set_verbosity(args)
    # Everything that can be checked is checked before the first model is loaded.
    if not args.tasks and not args.eval_file:
        raise ValueError("nothing to evaluate: give --eval-file and/or --tasks")
    merge_coefficients(2, "ema", args.alpha)
    if args.metric:
        parse_metric(args.metric)
    if args.output is None and (len(args.run) > 1 or not Path(args.run[0]).is_dir()):
        raise ValueError("give --output: the results go to RUN/sweep.json only when RUN is one run folder")
    output = Path(args.output) if args.output else Path(args.run[0]) / "sweep.json"
    check_output_file(output, "--output")
    plot = None if args.no_plot else Path(args.plot) if args.plot else output.with_suffix(".png")
    if plot is not None:
        check_output_file(plot, "--plot")
    if args.best:
        check_output_folder(args.best, args.overwrite)
    texts = load_heldout(args)

    run = args.run if len(args.run) > 1 else args.run[0]
    if args.revisions or args.last or args.include_final or any(not Path(r).exists() and parse_hub_spec(r) for r in args.run):
        run = resolve_sources(
            args.run, last=args.last, revisions=args.revisions, cache_dir=args.cache_dir, include_final=args.include_final
        )
    windows = args.window if args.window is not None else ([] if args.window_tokens else list(DEFAULT_WINDOWS))
    report = run_sweep(
        run,
        windows=windows,
        window_tokens=args.window_tokens or (),
        every=args.every,
        strategies=args.strategy,
        alpha=args.alpha,
        texts=texts,
        options=EvalOptions.from_args(args),
        metric=args.metric,
        higher_is_better=args.higher_is_better,
        tokenizer=args.tokenizer,
        device=args.device,
        eval_dataset=Path(args.eval_file).name if args.eval_file else None,
        progress=not args.quiet,
    )
    atomic_write_json(output, report)
    if plot is not None:
        plot_sweep(report, plot)
    if args.best:
        write_best(report, args.best, overwrite=args.overwrite, progress=not args.quiet)
    snapshots = [SimpleNamespace(**s) for s in report["snapshots"]]
    from hf_pma.utils.text import write_line, write_lines

    write_line(f"sweep over {describe_sources(snapshots)}")
    write_lines(sweep_table(report))  # its cells are escaped
    write_line(f"results: {output}" + (f", heatmap: {plot}" if plot else "") + (f", best merge: {args.best}" if args.best else ""))
    return 0
