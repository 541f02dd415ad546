"""Sub-commands of the ``hf-pma`` CLI (see :mod:`hf_pma.cli`), and the arguments they share."""

from __future__ import annotations

import argparse
from typing import Any

from hf_pma.utils.argtypes import positive_int
from hf_pma.utils.hub_client import add_hub_timeout_argument

__all__ = [
    "positive_int",
    "add_output_arguments",
    "add_revision_arguments",
    "add_heldout_arguments",
    "load_heldout",
    "set_verbosity",
]


def add_output_arguments(p: argparse.ArgumentParser, quiet: str = "no progress bar or info logs") -> None:
    """``-o/--output`` (a folder, created atomically), ``--overwrite`` and ``-q/--quiet``: the
    arguments of every sub-command that writes a folder."""
    p.add_argument("-o", "--output", required=True, help="output folder (created atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("-q", "--quiet", action="store_true", help=quiet)


def add_revision_arguments(p: argparse.ArgumentParser, every: bool = True) -> None:
    """``--revisions``, ``--every`` (when ``every``), ``--cache-dir`` and ``--hub-timeout``: Hub revisions as sources."""
    p.add_argument(
        "--revisions",
        metavar="PATTERN",
        help="with a Hub repo org/model: its branches and tags whose name matches PATTERN, a glob ('step14*') or "
        "a regex ('/^step1[34]\\d{4}$/' or 're:...'; named groups step/tokens set the order)",
    )
    if every:
        p.add_argument(
            "--every",
            type=positive_int,
            help="take every K-th source (snapshot or revision) counting back from the newest",
        )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where Hub revisions are downloaded (default: the Hugging Face cache)",
    )
    add_hub_timeout_argument(p)


def add_heldout_arguments(parser: argparse.ArgumentParser) -> None:
    """``--eval-file``, ``--text-column``, ``--eval-split``: the held-out text of ``eval`` and ``sweep``."""
    parser.add_argument(
        "--eval-file",
        metavar="FILE",
        help="held-out text: .txt (one document), .jsonl/.json/.csv/.parquet (--text-column), a folder of text "
        "files, or a dataset name[:config]",
    )
    parser.add_argument(
        "--text-column", default="text", help="column of the text in --eval-file tables (default: %(default)s)"
    )
    parser.add_argument("--eval-split", default="test", help="split of a --eval-file dataset (default: %(default)s)")


def load_heldout(args: argparse.Namespace) -> list[str] | None:
    """The documents of ``--eval-file`` (at most ``--limit``), ``None`` without it; ``ValueError``
    when it holds no text."""
    if not args.eval_file:
        return None
    from hf_pma.evaluation.corpus import load_documents

    texts = load_documents(
        args.eval_file, text_column=args.text_column, split=args.eval_split, limit=args.limit
    )
    if not any(texts):
        raise ValueError(f"--eval-file {args.eval_file} holds no text")
    return texts


def set_verbosity(args: Any) -> None:
    """Quiet transformers' loading messages (noise next to a command's tables; ``-v`` shows them),
    and with ``-q`` hf-pma's info logs and progress bars too."""
    import logging

    from hf_pma.utils.logs import enable_logging, set_transformers_verbosity

    quiet = getattr(args, "quiet", False)
    level = logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING
    set_transformers_verbosity(level, progress_bars=not quiet)  # without importing transformers
    if quiet:
        enable_logging(logging.WARNING)
