"""The one way in (hf_pma.io.guarded): files under a user's folder are read only when they are
regular files inside it after links, JSON is bounded in size and depth, and every refusal is one
line naming the file; a FIFO never hangs a reader. Safetensors headers are bounded by what a file
can hold (tensor count, dimensions, 64-bit products), as the safetensors library bounds them."""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc

import pytest

from hf_pma.io import safetensors as st
from hf_pma.io.guarded import (
    UnsafeFileError,
    copy_file,
    open_file,
    read_bytes,
    read_json,
    regular_files,
)
from hf_pma.io.safetensors import CheckpointFormatError, SafetensorsReader

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture
def folder(tmp_path):
    """A user's folder holding a regular file, a link inside, a link outside, a FIFO."""
    inside = tmp_path / "run"
    inside.mkdir()
    (inside / "config.json").write_text('{"a": 1}')
    (inside / "sub").mkdir()
    (inside / "sub" / "tokenizer.model").write_bytes(b"tok")
    (inside / "inner-link.json").symlink_to("config.json")
    secret = tmp_path / "id_rsa"
    secret.write_text("SECRET")
    (inside / "outside.json").symlink_to(secret)
    os.mkfifo(inside / "fifo.json")
    return inside


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_a_link_inside_is_read_as_the_file_it_names(folder):
    assert read_json(folder / "inner-link.json", folder) == {"a": 1}
    assert read_json(folder / "config.json") == {"a": 1}


def test_a_link_to_outside_is_refused_naming_it(folder):
    with pytest.raises(UnsafeFileError) as err:
        read_json(folder / "outside.json", folder)
    assert _one_line(err.value).startswith(
        f"{folder / 'outside.json'} is a symbolic link to outside the folder"
    )
    with pytest.raises(UnsafeFileError, match="symbolic link to outside"):
        read_bytes(folder / "outside.json", max_bytes=100)


def test_a_fifo_is_refused_without_hanging(folder):
    started = time.monotonic()
    for read in (lambda: read_json(folder / "fifo.json"), lambda: open_file(folder / "fifo.json")):
        with pytest.raises(UnsafeFileError) as err:
            read()
        assert _one_line(err.value) == f"{folder / 'fifo.json'} is not a regular file (a FIFO)"
    assert time.monotonic() - started < 5


def test_size_and_depth_limits(folder):
    (folder / "deep.json").write_text(DEEP)
    with pytest.raises(ValueError) as err:
        read_json(folder / "deep.json", kind="config")
    assert _one_line(err.value) == f"{folder / 'deep.json'} is not valid JSON: nested deeper than 64 levels"
    (folder / "deep70.json").write_text("[" * 70 + "]" * 70)  # parses, but deeper than the limit
    with pytest.raises(ValueError, match="nested deeper than 64"):
        read_json(folder / "deep70.json")
    with pytest.raises(UnsafeFileError, match=r"is larger than 2 bytes \(8 bytes\)"):
        read_bytes(folder / "config.json", max_bytes=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_json(folder / "missing.json")


def test_copy_takes_regular_files_inside_and_refuses_links_out(folder, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    copy_file(folder / "inner-link.json", dest / "c.json", folder)
    assert not (dest / "c.json").is_symlink() and (dest / "c.json").read_text() == '{"a": 1}'
    with pytest.raises(UnsafeFileError, match="symbolic link to outside"):
        copy_file(folder / "outside.json", dest / "o.json", folder)
    assert not (dest / "o.json").exists()
    with pytest.raises(FileExistsError):
        copy_file(folder / "config.json", dest / "c.json", folder)


def test_regular_files_refuses_links_out_fifos_and_control_names(folder):
    with pytest.raises(UnsafeFileError, match="fifo.json is not a regular file"):
        regular_files(folder)
    (folder / "fifo.json").unlink()
    with pytest.raises(UnsafeFileError, match="outside.json is a symbolic link to outside the folder"):
        regular_files(folder)
    (folder / "outside.json").unlink()
    (folder / "loop").symlink_to(".")  # a folder link inside: walked once
    assert [str(p) for p in regular_files(folder)] == [
        "config.json",
        "inner-link.json",
        "sub/tokenizer.model",
    ]
    (folder / "evil\n.py").write_text("x")
    with pytest.raises(UnsafeFileError) as err:
        regular_files(folder)
    assert _one_line(err.value).endswith("evil\\n.py has a control character in its name")


# ---------------------------------------------------------------- safetensors headers


def _file(path, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize(
    "shape, message",
    [
        ([2**64, 0], "invalid shape"),
        ([2**63, 0], "invalid shape"),  # torch's sizes are int64
        ([2**62, 2**3, 0], "whose size overflows 64 bits"),  # the running product, as safetensors checks it
        ([1.0], "invalid shape"),
        ([True], "invalid shape"),
        ([1] * 65, "65 dimensions"),
    ],
)
def test_shapes_the_safetensors_library_refuses_are_refused(tmp_path, shape, message):
    path = tmp_path / "m.safetensors"
    _file(path, {"a": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(CheckpointFormatError) as err:
        SafetensorsReader(path)
    assert _one_line(err.value).startswith(f"{path} is not a valid safetensors file: tensor 'a' ")
    assert message in str(err.value)


def test_zero_sized_shapes_the_library_accepts_still_open(tmp_path):
    path = tmp_path / "m.safetensors"
    _file(path, {"a": {"dtype": "F32", "shape": [0, 2**40, 3], "data_offsets": [0, 0]}})
    with SafetensorsReader(path) as reader:
        assert reader.infos["a"].shape == (0, 2**40, 3)


def test_tensor_count_is_capped(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(50)}
    _file(path, header)
    with pytest.raises(CheckpointFormatError, match="header lists more than 49 tensors"):
        SafetensorsReader(path, max_tensors=49)
    monkeypatch.setattr(st, "MAX_TENSORS", 10)
    with pytest.raises(CheckpointFormatError, match="header lists more than 10 tensors"):
        SafetensorsReader(path)
    assert len(SafetensorsReader(path, max_tensors=50).infos) == 50


def test_a_header_over_the_cap_is_refused_before_it_is_parsed_whole(tmp_path, monkeypatch):
    """The parse stops at the cap: 50,000 empty tensors over a cap of 1,000 cost what 1,000 do.
    (At the real cap, 2**18, a header parses in about 2 s and ~100 MB: see MAX_TENSORS.)"""
    path = tmp_path / "m.safetensors"
    _file(path, {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(50_000)})
    monkeypatch.setattr(st, "MAX_TENSORS", 1000)
    tracemalloc.start()
    with pytest.raises(CheckpointFormatError, match="more than 1,000 tensors"):
        SafetensorsReader(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 3 * path.stat().st_size  # the raw header and ~1,000 entries, not 50,000


def test_a_weight_file_that_is_a_fifo_or_links_out_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "model.safetensors")
    with pytest.raises(UnsafeFileError, match=r"model.safetensors is not a regular file \(a FIFO\)"):
        SafetensorsReader(run / "model.safetensors")
    outside = tmp_path / "other.safetensors"
    _file(outside, {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    (run / "link.safetensors").symlink_to(outside)
    with pytest.raises(UnsafeFileError, match="symbolic link to outside the folder"):
        SafetensorsReader(run / "link.safetensors", run)
