"""The ``hf-pma`` command: a thin layer over the library, one module per sub-command.

Each module in :mod:`hf_pma.commands` exposes ``add_parser(subparsers)`` (which registers the
sub-command and sets ``func``) and does its heavy imports inside the function it runs, so
``hf-pma --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from hf_pma import __version__

# Sub-command name -> module under hf_pma.commands.
COMMANDS = {
    "merge": "merge",
    "eval": "eval",
    "make-tasks": "make_tasks",
    "card": "card",
    "push": "push",
    "sweep": "sweep",
    "inspect": "inspect",
    "consolidate": "consolidate",
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser of ``hf-pma``."""
    parser = argparse.ArgumentParser(
        prog="hf-pma",
        description="Pre-trained Model Averaging (PMA) for Hugging Face models: merge, evaluate and publish snapshots.",
    )
    parser.add_argument("--version", action="version", version=f"hf-pma {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(f"hf_pma.commands.{module}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-pma``; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from hf_pma.utils.logs import enable_logging

    level = logging.DEBUG if args.verbose else logging.INFO
    hf_logging.set_verbosity(level)
    hf_logging.enable_default_handler()
    hf_logging.enable_explicit_format()
    enable_logging(level)
    from hf_pma.utils.fs import NoSpaceError

    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError, NoSpaceError, ConnectionError) as err:
        # Bad input: one clear line, no traceback (use -v for the traceback).
        if args.verbose:
            raise
        sys.stderr.write(f"hf-pma {args.command}: error: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
