"""The ``hf-pma`` command starts fast: building its parser and printing help import no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "huggingface_hub", "safetensors", "yaml")

_PROBE = """
import contextlib, io, json, sys
from hf_pma.cli import build_parser, main
build_parser()
argv = sys.argv[1:]
if argv:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: hf-pma" in out.getvalue(), out.getvalue()
heavy = {heavy!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


@pytest.mark.parametrize("argv", [[], ["--help"], ["merge", "--help"], ["make-tasks", "--help"], ["eval", "--help"]])
def test_parser_and_help_import_no_heavy_module(argv):
    # A fresh interpreter: this one has torch loaded already.
    probe = _PROBE.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
