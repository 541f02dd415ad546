"""The parallel merge engine: bit-identical output for any number of workers, errors, chunking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_pma.cli import main
from hf_pma.merging.chunks import TensorPlan, chunk_tasks
from hf_pma.merging.engine import MergeError, merge_checkpoints, merge_state_dict
from tests.testing_utils import make_tiny_model, save_model_folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Five tiny Llama checkpoints in bf16 (the rounding of the output is where a race would show)."""
    root = tmp_path_factory.mktemp("parallel")
    return [
        save_model_folder(
            root / f"s{i}",
            make_tiny_model(seed=i, dtype=torch.bfloat16),
            max_shard_size="30KB",
            extra={"tokens": i + 1},
        )
        for i in range(5)
    ]


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors*"))}


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_output_is_bit_identical_for_any_number_of_workers(sources, tmp_path, dtype):
    # 1 KiB chunks: hundreds of chunks, so the workers really interleave.
    one = merge_checkpoints(
        sources,
        tmp_path / "one",
        strategy="ema",
        dtype=dtype,
        workers=1,
        chunk_bytes=1024,
        max_shard_size="20KB",
        progress=False,
    )
    reference = _file_bytes(one)
    assert len(reference) > 3  # several shards and their index
    for workers in (2, 5):
        many = merge_checkpoints(
            sources,
            tmp_path / f"w{workers}",
            strategy="ema",
            dtype=dtype,
            workers=workers,
            chunk_bytes=1024,
            max_shard_size="20KB",
            progress=False,
        )
        assert _file_bytes(many) == reference
    in_memory = merge_state_dict(sources, strategy="ema", dtype=dtype, workers=4)
    serial = merge_state_dict(sources, strategy="ema", dtype=dtype, workers=1)
    assert all(torch.equal(in_memory[k], serial[k]) for k in serial)


def test_cli_workers_flag_gives_the_same_bytes(sources, tmp_path):
    assert main(["merge", *map(str, sources), "-o", str(tmp_path / "a"), "--workers", "3", "-q"]) == 0
    assert main(["merge", *map(str, sources), "-o", str(tmp_path / "b"), "--workers", "1", "-q"]) == 0
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")
    with pytest.raises(SystemExit):
        main(["merge", *map(str, sources), "-o", str(tmp_path / "c"), "--workers", "0"])


def test_an_error_in_one_worker_stops_all_and_leaves_nothing(tmp_path):
    good = {"a": torch.ones(5000), "b": torch.ones(5000), "c": torch.ones(5000)}
    bad = dict(good, b=torch.ones(5000).index_fill_(0, torch.tensor([4321]), float("nan")))
    folders = []
    for i, state in enumerate([good, bad, good]):
        folder = tmp_path / f"s{i}"
        folder.mkdir()
        save_file(state, folder / "model.safetensors")
        (folder / "config.json").write_text("{}")
        folders.append(folder)
    with pytest.raises(MergeError, match=r"tensor 'b' in .*s1 holds non-finite values"):
        merge_checkpoints(folders, tmp_path / "out", workers=3, chunk_bytes=512, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0", "s1", "s2"]


def test_chunks_are_cut_at_the_same_places_whatever_the_range():
    plan = TensorPlan("t", (10, 7), "F32", "F32")
    whole = [(t.start, t.stop) for t in chunk_tasks(plan, 0, 70, 16, print)]
    assert whole == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]
    part = [(t.start, t.stop) for t in chunk_tasks(plan, 20, 50, 16, print)]
    assert part == [(20, 32), (32, 48), (48, 50)]
