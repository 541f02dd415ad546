"""The shard-local online average (``PMACallback(online=...)`` under FSDP2, gloo, CPU).

The scenario tests/dist/online_sharded.py runs in the shared 2-process launch ``world2``: every
gather raises there, so a finished launch is itself the proof that no rank gathered the model.
Here: the average equals the offline merge of the same weights' sharded snapshots (SMA, EMA,
the horizon-free EMA whose half-life is a share of the tokens seen, WSM's 1-sqrt decay emulation);
a run resumed from a checkpoint ends with a bit-identical average; a resume at another world
size reads the saved average by global offsets; the output folder is read by merge and consolidate.
A run killed by SIGKILL after a checkpoint and resumed in a new launch (tests/dist/online_killed.py)
ends with the uninterrupted run's averages, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_pma.core.manifest import MERGE_RECORD_NAME, manifest_snapshots
from hf_pma.core.strategies import (
    decay_emulation_weights,
    ema_half_life_updates,
    ema_weights,
    running_average_weights,
)
from hf_pma.merging.consolidate import consolidate_snapshot
from hf_pma.merging.engine import merge_state_dict
from hf_pma.snapshots.sharded import ShardedOnlineAverageSink
from hf_pma.snapshots.sinks import STAGED_STATE_DIR, OnlineAverageSink, ResumePoint, online_state_name
from tests.dist.online_sharded import ALPHA, CHECKPOINT_STEP, FRACTION, KINDS, STEPS, eval_batch, online_kind
from tests.helpers.launcher import Launch, launch, rank_reports, shared_launch_job

pytestmark = [pytest.mark.distributed, pytest.mark.shared_launch("world2")]


@shared_launch_job("online-kill-resume")
def kill_then_resume(folder: Path) -> Launch:
    """World size 2: the online run of tests/dist/online_killed.py, rank 1 killed by SIGKILL after the
    Trainer's checkpoint, before the online averages' ``on_save``, then resumed from that checkpoint
    in a new launch; what the kill left is recorded in ``killed.json``."""
    from tests.dist.online_killed import checkpoint_dir

    killed = launch("online_killed.py", "--out", folder, "--phase", "kill", check=False)
    left = {
        "returncode": killed.returncode,
        "checkpoint": sorted(p.name for p in checkpoint_dir(folder).iterdir())
        if checkpoint_dir(folder).is_dir()
        else [],
        "online_checkpoints": {
            kind: sorted(
                p.name for p in (folder / f"run-{kind}" / f"checkpoint-{CHECKPOINT_STEP}").glob("pma_online*")
            )
            for kind in KINDS
        },
        "staged": {
            kind: sorted(p.name for p in (folder / f"killed-{kind}" / "pma" / STAGED_STATE_DIR).glob("step-*"))
            for kind in KINDS
        },
        "final_folders": sorted(str(p.relative_to(folder)) for p in folder.glob("killed-*/pma/online-*")),
    }
    (folder / "killed.json").write_text(json.dumps(left))
    killed.discard_logs()
    if killed.returncode == 0:
        return killed  # the fixture reports that the run did not die
    return launch("online_killed.py", "--out", folder, "--phase", "resume", check=False)


@pytest.fixture(scope="module")
def run(shared_launch) -> Path:
    return shared_launch("world2", "online")


def online_folder(run: Path, which: str, kind: str) -> Path:
    return run / f"{which}-{kind}" / "pma" / f"online-{online_kind(kind)}"


def test_each_rank_averages_its_own_slices(run):
    reports = rank_reports(run, 2)
    for report in reports:
        assert report["sinks"] == {
            "sharded": "ShardedSnapshotSink",
            "sma": "ShardedOnlineAverageSink",
            "ema": "ShardedOnlineAverageSink",
            "ema-fraction": "ShardedOnlineAverageSink",
            "1-sqrt-decay": "ShardedOnlineAverageSink",
        }
        assert report["online_state_dict"]  # no process holds the full average
    assert reports[0]["saved_on_request"] == str(online_folder(run, "straight", "sma"))
    assert reports[1]["saved_on_request"] is None
    # One float32 copy of each rank's slices: together, about one float32 model (rank 0 also
    # holds the unsharded tensors), never one model per rank.
    full = sum(t.numel() for t in merge_state_dict([online_folder(run, "straight", "sma")]).values()) * 4
    per_rank = [r["average_bytes"] for r in reports]
    assert sum(per_rank) == full and max(per_rank) < 0.75 * full


@pytest.mark.parametrize("kind", KINDS)
def test_online_average_equals_the_offline_merge_of_the_same_weights(run, kind):
    records = manifest_snapshots(run / "sharded")
    snapshots = [run / "sharded" / r.path for r in records]
    assert len(snapshots) == STEPS
    # The horizon-free EMA's weights, offline from the snapshots' token counts alone.
    by_fraction = running_average_weights(ema_half_life_updates([r.tokens for r in records], half_life_fraction=FRACTION))
    if kind == "ema-fraction":
        offline = merge_state_dict(snapshots, weights=by_fraction)
    else:
        offline = merge_state_dict(snapshots, strategy=kind, alpha=ALPHA)
    folder = online_folder(run, "straight", kind)
    online = merge_state_dict([folder])
    assert online.keys() == offline.keys()
    for name, tensor in offline.items():
        assert torch.allclose(online[name], tensor, rtol=1e-6, atol=1e-7), name
    record = json.loads((folder / MERGE_RECORD_NAME).read_text())
    weights = {
        "sma": [1 / STEPS] * STEPS,
        "ema": ema_weights(STEPS, ALPHA),
        "ema-fraction": by_fraction,
        "1-sqrt-decay": decay_emulation_weights(STEPS, "1-sqrt"),
    }[kind]
    assert record["weights"] == pytest.approx(weights)
    assert [s["step"] for s in record["sources"]] == list(range(1, STEPS + 1))
    assert record["sharded"] and record["world_size"] == 2 and record["online"]
    assert record["half_life_fraction"] == (FRACTION if kind == "ema-fraction" else None)


@pytest.mark.parametrize("kind", KINDS)
def test_resumed_average_is_bit_identical_to_the_uninterrupted_one(run, kind):
    assert {r["resumed_counts"][kind] for r in rank_reports(run, 2)} == {STEPS}
    checkpoint = run / f"run-{kind}" / f"checkpoint-{CHECKPOINT_STEP}"
    assert sorted(p.name for p in checkpoint.iterdir()) == [online_state_name(0), online_state_name(1)]
    straight = merge_state_dict([online_folder(run, "straight", kind)])
    resumed = merge_state_dict([online_folder(run, "resumed", kind)])
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    a, b = (
        json.loads((online_folder(run, w, kind) / MERGE_RECORD_NAME).read_text())
        for w in ("straight", "resumed")
    )
    assert a["weights"] == b["weights"] and [s["tokens"] for s in a["sources"]] == [
        s["tokens"] for s in b["sources"]
    ]


@pytest.mark.shared_launch("online-kill-resume")
def test_a_run_killed_by_sigkill_and_resumed_ends_with_the_uninterrupted_average(run, shared_launch):
    folder = shared_launch("online-kill-resume")
    left = json.loads((folder / "killed.json").read_text())
    assert left["returncode"] != 0, "rank 1 should have died"
    assert {"dcp", "trainer_state.json"} <= set(left["checkpoint"]) and left["final_folders"] == []
    staged = f"step-{CHECKPOINT_STEP}-"
    for kind in KINDS:  # rank 1's part only staged; rank 0's moved in, or not yet when the launch stopped it
        assert f"{staged}{online_state_name(1)}" in left["staged"][kind], kind
        assert online_state_name(1) not in left["online_checkpoints"][kind], kind
        names = {*left["online_checkpoints"][kind], *(n.removeprefix(staged) for n in left["staged"][kind])}
        assert names == {online_state_name(0), online_state_name(1)}, kind
    for kind in KINDS:  # the ema average was kept on the "device" (the CPU here), the others on the host
        straight = merge_state_dict([online_folder(run, "straight", kind)])
        resumed = merge_state_dict([online_folder(folder, "killed", kind)])
        assert straight.keys() == resumed.keys(), kind
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), kind
        a, b = (
            json.loads((f / MERGE_RECORD_NAME).read_text())
            for f in (online_folder(run, "straight", kind), online_folder(folder, "killed", kind))
        )
        assert a["weights"] == b["weights"] and [s["step"] for s in b["sources"]] == list(range(1, STEPS + 1))


def test_resume_at_another_world_size_reads_the_average_by_global_offsets(run, tmp_path):
    from tests.helpers.models import make_tiny_model

    checkpoint = run / "run-sma" / f"checkpoint-{CHECKPOINT_STEP}"
    resume = ResumePoint(CHECKPOINT_STEP * 64, CHECKPOINT_STEP, checkpoint)
    # What the 2 ranks' files hold together: the SMA of the first snapshots.
    snapshots = [run / "sharded" / r.path for r in manifest_snapshots(run / "sharded")][:CHECKPOINT_STEP]
    expected = merge_state_dict(snapshots)

    def assert_equal(average: dict) -> None:
        assert average.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.allclose(average[name].reshape(tensor.shape), tensor, rtol=1e-6, atol=1e-7), name

    # One process, sharded=True (what a resume on fewer ranks does): its slices read from both files.
    sink = ShardedOnlineAverageSink(tmp_path / "a", online="sma", rank=0, world_size=1)
    sink.open(resume)
    sink.warm_up(make_tiny_model(seed=0, vocab_size=515))
    assert sink.count == CHECKPOINT_STEP
    assert_equal({s.name: tensor for s, tensor in sink.local_average()})
    # One process without sharding: the full average assembled the same way.
    plain = OnlineAverageSink(tmp_path / "b", online="sma")
    plain.open(resume)
    assert plain.count == CHECKPOINT_STEP
    assert_equal(plain.state_dict())
    # Other online options: one line.
    with pytest.raises(ValueError, match="resume with the same online options") as err:
        ShardedOnlineAverageSink(tmp_path / "c", online="ema", rank=0, world_size=1).open(resume)
    assert "\n" not in str(err.value)


def test_online_folder_is_read_by_consolidate(run, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = online_folder(run, "straight", "sma")
    consolidate_snapshot(folder, tmp_path / "full")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", trust_remote_code=False)
    merged = merge_state_dict([folder])
    live = model.state_dict()
    assert all(torch.equal(live[name], tensor) for name, tensor in merged.items())


def test_merged_eval_swaps_the_average_into_the_live_shards_and_back(run, tmp_path):
    from transformers import AutoModelForCausalLM

    rank0 = rank_reports(run, 2)[0]
    consolidate_snapshot(online_folder(run, "straight", "sma"), tmp_path / "full", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", trust_remote_code=False)
    ids = eval_batch()
    with torch.no_grad():
        expected = float(model(input_ids=ids, labels=ids).loss)
    assert rank0["swapped_loss"] == pytest.approx(expected, rel=1e-5)
    assert rank0["swapped_loss"] != rank0["live_loss"]
    assert rank0["restored_loss"] == rank0["live_loss"]
    # FSDP1's sharded state dict holds copies of the flat parameter: refused on every rank, in one line.
    for report in rank_reports(run, 2):
        assert "this rank's slice is a copy, not the live shard" in report["fsdp1_swap"]
        assert "\n" not in report["fsdp1_swap"]


def test_a_rank_file_under_another_ranks_name_is_refused(run, tmp_path):
    import shutil

    checkpoint = tmp_path / f"checkpoint-{CHECKPOINT_STEP}"
    checkpoint.mkdir()
    source = run / "run-sma" / f"checkpoint-{CHECKPOINT_STEP}" / online_state_name(1)
    shutil.copyfile(source, checkpoint / online_state_name(0))
    sink = ShardedOnlineAverageSink(tmp_path / "pma", online="sma", rank=0, world_size=2)
    with pytest.raises(ValueError, match="holds rank '1'.s part of the online average, not rank 0's"):
        sink.open(ResumePoint(CHECKPOINT_STEP * 64, CHECKPOINT_STEP, checkpoint))


def test_unsharded_average_is_broadcast_for_merged_eval(run):
    """DDP-like ranks: the main process's average, swapped in everywhere, then put back."""
    losses = rank_reports(run, 2, "ddp-rank{rank}.json")
    assert losses[0] == losses[1]  # every rank evaluates the same (broadcast) average
    assert losses[0]["swapped"] != losses[0]["live"] and losses[0]["restored"] == losses[0]["live"]


def test_rank_files_of_different_averages_are_not_read_into_one(run, tmp_path):
    """Rank 0's file of the SMA beside rank 1's of the EMA (same step): a resume on another world
    size, or without sharding, would read both by global offsets into one mixed average."""
    import shutil

    from tests.helpers.models import make_tiny_model

    checkpoint = tmp_path / f"checkpoint-{CHECKPOINT_STEP}"
    checkpoint.mkdir()
    for rank, kind in ((0, "sma"), (1, "ema")):
        source = run / f"run-{kind}" / f"checkpoint-{CHECKPOINT_STEP}" / online_state_name(rank)
        shutil.copyfile(source, checkpoint / online_state_name(rank))
    resume = ResumePoint(CHECKPOINT_STEP * 64, CHECKPOINT_STEP, checkpoint)
    message = (
        rf"^hf-pma: .*{online_state_name(1)} holds another online average than {online_state_name(0)} \(kind"
    )
    for sink in (
        ShardedOnlineAverageSink(tmp_path / "a", online="sma", rank=0, world_size=1),
        OnlineAverageSink(tmp_path / "b", online="sma"),
    ):
        with pytest.raises(ValueError, match=message) as err:
            sink.open(resume)
            sink.warm_up(make_tiny_model(seed=0, vocab_size=515))
        assert "\n" not in str(err.value)


def test_a_rank_file_with_other_bookkeeping_at_the_same_count_is_refused(run, tmp_path):
    """Same world size: each rank reads its own file, and the ranks compare only their counts,
    which a windowed average repeats from window to window. Rank 1's file with the same count but
    other update weights than rank 0's is refused in one line naming it."""
    import json
    import shutil

    from hf_pma.snapshots.online import OnlineAverage
    from hf_pma.snapshots.writer import write_safetensors

    checkpoint = tmp_path / f"checkpoint-{CHECKPOINT_STEP}"
    shutil.copytree(run / "run-sma" / f"checkpoint-{CHECKPOINT_STEP}", checkpoint)
    resume = ResumePoint(CHECKPOINT_STEP * 64, CHECKPOINT_STEP, checkpoint)
    ShardedOnlineAverageSink(tmp_path / "a", online="sma", rank=1, world_size=2).open(
        resume
    )  # as saved: restored
    path = checkpoint / online_state_name(1)
    saved = OnlineAverage.load_state(path)
    metadata = dict(saved.metadata)
    state = json.loads(metadata["online_state"])
    metadata["online_state"] = json.dumps({**state, "update_weights": [1.0, 0.5, 0.25]})
    path.unlink()
    write_safetensors(str(path), saved._average, metadata=metadata)
    sink = ShardedOnlineAverageSink(tmp_path / "b", online="sma", rank=1, world_size=2)
    message = (
        rf"{online_state_name(1)} holds another online average than {online_state_name(0)} \(online_state"
    )
    with pytest.raises(ValueError, match=message) as err:
        sink.open(resume)
    assert "\n" not in str(err.value)
