"""Help and wording come from the code: a default said in a help text is generated from the
constant or the rule it describes, a window's provenance names what chose it."""

from __future__ import annotations

import re

from hf_pma.commands.inspect import DEFAULT_WINDOW_SAID
from hf_pma.core.selection import DEFAULT_WINDOW
from tests.helpers.cli import run_cli


def test_inspects_help_says_the_default_window_the_code_uses():
    """After the run's own window, inspect takes the automatic one (analysis.inspection.merge_window),
    and a fixed DEFAULT_WINDOW only with a stride: the help says so, from the constant."""
    shown = " ".join(run_cli("inspect", "--help").stdout.split())
    assert shown.count(" ".join(DEFAULT_WINDOW_SAID.split())) == 2  # the description and --window
    assert f"({DEFAULT_WINDOW} with --every)" in DEFAULT_WINDOW_SAID
    assert not re.search(r"else \d+\)", shown), shown
