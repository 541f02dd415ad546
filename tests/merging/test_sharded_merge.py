"""Sharded folders (one safetensors file per rank, DCP layout) as merge / consolidate sources.

Rank files are written here by the snapshot writer's own function from slices cut by hand in
every layout the reader must handle: FSDP rows (uneven, some ranks empty), boxes of a 2-D
mesh (tensor + data parallel), ZeRO-3 flat partitions with padding, and a folder written by
torch DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` itself. The real multi-process
runs are in tests/snapshots/test_sharded.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_pma.io.safetensors import CheckpointFormatError
from hf_pma.io.sharded import rank_file_name, sharded_weight_files
from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
from hf_pma.merging.sources import CheckpointTensors, resolve_sources
from hf_pma.snapshots.gather import zero3_partition
from hf_pma.snapshots.writer import write_model_folder
from tests.helpers.models import make_tiny_model
from tests.helpers.sharded_files import LAYOUTS, FakeZero3Param, write_sharded


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Three tiny models (odd vocabulary: uneven splits) saved as plain HF folders."""
    root = tmp_path_factory.mktemp("full")
    states, folders = [], []
    for seed in range(3):
        model = make_tiny_model(seed=seed, vocab_size=501)
        folder = root / f"m{seed}"
        model.save_pretrained(folder)
        states.append({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
        folders.append(folder)
    return {"states": states, "folders": folders}




@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reader_assembles_every_layout(tmp_path, models, layout):
    state = models["states"][0]
    folder = write_sharded(tmp_path / layout, state, LAYOUTS[layout])
    with CheckpointTensors(sharded_weight_files(folder), sharded=True) as tensors:
        assert {n: i.shape for n, i in tensors.infos.items()} == {n: tuple(t.shape) for n, t in state.items()}
        loaded = tensors.state_dict()
        assert all(torch.equal(loaded[n], state[n]) for n in state)
        # Arbitrary flat ranges, into a reused buffer, across slice boundaries.
        buffer = torch.empty(1 << 16, dtype=torch.uint8)
        generator = torch.Generator().manual_seed(0)
        for name, t in state.items():
            for _ in range(5):
                a, b = sorted(torch.randint(0, t.numel() + 1, (2,), generator=generator).tolist())
                got = tensors.read(name, a, b, buffer)
                assert torch.equal(got, t.reshape(-1)[a:b]), (name, a, b)
                assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_merges_of_sharded_folders_equal_merges_of_full_folders(tmp_path, models):
    """Bit-identical, whatever the world size of each snapshot, in fp32 and in bf16."""
    folders = []
    for i, (state, layout) in enumerate(zip(models["states"], ("rows-2", "boxes-3x5", "zero3-3"))):
        folders.append(write_sharded(tmp_path / f"s{i}", state, LAYOUTS[layout], config_from=models["folders"][i]))
    for strategy in ("sma", "wma", "ema"):
        full = merge_state_dict(models["folders"], strategy=strategy)
        sharded = merge_state_dict(folders, strategy=strategy)
        assert full.keys() == sharded.keys()
        assert all(torch.equal(full[k], sharded[k]) for k in full), strategy
    bf16 = [write_sharded(tmp_path / f"b{i}", s, LAYOUTS["rows-3"], torch.bfloat16, models["folders"][i]) for i, s in enumerate(models["states"])]
    full_bf16 = []
    for i, state in enumerate(models["states"]):
        folder = tmp_path / f"fb{i}"
        write_model_folder(folder, {k: v.to(torch.bfloat16) for k, v in state.items()})
        (folder / "config.json").write_text((models["folders"][i] / "config.json").read_text())
        full_bf16.append(folder)
    a, b = merge_state_dict(full_bf16, strategy="ema"), merge_state_dict(bf16, strategy="ema")
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, b[k]) for k, v in a.items())
    # merge_checkpoints writes a normal HF folder that from_pretrained loads.
    out = merge_checkpoints(folders, tmp_path / "merged", strategy="wma", progress=False, workers=2)  # readers shared by threads
    from transformers import LlamaForCausalLM

    merged = LlamaForCausalLM.from_pretrained(out).state_dict()
    expected = merge_state_dict(models["folders"], strategy="wma")
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def test_missing_or_inconsistent_rank_files_fail_on_open(tmp_path, models):
    state = models["states"][0]
    folder = write_sharded(tmp_path / "s", state, LAYOUTS["rows-3"], config_from=models["folders"][0])
    (folder / rank_file_name(1)).unlink()
    with pytest.raises(CheckpointFormatError, match="exactly once: a rank's file is missing"):
        merge_state_dict([folder])
    # A record that says 3 ranks wrote it names the gap before any header is read.
    (folder / "pma.json").write_text(json.dumps({"path": "s", "tokens": 1, "step": 1, "extra": {"world_size": 3}}))
    with pytest.raises(CheckpointFormatError, match="written by 3 ranks but holds 2 rank files"):
        resolve_sources([folder])
    # Overlapping slices (a stale file of another layout) are refused too.
    other = write_sharded(tmp_path / "o", state, LAYOUTS["rows-2"])
    (folder / "pma.json").unlink()
    (other / rank_file_name(0)).rename(folder / rank_file_name(1))
    with pytest.raises(CheckpointFormatError, match="exactly once"):
        merge_state_dict([folder])


def test_consolidate_command_writes_a_loadable_folder(tmp_path, models, capsys):
    from hf_pma.cli import main

    folder = write_sharded(tmp_path / "snapshot-64", models["states"][1], LAYOUTS["boxes-2x2"], config_from=models["folders"][1])
    out = tmp_path / "consolidated"
    assert main(["consolidate", str(folder), "-o", str(out), "--dtype", "bfloat16", "--max-shard-size", "20KB", "-q"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in models["states"][1].items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # A folder that is not sharded is refused with a one-line reason.
    assert main(["consolidate", str(models["folders"][0]), "-o", str(tmp_path / "x")]) == 2
    assert "is not a sharded snapshot" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_folder_written_by_torch_dcp_is_a_source(tmp_path, models):
    """A folder from ``dcp.save(..., HuggingFaceStorageWriter(save_distributed=True))``, no manifest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    folder = tmp_path / "dcp"
    dcp.save(dict(models["states"][2]), storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))
    assert [p.name for p in sharded_weight_files(folder)] == [rank_file_name(0)]
    (folder / "config.json").write_text((models["folders"][2] / "config.json").read_text())
    (source,) = resolve_sources([folder])
    assert source.sharded
    merged = merge_state_dict([folder])
    assert all(torch.equal(merged[k], v) for k, v in models["states"][2].items())


def test_zero3_partition_matches_deepspeed_padding():
    t = torch.arange(10.0)
    starts = []
    for rank in range(4):
        param = FakeZero3Param(t, 4, rank)
        start, length = zero3_partition(param, rank)
        starts.append((start, length))
        assert torch.equal(param.ds_tensor[:length], t[start : start + length])
    # partition = ceil(10 / 4) + 3 = 6: ranks 0 and 1 hold 6 and 4 elements, ranks 2 and 3 none.
    assert starts == [(0, 6), (6, 4), (10, 0), (10, 0)]
    assert sum(n for _, n in starts) == t.numel() and math.prod(t.shape) == 10


def test_eval_reads_a_sharded_snapshot_like_its_full_folder(tmp_path, tiny_tokenizer):
    from hf_pma.evaluation.evaluator import evaluate_models
    from tests.helpers.data import sample_text

    model = make_tiny_model(seed=4)
    full = tmp_path / "full"
    model.save_pretrained(full)
    tiny_tokenizer.save_pretrained(full)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sharded = write_sharded(tmp_path / "snapshot-8", state, LAYOUTS["rows-3"], config_from=full)
    tiny_tokenizer.save_pretrained(sharded)
    report = evaluate_models([full, sharded], texts=[sample_text(4000)], batch_size=2, block_size=32, progress=False)
    assert report["results"]["full"] == report["results"]["snapshot-8"]
    assert report["results"]["full"]
