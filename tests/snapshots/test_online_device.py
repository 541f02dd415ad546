"""Where the online average lives (``PMACallback(online_device=...)``), on this machine's CPU tensors.

``"cpu"`` stages the weights into reused host buffers and folds them in on the background
thread; ``"device"`` folds the live tensors in place, in the training thread. On CPU both are
the same memory, so they must give bit-identical averages, checkpoints and resumes, for the
unsharded and the shard-local sink. (The CUDA side: side stream, pinned buffers, an average in
device memory, is checked by tests/gpu/test_gpu_tier.py.)
"""

from __future__ import annotations

import pytest
import torch

from hf_pma import PMACallback
from hf_pma.core.manifest import SnapshotRecord
from hf_pma.merging.engine import merge_state_dict
from hf_pma.snapshots.sharded import ShardedOnlineAverageSink
from hf_pma.snapshots.sinks import OnlineAverageSink, ResumePoint
from tests.helpers.models import make_tiny_model

STEPS = 4
SAVED_AT = 2


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def make_sink(kind: str, folder, device: str, async_write: bool = True):
    options = {"online": "ema", "alpha": 0.3, "online_device": device, "async_write": async_write}
    if kind == "sharded":
        return ShardedOnlineAverageSink(folder, rank=0, world_size=1, **options)
    return OnlineAverageSink(folder, **options)


def average_of(sink) -> dict[str, torch.Tensor]:
    if isinstance(sink, ShardedOnlineAverageSink):
        return {s.name: tensor.clone() for s, tensor in sink.local_average()}
    return sink.state_dict()


def run(tmp_path, kind: str, device: str, async_write: bool = True, resume_from=None) -> tuple[dict, object]:
    """STEPS steps of a tiny model with a snapshot after each; the sink saves a checkpoint at SAVED_AT.
    With ``resume_from`` (a checkpoint folder) a fresh sink resumes there instead of starting at 0."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = SAVED_AT if resume_from is not None else 0
    for step in range(1, start + 1):  # the checkpoint's weights (the optimizer's path is deterministic)
        train_step(model, optimizer, step)
    name = f"{kind}-{device}-{async_write}" + ("-resumed" if resume_from else "")
    sink = make_sink(kind, tmp_path / name / "pma", device, async_write)
    sink.open(ResumePoint(start, start, resume_from) if resume_from is not None else None)
    sink.warm_up(model)
    pointers = []
    for step in range(start + 1, STEPS + 1):
        train_step(model, optimizer, step)
        sink.take(model, SnapshotRecord(path=f"snapshot-{step}", tokens=step, step=step))
        sink.commit()
        pointers.append(sorted(b.data_ptr() for b in sink.staging._buffers.values()))
        if step == SAVED_AT and resume_from is None:
            checkpoint = tmp_path / name / f"checkpoint-{step}"
            checkpoint.mkdir()
            sink.before_checkpoint()
            sink.save_checkpoint(checkpoint)
    result = {
        "average": average_of(sink),
        "count": sink.count,
        "folds_in_background": sink.worker.tasks_done,
        "pointers": pointers,
        "checkpoint": tmp_path / name / f"checkpoint-{SAVED_AT}",
    }
    sink.close(model)
    result["folder"] = sink.target
    return result, sink


@pytest.mark.parametrize("kind", ["unsharded", "sharded"])
def test_device_and_host_averages_are_bit_identical_and_resume_exactly(tmp_path, kind):
    host, host_sink = run(tmp_path, kind, "cpu")
    device, device_sink = run(tmp_path, kind, "device")
    assert host["count"] == device["count"] == STEPS
    assert host["average"].keys() == device["average"].keys()
    assert all(torch.equal(host["average"][k], device["average"][k]) for k in host["average"])
    # "cpu": every fold went through the background worker, into host buffers reused from the
    # second snapshot on; "device": folded in the training thread, nothing staged.
    assert host["folds_in_background"] == STEPS and device["folds_in_background"] == 0
    assert host["pointers"][0] and all(p == host["pointers"][0] for p in host["pointers"])
    assert device["pointers"] == [[]] * STEPS
    # The folders written at the end hold the same weights.
    a, b = merge_state_dict([host["folder"]]), merge_state_dict([device["folder"]])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A checkpoint saved by one resumes in the other, bit for bit.
    for saved, device_kind in ((host, "device"), (device, "cpu")):
        resumed, _ = run(tmp_path, kind, device_kind, resume_from=saved["checkpoint"])
        assert resumed["count"] == STEPS
        assert all(torch.equal(resumed["average"][k], host["average"][k]) for k in host["average"])


def test_without_async_write_the_host_fold_runs_in_the_training_thread(tmp_path):
    inline, _ = run(tmp_path, "sharded", "cpu", async_write=False)
    background, _ = run(tmp_path, "sharded", "cpu")
    assert all(torch.equal(inline["average"][k], background["average"][k]) for k in inline["average"])


def test_online_device_is_checked_when_the_callback_is_made():
    assert PMACallback(online="sma", online_device="device").state()["args"]["online_device"] == "device"
    with pytest.raises(ValueError, match="online_device must be one of") as err:
        PMACallback(online="sma", online_device="cuda")
    assert "\n" not in str(err.value)
