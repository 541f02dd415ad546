"""MkDocs hook: replace ``<!-- hf-pma-table NAME/FILE.md -->`` with the tables of
``benchmarks/results/NAME/FILE.md``.

A page shows a benchmark's own result file, as the benchmark script wrote it, so its numbers
cannot drift from the committed results. A missing file, or one without a table, fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MARKER = re.compile(r"<!-- hf-pma-table (?P<path>[\w./-]+\.md) -->")


def results_tables(relative: str) -> str:
    """The Markdown table lines of ``benchmarks/results/<relative>`` (blank lines between tables kept)."""
    path = (RESULTS / relative).resolve()
    if RESULTS.resolve() not in path.parents or not path.is_file():
        raise ValueError(f"docs: <!-- hf-pma-table {relative} -->: no such file under benchmarks/results/")
    lines = path.read_text().splitlines()
    kept = [line if line.startswith("|") else "" for line in lines]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    if not text:
        raise ValueError(f"docs: benchmarks/results/{relative} holds no table")
    return text


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    """Expand every table marker of a page."""
    return MARKER.sub(lambda m: results_tables(m.group("path")), markdown)
