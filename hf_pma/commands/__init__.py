"""Sub-commands of the ``hf-pma`` CLI (see :mod:`hf_pma.cli`), and the argument types they share."""

from __future__ import annotations

import argparse


def add_revision_arguments(p: argparse.ArgumentParser, every: bool = True) -> None:
    """``--revisions``, ``--every`` (when ``every``) and ``--cache-dir``: Hub revisions as sources."""
    p.add_argument(
        "--revisions",
        metavar="PATTERN",
        help="with a Hub repo org/model: its branches and tags whose name matches PATTERN, a glob ('step14*') or "
        "a regex ('/^step1[34]\\d{4}$/' or 're:...'; named groups step/tokens set the order)",
    )
    if every:
        p.add_argument("--every", type=positive_int, help="take every K-th source (snapshot or revision) counting back from the newest")
    p.add_argument("--cache-dir", metavar="DIR", help="where Hub revisions are downloaded (default: the Hugging Face cache)")


def positive_int(text: str) -> int:
    """An ``argparse`` type: a positive integer, with a one-line error otherwise."""
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
