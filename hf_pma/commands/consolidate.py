"""``hf-pma consolidate``: turn one sharded snapshot (one file per rank) into a plain HF model folder."""

from __future__ import annotations

import argparse

from hf_pma.commands import add_output_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma consolidate``."""
    p = subparsers.add_parser(
        "consolidate",
        help="turn a sharded snapshot into one HF model folder",
        description=(
            "Read a sharded snapshot (per-rank shard-*-model-*.safetensors files, as written by "
            "PMACallback(sharded=True) or by torch DCP's HuggingFaceStorageWriter(save_distributed=True)) "
            "and write one Hugging Face model folder that from_pretrained loads, streaming tensor by tensor. "
            "Merging does not need this: `hf-pma merge` reads sharded snapshots directly."
        ),
    )
    p.add_argument("snapshot", metavar="SNAPSHOT", help="the sharded snapshot folder")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating tensors (default: keep)"
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default: %(default)s)")
    add_output_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma consolidate``."""
    from hf_pma.commands import set_verbosity
    from hf_pma.merging.consolidate import consolidate_snapshot
    from hf_pma.utils.fs import check_output_folder

    set_verbosity(args)
    check_output_folder(args.output, args.overwrite)  # before the snapshot is read
    consolidate_snapshot(
        args.snapshot,
        args.output,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    return 0
