"""A merge of a hostile run folder reads nothing outside it and stops in one line before any work:
weight files and support files that link outside, FIFOs, deep or truncated JSON, record values
out of range, crafted shapes and wrongly typed sharded metadata (hf_pma.io.guarded, the one way
in). Each case: exit 2, one line naming the file, no output folder, nothing outside copied."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest

from hf_pma.io.safetensors import CheckpointFormatError
from hf_pma.io.sharded import ShardedCheckpointTensors
from hf_pma.merging.engine import merge_checkpoints
from tests.helpers.cli import run_cli
from tests.helpers.snapshot_runs import copy_run

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture
def run(pristine_run, tmp_path):
    """A fresh copy of a 3-snapshot run, and a secret outside it (``tmp_path/id_rsa``)."""
    copy = copy_run(pristine_run, tmp_path)
    (tmp_path / "id_rsa").write_text("SECRET KEY")
    return copy


def _merge_fails(run: Path, tmp_path: Path) -> str:
    """Merge ``run`` (a 20 s alarm: a FIFO must not hang it); returns the one-line error."""
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the merge hung"))
    signal.alarm(20)
    try:
        result = run_cli("merge", run, "-o", tmp_path / "merged", "--last", "all", "-q")  # every snapshot is read
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[WARNING|")]
    assert len(lines) == 1, result.stderr  # the one-line error (after the log's warning, if any)
    assert not (tmp_path / "merged").exists()
    copies = [p for p in tmp_path.rglob("*") if p.name != "id_rsa" and p.is_file() and not p.is_symlink()]
    assert not any(b"SECRET" in p.read_bytes() for p in copies)  # nothing outside was copied in
    return lines[0]


def test_a_weight_file_linking_outside_the_run_is_refused(run, tmp_path):
    victim = tmp_path / "elsewhere" / "victim.safetensors"  # not beside the output: that folder would hold weights
    victim.parent.mkdir()
    shutil.copy(run / "pma" / "snapshot-2000" / "model.safetensors", victim)
    (run / "pma" / "snapshot-2000" / "model.safetensors").unlink()
    (run / "pma" / "snapshot-2000" / "model.safetensors").symlink_to(victim)
    error = _merge_fails(run, tmp_path)
    assert error.startswith(
        f"hf-pma merge: error: {run / 'pma' / 'snapshot-2000' / 'model.safetensors'} is a symbolic link to outside the folder"
    )


def test_a_link_inside_the_run_is_merged(run, tmp_path):
    snapshot = run / "pma" / "snapshot-3000"
    shutil.move(snapshot / "model.safetensors", run / "weights.safetensors")
    (snapshot / "model.safetensors").symlink_to(run / "weights.safetensors")
    assert run_cli("merge", run, "-o", tmp_path / "merged", "-q").returncode == 0


@pytest.mark.parametrize("name", ["tokenizer.model", "modeling_evil.py"])
def test_a_support_file_linking_outside_is_refused_before_any_tensor(run, tmp_path, name):
    (run / "pma" / "snapshot-3000" / name).symlink_to(tmp_path / "id_rsa")
    error = _merge_fails(run, tmp_path)
    assert error == (
        f"hf-pma merge: error: {run / 'pma' / 'snapshot-3000' / name} is a symbolic link to outside the folder {run}"
    )


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "trainer_state.json"])
def test_a_fifo_is_one_line_and_never_hangs(run, tmp_path, name):
    folder = run / "pma" / ("snapshot-3000" if name == "config.json" else "snapshot-2000")
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    if name == "trainer_state.json":  # read only for a folder without a pma.json
        (folder / "pma.json").unlink()
        error = _merge_fails(folder, tmp_path)
    else:
        error = _merge_fails(run, tmp_path)
    assert error == f"hf-pma merge: error: {folder / name} is not a regular file (a FIFO)"


@pytest.mark.parametrize(
    "where, content, expected",
    [
        ("pma/snapshot-3000/config.json", DEEP, "is not valid JSON: nested deeper than 64 levels"),
        (
            "pma/snapshot-3000/config.json",
            '{"model_type": "llama", "hidden',
            "is not valid JSON: Unterminated string",
        ),
        ("pma/snapshot-3000/config.json", "[1, 2]", "should hold a JSON object, got list"),
        ("pma/snapshot-3000/generation_config.json", '{"a": ', "is not valid JSON"),
        (
            "pma/snapshot-2000/model.safetensors.index.json",
            DEEP,
            "is not valid JSON: nested deeper than 64 levels",
        ),
        ("pma/manifest.json", DEEP, "is not valid JSON: nested deeper than 64 levels"),
    ],
    ids=[
        "deep-config",
        "truncated-config",
        "list-config",
        "truncated-generation",
        "deep-index",
        "deep-manifest",
    ],
)
def test_deep_or_truncated_json_is_one_line_naming_the_file(run, tmp_path, where, content, expected):
    (run / where).write_text(content)
    error = _merge_fails(run, tmp_path)
    assert error.startswith(f"hf-pma merge: error: {run / where}") and expected in error


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (
            "time",
            1e300,
            "'time' must be a finite number of seconds since the epoch, up to the year 9999, got 1e+300",
        ),
        (
            "tokens",
            10**400,
            "'tokens' must be a non-negative integer, got an integer of 401 digits (at most 2**63 - 1)",
        ),
        (
            "step",
            2**63,
            "'step' must be a non-negative integer, got an integer of 19 digits (at most 2**63 - 1)",
        ),
        ("lr", -(10**400), "'lr' must be a number or null, got an integer of 401 digits (at most 2**63 - 1)"),
        (
            "world_size",
            10**30,
            "'extra.world_size' must be a positive integer, got an integer of 31 digits (at most 2**63 - 1)",
        ),
    ],
    ids=["time-1e300", "tokens-10**400", "step-2**63", "lr-10**400", "world_size-10**30"],
)
def test_hostile_record_values_are_one_line(run, tmp_path, field, value, expected):
    manifest = run / "pma" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["snapshots"][-1][field] = value
    manifest.write_text(json.dumps(data))
    error = _merge_fails(run, tmp_path)
    assert error.startswith(f"hf-pma merge: error: {manifest}: snapshots[2] ('snapshot-3000'): ")
    assert error.endswith(expected)


def test_hostile_trainer_state_is_one_line(run, tmp_path):
    folder = run / "pma" / "snapshot-2000"
    (folder / "pma.json").unlink()
    (folder / "trainer_state.json").write_text('{"global_step": 1' + "0" * 400 + "}")
    error = _merge_fails(folder, tmp_path)
    assert error.startswith(
        f"hf-pma merge: error: {folder / 'trainer_state.json'}: 'global_step' must be an integer"
    )


def _rewrite_header(path: Path, change) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


@pytest.mark.parametrize("shape", [[2**64, 0], [2**62, 8, 0]])
def test_crafted_shapes_are_refused_not_merged(run, tmp_path, shape):
    for snapshot in ("snapshot-1000", "snapshot-2000", "snapshot-3000"):
        _rewrite_header(
            run / "pma" / snapshot / "model.safetensors",
            lambda h: h.update(bomb={"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}),
        )
    error = _merge_fails(run, tmp_path)
    assert "is not a valid safetensors file: tensor 'bomb' has" in error


def _sharded_file(path: Path, metadata: dict[str, str]) -> None:
    header = {"__metadata__": metadata, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 8)


@pytest.mark.parametrize(
    "metadata, expected",
    [
        ({"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": ["a"]}})}, "has saved_offsets ['a']"),
        ({"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [1.5]}})}, "has saved_offsets [1.5]"),
        ({"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [10**30]}})}, "has saved_offsets"),
        (
            {"hf_pma_global_shapes": json.dumps({"w": "abc"})},
            "has a full shape in hf_pma_global_shapes 'abc'",
        ),
        ({"hf_pma_global_shapes": json.dumps({"w": [2**62, 2**62]})}, "of more than 2**63 - 1 elements"),
        ({"hf_pma_global_shapes": DEEP}, "metadata 'hf_pma_global_shapes' is not valid JSON: nested deeper"),
    ],
    ids=["offsets-str", "offsets-float", "offsets-huge", "shape-str", "shape-overflow", "shapes-deep"],
)
def test_wrongly_typed_sharded_metadata_is_one_line(tmp_path, metadata, expected):
    path = tmp_path / "shard-00001-model-00001-of-00001.safetensors"
    _sharded_file(path, metadata)
    with pytest.raises(CheckpointFormatError) as err:
        ShardedCheckpointTensors([path])
    assert "\n" not in str(err.value) and str(err.value).startswith(str(path)) and expected in str(err.value)


def test_support_files_are_copied_as_regular_files(run, tmp_path):
    snapshot = run / "pma" / "snapshot-3000"
    (run / "shared_tokenizer.model").write_bytes(b"tok")
    (snapshot / "tokenizer.model").symlink_to(run / "shared_tokenizer.model")  # a link inside: taken
    out = merge_checkpoints([run], tmp_path / "merged", progress=False)
    assert not (out / "tokenizer.model").is_symlink() and (out / "tokenizer.model").read_bytes() == b"tok"
    assert json.loads((out / "config.json").read_text()) == json.loads((snapshot / "config.json").read_text())
