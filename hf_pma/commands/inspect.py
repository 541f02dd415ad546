"""``hf-pma inspect``: a run's snapshots, and the geometry of its merge window.

The work is :mod:`hf_pma.analysis.inspection`'s; this module parses, calls and prints."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hf_pma.commands import add_revision_arguments, positive_int, set_verbosity
from hf_pma.core.strategies import DEFAULT_ALPHA, STRATEGIES
from hf_pma.utils.argtypes import positive_count

# What --window defaults to after the run's own window, said from what the code does
# (analysis.inspection.window_size): the automatic window over every --every-th snapshot, as merge takes it.
DEFAULT_WINDOW_SAID = "the automatic window chosen from the records of every --every-th snapshot, as merge takes it"


def run_window(run: str | Path) -> tuple[int | None, int | None, str | None]:
    """The window a run merged (:func:`hf_pma.analysis.inspection.run_window`; kept here for
    scripts that imported it from this module)."""
    from hf_pma.analysis.inspection import run_window as recorded

    return recorded(run)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma inspect``."""
    p = subparsers.add_parser(
        "inspect",
        help="list a run's snapshots and diagnose its merge window",
        description=(
            "Print a table of the run's snapshots (tokens, step, learning rate, phase, loss, size), then the "
            "diagnostics of the merge window (the newest --window snapshots, or those within the last "
            "--window-tokens tokens, every --every-th; default: the window the run merged, from its "
            f"pma/merged/pma_merge.json or pma_training.json, else {DEFAULT_WINDOW_SAID}): the cosine similarity of each "
            "snapshot's deviation from the window mean, each snapshot's distance to the merge, the same numbers "
            "for the window ending at each snapshot over training, and a one-line reading of them. Weights are "
            "read tensor by tensor in chunks (bounded memory). Writes files only where asked: a PNG with --plot, "
            "JSON with --output."
        ),
    )
    p.add_argument(
        "run",
        metavar="RUN",
        help="run folder (pma/manifest.json or checkpoint-* folders), or a Hub repo with --revisions",
    )
    add_revision_arguments(p, every=False)  # --every is the merge window's own stride
    window = p.add_mutually_exclusive_group()
    window.add_argument(
        "--window",
        type=positive_int,
        help=f"snapshots in the merge window, N (default: the run's own, else {DEFAULT_WINDOW_SAID})",
    )
    window.add_argument(
        "--window-tokens",
        type=positive_count,
        metavar="T",
        help="the window: the snapshots within the last T tokens",
    )
    p.add_argument(
        "--include-final",
        action="store_true",
        help="also take the final model saved at the run folder's top, as the newest",
    )
    p.add_argument("--every", type=positive_int, default=1, help="take every k-th snapshot (default: %(default)s)")
    p.add_argument("--strategy", choices=STRATEGIES, default="auto", help="merge weights; auto: those the automatic window chose with it (WMA), SMA for a window given (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="EMA smoothing factor (default: %(default)s)")
    p.add_argument(
        "--last", type=positive_int, help="read only the newest K snapshots (default: all, for the series)"
    )
    p.add_argument(
        "--reference",
        metavar="MODEL",
        help="a model folder standing for the optimum, e.g. the annealed model",
    )
    p.add_argument("--plot", metavar="FILE", help="draw the diagnostics into this PNG (default: no plot)")
    p.add_argument(
        "--no-plot", action="store_true", help=argparse.SUPPRESS
    )  # the default now; kept for old scripts
    p.add_argument("-o", "--output", metavar="FILE", help="write the table and diagnostics as JSON here")
    p.add_argument("--no-diagnostics", action="store_true", help="only list the snapshots (reads no weights)")
    p.add_argument(
        "--chunk-mb", type=positive_int, default=64, help="memory for the Gram matrix chunks (default: %(default)s)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma inspect``: check the arguments, list the snapshots, diagnose the window, print."""
    from hf_pma.analysis.inspection import diagnose_window, list_snapshots
    from hf_pma.analysis.snapshot_listing import snapshot_table
    from hf_pma.core.strategies import validate_strategy
    from hf_pma.utils.fs import atomic_write_json, check_output_file
    from hf_pma.utils.text import write_line, write_lines

    set_verbosity(args)
    validate_strategy(args.strategy, args.alpha)
    plot = Path(args.plot) if args.plot and not (args.no_plot or args.no_diagnostics) else None
    for flag, path in (("--plot", plot), ("--output", args.output)):
        if path:  # a link, a folder, a missing or read-only folder, inside a listed snapshot: one line now
            check_output_file(path, flag)
    if args.reference and not Path(args.reference).exists():
        raise FileNotFoundError(f"--reference {args.reference} does not exist")

    rows, hub = list_snapshots(
        args.run,
        include_final=args.include_final,
        revisions=args.revisions,
        last=args.last,
        cache_dir=args.cache_dir,
    )
    write_lines(snapshot_table(rows))  # its cells are escaped
    report: dict[str, Any] = {"snapshots": rows}
    if not args.no_diagnostics:
        window = diagnose_window(
            args.run,
            hub,
            window=args.window,
            window_tokens=args.window_tokens,
            every=args.every,
            strategy=args.strategy,
            alpha=args.alpha,
            last=args.last,
            reference=args.reference,
            include_final=args.include_final,
            chunk_bytes=args.chunk_mb * 1024 * 1024,
            progress=not args.quiet,
        )
        write_line()
        write_lines(window.text())
        if plot is not None:
            n = len(window.window.indices)
            window.plot(plot, f"{Path(args.run).name}: {window.strategy} window of {n} (every {args.every})")
            write_line()
            write_line(f"plot: {plot}")
        report.update(window.to_dict())
    if args.output:
        atomic_write_json(Path(args.output), report)
        write_line(f"report: {args.output}")
    if "reading" in report:
        write_line()
        write_line(report["reading"])
    return 0
