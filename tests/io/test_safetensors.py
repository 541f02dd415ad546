"""The torch-free safetensors reader and writer: byte ranges, and headers refused in one line.

As the ``safetensors`` library does ("invalid offset"), a header whose tensors' byte ranges
overlap, leave a gap, or run past the end of the file is refused, naming the file and the
tensors; random mutations of a valid header never raise anything but that one-line error.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from hf_pma.io.safetensors import (
    CheckpointFormatError,
    SafetensorsCheckpoint,
    SafetensorsReader,
    SafetensorsWriter,
)

TENSORS = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.arange(4, dtype=np.int64),
    "c": np.ones(3, dtype=np.float16),
}


def _file(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _valid_header() -> tuple[dict, bytes]:
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, array in TENSORS.items():
        raw = array.tobytes()
        dtype = {"float32": "F32", "int64": "I64", "float16": "F16"}[str(array.dtype)]
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return header, data


def test_reads_byte_ranges_into_a_reused_buffer(tmp_path):
    save_file(TENSORS, tmp_path / "m.safetensors")
    with SafetensorsReader(tmp_path / "m.safetensors") as reader:
        assert {n: (i.dtype, i.shape) for n, i in reader.infos.items()} == {
            "a": ("F32", (2, 3)),
            "b": ("I64", (4,)),
            "c": ("F16", (3,)),
        }
        buffer = np.empty(64, dtype=np.uint8)
        got = reader.read("a", 1, 5, buffer)
        assert got.base is buffer or np.shares_memory(got, buffer)
        assert np.array_equal(got.view(np.float32), TENSORS["a"].reshape(-1)[1:5])
        assert np.array_equal(reader.read("b").view(np.int64), TENSORS["b"])


def test_written_file_is_what_safetensors_reads(tmp_path):
    path = tmp_path / "w.safetensors"
    writer = SafetensorsWriter(path, [("x", "F32", (2, 2)), ("y", "U8", (3,))], {"format": "pt"})
    writer.write_at("y", 0, np.array([7, 8, 9], dtype=np.uint8))
    writer.write_at("x", 2, np.array([3, 4], dtype=np.float32))
    writer.write_at("x", 0, np.array([1, 2], dtype=np.float32))
    writer.close()
    loaded = load_file(path)
    assert np.array_equal(loaded["x"], [[1, 2], [3, 4]]) and np.array_equal(loaded["y"], [7, 8, 9])
    with SafetensorsCheckpoint([path]) as checkpoint:
        assert checkpoint.read("y").tolist() == [7, 8, 9]
    unfinished = SafetensorsWriter(tmp_path / "u.safetensors", [("x", "F32", (2,))])
    unfinished.write("x", np.zeros(1, dtype=np.float32))
    with pytest.raises(RuntimeError, match="closed before every tensor was written"):
        unfinished.close()


@pytest.mark.parametrize("fadvise", ["works", "fails", "missing"])
def test_write_at_starts_the_writeback_of_each_range_and_never_needs_it(tmp_path, monkeypatch, fadvise):
    """Each range written by write_at has its writeback started at once (posix_fadvise
    DONTNEED); where that hint fails or does not exist the file is the same."""
    import hf_pma.io.safetensors as module

    calls = []
    real = getattr(module.os, "posix_fadvise", None)

    def fake(fd, offset, length, advice):
        calls.append((offset, length))
        if fadvise == "fails":
            raise OSError(22, "Invalid argument")
        if real is not None:
            real(fd, offset, length, advice)

    if fadvise == "missing":
        monkeypatch.delattr(module.os, "posix_fadvise", raising=False)
    else:
        monkeypatch.setattr(module.os, "posix_fadvise", fake, raising=False)
        monkeypatch.setattr(
            module.os, "POSIX_FADV_DONTNEED", getattr(module.os, "POSIX_FADV_DONTNEED", 4), raising=False
        )
    path = tmp_path / "w.safetensors"
    values = np.arange(1000, dtype=np.float32)
    writer = SafetensorsWriter(path, [("x", "F32", (1000,))])
    writer.write_at("x", 500, values[500:])
    writer.write_at("x", 0, values[:500])
    writer.close()
    assert np.array_equal(load_file(path)["x"], values)
    if fadvise != "missing":
        start = path.stat().st_size - 4000  # the data section: the header comes first
        assert calls == [(start + 2000, 2000), (start, 2000)]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h["b"].update(data_offsets=[16, 48]), r"invalid offset: tensors 'a' and 'b' overlap"),
        (
            lambda h: h["c"].update(data_offsets=[60, 66]),
            r"invalid offset: 4 bytes between tensors 'b' and 'c' belong to none",
        ),
        (
            lambda h: [h[k].update(data_offsets=[o + 8 for o in h[k]["data_offsets"]]) for k in TENSORS],
            r"tensor 'a' starts at byte 8",
        ),
        (
            lambda h: h["c"].update(data_offsets=[56, 68], shape=[6]),
            r"tensor 'c' ends at byte 68 of the data but the file holds only 62 \(truncated\)",
        ),
        (lambda h: h["a"].update(dtype="F99"), r"tensor 'a' has an unknown dtype 'F99'"),
        (lambda h: h["a"].update(shape=[2, -3]), r"tensor 'a' has an invalid shape"),
        (lambda h: h["a"].update(shape=[2, 4]), r"tensor 'a' spans 24 bytes, but F32\[2, 4\] needs 32"),
        (lambda h: h.update(__metadata__={"format": 1}), r"__metadata__ is not an object of strings"),
    ],
)
def test_bad_byte_ranges_are_refused_in_one_line(tmp_path, mutate, message):
    header, data = _valid_header()
    mutate(header)
    path = tmp_path / "bad.safetensors"
    _file(path, header, data)
    with pytest.raises(CheckpointFormatError, match=message) as err:
        SafetensorsReader(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_trailing_bytes_are_refused(tmp_path):
    header, data = _valid_header()
    _file(tmp_path / "t.safetensors", header, data + b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match="8 bytes after the last tensor belong to no tensor"):
        SafetensorsReader(tmp_path / "t.safetensors")


# Anything JSON can hold, for replacing a value of the header.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets"])


@st.composite
def _mutations(draw):
    header, data = _valid_header()
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["value", "entry", "offset", "shape", "drop", "metadata"]))
        name = draw(st.sampled_from(sorted(TENSORS)))
        if kind == "value" and isinstance(header[name], dict):
            header[name][draw(_FIELDS)] = draw(_JSON)
        elif kind == "entry":
            header[name] = draw(_JSON)
        elif kind == "offset" and isinstance(header[name], dict):
            header[name]["data_offsets"] = [draw(st.integers(-8, 80)), draw(st.integers(-8, 80))]
        elif kind == "shape" and isinstance(header[name], dict):
            header[name]["shape"] = draw(st.lists(st.integers(-2, 2**40), max_size=4))
        elif kind == "drop" and isinstance(header[name], dict):
            header[name].pop(draw(_FIELDS), None)
        elif kind == "metadata":
            header["__metadata__"] = draw(_JSON)
    blob = json.dumps(header).encode()
    length = draw(st.sampled_from([len(blob), len(blob) - 1, len(blob) + 3, 0, 2**63]))
    body = blob + data
    cut = draw(st.integers(0, len(body)))
    keep = draw(st.booleans())
    return struct.pack("<Q", length) + (body if keep else body[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_mutations())
def test_random_header_mutations_raise_only_the_one_line_format_error(tmp_path, raw):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(raw)
    try:
        with SafetensorsReader(path) as reader:
            for name, info in reader.infos.items():  # what opened must be readable as planned
                assert reader.read(name).size == info.numel * info.itemsize
    except CheckpointFormatError as err:
        assert str(err).startswith(str(path)) and "\n" not in str(err)
