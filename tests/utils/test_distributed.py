"""Multi-node safety: ranks that cannot see the snapshot folder rank 0 writes stop at once, all of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).resolve().parents[1] / "dist"

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_with_separate_disks_stop_with_a_clear_error(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(_free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # The timeout only turns a hang into a failure; the check itself answers within seconds.
    proc = subprocess.run(
        [*command, str(DIST_DIR / "two_nodes.py"), "--out", str(tmp_path), "--separate"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    reports = [json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["world_size"] == 2
        error = report["error"]
        assert error and f"snapshot folder {tmp_path / 'node0' / 'pma'} that rank 0 writes" in error
        assert "not visible to rank 1 " in error and str(tmp_path / "node1" / "pma") in error and "rank 0 on" not in error
    # Nothing trained, no snapshot written; the probe file is gone.
    assert sorted(p.name for p in (tmp_path / "node0" / "pma").iterdir()) == ["manifest.json"]
