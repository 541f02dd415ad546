"""Two trainings into one output folder (``tests/dist/one_writer_train.py``): the first holds its
snapshot folder until told to go on, the second starts meanwhile and must be refused."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import PMA_SUBDIR, manifest_snapshots
from hf_pma.utils.fs import _host
from tests.helpers.barriers import wait_for
from tests.helpers.repo import REPO_ROOT


def second_training_meanwhile(
    command: Sequence[Any], tmp_path: Path, while_first_holds: Callable[[], Any] = lambda: None, env=None
) -> tuple[subprocess.Popen, subprocess.Popen, str, Any]:
    """Start ``command READY GO`` (the first training, its log in ``first.log``) and ``command
    --after READY`` (the second, which starts training once the first holds its folder); once the
    first is ready, call ``while_first_holds()`` and collect the second's stderr, then let the
    first finish. Returns both processes, the second's stderr and what ``while_first_holds``
    returned."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    command = [str(c) for c in command]
    kwargs = {"env": env, "cwd": REPO_ROOT} if env is not None else {}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([*command, str(ready), str(go)], stdout=log, stderr=subprocess.STDOUT, **kwargs)
        second = subprocess.Popen(
            [*command, "--after", str(ready)], stderr=subprocess.PIPE, text=True, **kwargs
        )
        try:
            wait_for(ready, first)
            seen = while_first_holds()
            second_err = second.communicate(timeout=300)[1]
        finally:
            go.touch()
            first.wait(timeout=300)
            second.kill()
    return first, second, second_err, seen


def check_second_refused(first: subprocess.Popen, second: subprocess.Popen, second_err: str, out: Path, tmp_path: Path) -> None:
    """The first trained to its end (its 4 snapshots, and nothing else left in ``out``: the claim
    went with it); the second stopped at its start (rc 3) naming the first (host and pid)."""
    assert first.returncode == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert second.returncode == 3, second_err[-3000:]
    assert [line for line in second_err.splitlines() if line.startswith("REFUSED")] == [
        f"REFUSED rank 0: snapshot folder {out / PMA_SUBDIR} is in use by another training (host {_host()}, "
        f"pid {first.pid}); wait for it to finish or choose another folder"
    ]
    assert [r.path for r in manifest_snapshots(out / PMA_SUBDIR)] == [f"snapshot-{64 * k}" for k in (1, 2, 3, 4)]
    assert sorted(os.listdir(out)) == [PMA_SUBDIR]
