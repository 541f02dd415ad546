"""Sharded snapshots in real multi-process FSDP2 runs (torchrun, gloo, CPU).

The script tests/dist/sharded_snapshots.py saves the same weights sharded (every rank its own
slices) and gathered (rank 0, the full-gather path). Merges of the sharded snapshots must be
bit-identical to merges of the gathered ones: SMA, WMA, EMA, in float32 and bfloat16, at world
sizes 2 and 4 and across a world-size change. A rank killed mid-write leaves a manifest that
lists only complete snapshots, and the resumed run goes on (the 2-rank run is that resumed run:
three launches in all, run in the background from the start of the session: tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_pma.core.manifest import SnapshotRecord, manifest_snapshots
from hf_pma.io.sharded import rank_file_name
from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
from hf_pma.snapshots import sharded as sharded_module
from hf_pma.snapshots.gather import LocalSlice
from tests.helpers.launcher import Launch, launch, rank_reports, shared_launch_job
from tests.helpers.markers import require_deepspeed
from tests.helpers.models import make_tiny_model

pytestmark = pytest.mark.distributed


@shared_launch_job("sharded-crash-resume")
def crash_then_resume(folder: Path) -> Launch:
    """World size 2: a run whose rank 1 is killed half-way through its 3rd rank file (one of the
    two snapshots at 256 tokens), then resumed from the checkpoint at step 2 (128 tokens); what
    the crash left is recorded in ``crashed.json`` for the fault test."""
    crash = launch("sharded_snapshots.py", "--out", folder, "--crash-at", "3", check=False)
    crashed = {}
    for name in ("sharded-float32", "sharded-bfloat16") if crash.returncode != 0 else ():
        pma = folder / name
        listed = [r.tokens for r in manifest_snapshots(pma)]
        complete = []
        for tokens in listed:  # what is listed is complete: every slice of every tensor is there
            merge_state_dict([pma / f"snapshot-{tokens}"])
            complete.append(tokens)
        crashed[name] = {
            "listed": listed,
            "complete": complete,
            "entries": sorted(p.name for p in pma.iterdir()),
        }
    (folder / "crashed.json").write_text(json.dumps({"returncode": crash.returncode, "runs": crashed}))
    if crash.returncode == 0:
        return crash  # the fixture reports that the run did not die
    return launch("sharded_snapshots.py", "--out", folder, "--resume-at", "2", check=False)


@pytest.fixture(scope="module")
def runs(shared_launch) -> dict:
    """World size 4: one uninterrupted run (the shared 4-process launch). World size 2: the run
    killed, then resumed (:func:`crash_then_resume`)."""
    folder = shared_launch("world4", "sharded")
    out = {4: (folder, rank_reports(folder, 4))}
    folder = shared_launch("sharded-crash-resume")
    crashed = json.loads((folder / "crashed.json").read_text())
    assert crashed["returncode"] != 0, "the run should have died"
    out["crashed"] = crashed["runs"]
    out[2] = (folder, rank_reports(folder, 2))
    return out


def snapshot_folders(run: Path, kind: str) -> list[Path]:
    pma = run / kind
    return [pma / r.path for r in manifest_snapshots(pma)]


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.shared_launch("world4", "sharded-crash-resume")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_merges_are_bit_identical_to_gathered_merges(runs, dtype):
    per_world = {
        w: (
            snapshot_folders(runs[w][0], f"sharded-{dtype}"),
            snapshot_folders(runs[w][0], f"gathered-{dtype}"),
        )
        for w in (2, 4)
    }
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
            assert (
                record["extra"]["sharded"]
                and record["extra"]["world_size"] == world
                and record["dtype"] == dtype
            )
            assert record["num_bytes"] == sum((snapshot / f).stat().st_size for f in files)
        for strategy in ("sma", "wma", "ema"):
            assert_identical(
                merge_state_dict(sharded, strategy=strategy), merge_state_dict(gathered, strategy=strategy)
            )
    # A run resumed on more ranks: 2-rank and 4-rank snapshots merge together.
    mixed_sharded = per_world[2][0] + per_world[4][0]
    mixed_gathered = per_world[2][1] + per_world[4][1]
    for strategy in ("sma", "ema"):
        assert_identical(
            merge_state_dict(mixed_sharded, strategy=strategy),
            merge_state_dict(mixed_gathered, strategy=strategy),
        )


@pytest.mark.shared_launch("world4", "sharded-crash-resume")
def test_sharded_run_folder_merges_and_loads(runs, tmp_path):
    folder, reports = runs[4]
    # The run folder resolves through its manifest; the merge is a folder from_pretrained loads.
    out = merge_checkpoints(
        [folder / "sharded-bfloat16"], tmp_path / "merged", strategy="sma", progress=False
    )
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    expected = merge_state_dict(snapshot_folders(folder, "gathered-bfloat16"))
    assert_identical({k: v for k, v in model.state_dict().items() if k in expected}, expected)
    # Every rank wrote its part only (about a quarter, the 515-row embedding splits unevenly).
    sizes = [r["bytes_written"]["sharded-float32"] for r in reports]
    total = sum(
        f.stat().st_size for s in snapshot_folders(folder, "sharded-float32") for f in s.glob("*.safetensors")
    )
    assert sum(sizes) == total and max(sizes) < 0.3 * total


@pytest.mark.shared_launch("world4", "sharded-crash-resume")
def test_torch_dcp_folder_and_fsdp1(runs):
    for folder, reports in (runs[2], runs[4]):
        # A folder written by DCP's HuggingFaceStorageWriter(save_distributed=True), no manifest:
        # the same weights as the last sharded snapshot.
        last = snapshot_folders(folder, "sharded-float32")[-1]
        (folder / "dcp" / "config.json").write_text((last / "config.json").read_text())
        assert_identical(merge_state_dict([folder / "dcp"]), merge_state_dict([last]))
        assert reports[0]["fsdp1"] == {"equal": True}, reports[0]["fsdp1"]


@pytest.mark.shared_launch("world4", "sharded-crash-resume")
def test_rank_killed_mid_write_then_resume(runs):
    crashed = runs["crashed"]
    listed = {name: c["listed"] for name, c in crashed.items()}
    assert all(tokens in ([128], [128, 256]) for tokens in listed.values()), listed
    assert [128] in listed.values(), listed  # the snapshot whose rank file was cut is not listed
    for c in crashed.values():
        assert c["complete"] == c["listed"]
        if c["listed"] == [128]:
            assert "snapshot-256" not in c["entries"], c
    # The folder rank 1 was writing into is left under its temporary name (removed on resume).
    assert any(".tmp-snapshot-256" in c["entries"] for c in crashed.values()), crashed
    # Resumed from the checkpoint at step 2 (128 tokens): leftovers and later snapshots went, the
    # schedule went on, and the run ends as an uninterrupted one (its merges are checked above).
    folder, _ = runs[2]
    for dtype in ("float32", "bfloat16"):
        for kind in ("sharded", "gathered"):
            pma = folder / f"{kind}-{dtype}"
            assert [r.tokens for r in manifest_snapshots(pma)] == [128, 256, 384]
            assert sorted(p.name for p in pma.iterdir()) == [
                "manifest.json",
                "snapshot-128",
                "snapshot-256",
                "snapshot-384",
            ]


@require_deepspeed
@pytest.mark.shared_launch("zero3")
def test_zero3_sharded_snapshot_equals_gathered(shared_launch):
    """DeepSpeed ZeRO-3 on CPU: each rank writes its ``ds_tensor`` partitions (flat ranges)."""
    rank0, _ = rank_reports(shared_launch("zero3"), 2)
    assert rank0["kind"] == "zero3" and rank0["sharded"] == "ShardedSnapshotSink"
    assert rank0["layout"] == "dcp-hf-safetensors+flat"
    assert rank0["same_names"] and rank0["equal"], rank0
    # The shard-local online average of two snapshots (no gather) equals their merge.
    online = rank0["online"]
    assert online["sink"] == "ShardedOnlineAverageSink" and online["same_names"], online
    assert online["max_diff"] < 1e-6, online
    losses = online["losses"]  # swapped into the live partitions for a merged evaluation, and back
    assert losses["swapped"] != losses["live"] and losses["restored"] == losses["live"], losses
    assert losses["swapped"] == pytest.approx(losses["reference"], rel=1e-5), losses  # the average's own loss


def test_trainer_with_forced_sharded_snapshots_and_keep_last(tmp_path):
    """One process, a real Trainer, ``sharded=True``: rank 0 holds every slice; ``keep_last``
    deletes whole sharded snapshots; the run folder merges into a loadable model."""
    from transformers import LlamaForCausalLM, Trainer

    from hf_pma.snapshots.callback import PMACallback
    from tests.helpers.data import TokenDataset, pad_collate
    from tests.helpers.models import make_tiny_model
    from tests.helpers.training import make_args

    callback = PMACallback(interval_tokens=2 * 64, keep_last=2, sharded=True, save_dtype="bfloat16")
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(tmp_path, max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3),
        train_dataset=TokenDataset(n=64, min_len=16, max_len=16),
        data_collator=pad_collate,
        callbacks=[callback],
    )
    trainer.train()
    pma = tmp_path / "pma"
    records = manifest_snapshots(pma)
    assert [r.tokens for r in records] == [384, 512] and all(r.extra["sharded"] for r in records)
    assert sorted(p.name for p in pma.iterdir()) == ["manifest.json", "snapshot-384", "snapshot-512"]
    assert [p.name for p in (pma / "snapshot-512").glob("*.safetensors")] == [rank_file_name(0)]
    out = merge_checkpoints([pma], tmp_path / "merged", progress=False)
    model = LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    last = merge_state_dict([pma / "snapshot-512"])
    live = {k: v.to(torch.bfloat16) for k, v in trainer.model.state_dict().items()}
    assert_identical(last, {k: live[k] for k in last})


def test_rank_0_may_complete_the_snapshot_the_moment_the_last_rank_file_has_its_name(tmp_path, monkeypatch):
    """A rank's file is done once it has its final name: rank 0 then renames the folder at once.
    A rank slowed down right after its rename (a loaded machine) must not touch the old path
    again; it did (``stat``), died with ``FileNotFoundError`` and took the launch down."""
    model = make_tiny_model(seed=1, vocab_size=515)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    pma = tmp_path / "pma"
    record = SnapshotRecord(path="snapshot-64", tokens=64, step=1)
    folder = sharded_module.sharded_tmp_dir(pma, record.path)
    folder.mkdir(parents=True)

    def staged(rank: int):
        slices, buffers = [], sharded_module.StagingBuffers()
        for name, t in state.items():
            part = torch.chunk(t, 2, dim=0)[rank] if rank < len(torch.chunk(t, 2, dim=0)) else t[:0]
            start = sum(p.shape[0] for p in torch.chunk(t, 2, dim=0)[:rank])
            offsets = (start,) + (0,) * (t.dim() - 1)
            slices.append(LocalSlice(name, part, offsets, tuple(part.shape), tuple(t.shape)))
        return buffers.stage(slices)

    sizes = [sharded_module.write_rank_file(folder / rank_file_name(0), staged(0))]
    completed: list = []
    real_fsync_dir = sharded_module.fsync_dir

    def rank_0_completes_first(path):  # runs right after rank 1's rename, before rank 1 goes on
        if path == folder and not completed:
            completed.append(sharded_module.finish_sharded_snapshot(pma, record, world_size=2, timeout_s=0))
        real_fsync_dir(path)

    monkeypatch.setattr(sharded_module, "fsync_dir", rank_0_completes_first)
    sizes.append(sharded_module.write_rank_file(folder / rank_file_name(1), staged(1)))
    assert completed and not folder.exists()
    final = pma / record.path
    assert sizes == [(final / rank_file_name(r)).stat().st_size for r in (0, 1)]
    assert completed[0][0].num_bytes == sum(sizes)
    (final / "config.json").write_text(model.config.to_json_string())
    assert_identical(merge_state_dict([final]), state)
