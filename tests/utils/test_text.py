"""One escape for shown text (hf_pma.utils.text): what a terminal, a log, a table or a plot shows
of a name from a folder, a record or the Hub; command lines quoted for pasting."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pma.utils.formatting import markdown_table, text_table
from hf_pma.utils.logs import RedactingFilter
from hf_pma.utils.text import command_line, escape, plot_text, shown, write_line, write_lines

HOSTILE = [
    ("C0 newline", "run\nmerged OK", "run\\nmerged OK"),
    ("C0 escape", "a\x1b[2Jb", "a\\x1b[2Jb"),
    ("C0 NUL, CR, tab", "a\x00\r\tb", "a\\x00\\r\\tb"),
    ("DEL", "a\x7fb", "a\\x7fb"),
    ("C1 CSI", "a\x9b31mb", "a\\x9b31mb"),
    ("bidi override", "evil\u202ecod.py", "evil\\u202ecod.py"),
    ("bidi isolate", "a\u2066b\u2069", "a\\u2066b\\u2069"),
    ("line separator", "a\u2028b\u2029", "a\\u2028b\\u2029"),
    ("lone surrogate", os.fsdecode(b"snap\xff"), "snap\\udcff"),
    ("non-BMP format character", "a\U000e0001b", "a\\U000e0001b"),
]


@pytest.mark.parametrize("what, text, expected", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_escape_writes_every_unprintable_character_as_repr_does(what, text, expected):
    assert escape(text) == expected
    assert escape(text).isprintable()


def test_escape_leaves_printable_text_and_accepts_paths_bytes_and_objects():
    printable = "snapshot-1024 é 日本語 ελληνικά 🙂 a|b $x$ \\n"
    assert escape(printable) == printable
    assert escape(Path("run") / "snap\x1b") == "run/snap\\x1b"
    assert escape(b"snap\xff\n") == "snap\\udcff\\n"
    assert escape(12) == "12" and escape(None) == "None"


def test_shown_is_a_quoted_one_line_repr_cut_to_a_length():
    assert shown("a\nb") == "'a\\nb'"
    assert shown(Path("x\u202e")) == "'x\\u202e'"

    class Sly(str):
        def __repr__(self):
            return "fake\nline"

    assert shown(Sly("x")) == "fake\\nline"
    assert shown("x" * 500, 20) == "'" + "x" * 16 + "..."
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert shown(10**5000) == "<an integer of about 5001 digits>"  # repr refuses it
    assert shown(nested) == "<a list nested too deep to show>"


def test_write_line_and_write_lines_never_write_a_control_character():
    out = io.StringIO()
    write_line("merged \x1b[2Jrun\nmerged OK -> x", out)
    write_lines("header\nrow \x1b]0;title\x07", out)
    assert out.getvalue() == "merged \\x1b[2Jrun\\nmerged OK -> x\nheader\nrow \\x1b]0;title\\x07\n"


def test_table_cells_are_escaped():
    rows = [["snap\x1b[2J\nmerged OK", "1\u202e"]]
    for table in (markdown_table(["name", "n"], rows), text_table(["name", "n"], rows)):
        assert all(line.isprintable() for line in table.split("\n")), table
        assert "snap\\x1b[2J\\nmerged OK" in table and "1\\u202e" in table
    assert "a\\|b" in markdown_table(["x"], [["a|b"]])


def test_log_filter_escapes_the_message():
    record = logging.LogRecord(
        "hf_pma.x", logging.INFO, __file__, 1, "reading %s", ("snap\n[INFO] forged\x1b[2J",), None
    )
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "reading snap\\n[INFO] forged\\x1b[2J"


def test_plot_text_escapes_mathtext_and_control_characters():
    assert plot_text("$\\alpha$ snap\n") == "\\$\\alpha\\$ snap\\n"


def test_command_line_is_one_line_that_a_shell_reads_back_exactly(tmp_path):
    args = [
        "prog",
        "merge",
        "my run/pma",
        "a'b",
        "x\ny\x1b[2J",
        "\u202e",
        "$HOME",
        "",
        "b\\s",
        os.fsdecode(b"\xff"),
    ]
    line = command_line(args)
    assert line.isprintable() and line.startswith("prog merge 'my run/pma' 'a'\"'\"'b' $'x\\ny\\x1b[2J' ")
    script = f"{sys.executable} -c 'import json, os, sys; print(json.dumps([os.fsencode(a).hex() for a in sys.argv[1:]]))' {line}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert json.loads(done.stdout) == [os.fsencode(a).hex() for a in args], done.stderr
    assert command_line([Path("a b"), 3]) == "'a b' 3"
