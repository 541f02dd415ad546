"""``hf-pma sweep``: evaluate the merges of a run's snapshots over window, stride and strategy."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_pma.commands import add_revision_arguments, positive_int
from hf_pma.core.strategies import STRATEGIES


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from err
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


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
            "For each window N (--window), stride k (--every: take every k-th snapshot counting back from the "
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
    p.add_argument("--window", type=_int_list, default=[3, 6, 10, 15], help="merge sizes N (default: 3,6,10,15)")
    p.add_argument("--every", type=_int_list, default=[1, 2, 4], help="take every k-th snapshot (default: 1,2,4)")
    p.add_argument("--strategy", type=_strategy_list, default=["sma", "wma", "ema"], help="strategies (default: sma,wma,ema)")
    p.add_argument("--alpha", type=float, default=0.2, help="EMA smoothing factor (default: 0.2)")
    p.add_argument("--eval-file", metavar="FILE", help="held-out text (as hf-pma eval --eval-file)")
    p.add_argument("--text-column", default="text", help="column of the text in --eval-file tables (default: text)")
    p.add_argument("--eval-split", default="test", help="split of a --eval-file dataset (default: test)")
    p.add_argument("--tasks", help="comma-separated lm-eval task, group or tag names")
    p.add_argument("--include-path", action="append", metavar="DIR", help="folder of local lm-eval YAML tasks (repeatable)")
    p.add_argument("--metric", help="TASK/METRIC that picks the best merge (default: lm/loss, else the first task's acc)")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--higher-is-better", dest="higher_is_better", action="store_true", default=None)
    direction.add_argument("--lower-is-better", dest="higher_is_better", action="store_false")
    p.add_argument("--tokenizer", help="tokenizer (default: the newest snapshot's, or its run folder's)")
    p.add_argument("--limit", type=positive_int, help="at most K examples per task and K held-out documents")
    p.add_argument("--batch-size", type=positive_int, default=8, help="batch size (default: 8)")
    p.add_argument("--block-size", type=positive_int, help="held-out LM window (default: the model's context)")
    p.add_argument("--stride", type=positive_int, help="held-out LM window step (default: block size / 2)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples for lm-eval tasks")
    p.add_argument("--device", help="device (default: cuda if available, else cpu)")
    p.add_argument("-o", "--output", default="sweep.json", metavar="FILE", help="results as JSON (default: sweep.json)")
    p.add_argument("--plot", metavar="FILE", help="heatmap PNG (default: the --output path with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the heatmap")
    p.add_argument("--best", metavar="DIR", help="write the best merge as a model folder here")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --best folder")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma sweep``."""
    import logging as std_logging

    from transformers.utils import logging

    from hf_pma.analysis.sweep import parse_metric, plot_sweep, run_sweep, sweep_table, write_best
    from hf_pma.core.strategies import merge_weights
    from hf_pma.evaluation.corpus import load_documents
    from hf_pma.merging.hub_revisions import parse_hub_spec
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.utils.fs import atomic_write_json, check_output_folder
    from hf_pma.utils.logs import enable_logging

    if not getattr(args, "verbose", False):
        logging.set_verbosity_warning()  # transformers' loading messages: noise next to the tables (-v shows them)
    if args.quiet:
        enable_logging(std_logging.WARNING)
        logging.disable_progress_bar()
    # Everything that can be checked is checked before the first model is loaded.
    if not args.tasks and not args.eval_file:
        raise ValueError("nothing to evaluate: give --eval-file and/or --tasks")
    merge_weights(2, "ema", args.alpha)
    if args.metric:
        parse_metric(args.metric)
    output = Path(args.output)
    if not output.absolute().parent.is_dir():
        raise FileNotFoundError(f"the folder of --output {output} does not exist")
    plot = None if args.no_plot else Path(args.plot) if args.plot else output.with_suffix(".png")
    if plot is not None and not plot.absolute().parent.is_dir():
        raise FileNotFoundError(f"the folder of --plot {plot} does not exist")
    if args.best:
        check_output_folder(args.best, args.overwrite)
    texts = None
    if args.eval_file:
        texts = load_documents(args.eval_file, text_column=args.text_column, split=args.eval_split, limit=args.limit)
        if not any(texts):
            raise ValueError(f"--eval-file {args.eval_file} holds no text")

    run = args.run if len(args.run) > 1 else args.run[0]
    if args.revisions or args.last or any(not Path(r).exists() and parse_hub_spec(r) for r in args.run):
        run = resolve_sources(args.run, last=args.last, revisions=args.revisions, cache_dir=args.cache_dir)
    report = run_sweep(
        run,
        windows=args.window,
        every=args.every,
        strategies=args.strategy,
        alpha=args.alpha,
        texts=texts,
        tasks=args.tasks,
        include_path=args.include_path,
        metric=args.metric,
        higher_is_better=args.higher_is_better,
        tokenizer=args.tokenizer,
        limit=args.limit,
        batch_size=args.batch_size,
        block_size=args.block_size,
        stride=args.stride,
        num_fewshot=args.num_fewshot,
        device=args.device,
        eval_dataset=Path(args.eval_file).name if args.eval_file else None,
        progress=not args.quiet,
    )
    atomic_write_json(output, report)
    if plot is not None:
        plot_sweep(report, plot)
    if args.best:
        write_best(report, args.best, overwrite=args.overwrite, progress=not args.quiet)
    sys.stdout.write(sweep_table(report) + "\n")
    sys.stdout.write(f"results: {output}" + (f", heatmap: {plot}" if plot else "") + (f", best merge: {args.best}" if args.best else "") + "\n")
    return 0
