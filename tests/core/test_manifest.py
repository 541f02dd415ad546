"""hf_pma.core.manifest as untrusted input: the checked reader, confined paths, what may be deleted,
and property-based mutations of a real manifest (hypothesis)."""

from __future__ import annotations

import copy
import json
import re
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from hf_pma.core.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ManifestError,
    SnapshotRecord,
    add_snapshot,
    drop_snapshots_after,
    included_snapshots,
    is_snapshot_folder,
    manifest_snapshots,
    orphan_snapshots,
    read_manifest,
    read_snapshot_record,
    write_manifest,
)
from hf_pma.merging.sources import open_all, resolve_sources
from tests.helpers.audit import AuditWatch


def snapshot_folder(folder: Path, record: SnapshotRecord) -> None:
    """A snapshot folder as the writer leaves it, with a one-tensor weights file."""
    folder.mkdir(parents=True)
    save_file({"w": torch.full((2,), float(record.tokens))}, str(folder / "model.safetensors"))
    (folder / "pma.json").write_text(json.dumps(record.to_dict()))


def make_pma(root: Path, count: int = 3) -> tuple[Path, dict]:
    """``root/run/pma`` with ``count`` snapshot folders and their manifest, plus
    ``root/victim/snapshot-1``: a snapshot folder outside the run that nothing may read or delete."""
    pma = root / "run" / "pma"
    pma.mkdir(parents=True)
    records = []
    for i in range(1, count + 1):
        record = SnapshotRecord(path=f"snapshot-{100 * i}", tokens=100 * i, step=i, lr=1e-3, phase="stable")
        snapshot_folder(pma / record.path, record)
        records.append(record)
    write_manifest(pma, records, interval_tokens=100)
    snapshot_folder(root / "victim" / "snapshot-1", SnapshotRecord("snapshot-1", 1, 1))
    return pma, json.loads((pma / MANIFEST_NAME).read_text())


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its content."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write(pma: Path, data) -> None:
    (pma / MANIFEST_NAME).write_text(json.dumps(data))


def refusal(pma: Path) -> str:
    """The one-line error of reading the manifest of ``pma``."""
    with pytest.raises(ManifestError) as info:
        manifest_snapshots(pma)
    message = str(info.value)
    assert "\n" not in message and str(pma / MANIFEST_NAME) in message, message
    return message


# ---------------------------------------------------------------- the checked reader


def test_a_written_manifest_reads_back(tmp_path):
    pma, data = make_pma(tmp_path)
    assert [r.tokens for r in manifest_snapshots(pma)] == [100, 200, 300]
    assert data["format_version"] == FORMAT_VERSION and read_manifest(pma)["interval_tokens"] == 100
    # No manifest yet: empty. An entry with keys of a newer version: kept in extra.
    assert manifest_snapshots(tmp_path) == [] and read_manifest(tmp_path)["snapshots"] == []
    data["snapshots"][0]["future_key"] = {"any": "thing"}
    write(pma, data)
    assert manifest_snapshots(pma)[0].extra["future_key"] == {"any": "thing"}


def _set(index, key, value):
    def mutate(data):
        data["snapshots"][index][key] = value

    return mutate


def _set_top(key, value):
    def mutate(data):
        data[key] = value

    return mutate


def _swap(data):
    data["snapshots"][0], data["snapshots"][1] = data["snapshots"][1], data["snapshots"][0]


def _duplicate_tokens(data):
    data["snapshots"][1]["tokens"] = data["snapshots"][0]["tokens"]


def _entry(value):
    def mutate(data):
        data["snapshots"][1] = value

    return mutate


# mutation -> what the one-line error must name (besides the file).
MALFORMED = {
    "tokens string": (
        _set(1, "tokens", "abc"),
        r"snapshots\[1\] \('snapshot-200'\): 'tokens' must be a non-negative integer, got 'abc'",
    ),
    "tokens null": (
        _set(1, "tokens", None),
        r"snapshots\[1\].*'tokens' must be a non-negative integer, got None",
    ),
    "tokens negative": (
        _set(0, "tokens", -5),
        r"snapshots\[0\].*'tokens' must be a non-negative integer, got -5",
    ),
    "tokens float": (_set(0, "tokens", 100.0), r"'tokens' must be a non-negative integer, got 100.0"),
    "tokens bool": (_set(0, "tokens", True), r"'tokens' must be a non-negative integer, got True"),
    "step bool": (
        _set(2, "step", False),
        r"snapshots\[2\].*'step' must be a non-negative integer, got False",
    ),
    "step list": (_set(2, "step", [3]), r"'step' must be a non-negative integer, got \[3\]"),
    "path int": (_set(1, "path", 5), r"snapshots\[1\]: 'path' must be a non-empty relative path, got 5"),
    "path empty": (_set(1, "path", ""), r"snapshots\[1\].*'path' must be a non-empty relative path, got ''"),
    "path missing": (lambda d: d["snapshots"][1].pop("path"), r"snapshots\[1\]: 'path' is missing"),
    "lr string": (_set(0, "lr", "fast"), r"'lr' must be a number or null, got 'fast'"),
    "num_bytes negative": (_set(0, "num_bytes", -1), r"'num_bytes' must be a non-negative integer or null"),
    "time NaN": (_set(0, "time", float("nan")), r"'time' must be a finite number"),
    "extra list": (_set(0, "extra", []), r"'extra' must be an object, got \[\]"),
    "excluded string": (
        _set(1, "excluded", "false"),
        r"snapshots\[1\].*'extra.excluded' must be true or false, got 'false'",
    ),
    "extra.excluded 0": (_set(1, "extra", {"excluded": 0}), r"'extra.excluded' must be true or false, got 0"),
    "world_size zero": (
        _set(1, "extra", {"world_size": 0}),
        r"'extra.world_size' must be a positive integer",
    ),
    "entry string": (_entry("snapshot-200"), r"snapshots\[1\]: expected an object, got 'snapshot-200'"),
    "entry null": (_entry(None), r"snapshots\[1\]: expected an object, got None"),
    "snapshots object": (
        _set_top("snapshots", {}),
        r"'snapshots' must be a list of snapshot records, got \{\}",
    ),
    "snapshots missing": (
        lambda d: d.pop("snapshots"),
        r"'snapshots' must be a list of snapshot records, got None",
    ),
    "format_version newer": (
        _set_top("format_version", 99),
        r"written by a newer hf-pma \(format_version 99; .*upgrade hf-pma",
    ),
    "format_version string": (
        _set_top("format_version", "banana"),
        r"'format_version' must be an integer, got 'banana'",
    ),
    "format_version bool": (
        _set_top("format_version", True),
        r"'format_version' must be an integer, got True",
    ),
    "format_version float": (
        _set_top("format_version", 1.0),
        r"'format_version' must be an integer, got 1.0",
    ),
    "format_version zero": (_set_top("format_version", 0), r"unknown 'format_version' 0"),
    "interval_tokens string": (
        _set_top("interval_tokens", "1k"),
        r"'interval_tokens' must be a positive integer or null",
    ),
    "out of order": (_swap, r"snapshots\[1\].*'tokens' 100 does not increase on the entry before it \(200\)"),
    "duplicate tokens": (_duplicate_tokens, r"snapshots\[1\].*'tokens' 100 does not increase"),
    "duplicate step": (_set(1, "step", 1), r"snapshots\[1\].*'step' 1 does not increase"),
    "not an object": (lambda d: d.clear() or d.update(x=1), r"'snapshots' must be a list"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_manifest_is_one_line_naming_file_entry_and_field(tmp_path, name):
    pma, data = make_pma(tmp_path)
    mutate, expected = MALFORMED[name]
    mutate(data)
    write(pma, data)
    before = tree(tmp_path)
    message = refusal(pma)
    assert re.search(expected, message), message
    # Every reader and writer refuses it the same way, and nothing changed on disk.
    for call in (
        lambda: read_manifest(pma),
        lambda: included_snapshots(pma),
        lambda: drop_snapshots_after(pma, 0),
        lambda: add_snapshot(pma, SnapshotRecord("snapshot-400", 400, 4), keep_last=1),
        lambda: orphan_snapshots(pma),
    ):
        with pytest.raises(ManifestError):
            call()
    assert tree(tmp_path) == before


def test_unreadable_manifest_files_are_one_line(tmp_path):
    pma, _ = make_pma(tmp_path)
    for content in (
        b'{"snapshots": [',
        b"\xff\xfe not utf-8",
        b"[" * 100_000,
        b'{"format_version": 1' + b"9" * 5000 + b"}",
    ):
        (pma / MANIFEST_NAME).write_bytes(content)
        assert "is not valid JSON" in refusal(pma)
    (pma / MANIFEST_NAME).write_text("[]")
    assert "expected a JSON object, got list" in refusal(pma)
    (pma / MANIFEST_NAME).unlink()
    (pma / MANIFEST_NAME).mkdir()
    assert "not a readable file" in refusal(pma)


def test_the_writer_never_writes_what_the_reader_refuses(tmp_path):
    pma, _ = make_pma(tmp_path)
    before = (pma / MANIFEST_NAME).read_bytes()
    with pytest.raises(ManifestError, match="'tokens' 200 does not increase"):
        add_snapshot(pma, SnapshotRecord("snapshot-250", 200, 9))  # the same tokens as snapshot-200
    with pytest.raises(ManifestError, match="'path' refused: the path '../x' leaves"):
        write_manifest(pma, [SnapshotRecord("../x", 1, 1)])
    assert (pma / MANIFEST_NAME).read_bytes() == before


def test_snapshot_record_file_is_checked(tmp_path):
    folder = tmp_path / "snapshot-5"
    folder.mkdir()
    assert read_snapshot_record(folder) is None
    (folder / "pma.json").write_text(json.dumps({"path": "/anywhere", "tokens": 5, "step": 1}))
    assert read_snapshot_record(folder)["path"] == "snapshot-5"  # where it is, not what it says
    (folder / "pma.json").write_text(json.dumps({"tokens": 5}))
    with pytest.raises(ManifestError, match="'step' is missing"):
        read_snapshot_record(folder)
    assert read_snapshot_record(folder, required=())["tokens"] == 5
    for bad, field in (
        ({"tokens": "5"}, "'tokens'"),
        ({"step": -1}, "'step'"),
        ({"extra": {"sharded": "yes"}}, "'extra.sharded'"),
    ):
        (folder / "pma.json").write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match=f"^{folder / 'pma.json'}: {field} must be"):
            read_snapshot_record(folder, required=())


# ---------------------------------------------------------------- confined paths


def _paths_leaving(pma: Path, victim: Path) -> dict[str, str]:
    """Entry paths that are refused (most lead outside ``pma``) -> what the error says."""
    (pma / "snapshot-900").symlink_to(victim / "snapshot-1")
    (pma / "inner").mkdir()
    (pma / "inner" / "up").symlink_to(victim)
    return {
        "../../victim/snapshot-1": "leaves",
        str(victim / "snapshot-1"): "is absolute",
        "snapshot-100/../../../victim/snapshot-1": "leaves",
        "snapshot-900": f"resolves to {victim / 'snapshot-1'}, outside",
        "inner/up/snapshot-1": "outside",
        ".": "itself",
        "./": "itself",
        "0\n": "control character",  # found by the fuzz test: the error was two lines
        "snapshot-1\x1b[2J": "control character",
    }


def test_paths_that_leave_the_folder_are_refused_naming_the_entry(tmp_path):
    pma, data = make_pma(tmp_path)
    victim = tmp_path / "victim"
    for path, why in _paths_leaving(pma, victim).items():
        mutated = copy.deepcopy(data)
        mutated["snapshots"][2]["path"] = path
        write(pma, mutated)
        message = refusal(pma)
        assert f"snapshots[2] ({path!r}): 'path' refused: " in message and why in message, message
    # A symlink inside to a folder inside is fine; two entries on one folder are not.
    (pma / "snapshot-300-link").symlink_to(pma / "snapshot-300")
    mutated = copy.deepcopy(data)
    mutated["snapshots"][2]["path"] = "snapshot-300-link"
    write(pma, mutated)
    assert [r.path for r in manifest_snapshots(pma)][-1] == "snapshot-300-link"
    mutated["snapshots"][1]["path"] = "snapshot-300"
    write(pma, mutated)
    assert "'path' names the same folder as the entry 'snapshot-300'" in refusal(pma)


# ---------------------------------------------------------------- what may be deleted


def test_deletion_only_of_snapshot_folders_that_hf_pma_wrote(tmp_path):
    pma, data = make_pma(tmp_path, count=2)
    # Inside the folder, listed, but not ours: a user's notes, a folder without a record, a
    # symlink to one of ours, a snapshot-named folder whose record is a symlink.
    (pma / "notes").mkdir()
    (pma / "notes" / "mine.txt").write_text("keep me")
    (pma / "snapshot-500").mkdir()
    (pma / "snapshot-500" / "weights").write_text("no record")
    (pma / "snapshot-600").symlink_to(pma / "snapshot-100")
    (pma / "snapshot-700").mkdir()
    (pma / "snapshot-700" / "pma.json").symlink_to(pma / "snapshot-100" / "pma.json")
    extra = [("notes", 300, 3), ("snapshot-500", 500, 5), ("snapshot-700", 700, 7)]
    data["snapshots"] += [SnapshotRecord(p, t, s).to_dict() for p, t, s in extra]
    write(pma, data)
    assert is_snapshot_folder(pma / "snapshot-200", pma)
    for name in ("notes", "snapshot-500", "snapshot-600", "snapshot-700"):
        assert not is_snapshot_folder(pma / name, pma), name
    dropped = drop_snapshots_after(pma, 100)
    assert [r.path for r in dropped] == ["snapshot-200", "notes", "snapshot-500", "snapshot-700"]
    assert [r.path for r in manifest_snapshots(pma)] == ["snapshot-100"]
    assert not (pma / "snapshot-200").exists()  # ours: deleted
    assert (pma / "notes" / "mine.txt").read_text() == "keep me"
    assert (pma / "snapshot-500" / "weights").exists() and (pma / "snapshot-700").is_dir()
    # keep_last: the same rule.
    write(
        pma,
        {
            "format_version": 1,
            "snapshots": [
                SnapshotRecord("notes", 50, 1).to_dict(),
                SnapshotRecord("snapshot-100", 100, 2).to_dict(),
            ],
        },
    )
    (pma / "snapshot-800").mkdir()
    (pma / "snapshot-800" / "pma.json").write_text("{}")
    deleted = add_snapshot(pma, SnapshotRecord("snapshot-800", 800, 8), keep_last=1)
    assert [r.path for r in deleted] == ["snapshot-100"]
    assert (pma / "notes" / "mine.txt").exists() and not (pma / "snapshot-100").exists()
    assert [r.path for r in manifest_snapshots(pma)] == ["snapshot-800"]
    # Orphans: only real snapshot folders with a record; a symlink is never one.
    orphans = [p.name for p, _ in orphan_snapshots(pma)]
    assert "snapshot-600" not in orphans and "snapshot-500" not in orphans and "snapshot-700" not in orphans


# ---------------------------------------------------------------- fuzz

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = [
    "path",
    "tokens",
    "step",
    "lr",
    "loss",
    "phase",
    "dtype",
    "time",
    "num_bytes",
    "extra",
    "excluded",
    "sharded",
]


def path_values(victim: str) -> st.SearchStrategy:
    """Entry paths, many of them aimed outside the folder."""
    return st.sampled_from(
        [
            "../../victim/snapshot-1",
            "../victim",
            victim,
            victim + "/snapshot-1",
            "/",
            "..",
            ".",
            "",
            "./",
            "to_victim",
            "to_victim/snapshot-1",
            "snapshot-5",
            "inner/up/snapshot-1",
            "snapshot-100/../../../victim/snapshot-1",
            "snapshot-100",
            "snapshot-200",
            "snapshot-300",
            "loop",
            "nonexistent",
            "a\x00b",
            "0\n",
            "\udcff",
            "snapshot-100/",
            "./snapshot-200",
            "\\..\\..\\victim",
        ]
    ) | st.text(max_size=20)


@st.composite
def mutations(draw, victim: str):
    """A list of (where, key, value) changes to a valid manifest."""
    changes = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["field", "path", "top", "entry", "reorder"]))
        if kind == "field":
            changes.append(
                ("field", draw(st.integers(0, 2)), draw(st.sampled_from(FIELDS)), draw(json_values))
            )
        elif kind == "path":
            changes.append(("field", draw(st.integers(0, 2)), "path", draw(path_values(victim))))
        elif kind == "top":
            key = draw(
                st.sampled_from(["format_version", "snapshots", "interval_tokens", "keep_last", "recoveries"])
            )
            changes.append(("top", None, key, draw(json_values | st.integers(-3, 5))))
        elif kind == "entry":
            changes.append(("entry", draw(st.integers(0, 2)), None, draw(json_values)))
        else:
            changes.append(("reorder", draw(st.permutations([0, 1, 2])), None, None))
    return changes


def _apply(data: dict, changes: list) -> dict:
    data = copy.deepcopy(data)
    for kind, index, key, value in changes:
        entries = data.get("snapshots")
        if kind == "top":
            data[key] = value
        elif not isinstance(entries, list) or (isinstance(index, int) and index >= len(entries)):
            continue
        elif kind == "entry":
            entries[index] = value
        elif kind == "reorder":
            data["snapshots"] = [entries[i] for i in index if i < len(entries)]
        elif isinstance(entries[index], dict):
            entries[index][key] = value
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifests_give_one_line_errors_and_never_touch_outside(data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pma, valid = make_pma(root)
        victim = root / "victim"
        (pma / "to_victim").symlink_to(victim)
        (pma / "snapshot-5").symlink_to(victim / "snapshot-1")
        (pma / "inner").mkdir()
        (pma / "inner" / "up").symlink_to(victim)
        (pma / "loop").symlink_to(pma / "loop")
        changes = data.draw(mutations(str(victim)))
        try:
            write(pma, _apply(valid, changes))
        except ValueError:  # not representable as JSON text (a lone surrogate): not a file anyone wrote
            return
        before = tree(victim)
        with AuditWatch(victim) as watch:
            for call in (
                lambda: manifest_snapshots(pma),
                lambda: read_manifest(pma),
                lambda: [t.close() for t in open_all(resolve_sources([pma.parent]))],
                lambda: orphan_snapshots(pma),
                lambda: drop_snapshots_after(pma, data.draw(st.integers(-1, 400))),
                lambda: add_snapshot(pma, SnapshotRecord("snapshot-1000", 1000, 1000), keep_last=1),
            ):
                try:
                    call()
                except (ValueError, FileNotFoundError) as err:  # what the CLI reports in one line (exit 2)
                    assert "\n" not in str(err), str(err)
                    assert "/hf_pma/" in traceback.extract_tb(err.__traceback__)[-1].filename, repr(err)
        assert watch.touched == [], watch.touched
        assert tree(victim) == before


def test_snapshot_row_is_what_inspect_lists_for_each_snapshot():
    from hf_pma.core.manifest import snapshot_row

    row = snapshot_row("snapshot-2048", 2048, 2, num_bytes=10)
    assert row == {
        "name": "snapshot-2048",
        "tokens": 2048,
        "step": 2,
        "lr": None,
        "phase": None,
        "loss": None,
        "bytes": 10,
        "excluded": False,
        "excluded_reason": None,
        "missing": False,
    }
    assert json.loads(json.dumps(row)) == row  # the JSON report writes it as it is
