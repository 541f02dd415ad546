"""Reading what a command, a page or a logger shows: markdown tables, plain-text tables, log
messages."""

from __future__ import annotations

import logging
import re


def markdown_rows(text: str) -> list[list[str]]:
    """The rows of the markdown tables in ``text`` (header rows included, rule rows left out),
    each a list of stripped cells."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            continue
        cells = [c.strip() for c in line[1:-1].split(" | ")]
        if all(c and set(c) <= set(":-") for c in cells):
            continue
        rows.append(cells)
    return rows


def text_rows(text: str) -> list[list[str]]:
    """The rows of the plain-text tables in ``text`` (``hf_pma.utils.formatting.text_table``):
    each table's header and body rows, cut at the columns its dashed rule marks, cells stripped."""

    lines = text.splitlines()
    rows = []
    for k, rule in enumerate(lines):
        if k == 0 or not rule.strip() or set(rule) - {"-", " "} or "--" not in rule:
            continue
        spans = [m.span() for m in re.finditer(r"-+", rule)]
        starts = [a for a, _ in spans] + [None]
        table = [lines[k - 1]]
        for line in lines[k + 1 :]:
            if not line.strip():
                break
            table.append(line)
        for line in table:
            rows.append(
                [
                    line[starts[i] : starts[i + 1]].strip() if starts[i + 1] else line[starts[i] :].strip()
                    for i in range(len(spans))
                ]
            )
    return rows


class CollectLogs(logging.Handler):
    """A logging handler that keeps every message (DEBUG and up) in ``messages``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
