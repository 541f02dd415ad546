"""How hf-pma shows numbers, sizes and tables: one number formatter, one byte formatter, one markdown table.

Every command (``eval``, ``sweep``, ``inspect``) and the model card show a metric the same way
(:func:`format_number`: ``0.3120``, ``1,234.5``), a size in bytes in binary units
(:func:`format_bytes`: ``1.5 KiB``, ``2.0 GiB``), a metric with its standard error as
``0.3120 ± 0.0140`` (:func:`format_metric`), and tables as GitHub markdown with padded columns
(:func:`markdown_table`), which paste into an issue, a model card or the docs as they are.
What is only read in a terminal (``inspect``'s tables) is a plain-text table
(:func:`text_table`): no pipes, no markdown escapes. The cells of both are escaped
(:func:`hf_pma.utils.text.escape`): a table never writes a control character it was given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hf_pma.utils.parsing import is_number
from hf_pma.utils.text import escape

__all__ = ["MISSING", "format_bytes", "format_number", "format_metric", "markdown_table", "metric_label", "text_table"]

MISSING = "-"


def metric_label(task: str, metric: str) -> str:
    """How a table names a metric: the held-out language-modelling ``loss`` (task ``lm``) says that
    it is per token (over all held-out tokens), unlike the per-document means shown beside it."""
    return f"{metric} (per token)" if task == "lm" and metric == "loss" else metric


def format_number(value: Any, spec: str | None = None, missing: str = MISSING) -> str:
    """A number as text: ``spec`` (a format spec such as ``".3g"``, ``"+.4f"``, ``","``) when
    given, else the metric format: 4 decimals (``0.3120``), or thousands separators and one
    decimal from 1000 on (``1,234.5``). ``None`` is ``missing``; NaN and infinities print as
    ``nan`` / ``inf`` / ``-inf``; booleans and non-numbers are shown as they are.
    """
    if value is None:
        return missing
    if not is_number(value):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if spec is not None:
        return format(value, spec)
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4f}"


def format_metric(value: Any, stderr: Any = None, missing: str = MISSING) -> str:
    """A metric value, with its standard error when known: ``0.3120 ± 0.0140``."""
    text = format_number(value, missing=missing)
    if value is not None and stderr is not None:
        text += f" ± {format_number(stderr)}"
    return text


def format_bytes(num_bytes: Any, missing: str = MISSING) -> str:
    """A size in binary units, as ``df -h`` and ``du -h`` count: ``512 B``, ``1.5 KiB``,
    ``2.0 GiB`` (one decimal; ``None`` is ``missing``). The one byte formatter: every message
    about memory, disk space or file sizes uses it."""
    if num_bytes is None:
        return missing
    n = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _cell(value: Any) -> str:
    return escape(value).replace("|", "\\|")


def markdown_table(header: Sequence[Any], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table with padded columns.

    ``align`` has one letter per column, ``l`` (left) or ``r`` (right); default: the first
    column left, the others right (labels, then numbers). Cells are converted with ``str``
    (format numbers with :func:`format_number` first) and escaped (:func:`hf_pma.utils.text.escape`:
    a name from a folder or a record shows its control characters and newlines as ``\\x1b``,
    ``\\n``); ``|`` in a cell is escaped.
    """
    header, body, align, widths = _aligned(header, rows, align, _cell)

    def line(cells: Sequence[str]) -> str:
        padded = (c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align))
        return "| " + " | ".join(padded) + " |"

    rule = (
        "| "
        + " | ".join(":" + "-" * (w - 1) if a == "l" else "-" * (w - 1) + ":" for w, a in zip(widths, align))
        + " |"
    )
    return "\n".join([line(header), rule, *(line(r) for r in body)])


def _aligned(
    header: Sequence[Any], rows: Sequence[Sequence[Any]], align: str | None, cell: Callable[[Any], str]
) -> tuple[list[str], list[list[str]], str, list[int]]:
    """Cells as text, the alignment checked, and each column's width."""
    header = [cell(h) for h in header]
    body = [[cell(c) for c in row] for row in rows]
    for row in body:
        if len(row) != len(header):
            raise ValueError(f"table row {row} has {len(row)} cells, the header has {len(header)}")
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one 'l' or 'r' per column ({len(header)}), got {align!r}")
    widths = [max(3, *(len(r[i]) for r in [header, *body])) for i in range(len(header))]
    return header, body, align, widths


def text_table(header: Sequence[Any], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table for a terminal: padded columns two spaces apart, the header
    underlined with dashes, cells shown as they are (``|`` included) but escaped as in
    :func:`markdown_table` (control characters and newlines).

    ``align`` as in :func:`markdown_table`; trailing spaces are stripped from each line.
    """
    header, body, align, widths = _aligned(header, rows, align, escape)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in body)])
