"""``hf-pma compare``: runs at matched tokens (last snapshot, merge, annealed), ranked and fitted."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_pma.commands import add_heldout_arguments, load_heldout, set_verbosity
from hf_pma.core.strategies import DEFAULT_ALPHA, STRATEGIES
from hf_pma.evaluation.options import EvalOptions
from hf_pma.utils.argtypes import positive_count, window_count


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma compare``."""
    p = subparsers.add_parser(
        "compare",
        help="compare runs at matched tokens: last snapshot, merge and annealed model; ranks, tau, fits",
        description=(
            "For every run, at the largest token count at which every run has a snapshot (or --at-tokens): "
            "the last snapshot, the merge of its snapshots up to there (the run's own window, or --last / "
            "--window-tokens; built in memory, nothing written) and its annealed model (RUN/annealed/, when it "
            "ends there), evaluated on the same held-out text (--eval-file) and tasks (--tasks). Prints and "
            "writes (-o) each run's values with the merge's paired difference from the last snapshot, the "
            "ranking of the runs by each (tied values share a rank; within the groups of --group), the rank "
            "agreement with annealed (Kendall's tau-b, with a bootstrap interval over the held-out documents) "
            "and the mean absolute error; --fit fits L(x) = E + A * x^(-alpha) across runs (flagged when a "
            "parameter sits on a bound). An automatic window is checked on every 4th held-out document (the "
            "selection split; results are on the others: --no-window-check to turn it off). A merge worse than "
            "its last snapshot is explained, with the smaller window that does better."
        ),
    )
    p.add_argument(
        "run", nargs="+", metavar="RUN", help="run folders (pma/manifest.json or checkpoint-* folders)"
    )
    p.add_argument(
        "--at-tokens",
        type=positive_count,
        metavar="T",
        help="compare at this token count (default: the largest at which every run has a snapshot)",
    )
    window = p.add_mutually_exclusive_group()
    window.add_argument(
        "--last",
        type=window_count,
        metavar="N|auto",
        help=(
            "merge each run's newest N snapshots up to the matched tokens; auto: the window chosen from each run's "
            "records (the default, unless a run records a window of its own)"
        ),
    )
    window.add_argument(
        "--window-tokens",
        type=positive_count,
        metavar="T",
        help="merge each run's snapshots within the last T tokens",
    )
    p.add_argument(
        "--strategy", choices=list(STRATEGIES), default="auto", help="merge weights; auto: those the automatic window chose with it (WMA), SMA for a window given (default: %(default)s)"
    )
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="EMA smoothing factor (default: %(default)s)")
    EvalOptions.add_arguments(p)
    add_heldout_arguments(p)
    p.add_argument(
        "--metric", help="TASK/METRIC that ranks the runs (default: lm/loss, else the first task's acc)"
    )
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--higher-is-better", dest="higher_is_better", action="store_true", default=None)
    direction.add_argument("--lower-is-better", dest="higher_is_better", action="store_false")
    p.add_argument(
        "--group",
        metavar="KEY[,KEY...]",
        help="rank and compare runs only within groups of equal recorded values of these keys (e.g. seed, or "
        "seed,max_steps): from each run's training record (pma/merged/pma_training.json: seed, learning_rate, "
        "max_steps...) or its model's config.json",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        metavar="N",
        help="resamples of the held-out documents for the interval of Kendall's tau (default: %(default)s; 0: none)",
    )
    p.add_argument("--bootstrap-seed", type=int, default=0, metavar="S", help="seed of the resamples (default: %(default)s)")
    p.add_argument(
        "--no-window-check",
        action="store_true",
        help="take each automatic window as the rule chose it; by default, with --eval-file (20 documents or more), "
        "every 4th document checks it and its smaller candidates, and results are on the other documents",
    )
    p.add_argument(
        "--fit",
        choices=["params", "tokens", "compute"],
        help="fit L(x) = E + A * x^(-alpha) across the runs for last, merge and annealed (from 4 distinct x; with 3, "
        "A * x^(-alpha)); x from the runs: parameters (the snapshots' tensors), tokens, or compute = 6 * params * tokens",
    )
    p.add_argument(
        "--x", metavar="RUN=VALUE,...", help="the x of each run for --fit (by run folder name or path)"
    )
    p.add_argument("--tokenizer", help="tokenizer for every run (default: each run's own, which must be one)")
    p.add_argument("--device", help="device (default: cuda if available, else cpu)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the comparison as JSON here")
    p.add_argument(
        "--plot", metavar="FILE", help="with --fit: the plot (default: the --output path with .png)"
    )
    p.add_argument("--no-plot", action="store_true", help="with --fit: draw no plot")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma compare``."""
    from hf_pma.analysis.compare_runs import (
        compare_runs,
        compare_table,
        parse_x_values,
        plan_comparison,
        plot_fit,
    )
    from hf_pma.analysis.inspection import run_window
    from hf_pma.analysis.sweep import parse_metric
    from hf_pma.utils.fs import atomic_write_json, check_output_file

    set_verbosity(args)
    # Everything that can be checked is checked before the first model is loaded.
    if not args.tasks and not args.eval_file:
        raise ValueError("nothing to evaluate: give --eval-file and/or --tasks")
    if args.metric:
        parse_metric(args.metric)
    for flag, value in (("--bootstrap", args.bootstrap), ("--bootstrap-seed", args.bootstrap_seed)):
        if value < 0:  # one line here, not argparse's usage and line
            raise ValueError(f"{flag} must be a non-negative integer, got {value}")
    if args.x and not args.fit:
        raise ValueError("--x gives the x of each run for --fit: give --fit too")
    x_values = parse_x_values(args.x) if args.x else None
    output = Path(args.output) if args.output else None
    if output is not None:
        check_output_file(output, "--output")
    plot = None
    if args.fit and not args.no_plot:
        plot = Path(args.plot) if args.plot else output.with_suffix(".png") if output else None
        if plot is not None:
            check_output_file(plot, "--plot")
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError(
                    "drawing the fit needs matplotlib: pip install 'hf-pma[plot]', or --no-plot"
                ) from None
    recorded = None if args.last or args.window_tokens else [run_window(r) for r in args.run]
    at_tokens, plans = plan_comparison(
        args.run,
        at_tokens=args.at_tokens,
        last=args.last,
        window_tokens=args.window_tokens,
        strategy=args.strategy,
        alpha=args.alpha,
        recorded_windows=recorded,
        tokenizer=args.tokenizer,
        fit=args.fit,
        x_values=x_values,
        group=args.group,
    )
    texts = load_heldout(args)

    from hf_pma.utils.distributed import is_main_process

    report = compare_runs(
        at_tokens,
        plans,
        texts,
        EvalOptions.from_args(args),
        strategy=args.strategy,
        alpha=args.alpha,
        metric=args.metric,
        higher_is_better=args.higher_is_better,
        tokenizer=args.tokenizer,
        device=args.device,
        fit=args.fit,
        eval_dataset=Path(args.eval_file).name if args.eval_file else None,
        progress=not args.quiet,
        bootstrap=args.bootstrap,
        bootstrap_seed=args.bootstrap_seed,
        window_check=not args.no_window_check,
    )
    if is_main_process():  # the evaluations ran on the main process; it alone writes and prints
        if output is not None:
            atomic_write_json(output, report)
        if plot is not None:
            plot_fit(report, plot)
        from hf_pma.utils.text import write_line, write_lines

        write_lines(compare_table(report))  # its names are escaped
        written = [f"results: {output}"] if output else []
        written += [f"plot: {plot}"] if plot else []
        if written:
            write_line(", ".join(written))
        from hf_pma.utils.text import flush_out

        flush_out()
    return 0
