"""Merged evaluation by local slice and the spread final merge in real multi-process runs (gloo, CPU).

``tests/dist/merged_eval.py`` in the shared ``torchrun --nproc_per_node W`` launches (tests/conftest.py): the slice path's
``eval_pma_loss`` (DDP, through PMATrainer) and merged loss (FSDP2 and FSDP1, on the sharded
model directly: the Trainer does not shard on CPU) equal the full merge's; the job reads each
snapshot once in total; every rank backs up only its part; the final merge written by all
ranks equals a single process's, byte for byte. One process: tests/merging/test_slices.py and
tests/training/test_trainer.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.launcher import rank_reports

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.shared_launch("world2", "world4")]


@pytest.mark.parametrize("world", [2, 4])
def test_slice_merge_equals_full_merge_and_reads_each_snapshot_once(shared_launch, world):
    reports = rank_reports(shared_launch(f"world{world}", "merged_eval"), world)
    assert [r["rank"] for r in reports] == list(range(world))
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
