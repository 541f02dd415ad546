"""MkDocs hook: publish the figures of ``benchmarks/results/`` with the site.

They stay where the benchmark scripts write them; a page at the top of docs/ shows one with the
same relative path as the repository's README (``benchmarks/results/<name>/<figure>.png``).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]


def on_files(files: Files, config, **kwargs: object) -> Files:
    """Add every PNG under benchmarks/results/ as a site file."""
    for figure in sorted((ROOT / "benchmarks" / "results").rglob("*.png")):
        files.append(
            File(
                figure.relative_to(ROOT).as_posix(),
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
