"""MkDocs hook: replace ``<!-- hf-pma-help COMMAND -->`` with the ``--help`` text of that sub-command.

The command-line reference is rendered from the argument parsers themselves, so it cannot drift
from the code. An unknown command name fails the build.
"""

from __future__ import annotations

import argparse
import os
import re

MARKER = re.compile(r"<!-- hf-pma-help (?P<command>[\w-]+) -->")
WIDTH = "100"


def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    from hf_pma.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("hf-pma's parser has no sub-commands")


def _help(command: str, parsers: dict[str, argparse.ArgumentParser]) -> str:
    if command not in parsers:
        raise ValueError(f"docs: <!-- hf-pma-help {command} -->: no such sub-command (known: {', '.join(parsers)})")
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse wraps at the terminal width: make the page reproducible
    try:
        text = parsers[command].format_help()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return f"```text\n{text.rstrip()}\n```"


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    """Expand every help marker of a page."""
    if not MARKER.search(markdown):
        return markdown
    parsers = _subcommand_parsers()
    return MARKER.sub(lambda m: _help(m.group("command"), parsers), markdown)
