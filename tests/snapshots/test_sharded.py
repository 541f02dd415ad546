"""Sharded snapshots in real multi-process FSDP2 runs (torchrun, gloo, CPU).

The script tests/dist/sharded_snapshots.py saves the same weights sharded (every rank its own
slices) and gathered (rank 0, the full-gather path). Merges of the sharded snapshots must be
bit-identical to merges of the gathered ones: SMA, WMA, EMA, in float32 and bfloat16, at world
sizes 2 and 4 and across a world-size change. A rank killed mid-write leaves a manifest that
lists only complete snapshots, and the resumed run goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_pma.core.manifest import manifest_snapshots
from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
from hf_pma.merging.sharded import rank_file_name
from tests.snapshots.test_callback_distributed import free_port

DIST_DIR = Path(__file__).resolve().parents[1] / "dist"

pytestmark = pytest.mark.distributed


def torchrun(out: Path, nproc: int, *args: str, expect_ok: bool = True) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*command, str(DIST_DIR / "sharded_snapshots.py"), "--out", str(out), *args], capture_output=True, text=True, env=env, timeout=300)
    if not expect_ok:
        assert proc.returncode != 0, "the run should have died"
        return []
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = {}
    for world in (2, 4):
        folder = tmp_path_factory.mktemp(f"w{world}")
        out[world] = (folder, torchrun(folder, world))
    return out


def snapshot_folders(run: Path, kind: str) -> list[Path]:
    pma = run / kind
    return [pma / r.path for r in manifest_snapshots(pma)]


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_merges_are_bit_identical_to_gathered_merges(runs, dtype):
    per_world = {w: (snapshot_folders(f, f"sharded-{dtype}"), snapshot_folders(f, f"gathered-{dtype}")) for w, (f, _) in runs.items()}
    for world, (sharded, gathered) in per_world.items():
        assert len(sharded) == len(gathered) == 3
        for folder in sharded:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            assert files == [rank_file_name(r) for r in range(world)]
            record = json.loads((folder / "pma.json").read_text())
            assert record["extra"]["sharded"] and record["extra"]["world_size"] == world and record["dtype"] == dtype
            assert record["num_bytes"] == sum((folder / f).stat().st_size for f in files)
        for strategy in ("sma", "wma", "ema"):
            assert_identical(merge_state_dict(sharded, strategy=strategy), merge_state_dict(gathered, strategy=strategy))
    # A run resumed on more ranks: 2-rank and 4-rank snapshots merge together.
    mixed_sharded = per_world[2][0] + per_world[4][0]
    mixed_gathered = per_world[2][1] + per_world[4][1]
    for strategy in ("sma", "ema"):
        assert_identical(merge_state_dict(mixed_sharded, strategy=strategy), merge_state_dict(mixed_gathered, strategy=strategy))


def test_sharded_run_folder_merges_and_loads(runs, tmp_path):
    folder, reports = runs[4]
    # The run folder resolves through its manifest; the merge is a folder from_pretrained loads.
    out = merge_checkpoints([folder / "sharded-bfloat16"], tmp_path / "merged", strategy="sma", progress=False)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    expected = merge_state_dict(snapshot_folders(folder, "gathered-bfloat16"))
    assert_identical({k: v for k, v in model.state_dict().items() if k in expected}, expected)
    # Every rank wrote about a quarter of the model, and staged no more than it wrote.
    sizes = [r["bytes_written"]["float32"] for r in reports]
    total = sum(p.stat().st_size for p in snapshot_folders(folder, "sharded-float32")[0].glob("*.safetensors"))
    assert sum(sizes) == 3 * total and max(sizes) < 0.5 * 3 * total
    assert all(r["staging_bytes"]["float32"] <= r["bytes_written"]["float32"] / 3 for r in reports)


def test_torch_dcp_folder_and_fsdp1(runs):
    for folder, reports in runs.values():
        # A folder written by DCP's HuggingFaceStorageWriter(save_distributed=True): same weights as
        # the last sharded snapshot.
        last = snapshot_folders(folder, "sharded-float32")[-1]
        (folder / "dcp" / "config.json").write_text((last / "config.json").read_text())
        assert_identical(merge_state_dict([folder / "dcp"]), merge_state_dict([last]))
        assert reports[0]["fsdp1"] == {"equal": True}, reports[0]["fsdp1"]


def test_rank_killed_mid_write_then_resume(tmp_path):
    torchrun(tmp_path, 2, "--crash-at", "3", expect_ok=False)
    for name in ("sharded-float32", "sharded-bfloat16"):
        pma = tmp_path / name
        listed = [r.tokens for r in manifest_snapshots(pma)]
        # Rank 1 died in its 3rd file: the float32 snapshot 2 (files 1 = f32 #1, 2 = bf16 #1, 3 = f32 #2).
        assert listed == ([1002] if name == "sharded-float32" else [1002]), (name, listed)
        assert not (pma / "snapshot-2002").exists()
    leftovers = [p.name for p in (tmp_path / "sharded-float32").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [".tmp-snapshot-2002"]
    # Resume from a checkpoint at 1002 tokens: the leftover goes, the schedule continues.
    torchrun(tmp_path, 2, "--resume-at", "1002")
    for name in ("sharded-float32", "sharded-bfloat16"):
        pma = tmp_path / name
        assert [r.tokens for r in manifest_snapshots(pma)] == [1002, 2002, 3002]
        assert sorted(p.name for p in pma.iterdir()) == ["manifest.json", "snapshot-1002", "snapshot-2002", "snapshot-3002"]
    assert_identical(merge_state_dict(snapshot_folders(tmp_path, "sharded-float32")), merge_state_dict(snapshot_folders(tmp_path, "gathered-float32")))
