"""The one write path: temporary names, stale temporaries (never a live writer's), full disks."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest

from hf_pma.core.manifest import clean_incomplete
from hf_pma.core.outputs import listing_manifest
from hf_pma.utils.fs import (
    FOREIGN_STALE_AFTER_S,
    NoSpaceError,
    atomic_write_text,
    check_output_folder,
    confined_path,
    is_confined,
    is_library_folder,
    is_stale_temporary,
    listed_snapshot_of,
    parse_temporary,
    remove_stale_temporaries,
    temporary_path,
    write_folder_atomically,
)
from hf_pma.utils.read_files import PEEK_MAX_BYTES, PEEK_MAX_ENTRIES, PEEK_MAX_PARTS


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _temporary(folder, name, host, pid, kind="tmp", files=1):
    path = folder / f".{name}.{kind}-{host}-{pid}-0"
    path.mkdir()
    for i in range(files):
        (path / f"f{i}").write_text("x")
    return path


def test_temporary_names_round_trip():
    path = temporary_path("/data/run/pma/merged")
    info = parse_temporary(path.name)
    assert path.parent.as_posix() == "/data/run/pma" and path.name.startswith(".merged.tmp-")
    assert info["name"] == "merged" and info["kind"] == "tmp" and info["pid"] == os.getpid()
    assert temporary_path("/x/merged") != temporary_path("/x/merged")  # a counter: never the same twice
    assert parse_temporary(".snapshot-12.deleting-my-host.example-77-3") == {
        "name": "snapshot-12", "kind": "deleting", "host": "my-host.example", "pid": 77}
    for other in ("merged", ".merged", ".merged.tmp", ".tmp-merged-12-0", ".merged.old-1234abcd"):
        assert parse_temporary(other) is None
    # a name with a newline is still a name; a pid no process can have is no temporary of ours
    assert parse_temporary(temporary_path("/x/a\nb").name)["name"] == "a\nb"
    assert parse_temporary(f".merged.tmp-h-{2**70}-0") is None


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path, live_pid):
    host = socket.gethostname()
    dead = _temporary(tmp_path, "merged", host, _dead_pid())
    dead_file = tmp_path / f".merged.tmp-{host}-{_dead_pid()}-4"
    dead_file.write_text("half a file")
    deleting = _temporary(tmp_path, "merged", host, _dead_pid(), kind="deleting")
    live = _temporary(tmp_path, "merged", host, live_pid)
    mine = _temporary(tmp_path, "merged", host, os.getpid())
    other_target = _temporary(tmp_path, "snapshot-5", host, _dead_pid())
    foreign_recent = _temporary(tmp_path, "merged", "elsewhere-node-7", 1234)
    foreign_old = _temporary(tmp_path, "merged", "elsewhere-node-8", 1234, files=2)
    long_ago = time.time() - FOREIGN_STALE_AFTER_S - 60
    for path in (foreign_old, *foreign_old.iterdir()):
        os.utime(path, (long_ago, long_ago))
    # A foreign writer that still touches one of its files is alive.
    foreign_busy = _temporary(tmp_path, "merged", "elsewhere-node-9", 1234, files=2)
    os.utime(foreign_busy, (long_ago, long_ago))
    os.utime(foreign_busy / "f0", (long_ago, long_ago))
    unrelated = tmp_path / ".merged.backup"
    unrelated.mkdir()

    assert not is_stale_temporary(live) and not is_stale_temporary(mine) and is_stale_temporary(dead)
    removed = remove_stale_temporaries(tmp_path, "merged")
    assert sorted(removed) == sorted([dead, dead_file, deleting, foreign_old])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {p.name for p in (live, mine, other_target, foreign_recent, foreign_busy, unrelated)}
    assert remove_stale_temporaries(tmp_path) == [other_target]  # every target's, without a name


def test_write_folder_atomically_removes_a_dead_writers_folder_and_replaces_the_old(tmp_path, live_pid):
    target = tmp_path / "out"
    dead = _temporary(tmp_path, "out", socket.gethostname(), _dead_pid())
    live = _temporary(tmp_path, "out", socket.gethostname(), live_pid)
    write_folder_atomically(target, lambda tmp: (tmp / "a.txt").write_text("first"))
    assert (target / "a.txt").read_text() == "first" and not dead.exists() and live.exists()
    write_folder_atomically(target, lambda tmp: (tmp / "b.txt").write_text("second"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]

    def fail(tmp):
        (tmp / "c.txt").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_folder_atomically(target, fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])
    assert (target / "b.txt").read_text() == "second"


def test_clean_incomplete_keeps_a_live_writers_temporaries(tmp_path, live_pid):
    host = socket.gethostname()
    dead = _temporary(tmp_path, "snapshot-64", host, _dead_pid())
    dead_manifest = tmp_path / f".manifest.json.tmp-{host}-{_dead_pid()}-0"
    dead_manifest.write_text('{"snapshots": [')
    live = _temporary(tmp_path, "snapshot-128", host, live_pid)
    unmarked = tmp_path / ".tmp-snapshot-32-99-0"  # a name no released version wrote: the user's
    unmarked.mkdir()
    assert sorted(clean_incomplete(tmp_path)) == sorted([dead, dead_manifest])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, unmarked.name])


def _fill(folder, leave: int) -> None:
    """Fill the filesystem of ``folder`` up to ``leave`` free bytes."""
    filler = folder / "filler"
    with pytest.raises(OSError):
        with open(filler, "wb") as fh:
            while True:
                fh.write(b"x" * 4096)
                fh.flush()
    filler.write_bytes(filler.read_bytes()[:-leave])


def test_no_space_left_names_the_target_and_leaves_nothing(small_filesystem):
    target = small_filesystem / "model"
    # Known size, checked before anything is written.
    with pytest.raises(NoSpaceError) as info:
        write_folder_atomically(target, lambda tmp: pytest.fail("written despite the check"), needed=10**7)
    assert info.value.needed == 10**7 and info.value.free <= 256 * 1024 and info.value.path == target
    assert str(info.value).startswith(f"no space left on the device to write {target}; it needs 9.5 MiB (10,000,000 bytes); ")
    assert isinstance(info.value, OSError) and list(small_filesystem.iterdir()) == []
    # It reaches the other ranks intact (run_on_main_process pickles it).
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)

    # Unknown size: the disk fills up during the write.
    def write(tmp):
        (tmp / "weights.bin").write_bytes(b"\0" * 400 * 1024)

    with pytest.raises(NoSpaceError, match="no space left on the device to write .*model; .* free in"):
        write_folder_atomically(target, write)
    assert list(small_filesystem.iterdir()) == []

    # A file: the same error, and the old content stays.
    manifest = small_filesystem / "manifest.json"
    atomic_write_text(manifest, "old")
    _fill(small_filesystem, 8 * 1024)
    with pytest.raises(NoSpaceError, match=f"to write {manifest}; it needs 39.1 KiB"):
        atomic_write_text(manifest, "y" * 40_000)
    assert manifest.read_text() == "old"
    assert sorted(p.name for p in small_filesystem.iterdir()) == ["filler", "manifest.json"]


# ---------------------------------------------------------------- confinement


def test_confined_path_refuses_what_leaves_the_folder(tmp_path):
    root, outside = tmp_path / "run", tmp_path / "elsewhere"
    (root / "inside").mkdir(parents=True)
    outside.mkdir()
    (root / "to_inside").symlink_to(root / "inside")
    (root / "to_outside").symlink_to(outside)
    (root / "loop").symlink_to(root / "loop")
    assert confined_path(root, "inside") == root / "inside"
    assert confined_path(root, "to_inside") == root / "to_inside"
    assert confined_path(root, "not/yet/there") == root / "not/yet/there"
    refused = {
        "../elsewhere": "leaves",
        "inside/../../elsewhere": "leaves",
        str(outside): "is absolute",
        "to_outside": "resolves to .*elsewhere, outside",
        "to_outside/model": "outside",
        ".": "itself",
        "": "non-empty",
        "a\x00b": "control character",
        "0\n": "control character",
        "snap\x1b[2Jshot": "control character",
        "a\x7f": "control character",
        "loop": "cannot be resolved",
        "\ud800": "cannot be resolved",
    }
    for relative, why in refused.items():
        with pytest.raises(ValueError, match=why) as info:
            confined_path(root, relative)
        assert "\n" not in str(info.value)
    for value in (5, None, ["inside"], True):
        with pytest.raises(ValueError, match="non-empty relative path"):
            confined_path(root, value)
    assert is_confined(root / "inside", root) and not is_confined(root / "to_outside", root)
    assert not is_confined(root, root) and is_confined(root, root, allow_self=True)


def test_is_library_folder_needs_a_real_folder_its_marker_and_its_name(tmp_path):
    run = tmp_path / "run"
    ours = run / "snapshot-10"
    ours.mkdir(parents=True)
    (ours / "pma.json").write_text("{}")
    assert is_library_folder(ours, "pma.json", within=run, name_pattern=r"snapshot-\d+")
    assert is_library_folder(ours, ("pma_merge.json", "pma.json"))
    assert not is_library_folder(ours, "pma.json", within=ours)  # not strictly inside
    assert not is_library_folder(ours, "pma.json", name_pattern=r"checkpoint-\d+")
    assert not is_library_folder(ours, "pma_merge.json")
    # A symlink to one of ours, a marker that is a symlink, a file, nothing.
    (run / "snapshot-20").symlink_to(ours)
    assert not is_library_folder(run / "snapshot-20", "pma.json")
    user = tmp_path / "user"
    user.mkdir()
    (user / "pma.json").symlink_to(ours / "pma.json")
    assert not is_library_folder(user, "pma.json")
    (run / "file").write_text("x")
    assert not is_library_folder(run / "file", "pma.json")
    assert not is_library_folder(run / "missing", "pma.json")


# ---------------------------------------------------------------- bounded reads of others' manifests


def _manifest_listing(path, listed: str, entries: int = 1, pad: int = 0) -> None:
    """A run manifest at ``path`` listing ``entries`` snapshots, ``listed`` last, padded to size."""
    snapshots = [{"path": f"other-{i}"} for i in range(entries - 1)] + [{"path": listed}]
    path.write_text(json.dumps({"snapshots": snapshots, "pad": "x" * pad}))


@pytest.mark.parametrize("where", ["manifest.json", "pma/manifest.json"])
def test_an_output_check_reads_a_manifest_above_it_only_within_its_byte_bound(tmp_path, where):
    shared = tmp_path / "shared"
    (shared / "pma").mkdir(parents=True)
    manifest = shared / where
    out, listed = manifest.parent / "sub" / "m", "sub"
    _manifest_listing(manifest, listed, pad=PEEK_MAX_BYTES - 200)
    assert manifest.stat().st_size <= PEEK_MAX_BYTES
    with pytest.raises(FileExistsError, match="a snapshot listed in"):  # within the bound: read, and it lists sub
        check_output_folder(out, overwrite=False)
    assert listing_manifest(out.parent) == manifest
    _manifest_listing(manifest, listed, pad=PEEK_MAX_BYTES)  # one past the bound: not read at all
    assert manifest.stat().st_size > PEEK_MAX_BYTES
    check_output_folder(out, overwrite=False)
    assert listed_snapshot_of(out) is None and listing_manifest(out.parent) is None


def test_an_output_check_resolves_at_most_the_entry_bound_of_a_manifest_above_it(tmp_path):
    out = tmp_path / "sub" / "m"
    manifest = tmp_path / "manifest.json"
    _manifest_listing(manifest, "sub", entries=PEEK_MAX_ENTRIES)
    assert listed_snapshot_of(out) == ((tmp_path / "sub").resolve(), manifest)
    _manifest_listing(manifest, "sub", entries=PEEK_MAX_ENTRIES + 1)  # within the bytes, one entry too many
    assert manifest.stat().st_size <= PEEK_MAX_BYTES
    check_output_folder(out, overwrite=False)
    assert listed_snapshot_of(out) is None and listing_manifest(tmp_path / "sub") is None
    # Within the entries, too many path components in all (each one a system call to resolve).
    deep = [{"path": "gone/" * (PEEK_MAX_PARTS // 100)} for _ in range(100)] + [{"path": "sub"}]
    manifest.write_text(json.dumps({"snapshots": deep}))
    check_output_folder(out, overwrite=False)
    assert listed_snapshot_of(out) is None and listing_manifest(tmp_path / "sub") is None


def test_a_large_manifest_in_a_shared_parent_does_not_hold_up_a_merge_below_it(tmp_path):
    from tests.helpers.cli import run_cli
    from tests.helpers.models import make_tiny_model, save_model_folder

    source = save_model_folder(tmp_path / "src", make_tiny_model(seed=0))
    shared = tmp_path / "shared"
    shared.mkdir()
    # Entries past both bounds, the last naming the merge's folder: the file is not read, so it
    # holds up nothing (and gives no reason to refuse: it is not a run's manifest hf-pma reads).
    entries = [{"path": f"gone/{i}/" + "d/" * 20} for i in range(PEEK_MAX_ENTRIES * 8)] + [{"path": "sub"}]
    (shared / "manifest.json").write_text(json.dumps({"snapshots": entries}))
    assert (shared / "manifest.json").stat().st_size > PEEK_MAX_BYTES
    result = run_cli("merge", source, "-o", shared / "sub" / "m", "-q")
    assert result.returncode == 0, result.stderr
    assert (shared / "sub" / "m" / "pma_merge.json").is_file()


def test_an_output_deep_below_a_run_is_checked_in_work_linear_in_its_depth(tmp_path, monkeypatch):
    """The check that an output is not inside a run's snapshot looks at every folder above it, but
    resolves only the manifests that are there (a path 250 folders deep took a minute, cubic in
    its depth, when every level's candidate was resolved and compared with every other)."""
    from hf_pma.utils import fs

    manifest = tmp_path / "manifest.json"
    _manifest_listing(manifest, "sub")
    out = tmp_path.joinpath("sub", *["a"] * 300, "out")
    resolved = []
    real = fs._resolved
    monkeypatch.setattr(fs, "_resolved", lambda path: resolved.append(path) or real(path))
    assert listed_snapshot_of(out) == ((tmp_path / "sub").resolve(), manifest)
    assert len(resolved) == 2  # the output, and the one manifest's folder
