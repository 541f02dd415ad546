"""A replacement survives a crash: a name holds the old folder or the new one, whole, after a
SIGKILL at any point of ``--overwrite`` (or the next command restores one, and says so).

Real processes, killed for real (SIGKILL) while stopped at a known point: between the two renames
of a filesystem that cannot swap two names at once (NFS, Lustre: the child is told its
``renameat2(RENAME_EXCHANGE)`` fails, as it does there), and right after the swap where it can.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pma.core.manifest import clean_incomplete
from hf_pma.utils.fs import (
    OutputExistsError,
    parse_temporary,
    read_claim,
    remove_stale_temporaries,
    restore_interrupted,
    write_folder_atomically,
)
from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.repo import REPO_ROOT

# Runs ``hf-pma ARGS`` (or, with ``write``, one library write of a folder) stopped at ``STAGE``:
# "between-renames" (no swap on this filesystem; stopped before the second rename) or
# "after-swap" (stopped once the names are swapped, before the old folder is deleted). It says
# ``PAUSED`` on stderr and waits for stdin; the test kills it there.
CHILD = r"""
import sys
from pathlib import Path

import hf_pma.utils.fs as fs

stage, args = sys.argv[1], sys.argv[2:]


def pause():
    sys.stderr.write("PAUSED\n")
    sys.stderr.flush()
    sys.stdin.readline()


if stage == "between-renames":
    fs._exchange = lambda first, second: False  # what renameat2 answers on NFS or Lustre
    second_rename = fs._rename_into_place

    def stop(tmp, final):
        pause()
        second_rename(tmp, final)

    fs._rename_into_place = stop
else:
    swap = fs._exchange

    def stop(first, second):
        assert swap(first, second), "this filesystem cannot swap two names"
        pause()
        return True

    fs._exchange = stop

def write(tmp):
    (tmp / "weights.bin").write_bytes(b"new " * 4096)
    (tmp / "record.json").write_text('{"version": "new"}')


if args[0] == "write":
    fs.write_folder_atomically(Path(args[1]), write)
elif args[0] == "publish":  # a folder written under a name of its own (the ranks' sharded snapshot folder)
    target = Path(args[1])
    tmp = target.with_name(".tmp-" + target.name)
    tmp.mkdir()
    write(tmp)
    fs.publish_folder(tmp, target)
else:
    from hf_pma.cli import main

    sys.exit(main(args))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def _killed_at(stage: str, *args, while_paused=None) -> None:
    """Run the child stopped at ``stage``, call ``while_paused()`` (its holder alive), SIGKILL it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, stage, *map(str, args)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(),
    )
    try:
        for line in proc.stderr:
            if line.strip() == "PAUSED":
                break
        else:
            pytest.fail(f"never reached {stage}: exit {proc.wait()}")
        if while_paused is not None:
            while_paused()
    finally:
        proc.kill()
        proc.wait()


def _temporaries(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if parse_temporary(name) is not None)


def _write_old(target: Path) -> None:
    def write(tmp):
        (tmp / "weights.bin").write_bytes(b"old " * 4096)
        (tmp / "record.json").write_text('{"version": "old"}')

    write_folder_atomically(target, write)


def _version(target: Path) -> str:
    """Which whole folder ``target`` holds ("old" or "new"); fails on anything but a whole one."""
    version = json.loads((target / "record.json").read_text())["version"]
    assert sorted(os.listdir(target)) == ["record.json", "weights.bin"]
    assert (target / "weights.bin").read_bytes() == f"{version} ".encode() * 4096
    return version


# ---------------------------------------------------------------- the library's one write path


def _crash_between_renames(tmp_path: Path, name: str = "model") -> Path:
    target = tmp_path / "out" / name
    target.parent.mkdir()
    _write_old(target)

    def while_paused():
        assert not target.exists()
        kinds = sorted(parse_temporary(n)["kind"] for n in _temporaries(target.parent))
        assert kinds == ["deleting", "tmp"]
        # The writer is alive: its pair is its own, nothing is restored or removed.
        assert restore_interrupted(target) is None and remove_stale_temporaries(target.parent) == []
        assert not target.exists() and len(_temporaries(target.parent)) == 2

    _killed_at("between-renames", "write", target, while_paused=while_paused)
    assert not target.exists() and len(_temporaries(target.parent)) == 2  # what the crash left
    return target


@pytest.mark.parametrize("next_command", ["write", "clean", "read", "eval", "push", "merge-source", "restore"])
def test_a_write_killed_between_its_two_renames_is_rolled_forward_by_whatever_comes_next(
    tmp_path, caplog, next_command
):
    target = _crash_between_renames(tmp_path)
    with caplog.at_level("WARNING", logger="hf_pma"):
        if next_command == "write":  # the next write into the name (not replacing): refused, nothing lost
            with pytest.raises(OutputExistsError):
                write_folder_atomically(target, lambda tmp: (tmp / "x").write_text("x"), overwrite=False)
        elif next_command == "clean":  # a run's clean-up of its whole folder
            clean_incomplete(target.parent)
        elif next_command == "read":  # a reader of the folder
            with read_claim(target, wait=0):
                assert _version(target) == "new"
        elif next_command in ("eval", "push", "merge-source"):  # their checks of a model folder (this is none)
            from hf_pma.evaluation.model_checks import resolve_model
            from hf_pma.merging.sources import resolve_sources
            from hf_pma.publishing.hub import check_model_folder

            check = {"eval": resolve_model, "push": check_model_folder, "merge-source": lambda t: resolve_sources([t])}
            with pytest.raises((ValueError, FileNotFoundError)) as err:
                check[next_command](target)
            assert "does not exist" not in str(err.value) and "not a folder" not in str(err.value)
        else:
            assert restore_interrupted(target) == target
    assert _version(target) == "new"
    assert _temporaries(target.parent) == []
    restored = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert len(restored) == 1 and str(target) in restored[0], restored


def test_a_name_with_a_newline_is_replaced_and_restored_as_any_other(tmp_path):
    """A folder's name may hold a newline (``-o $'a\\nb'``): its temporaries are still recognised,
    so a crash between the renames is restored, and nothing is left behind."""
    target = _crash_between_renames(tmp_path, "mo\ndel")
    assert restore_interrupted(target) == target
    assert _version(target) == "new" and _temporaries(target.parent) == []


def test_a_shortened_name_left_missing_is_kept_by_a_folder_wide_cleanup_and_restored_by_its_next_writer(
    tmp_path,
):
    target = _crash_between_renames(tmp_path, "m" * 240)  # its temporaries embed a shortened name
    assert all("~" in name for name in _temporaries(target.parent))
    assert clean_incomplete(target.parent) == []  # which name the pair belongs to is not known here
    assert not target.exists() and len(_temporaries(target.parent)) == 2
    with pytest.raises(OutputExistsError):  # restored first, so this write (not replacing) is refused
        write_folder_atomically(target, lambda tmp: (tmp / "x").write_text("x"), overwrite=False)
    assert _version(target) == "new" and _temporaries(target.parent) == []


def test_a_write_killed_after_the_swap_leaves_the_new_folder_and_its_leftover_is_removed(tmp_path):
    target = tmp_path / "model"
    _write_old(target)
    _killed_at("after-swap", "write", target)
    assert _version(target) == "new"  # the name never went missing
    (leftover,) = _temporaries(tmp_path)
    assert json.loads((tmp_path / leftover / "record.json").read_text())["version"] == "old"
    assert remove_stale_temporaries(tmp_path, target.name) == [tmp_path / leftover]
    assert _version(target) == "new" and _temporaries(tmp_path) == []


@pytest.mark.parametrize("stage", ["between-renames", "after-swap"])
def test_a_folder_written_under_another_name_is_published_through_temporaries_a_cleanup_recognises(
    tmp_path, stage
):
    target = tmp_path / "snapshot-5"
    _write_old(target)
    _killed_at(stage, "publish", target)
    assert not (tmp_path / ".tmp-snapshot-5").exists()  # renamed to this library's temporary name first
    clean_incomplete(tmp_path)
    assert _version(target) == "new" and sorted(os.listdir(tmp_path)) == ["snapshot-5"]


def _plant_pair(folder: Path, name: str, pid: int, new_is_link: bool = False) -> tuple[Path, Path]:
    host = socket.gethostname()
    new, old = folder / f".{name}.tmp-{host}-{pid}-7", folder / f".{name}.deleting-{host}-{pid}-7"
    old.mkdir()
    (old / "record.json").write_text('{"version": "old"}')
    if new_is_link:
        elsewhere = folder / "elsewhere"
        elsewhere.mkdir()
        new.symlink_to(elsewhere)
    else:
        new.mkdir()
    return new, old


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_a_stale_pair_of_real_folders_is_restored(tmp_path):
    # A link at the new half (planted): never renamed into the name.
    new, old = _plant_pair(tmp_path, "linked", _dead_pid(), new_is_link=True)
    assert restore_interrupted(tmp_path / "linked") is None
    assert not (tmp_path / "linked").exists() and new.is_symlink() and old.is_dir()
    # Nor is the pair deleted while the name is missing: the old half may be its only copy.
    assert remove_stale_temporaries(tmp_path, "linked") == [] and new.is_symlink() and old.is_dir()
    # A tmp without its pair: a first write killed midway, never made the output.
    half = tmp_path / f".half.tmp-{socket.gethostname()}-{_dead_pid()}-3"
    half.mkdir()
    assert restore_interrupted(tmp_path / "half") is None and not (tmp_path / "half").exists()
    # The name exists: nothing is restored over it.
    (tmp_path / "present").mkdir()
    _plant_pair(tmp_path, "present", _dead_pid())
    assert restore_interrupted(tmp_path / "present") is None and not any((tmp_path / "present").iterdir())


# ---------------------------------------------------------------- hf-pma merge --overwrite, killed


@pytest.fixture()
def sources(tmp_path):
    return [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(3)]


def _merged_sources(out: Path) -> int:
    return len(json.loads((out / "pma_merge.json").read_text())["sources"])


def test_merge_overwrite_killed_between_renames_then_the_next_merge_restores_the_new_merge(tmp_path, sources):
    out, reference = tmp_path / "merged", tmp_path / "reference"
    assert run_cli("merge", *sources, "-o", reference, "-q").returncode == 0
    assert run_cli("merge", *sources[:2], "-o", out, "-q").returncode == 0
    _killed_at("between-renames", "merge", *sources, "-o", out, "--overwrite", "-q")
    assert not out.exists()  # the crash left nothing under the name
    # The next merge into the name, without --overwrite: the new merge is restored first, so it is refused.
    result = run_cli("merge", *sources[:2], "-o", out)
    assert result.returncode == 2
    assert f"output folder {out} is not empty" in result.stderr.strip().splitlines()[-1]
    assert sum("restored" in line and str(out) in line for line in result.stderr.splitlines()) == 1
    assert _merged_sources(out) == 3 and sorted(os.listdir(out)) == sorted(os.listdir(reference))
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert _temporaries(tmp_path) == []


def test_merge_overwrite_killed_after_the_swap_keeps_the_new_merge_and_the_next_one_removes_the_old(
    tmp_path, sources
):
    out = tmp_path / "merged"
    assert run_cli("merge", *sources[:2], "-o", out, "-q").returncode == 0
    _killed_at("after-swap", "merge", *sources, "-o", out, "--overwrite", "-q")
    assert _merged_sources(out) == 3  # the new merge, whole, from the moment of the swap
    (leftover,) = _temporaries(tmp_path)
    assert _merged_sources(tmp_path / leftover) == 2  # the old one, not yet deleted
    assert run_cli("merge", *sources[:2], "-o", out, "--overwrite", "-q").returncode == 0
    assert _merged_sources(out) == 2 and _temporaries(tmp_path) == []


def test_a_pair_left_by_another_host_is_named_never_touched(tmp_path, caplog):
    """A replacement interrupted on another host (its process cannot be checked from here) is not
    restored by this one, but the missing name's reader is told which folder holds its new version."""
    new, old = tmp_path / ".model.tmp-node-b-77-7", tmp_path / ".model.deleting-node-b-77-7"
    new.mkdir()
    old.mkdir()
    with caplog.at_level("WARNING", logger="hf_pma"):
        assert restore_interrupted(tmp_path / "model") is None
    said = [r.getMessage() for r in caplog.records if "is missing" in r.getMessage()]
    assert len(said) == 1 and f"({new.name} holds its new version)" in said[0] and "rename that folder to model" in said[0]
    assert new.is_dir() and old.is_dir() and not (tmp_path / "model").exists()
