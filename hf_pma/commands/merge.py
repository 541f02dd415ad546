"""``hf-pma merge``: merge snapshots, Trainer checkpoints or any HF models into one folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_pma.commands import add_output_arguments, add_revision_arguments, positive_int
from hf_pma.core.strategies import DEFAULT_ALPHA, STRATEGIES
from hf_pma.utils.argtypes import positive_count, window_count


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",") if w.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--weights must be comma-separated numbers, got {text!r}") from err


def _last(text: str) -> int | str | None:
    """``--last``: N, ``auto`` or ``all`` (every source: no window)."""
    if text.strip().lower() == "all":
        return None
    return window_count(text)


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
            "from revision names) when known. Only the selected revisions are downloaded. "
            "A run folder is read as its PMA manifest's snapshots (manifest.json or pma/manifest.json), else its "
            "checkpoint-* folders; the final model a Trainer script saves at the top of its output folder is "
            "merged only with --include-final, or when its weight file (RUN/model.safetensors) is named. "
            "Prints which sources were merged (count, first and last, the tokens or steps they span)."
        ),
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE")
    p.add_argument("--strategy", default="auto", choices=STRATEGIES, help="merge weights; auto: those the automatic window chose with it (WMA), SMA for a window given (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="EMA smoothing factor (default: %(default)s)")
    p.add_argument("--weights", type=_weights, help="explicit weights, oldest first, e.g. 1,1,2 (normalized)")
    window = p.add_mutually_exclusive_group()
    window.add_argument(
        "--last",
        type=_last,
        default="auto",
        metavar="N|auto|all",
        help=(
            "with a run folder or a revision pattern: merge its newest N checkpoints; auto (the default) chooses "
            "N from the run's records (the longest recent constant-LR stretch over which the training loss no "
            "longer falls beyond its noise, at most a quarter of the tokens trained) and says why; all: every one. "
            "Sources named one by one are all merged"
        ),
    )
    window.add_argument(
        "--window-tokens",
        type=positive_count,
        metavar="T",
        help="merge the sources within the last T tokens of the newest (e.g. 2M; snapshots every V tokens: T = N*V takes N)",
    )
    window.add_argument(
        "--window-steps",
        type=positive_count,
        metavar="S",
        help="merge the sources within the last S optimizer steps of the newest (checkpoints without token counts)",
    )
    p.add_argument(
        "--include-final",
        action="store_true",
        help=(
            "with a run folder: also merge the final model saved at its top, as the newest source "
            "(in place of a snapshot or checkpoint saved at the same point)"
        ),
    )
    add_revision_arguments(p)
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="output dtype (default: input dtype)"
    )
    p.add_argument(
        "--clip-to-dtype",
        action="store_true",
        help=(
            "clip merged values beyond the range of the output dtype (float16: 65504) to it, and say how many; "
            "by default such a merge is refused, naming the tensor"
        ),
    )
    p.add_argument(
        "--allow-different-configs",
        action="store_true",
        help=(
            "merge sources whose config.json differ in what changes the meaning of the weights (architecture, "
            "heads, head size, key-value heads, RoPE, vocabulary, layers, ...): a deliberate soup of models, "
            "with a warning; by default refused, naming the two sources and the fields"
        ),
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help=(
            "the folder whose tokenizer the merged folder takes (default: the newest source's, else that of "
            "the run folder named; recorded in pma_merge.json)"
        ),
    )
    p.add_argument("--accumulate-dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default: %(default)s)")
    p.add_argument(
        "--workers",
        type=positive_int,
        help="merge threads (default: the usable cores); the output is bit-identical for any number",
    )
    add_output_arguments(p)
    p.set_defaults(func=run)


def _warn_whole_run(args: argparse.Namespace, sources: list) -> None:
    """A run folder merged whole (``--last all``) merges every snapshot it lists: say so, once."""
    windowed = args.last or args.window_tokens or args.window_steps or args.weights is not None
    if windowed or len(sources) <= len(args.sources) or len(sources) <= 2:
        return
    from hf_pma.utils.logs import get_logger

    get_logger("hf_pma.merge").warning(
        f"merging all {len(sources)} sources found in {', '.join(args.sources)} (every one it keeps, not only its end); "
        "PMA averages the end of a run: --last auto, --last N or --window-tokens T merges only the newest"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma merge``."""
    from hf_pma.core.manifest import MERGE_RECORD_NAME
    from hf_pma.core.outputs import check_overwrite_target
    from hf_pma.core.strategies import validate_strategy
    from hf_pma.core.window_choice import merge_strategy
    from hf_pma.merging.engine import merge_checkpoints
    from hf_pma.merging.sources import describe_sources, resolve_sources_and_window, tokenizer_folder
    from hf_pma.utils.fs import check_output_folder

    validate_strategy(args.strategy, args.alpha, args.weights)  # before any source is downloaded
    output = Path(args.output)
    check_output_folder(output, args.overwrite)  # before any download
    if args.overwrite:
        check_overwrite_target(output, (MERGE_RECORD_NAME,))
    if args.tokenizer is not None:
        tokenizer_folder((), args.tokenizer)  # holds a tokenizer: checked before any download
    selection = ("last", "every", "revisions", "cache_dir", "include_final", "window_tokens", "window_steps")
    if args.weights is not None and args.last == "auto":
        args.last = None  # explicit weights name every source: no window
    sources, choice = resolve_sources_and_window(args.sources, **{k: getattr(args, k) for k in selection})
    _warn_whole_run(args, sources)
    same_names = (
        "strategy",
        "alpha",
        "weights",
        "dtype",
        "max_shard_size",
        "overwrite",
        "accumulate_dtype",
        "workers",
        "window_tokens",
        "window_steps",
        "allow_different_configs",
        "clip_to_dtype",
        "tokenizer",
    )
    merge_checkpoints(
        sources,
        args.output,
        progress=not args.quiet,
        window_choice=choice,
        **{k: getattr(args, k) for k in same_names},
    )
    # Explicit weights name every source (--last auto was cleared above): no automatic choice then.
    strategy, choice = merge_strategy(args.strategy, choice, len(sources))
    how = "explicit weights" if args.weights is not None else strategy
    unit = "tokens" if args.window_tokens else "steps" if args.window_steps else None
    said = describe_sources(sources, args.window_tokens or args.window_steps, unit)
    from hf_pma.utils.text import write_line

    write_line(f"merged {said}; {how} -> {output}")
    if choice is not None:
        write_line(choice.describe())
    return 0
