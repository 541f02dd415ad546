"""``hf-pma merge`` in a child process paused after its first output bytes
(``tests/dist/merge_pause.py``), for tests that act on a merge caught mid-write: a second merge
into its folder, its sources changed under it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from tests.helpers.repo import REPO_ROOT

MERGE_PAUSE = REPO_ROOT / "tests" / "dist" / "merge_pause.py"


def child_env() -> dict[str, str]:
    """The environment of a child that runs this checkout's hf-pma offline, on one thread."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


@contextlib.contextmanager
def paused_merge(*args: object) -> Iterator[subprocess.Popen]:
    """``hf-pma merge ARGS`` started and paused after its first output bytes; killed on leaving
    the block if it still runs (:func:`resume` lets it go on)."""
    child = subprocess.Popen(
        [sys.executable, str(MERGE_PAUSE), *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        line = child.stdout.readline()
        assert line.startswith("PAUSED "), line + child.stderr.read()
        yield child
    finally:
        if child.poll() is None:
            child.kill()


def resume(child: subprocess.Popen, timeout: float = 300) -> int:
    """Let a paused merge go on; its exit code once it has ended."""
    child.stdin.write("\n")
    child.stdin.flush()
    return child.wait(timeout=timeout)
