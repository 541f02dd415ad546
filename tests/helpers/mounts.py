"""Folders that fail for real: read-only, through a bind mount (root ignores permission bits).
Needs root, as CI runs (the ``small_filesystem`` fixture of tests/conftest.py mounts a tiny
tmpfs the same way)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """``folder`` made read-only for real (a read-only bind mount: root ignores permission bits)."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder), str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
