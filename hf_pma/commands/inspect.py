"""``hf-pma inspect``: a run's snapshots, and the geometry of its merge window."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hf_pma.commands import add_revision_arguments, positive_int, set_verbosity
from hf_pma.core.strategies import STRATEGIES
from hf_pma.utils.argtypes import positive_count

# The window when neither the command line nor the run's records give one: the paper's compromise.
DEFAULT_WINDOW = 10


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma inspect``."""
    p = subparsers.add_parser(
        "inspect",
        help="list a run's snapshots and diagnose its merge window",
        description=(
            "Print a table of the run's snapshots (tokens, step, learning rate, phase, loss, size), then the "
            "diagnostics of the merge window (the newest --window snapshots, or those within the last "
            "--window-tokens tokens, every --every-th; default: the window the run merged, from its "
            "pma/merged/pma_merge.json or pma_training.json, else 10): the cosine similarity of each "
            "snapshot's deviation from the window mean, each snapshot's distance to the merge, the same numbers "
            "for the window ending at each snapshot over training, and a one-line reading of them. Weights are "
            "read tensor by tensor in chunks (bounded memory). Writes files only where asked: a PNG with --plot, "
            "JSON with --output."
        ),
    )
    p.add_argument("run", metavar="RUN", help="run folder (pma/manifest.json or checkpoint-* folders), or a Hub repo with --revisions")
    add_revision_arguments(p, every=False)  # --every is the merge window's own stride
    window = p.add_mutually_exclusive_group()
    window.add_argument(
        "--window", type=positive_int, help=f"snapshots in the merge window, N (default: the run's own, else {DEFAULT_WINDOW})"
    )
    window.add_argument(
        "--window-tokens", type=positive_count, metavar="T", help="the window: the snapshots within the last T tokens"
    )
    p.add_argument(
        "--include-final", action="store_true", help="also take the final model saved at the run folder's top, as the newest"
    )
    p.add_argument("--every", type=positive_int, default=1, help="take every k-th snapshot (default: 1)")
    p.add_argument("--strategy", choices=STRATEGIES, default="sma", help="merge weights (default: sma)")
    p.add_argument("--alpha", type=float, default=0.2, help="EMA smoothing factor (default: 0.2)")
    p.add_argument("--last", type=positive_int, help="read only the newest K snapshots (default: all, for the series)")
    p.add_argument("--reference", metavar="MODEL", help="a model folder standing for the optimum, e.g. the annealed model")
    p.add_argument("--plot", metavar="FILE", help="draw the diagnostics into this PNG (default: no plot)")
    p.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("-o", "--output", metavar="FILE", help="write the table and diagnostics as JSON here")
    p.add_argument("--no-diagnostics", action="store_true", help="only list the snapshots (reads no weights)")
    p.add_argument("--chunk-mb", type=positive_int, default=64, help="memory for the Gram matrix chunks (default: 64)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info logs")
    p.set_defaults(func=run)


def run_window(run: str | Path) -> tuple[int | None, int | None, str | None]:
    """The window a run merged: ``(N, T, where)`` from its merge record (``pma/merged/pma_merge.json``),
    else its training record (``pma_training.json``: ``pma_window`` / ``pma_window_tokens``);
    ``(None, None, None)`` when the run records none (or is not a local folder)."""
    from hf_pma.core.manifest import MERGE_RECORD_NAME, PMA_SUBDIR, TRAINING_RECORD_NAME
    from hf_pma.io.guarded import read_json
    from hf_pma.merging.sources import run_layout

    run = Path(run)
    if not run.is_dir():
        return None, None, None
    try:
        layout = run_layout(run)
    except (ValueError, OSError):
        return None, None, None
    merged = (layout.manifest.parent if layout.manifest is not None else run / PMA_SUBDIR) / "merged"
    for name in (MERGE_RECORD_NAME, TRAINING_RECORD_NAME):
        path = merged / name
        try:
            record: Any = read_json(path) if path.is_file() else None
        except (ValueError, OSError):
            continue
        if not isinstance(record, dict):
            continue
        where = str(path.relative_to(run)) if path.is_relative_to(run) else str(path)
        if name == MERGE_RECORD_NAME:
            window = record.get("window") if isinstance(record.get("window"), dict) else {}
            tokens = window.get("requested") if window.get("unit") == "tokens" else None
            count = record.get("num_sources") or (len(record["sources"]) if isinstance(record.get("sources"), list) else None)
        else:
            tokens, count = record.get("pma_window_tokens"), record.get("pma_window")
        tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None
        count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None
        if tokens or count:
            return count, tokens, where
    return None, None, None


def _window_size(args: argparse.Namespace, sources: list, log: Any) -> tuple[int, str]:
    """N for the window and where it comes from (the command line, the run's record, the default)."""
    from hf_pma.core.selection import window_by_progress

    count, tokens, where = (None, None, None) if args.window or args.window_tokens else run_window(args.run)
    tokens = args.window_tokens or tokens
    if args.window:
        return args.window, "--window"
    if tokens:
        strided = list(range(len(sources) - 1, -1, -args.every))[::-1]
        try:
            n = len(window_by_progress([sources[i].tokens for i in strided], tokens, "tokens"))
        except ValueError as err:
            raise ValueError(f"a window of {tokens:,} tokens: {err}") from None
        origin = "--window-tokens" if args.window_tokens else f"the run's own, {where}"
        return n, f"the last {tokens:,} tokens; {origin}"
    if count:
        return count, f"the run's own, {where}"
    return DEFAULT_WINDOW, "the default: the run records no merge window"


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma inspect``."""
    from transformers.utils import logging

    from hf_pma.analysis.diagnostics import (
        compute_gram,
        diagnostics_table,
        plot_diagnostics,
        reading,
        snapshot_rows,
        snapshot_table,
        strategy_weights,
        training_series,
        window_diagnostics,
        window_indices,
    )
    from hf_pma.merging.hub_revisions import parse_hub_spec
    from hf_pma.merging.sources import model_source, resolve_sources
    from hf_pma.utils.formatting import format_number, text_table
    from hf_pma.utils.fs import atomic_write_json, check_output_file
    from hf_pma.utils.text import write_line, write_lines

    set_verbosity(args)
    log = logging.get_logger("hf_pma.inspect")
    weights_fn = strategy_weights(args.strategy, args.alpha)
    plot = Path(args.plot) if args.plot and not (args.no_plot or args.no_diagnostics) else None
    for flag, path in (("--plot", plot), ("--output", args.output)):
        if path:  # a link, a folder, a missing or read-only folder, inside a listed snapshot: one line now
            check_output_file(path, flag)
    if args.reference and not Path(args.reference).exists():
        raise FileNotFoundError(f"--reference {args.reference} does not exist")

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
        rows = snapshot_rows(args.run, include_final=args.include_final)
    write_lines(snapshot_table(rows))  # its cells are escaped
    report = {"snapshots": rows}
    if not args.no_diagnostics:
        sources = hub if hub is not None else resolve_sources([args.run], include_final=args.include_final)
        if args.last:
            sources = sources[-args.last :]
        if len(sources) < 2:
            raise ValueError(f"{args.run} has {len(sources)} usable snapshot(s): the diagnostics need at least 2")
        count = len(sources)
        window, origin = _window_size(args, sources, log)
        if window_indices(count, window, args.every) is None:
            shrunk = (count - 1) // args.every + 1
            log.warning(f"only {count} snapshots: the window shrinks from {window} to {shrunk}")
            window = shrunk
        reference = None
        if args.reference:
            sources = [*sources, model_source(args.reference)]
            reference = count
        gram = compute_gram(sources, chunk_bytes=args.chunk_mb * 1024 * 1024, progress=not args.quiet)
        indices = window_indices(count, window, args.every)
        diag = window_diagnostics(gram.gram, indices, weights_fn(len(indices)), reference)
        series = training_series(gram.gram, window, args.every, weights_fn, count=count, reference=reference)
        ends = [d.indices[-1] for d in series]
        use_tokens = all(gram.tokens[i] is not None for i in ends)
        xs = [gram.tokens[i] if use_tokens else (gram.steps[i] or i) for i in ends]
        write_line()
        write_line(f"Window: {len(indices)} snapshots ({origin}), every {args.every}, {args.strategy} weights "
                   f"({gram.numel:,} weights in {gram.num_tensors} tensors)")
        write_lines(diagnostics_table(gram.names, diag))
        if len(series) > 1:
            write_line()
            write_line("Over training (window ending at each snapshot):")
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
            write_lines(text_table(header, body))
        if plot is not None:
            title = f"{Path(args.run).name}: {args.strategy} window of {len(indices)} (every {args.every})"
            plot_diagnostics(plot, gram.names, diag, series, xs, "tokens" if use_tokens else "step", title)
            write_line()
            write_line(f"plot: {plot}")
        report.update(
            window=diag.to_dict() | {"names": [gram.names[i] for i in indices], "strategy": args.strategy, "every": args.every,
                                     "origin": origin},
            series=[d.to_dict() | {"end": gram.names[i], "x": x} for d, i, x in zip(series, ends, xs)],
            gram=gram.to_dict(),
            reading=reading(diag),
        )
    if args.output:
        atomic_write_json(Path(args.output), report)
        write_line(f"report: {args.output}")
    if "reading" in report:
        write_line()
        write_line(report["reading"])
    return 0
