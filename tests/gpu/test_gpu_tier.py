"""The GPU tier: checks that need one CUDA GPU. Deselected by default (``-m "not gpu"`` in the
pytest configuration); run them with ``python -m pytest -m gpu`` on a machine with a GPU. They
fail (never skip) without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_pma.io.sharded import rank_file_name
from hf_pma.merging.engine import merge_state_dict
from hf_pma.snapshots.gather import LocalSlice
from hf_pma.snapshots.sharded import StagingBuffers, write_rank_file
from tests.helpers.launcher import launch
from tests.helpers.models import make_tiny_model
from tests.helpers.repo import REPO_ROOT

pytestmark = pytest.mark.gpu


def test_a_cuda_gpu_is_there():
    assert torch.cuda.is_available(), "the gpu tier needs a CUDA GPU (torch.cuda.is_available() is False)"


def test_staging_casts_on_the_device_into_reused_pinned_buffers(tmp_path):
    model = make_tiny_model(seed=2).cuda()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    slices = [LocalSlice(k, v, (0,) * v.dim(), tuple(v.shape), tuple(v.shape)) for k, v in state.items()]
    staging = StagingBuffers()
    first = staging.stage(slices, torch.bfloat16)
    assert first.event is not None and all(b.is_pinned() and b.dtype == torch.bfloat16 for b in first.buffers)
    folder = tmp_path / "snapshot-1"
    folder.mkdir()
    write_rank_file(folder / rank_file_name(0), first)
    (folder / "config.json").write_text(model.config.to_json_string())
    merged = merge_state_dict([folder])
    assert all(torch.equal(merged[k], v.to(torch.bfloat16).cpu()) for k, v in state.items())
    pointers = [b.data_ptr() for b in first.buffers]
    second = staging.stage(slices, torch.bfloat16)
    assert [b.data_ptr() for b in second.buffers] == pointers  # reused, no new pinned memory


def test_gpu_check_small_run(tmp_path):
    """benchmarks/gpu_check.py end to end on a small model: every part, one table, the files."""
    out = tmp_path / "results"
    argv = "--hidden 256 --heads 4 --layers 2 --intermediate 512 --vocab 4096 --seq 128 --batch 4"
    argv += " --intervals 8,4 --pairs 3 --min-ab-steps 0 --fsdp-interval 4 --fsdp-pairs 3 --time-limit 300"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check.py"), *argv.split(), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    results = json.loads((out / "results.json").read_text())
    for ab in results["train"]:
        costs = ab["costs"]
        assert ab["pairs"] == 3 and costs["snapshots"] == 4 and len(costs["write_ms"]) == costs["snapshots"]
        assert ab["staging"]["all_pinned"] and ab["staging"]["reused"] == ab["staging"]["possible"] > 0
        assert ab["step_ms"] > 0 and costs["blocked_steady_ms"] > 0
    fsdp = results["fsdp"]
    assert fsdp["ab"]["sink"] == "ShardedSnapshotSink" and fsdp["rank_files_ok"] and fsdp["merged_loads"], fsdp
    assert fsdp["ab"]["costs"]["snapshots"] == fsdp["snapshots"]
    evaluation = results["eval"]
    assert evaluation["eval_pma_loss"] > 0 and evaluation["eval_pma_loss"] != evaluation["eval_loss"]
    assert (out / "results.md").read_text().count("| ") > 5 and "overhead, a snapshot every 8 steps" in done.stdout


def test_pretrain_under_the_fsdp2_config_saves_whole_final_and_annealed_models(tmp_path):
    """``accelerate launch --config_file scripts/configs/fsdp2.yaml scripts/pretrain.py``: the
    config keeps checkpoints sharded (SHARDED_STATE_DICT), where ``Trainer.save_model`` writes no
    weights; the final and annealed models must still load, and the snapshots are per rank."""
    from transformers import AutoModelForCausalLM

    from hf_pma.core.manifest import manifest_snapshots
    from tests.helpers.pretrain_runs import SHORT

    out = tmp_path / "run"
    launch(
        REPO_ROOT / "scripts" / "pretrain.py",
        *SHORT,
        "--use_cpu", "false", "--make_tasks", "false", "--output_dir", out,
        nproc=1,
        launcher="accelerate",
        launcher_args=["--config_file", str(REPO_ROOT / "scripts" / "configs" / "fsdp2.yaml")],
        env={"ACCELERATE_USE_CPU": "false", "HF_HOME": str(tmp_path / "hf_home")},
        timeout=1200,
    )  # fmt: skip
    for name in ("final", "annealed"):
        model = AutoModelForCausalLM.from_pretrained(out / name)
        assert sum(p.numel() for p in model.parameters()) > 0
    records = manifest_snapshots(out / "pma")
    assert records and all(r.extra.get("sharded") for r in records)


def test_online_average_on_cuda_equals_the_offline_merge_with_the_average_on_host_or_device(tmp_path):
    """``online_device="cpu"``: pinned host buffers, reused, copied on a side stream and folded in the
    background; ``"device"``: a float32 average in CUDA memory. Both equal the offline merge of the
    same weights' snapshots (unsharded sink, and the shard-local sink on one rank)."""
    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink
    from hf_pma.snapshots.sinks import DiskSnapshotSink, OnlineAverageSink

    model = make_tiny_model(seed=4).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    disk = DiskSnapshotSink(tmp_path / "snapshots", async_write=False)
    disk.open(None)
    online = {
        (sink, device): cls(
            tmp_path / f"{sink}-{device}", online="ema", alpha=0.3, online_device=device, **extra
        )
        for sink, cls, extra in (
            ("unsharded", OnlineAverageSink, {}),
            ("sharded", ShardedOnlineAverageSink, {"rank": 0, "world_size": 1}),
        )
        for device in ("cpu", "device")
    }
    for sink in online.values():
        sink.open(None)
    pointers: dict = {key: [] for key in online}
    for step in range(1, 5):
        ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(step)).cuda()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record = SnapshotRecord(path=f"snapshot-{step}", tokens=step, step=step)
        disk.take(model, record)
        disk.commit()
        for key, sink in online.items():
            sink.take(model, SnapshotRecord(path=f"snapshot-{step}", tokens=step, step=step))
            sink.commit()  # the next optimizer step starts at once: the fold is in the background
            pointers[key].append([(b.data_ptr(), b.is_pinned()) for b in sink.staging._buffers.values()])
    disk.close(model)
    folders = [folder for _, folder in disk.snapshots()]
    offline = merge_state_dict(folders, strategy="ema", alpha=0.3)
    for (kind, device), sink in online.items():
        if device == "cpu":
            assert pointers[kind, device][0] and all(
                p == pointers[kind, device][0] for p in pointers[kind, device]
            )
            assert all(pinned for _, pinned in pointers[kind, device][0])
        else:
            assert pointers[kind, device] == [[]] * 4
            assert {t.device.type for t in sink.average._average.values()} == {"cuda"}
        if kind == "sharded":
            average = {s.name: t.cpu().reshape(s.global_shape) for s, t in sink.local_average()}
        else:
            average = sink.state_dict()
        assert average.keys() == offline.keys(), (kind, device)
        for name, tensor in offline.items():
            assert torch.allclose(average[name], tensor, rtol=1e-6, atol=1e-7), (kind, device, name)
        sink.close(model)
        written = merge_state_dict([sink.target])
        assert all(torch.allclose(written[k], offline[k], rtol=1e-6, atol=1e-7) for k in offline)
