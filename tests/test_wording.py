"""Help and wording come from the code: a default said in a help text is generated from the
constant or the rule it describes, a window's provenance names what chose it."""

from __future__ import annotations

import re

from hf_pma.commands.inspect import DEFAULT_WINDOW_SAID
from tests.helpers.cli import run_cli


def test_inspects_help_says_the_default_window_the_code_uses():
    """After the run's own window, inspect takes the automatic one over every --every-th snapshot,
    as merge does (analysis.inspection.window_size): the help says so, and names no fixed count."""
    shown = " ".join(run_cli("inspect", "--help").stdout.split())
    assert shown.count(" ".join(DEFAULT_WINDOW_SAID.split())) == 2  # the description and --window
    assert "every --every-th snapshot" in DEFAULT_WINDOW_SAID and not re.search(r"\d", DEFAULT_WINDOW_SAID)
    assert not re.search(r"else \d+\)", shown), shown


def _options():
    """Every option of every hf-pma sub-command: (command, action)."""
    import argparse

    from hf_pma.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.help and action.option_strings:
                yield name, sub, action


def test_every_default_a_help_names_is_the_default_the_option_has():
    """A help's "(default: X)" is the parser's default for that option, rendered from it
    (``%(default)s``) wherever the default is one value: a changed default cannot leave the help behind."""
    wrong = []
    for name, sub, action in _options():
        shown = sub._get_formatter()._expand_help(action)  # the help as --help prints it
        said = re.search(r"\(default: ([^);]+)", shown)
        if said is None or not isinstance(action.default, (int, float, str)) or isinstance(action.default, bool):
            continue
        if "%(default)" not in action.help:
            wrong.append(f"{name} {action.option_strings[0]}: {action.help!r} does not render its default")
        elif said.group(1).strip() != str(action.default):
            wrong.append(f"{name} {action.option_strings[0]}: says {said.group(1)!r}, default {action.default!r}")
    assert wrong == [], "\n".join(wrong)
