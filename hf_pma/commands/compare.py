"""``hf-pma compare``: runs at matched tokens (last snapshot, merge, annealed), ranked and fitted."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_pma.commands import add_heldout_arguments, load_heldout, positive_int, set_verbosity
from hf_pma.core.strategies import STRATEGIES
from hf_pma.evaluation.options import EvalOptions
from hf_pma.utils.argtypes import positive_count


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
            "ranking of the runs by each, the rank agreement with annealed (Kendall's tau) and the mean "
            "absolute error; --fit fits L(x) = E + A * x^(-alpha) across runs. A merge worse than its last "
            "snapshot is explained, with the smaller window that does better."
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
        "--last", type=positive_int, help="merge each run's newest N snapshots up to the matched tokens"
    )
    window.add_argument(
        "--window-tokens",
        type=positive_count,
        metavar="T",
        help="merge each run's snapshots within the last T tokens",
    )
    p.add_argument(
        "--strategy", choices=list(STRATEGIES), default="sma", help="merge strategy (default: sma)"
    )
    p.add_argument("--alpha", type=float, default=0.2, help="EMA smoothing factor (default: 0.2)")
    EvalOptions.add_arguments(p)
    add_heldout_arguments(p)
    p.add_argument(
        "--metric", help="TASK/METRIC that ranks the runs (default: lm/loss, else the first task's acc)"
    )
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--higher-is-better", dest="higher_is_better", action="store_true", default=None)
    direction.add_argument("--lower-is-better", dest="higher_is_better", action="store_false")
    p.add_argument(
        "--fit",
        choices=["params", "tokens", "compute"],
        help="fit L(x) = E + A * x^(-alpha) across the runs (at least 3) for last, merge and annealed; x from the "
        "runs: parameters (the snapshots' tensors), tokens, or compute = 6 * params * tokens",
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
