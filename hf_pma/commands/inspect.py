"""``hf-pma inspect``: a run's snapshots, and the geometry of its merge window."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_pma.commands import add_revision_arguments, positive_int, set_verbosity
from hf_pma.core.strategies import STRATEGIES

# Where the diagnostics plot goes by default: the run folder, never the current directory.
PLOT_NAME = "inspect.png"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma inspect``."""
    p = subparsers.add_parser(
        "inspect",
        help="list a run's snapshots and diagnose its merge window",
        description=(
            "Print a table of the run's snapshots (tokens, step, learning rate, phase, loss, size), then the "
            "diagnostics of the merge window (the newest --window snapshots, every --every-th): the cosine "
            "similarity of each snapshot's deviation from the window mean, each snapshot's distance to the "
            "merge, and the same numbers for the window ending at each snapshot over training. Weights are "
            "read tensor by tensor in chunks (bounded memory). Writes a PNG and, with --output, JSON."
        ),
    )
    p.add_argument("run", metavar="RUN", help="run folder (pma/manifest.json or checkpoint-* folders), or a Hub repo with --revisions")
    add_revision_arguments(p, every=False)  # --every is the merge window's own stride
    p.add_argument("--window", type=positive_int, default=10, help="snapshots in the merge window, N (default: 10)")
    p.add_argument("--every", type=positive_int, default=1, help="take every k-th snapshot (default: 1)")
    p.add_argument("--strategy", choices=STRATEGIES, default="sma", help="merge weights (default: sma)")
    p.add_argument("--alpha", type=float, default=0.2, help="EMA smoothing factor (default: 0.2)")
    p.add_argument("--last", type=positive_int, help="read only the newest K snapshots (default: all, for the series)")
    p.add_argument("--reference", metavar="MODEL", help="a model folder standing for the optimum, e.g. the annealed model")
    p.add_argument("--plot", metavar="FILE", help="PNG of the diagnostics (default: RUN/inspect.png for a local run folder)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the diagnostics")
    p.add_argument("-o", "--output", metavar="FILE", help="write the table and diagnostics as JSON here")
    p.add_argument("--no-diagnostics", action="store_true", help="only list the snapshots (reads no weights)")
    p.add_argument("--chunk-mb", type=positive_int, default=64, help="memory for the Gram matrix chunks (default: 64)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma inspect``."""
    from transformers.utils import logging

    from hf_pma.analysis.diagnostics import (
        compute_gram,
        diagnostics_table,
        plot_diagnostics,
        snapshot_rows,
        snapshot_table,
        strategy_weights,
        training_series,
        window_diagnostics,
        window_indices,
    )
    from hf_pma.merging.hub_revisions import parse_hub_spec
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.utils.formatting import format_number, markdown_table
    from hf_pma.utils.fs import atomic_write_json

    set_verbosity(args)
    log = logging.get_logger("hf_pma.inspect")
    weights_fn = strategy_weights(args.strategy, args.alpha)
    no_plot = args.no_plot or args.no_diagnostics or args.plot == ""
    if not no_plot and not args.plot and not Path(args.run).is_dir():
        if Path(args.run).exists() or not parse_hub_spec(args.run):
            raise FileNotFoundError(f"run folder {args.run} does not exist")
        raise ValueError(f"{args.run} is a Hub repo: give --plot FILE (the plot goes to RUN/{PLOT_NAME} for a local run) or --no-plot")
    plot = None if no_plot else Path(args.plot) if args.plot else Path(args.run) / PLOT_NAME
    for flag, path in (("--plot", plot), ("--output", args.output)):
        if path and not Path(path).absolute().parent.is_dir():
            raise FileNotFoundError(f"the folder of {flag} {path} does not exist")
    if args.reference and not Path(args.reference).is_dir():
        raise FileNotFoundError(f"--reference {args.reference} is not a folder")

    hub = None
    if args.revisions or (not Path(args.run).exists() and parse_hub_spec(args.run)):
        # Hub revisions: only the selected ones are downloaded (their weights, even with --no-diagnostics).
        hub = resolve_sources([args.run], last=args.last, revisions=args.revisions, cache_dir=args.cache_dir)
        rows = [
            {"name": s.name, "tokens": s.tokens, "step": s.step, "lr": None, "phase": None, "loss": None,
             "bytes": s.num_bytes(), "excluded": False, "excluded_reason": None, "missing": False}
            for s in hub
        ]
    else:
        rows = snapshot_rows(args.run)
    sys.stdout.write(snapshot_table(rows) + "\n")
    report = {"snapshots": rows}
    if not args.no_diagnostics:
        sources = hub if hub is not None else resolve_sources([args.run], last=None)
        if args.last:
            sources = sources[-args.last :]
        if len(sources) < 2:
            raise ValueError(f"{args.run} has {len(sources)} usable snapshot(s): the diagnostics need at least 2")
        count = len(sources)
        window = args.window
        if window_indices(count, window, args.every) is None:
            window = (count - 1) // args.every + 1
            log.warning(f"only {count} snapshots: the window shrinks from {args.window} to {window}")
        reference = None
        if args.reference:
            sources = sources + resolve_sources([args.reference])
            reference = count
        gram = compute_gram(sources, chunk_bytes=args.chunk_mb * 1024 * 1024, progress=not args.quiet)
        indices = window_indices(count, window, args.every)
        diag = window_diagnostics(gram.gram, indices, weights_fn(len(indices)), reference)
        series = training_series(gram.gram, window, args.every, weights_fn, count=count, reference=reference)
        ends = [d.indices[-1] for d in series]
        use_tokens = all(gram.tokens[i] is not None for i in ends)
        xs = [gram.tokens[i] if use_tokens else (gram.steps[i] or i) for i in ends]
        sys.stdout.write(f"\nWindow: {len(indices)} snapshots, every {args.every}, {args.strategy} weights "
                         f"({gram.numel:,} weights in {gram.num_tensors} tensors)\n")
        sys.stdout.write(diagnostics_table(gram.names, diag) + "\n")
        if len(series) > 1:
            sys.stdout.write("\nOver training (window ending at each snapshot):\n")
            header = ["window end", "mean cos", "straight", "spread", "merge shift"]
            header += ["|M - ref|", "|new - ref|"] if reference is not None else []
            body = []
            for i, d in zip(ends, series):
                row = [gram.names[i], format_number(d.mean_cosine, "+.3f"), format_number(d.straightness, ".3f"),
                       format_number(d.spread, ".4g"), format_number(d.merge_shift, ".4g")]
                if d.reference is not None:
                    row += [format_number(d.reference["merge_to_reference"], ".4g"),
                            format_number(d.reference["newest_to_reference"], ".4g")]
                body.append(row)
            sys.stdout.write(markdown_table(header, body) + "\n")
        if plot is not None:
            title = f"{Path(args.run).name}: {args.strategy} window of {len(indices)} (every {args.every})"
            plot_diagnostics(plot, gram.names, diag, series, xs, "tokens" if use_tokens else "step", title)
            sys.stdout.write(f"\nplot: {plot}\n")
        report.update(
            window=diag.to_dict() | {"names": [gram.names[i] for i in indices], "strategy": args.strategy, "every": args.every},
            series=[d.to_dict() | {"end": gram.names[i], "x": x} for d, i, x in zip(series, ends, xs)],
            gram=gram.to_dict(),
        )
    if args.output:
        atomic_write_json(Path(args.output), report)
    return 0
