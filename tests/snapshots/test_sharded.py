"""Sharded snapshots in real multi-process FSDP2 runs (torchrun, gloo, CPU).

The script tests/dist/sharded_snapshots.py saves the same weights sharded (every rank its own
slices) and gathered (rank 0, the full-gather path). Merges of the sharded snapshots must be
bit-identical to merges of the gathered ones: SMA, WMA, EMA, in float32 and bfloat16, at world
sizes 2 and 4 and across a world-size change. A rank killed mid-write leaves a manifest that
lists only complete snapshots, and the resumed run goes on.
"""

from __future__ import annotations

import importlib.util
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


require_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed; runs on CPU with gloo)"
)


def torchrun(out: Path, nproc: int, *args: str, expect_ok: bool = True, script: str = "sharded_snapshots.py") -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*command, str(DIST_DIR / script), "--out", str(out), *args], capture_output=True, text=True, env=env, timeout=300)
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
        folder, reports = runs[world]
        assert [r["sinks"][f"sharded-{dtype}"] for r in reports] == ["ShardedSnapshotSink"] * world
        manifest = json.loads((folder / f"sharded-{dtype}" / "manifest.json").read_text())
        assert manifest["sharded"] and manifest["world_size"] == world and manifest["layout"] == "sharded"
        assert len(sharded) == len(gathered) == 3
        for snapshot in sharded:
            files = sorted(p.name for p in snapshot.glob("*.safetensors"))
            assert files == [rank_file_name(r) for r in range(world)]
            record = json.loads((snapshot / "pma.json").read_text())
            assert record["extra"]["sharded"] and record["extra"]["world_size"] == world and record["dtype"] == dtype
            assert record["num_bytes"] == sum((snapshot / f).stat().st_size for f in files)
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
    # Every rank wrote its part only (about a quarter, the 515-row embedding splits unevenly).
    sizes = [r["bytes_written"]["sharded-float32"] for r in reports]
    total = sum(f.stat().st_size for s in snapshot_folders(folder, "sharded-float32") for f in s.glob("*.safetensors"))
    assert sum(sizes) == total and max(sizes) < 0.3 * total


def test_torch_dcp_folder_and_fsdp1(runs):
    for folder, reports in runs.values():
        # A folder written by DCP's HuggingFaceStorageWriter(save_distributed=True), no manifest:
        # the same weights as the last sharded snapshot.
        last = snapshot_folders(folder, "sharded-float32")[-1]
        (folder / "dcp" / "config.json").write_text((last / "config.json").read_text())
        assert_identical(merge_state_dict([folder / "dcp"]), merge_state_dict([last]))
        assert reports[0]["fsdp1"] == {"equal": True}, reports[0]["fsdp1"]


def test_rank_killed_mid_write_then_resume(tmp_path):
    # Rank 1 dies half-way through its 3rd rank file (one of the two snapshots at 256 tokens).
    torchrun(tmp_path, 2, "--crash-at", "3", expect_ok=False)
    listed = {name: [r.tokens for r in manifest_snapshots(tmp_path / name)] for name in ("sharded-float32", "sharded-bfloat16")}
    assert all(tokens in ([128], [128, 256]) for tokens in listed.values()), listed
    assert [128] in listed.values(), listed  # the snapshot whose rank file was cut is not listed
    for name, tokens in listed.items():
        for t in tokens:  # what is listed is complete: every slice of every tensor is there
            merge_state_dict([tmp_path / name / f"snapshot-{t}"])
        if tokens == [128]:
            assert not (tmp_path / name / "snapshot-256").exists()
            assert any(p.name.startswith(".tmp-snapshot-256") for p in (tmp_path / name).iterdir())
    # Resumed from the checkpoint at step 2 (128 tokens): leftovers and later snapshots go, the
    # schedule continues, and the run ends as an uninterrupted one.
    torchrun(tmp_path, 2, "--resume-at", "2")
    for dtype in ("float32", "bfloat16"):
        for kind in ("sharded", "gathered"):
            pma = tmp_path / f"{kind}-{dtype}"
            assert [r.tokens for r in manifest_snapshots(pma)] == [128, 256, 384]
            assert sorted(p.name for p in pma.iterdir()) == ["manifest.json", "snapshot-128", "snapshot-256", "snapshot-384"]
        sharded, gathered = snapshot_folders(tmp_path, f"sharded-{dtype}"), snapshot_folders(tmp_path, f"gathered-{dtype}")
        assert_identical(merge_state_dict(sharded, strategy="ema"), merge_state_dict(gathered, strategy="ema"))


@require_deepspeed
def test_zero3_sharded_snapshot_equals_gathered(tmp_path):
    """DeepSpeed ZeRO-3 on CPU: each rank writes its ``ds_tensor`` partitions (flat ranges)."""
    rank0, _ = torchrun(tmp_path, 2, script="sharded_zero3.py")
    assert rank0["kind"] == "zero3" and rank0["sharded"] == "ShardedSnapshotSink"
    assert rank0["layout"] == "dcp-hf-safetensors+flat"
    assert rank0["same_names"] and rank0["equal"], rank0
