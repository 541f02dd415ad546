"""``hf-pma merge``: merge snapshots, Trainer checkpoints or any HF models into one folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_pma.commands import add_revision_arguments, positive_int
from hf_pma.core.strategies import STRATEGIES


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",") if w.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--weights must be comma-separated numbers, got {text!r}") from err


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma merge``."""
    p = subparsers.add_parser(
        "merge",
        help="merge checkpoints (PMA)",
        description=(
            "Merge the weights of several checkpoints into one model folder, streaming tensor by tensor. "
            "SOURCES are model folders, PMA snapshot folders, Trainer checkpoint-* folders, run folders "
            "(holding pma/manifest.json or checkpoint-* folders), Hub models (org/model) or Hub revisions "
            "(org/model@REV; or org/model --revisions PATTERN for the branches and tags matching a glob, or a "
            "regex written /.../ or re:...); they are ordered by training progress (tokens, then step, parsed "
            "from revision names) when known. Only the selected revisions are downloaded."
        ),
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE")
    p.add_argument("-o", "--output", required=True, help="output folder (created atomically)")
    p.add_argument("--strategy", default="sma", choices=STRATEGIES, help="merge weights (default: sma)")
    p.add_argument("--alpha", type=float, default=0.2, help="EMA smoothing factor (default: 0.2)")
    p.add_argument("--weights", type=_weights, help="explicit weights, oldest first, e.g. 1,1,2 (normalized)")
    p.add_argument("--last", type=int, help="merge only the newest N sources")
    add_revision_arguments(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="output dtype (default: input dtype)")
    p.add_argument("--accumulate-dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default: 5GB)")
    p.add_argument(
        "--workers",
        type=positive_int,
        help="merge threads (default: the usable cores); the output is bit-identical for any number",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma merge``."""
    import torch
    from transformers.utils import logging

    from hf_pma.merging.engine import merge_checkpoints
    from hf_pma.merging.sources import resolve_sources

    if args.quiet:
        logging.set_verbosity_warning()
    output = Path(args.output)
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:  # before any download
        raise FileExistsError(f"output folder {output} is not empty; pass --overwrite to replace it")
    sources = resolve_sources(
        args.sources, last=args.last, every=args.every, revisions=args.revisions, cache_dir=args.cache_dir
    )
    merge_checkpoints(
        sources,
        args.output,
        strategy=args.strategy,
        alpha=args.alpha,
        weights=args.weights,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        accumulate_dtype=getattr(torch, args.accumulate_dtype),
        progress=not args.quiet,
        workers=args.workers,
    )
    return 0
