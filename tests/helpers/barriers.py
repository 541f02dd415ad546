"""Barriers for tests that race real processes: each child makes a ready file, then waits for a
go file, so that all of them start their contended work together."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def wait_for(path: Path, *procs: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until ``path`` exists (a barrier file); fail if a process it depends on exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        for proc in procs:
            assert proc.poll() is None, f"a process exited with {proc.returncode} before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def release_together(procs: Sequence[subprocess.Popen], ready: Sequence[Path], go: Path) -> list:
    """Wait until every process has made its ``ready`` file, release them all (``go``), and return
    each one's standard error once it has exited (go is made even when a wait fails, so that no
    child is left waiting)."""
    try:
        for path in ready:
            wait_for(path, *procs)
    finally:
        go.touch()
        errors = [p.communicate(timeout=300)[1] for p in procs]
    return errors
