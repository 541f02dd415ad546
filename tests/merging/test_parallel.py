"""The parallel merge engine: bit-identical output for any number of workers, errors, chunking."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hf_pma.cli import main
from hf_pma.io.safetensors import TensorInfo
from hf_pma.merging.chunks import TensorPlan, chunk_tasks, run_chunks
from hf_pma.merging.engine import MergeError, merge_checkpoints, merge_state_dict
from tests.helpers.models import make_tiny_model, save_model_folder


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


class _ArrayReader:
    """A reader that returns views of its own arrays (memory it does not lend to be written,
    as the ``.bin`` reader's memory-mapped tensors)."""

    def __init__(self, arrays: dict[str, np.ndarray], dtype: str) -> None:
        self.arrays = arrays
        self.infos = {n: TensorInfo(n, dtype, a.shape, 0, a.nbytes) for n, a in arrays.items()}

    def read(self, name, start=0, stop=None, buffer=None):
        raw = self.arrays[name].reshape(-1).view(np.uint8)
        item = self.arrays[name].itemsize
        return raw[start * item : None if stop is None else stop * item]


class _CopyingReader(_ArrayReader):
    """The same bytes, copied into the worker's buffer as the safetensors reader does."""

    def read(self, name, start=0, stop=None, buffer=None):
        raw = super().read(name, start, stop)
        out = buffer[: raw.size]
        out[...] = raw
        return out


@pytest.mark.parametrize(
    ("in_dtype", "acc"), [("F32", "F32"), ("BF16", "F32"), ("F32", "F64"), ("F16", "F32")]
)
def test_the_product_in_place_changes_no_bit_and_never_writes_a_readers_memory(in_dtype, acc):
    """Per source, ``w * x`` goes into the worker's own read buffer (or decode scratch) when it
    can: same bits as a plain numpy ``acc + w * x`` with a separate product, with or without the
    read thread, and a reader's own memory is never written."""
    rng = np.random.default_rng(0)
    numpy_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[in_dtype]
    sources = []
    for _ in range(5):
        values = (rng.standard_normal(3001) * 2.0 ** rng.integers(-12, 12, 3001)).astype(np.float32)
        if in_dtype == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        sources.append({"t": values.astype(numpy_dtype)})
    kept = [{n: a.copy() for n, a in s.items()} for s in sources]
    weights = [0.1, 0.15, 0.2, 0.25, 0.3]
    kind = np.float32 if acc == "F32" else np.float64
    reference = None
    for state, w in zip(sources, weights):
        x = state["t"]
        x = (x.astype(np.uint32) << 16).view(np.float32) if in_dtype == "BF16" else x.astype(np.float32)
        product = np.multiply(x, kind(w), dtype=kind)
        reference = product if reference is None else reference + product
    plan = TensorPlan("t", (3001,), in_dtype, acc)
    results = []
    for reader_type in (_ArrayReader, _CopyingReader):
        for prefetch in (False, True):
            out = np.zeros(3001, dtype=kind)

            def sink(start, chunk, out=out):
                out[start : start + chunk.size // out.itemsize] = chunk.view(kind)

            readers = [reader_type(s, in_dtype) for s in sources]
            tasks = chunk_tasks(plan, 0, 3001, 256, sink)
            run_chunks(
                tasks, ["a", "b", "c", "d", "e"], readers, weights, acc, 256 * out.itemsize, 2, prefetch
            )
            results.append(out)
            assert all(np.array_equal(s["t"], k["t"]) for s, k in zip(sources, kept))
    for out in results:
        assert out.tobytes() == reference.tobytes()
