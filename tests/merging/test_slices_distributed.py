"""Merged evaluation by local slice and the spread final merge in real multi-process runs (gloo, CPU).

``tests/dist/merged_eval.py`` under ``torchrun --nproc_per_node W``: the slice path's
``eval_pma_loss`` (DDP, through PMATrainer) and merged loss (FSDP2 and FSDP1, on the sharded
model directly: the Trainer does not shard on CPU) equal the full merge's; the job reads each
snapshot once in total; every rank backs up only its part; the final merge written by all
ranks equals a single process's, byte for byte. One process: tests/merging/test_slices.py and
tests/training/test_trainer.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).resolve().parents[1] / "dist"

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(world: int, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master-port", str(_free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([*command, str(DIST_DIR / "merged_eval.py"), "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    reports = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in reports] == list(range(world))
    return reports


@pytest.mark.parametrize("world", [2, 4])
def test_slice_merge_equals_full_merge_and_reads_each_snapshot_once(tmp_path, world):
    reports = _torchrun(world, tmp_path)
    ddp = [r["ddp"] for r in reports]
    assert all(d["world_size"] == world and d["num_snapshots"] == 3 for d in ddp)
    for d in ddp:
        assert d["slice_loss"] == pytest.approx(d["full_loss"], rel=1e-6)
        assert d["slice_loss"] != d["live_loss"] and d["live_loss_after"] == d["live_loss"]
    model = ddp[0]["model_bytes"]
    # Replicated (DDP): the ranks share the reading, N x model in total, not world x N x model.
    assert sum(d["bytes_read"] for d in ddp) == 3 * model
    assert sum(d["backup_bytes"] for d in ddp) == model and max(d["backup_bytes"] for d in ddp) < model
    for kind in ("fsdp2", "fsdp1"):
        runs = [r[kind] for r in reports]
        for run in runs:
            assert run["slice_loss"] == pytest.approx(run["full_loss"], rel=1e-6), kind
            assert run["live_loss_after"] == run["live_loss"] != run["slice_loss"], kind
        # Sharded: each rank reads and backs up its own shard only.
        assert sum(run["bytes_read"] for run in runs) == 3 * model, kind
        assert max(run["bytes_read"] for run in runs) <= 1.1 * 3 * model / world, kind
        assert sum(run["backup_bytes"] for run in runs) == model, kind
    final = reports[0]["final_merge"]
    assert final["identical"] and final["files"] == final["dist_files"]
    assert sum(f.endswith(".safetensors") for f in final["files"]) == 4
