"""One way out: outputs, claims, temporaries and records are created exclusively and never through a
link, in places checked before any work; hf-pma deletes or replaces only what it wrote (by name and
record, and only when nothing else is inside); a resume deletes nothing the run has not passed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import pytest

from hf_pma.cli import main
from hf_pma.core.manifest import (
    MODEL_SUPPORT_FILES,
    PMA_SUBDIR,
    SnapshotRecord,
    clean_incomplete,
    is_excluded,
    manifest_snapshots,
)
from hf_pma.snapshots.callback import PMACallback
from hf_pma.snapshots.gather import gather_full_state_dict
from hf_pma.snapshots.sharded import mark_sharded_tmp_dir, sharded_tmp_dir
from hf_pma.snapshots.writer import prepare_snapshot, write_snapshot
from hf_pma.utils.fs import (
    RUN_MANIFESTS,
    atomic_write_text,
    check_output_folder,
    claim_path,
    embedded_name,
    parse_temporary,
    remove_stale_temporaries,
    temporary_path,
)
from tests.helpers.models import make_tiny_model
from tests.helpers.snapshot_runs import noise_deviation, write_run
from tests.helpers.training import TRAIN_SMALL_TPS, StopAt, train_small

TPS = TRAIN_SMALL_TPS


def the_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A run of 3 snapshots (read only by these tests: copy it to change it)."""
    run, _ = write_run(tmp_path_factory.mktemp("small") / "run", 3, noise_deviation())
    return run


# ---------------------------------------------------------------- claims and temporaries


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "folder"])
def test_a_planted_claim_is_refused_in_one_line_and_nothing_outside_is_written(
    small_run, tmp_path, capsys, kind
):
    victim = tmp_path / "victim.txt"
    victim.write_text("my thesis")
    out = tmp_path / "out" / "merged"
    out.parent.mkdir()
    claim = claim_path(out)
    {
        "symlink": lambda: claim.symlink_to(victim),
        "hardlink": lambda: os.link(victim, claim),
        "fifo": lambda: os.mkfifo(claim),
        "folder": lambda: claim.mkdir(),
    }[kind]()
    assert main(["merge", str(small_run), "-o", str(out), "-q"]) == 2
    error = the_error(capsys.readouterr().err)
    assert f"the claim file {claim} of output folder {out} is not a regular file" in error, error
    assert victim.read_text() == "my thesis" and not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [claim.name]  # no temporary either


def test_atomic_writes_never_follow_a_link_planted_at_a_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    target = tmp_path / "record.json"
    probe = parse_temporary(temporary_path(target).name)
    n = int(temporary_path(target).name.rsplit("-", 1)[1])
    planted = [
        target.with_name(f".record.json.tmp-{probe['host']}-{os.getpid()}-{n + k}") for k in range(1, 4)
    ]
    for link in planted:
        link.symlink_to(victim)
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and victim.read_text() == "keep"
    assert all(link.is_symlink() for link in planted)  # not ours: left as they are


def test_names_at_the_file_name_limit(small_run, tmp_path):
    """A legal 255-byte output name: its claim and temporaries fit NAME_MAX, stay recognisable,
    and a dead writer's temporary of that name is found again."""
    long_name = "m" * 200 + "é" * 27 + "x"  # 255 bytes in UTF-8
    assert len(os.fsencode(long_name)) == 255
    out = tmp_path / long_name
    embedded = embedded_name(out)
    assert embedded.startswith("m" * 100) and len(os.fsencode(embedded)) <= 255 - 107
    assert embedded == embedded_name(tmp_path / long_name) != embedded_name(tmp_path / (long_name[:-1] + "y"))
    for kind in ("tmp", "deleting"):
        name = temporary_path(out, kind).name
        assert len(os.fsencode(name)) <= 255 and parse_temporary(name)["name"] == embedded
    assert len(os.fsencode(claim_path(out).name)) <= 255
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".{embedded}.tmp-{socket.gethostname()}-{int(dead.stdout)}-0"
    stale.mkdir()
    assert remove_stale_temporaries(tmp_path, long_name) == [stale]
    assert main(["merge", str(small_run), "-o", str(out), "-q"]) == 0
    assert (out / "pma_merge.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [long_name]


# ---------------------------------------------------------------- places checked before any work


def test_output_places_are_checked_before_any_work(small_run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)
    (tmp_path / "file").write_text("x")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    cases = {
        tmp_path / "link": "is a symbolic link",
        tmp_path / "file": "exists and is not a folder",
        run
        / "pma"
        / "snapshot-1000"
        / "my-merge": f"it lies inside {run / 'pma' / 'snapshot-1000'}, a snapshot listed in",
    }
    if os.geteuid() != 0:  # root writes anywhere
        cases[readonly / "merged"] = "is not writable"
    readonly.chmod(0o555)
    try:
        for output, why in cases.items():
            assert main(["merge", str(small_run), "-o", str(output), "--last", "2"]) == 2, output
            captured = capsys.readouterr()
            assert why in the_error(captured.err) and "Merging" not in captured.err, captured.err
        assert list(empty.iterdir()) == [] and list(readonly.iterdir()) == []
        assert not (run / "pma" / "snapshot-1000" / "my-merge").exists()
        for command in (
            ["consolidate", str(run / "pma" / "snapshot-1000")],
            ["make-tasks", str(tmp_path / "file")],
        ):
            assert main([*command, "-o", str(tmp_path / "link"), "-q"]) == 2
            assert "is a symbolic link" in the_error(capsys.readouterr().err)
    finally:
        readonly.chmod(0o755)
    # The library's one check, for the commands that write folders.
    with pytest.raises(FileExistsError, match="lies inside"):
        check_output_folder(run / "pma" / "snapshot-2000" / "a" / "b", False)
    check_output_folder(run / "elsewhere", False)  # beside the snapshots: fine


def test_run_manifest_names_match_the_manifest_module():
    from hf_pma.core.manifest import MANIFEST_NAME

    assert RUN_MANIFESTS == (MANIFEST_NAME, f"{PMA_SUBDIR}/{MANIFEST_NAME}")
    assert "config.json" in MODEL_SUPPORT_FILES


# ---------------------------------------------------------------- deleting only what hf-pma wrote


@pytest.fixture
def resumable(trained, tmp_path):
    """A copy of the finished 8-step run of tests/test_run_folder_trust.py (snapshots at steps
    2, 4, 6, 8; checkpoints at 4 and 8)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    train_small(out, [PMACallback(interval_tokens=2 * TPS)])
    return out


def test_snapshot_records_list_their_files(trained):
    folder = trained / "pma" / f"snapshot-{2 * TPS}"
    files = json.loads((folder / "pma.json").read_text())["extra"]["files"]
    assert files == sorted(p.name for p in folder.iterdir())
    assert "files" not in manifest_snapshots(trained / "pma")[0].extra  # the manifest stays small


def test_keep_last_leaves_a_snapshot_folder_holding_a_users_merge(resumable, caplog):
    pma = resumable / "pma"
    oldest = pma / f"snapshot-{2 * TPS}"
    mine = oldest / "my-merge"
    mine.mkdir()
    (mine / "model.safetensors").write_text("weeks of work")
    stray = pma / f"snapshot-{4 * TPS}" / "notes.txt"
    stray.write_text("mine too")
    with caplog.at_level(logging.WARNING):
        train_small(
            resumable,
            [PMACallback(interval_tokens=2 * TPS, keep_last=1)],
            resume=str(resumable / "checkpoint-4"),
        )
    assert [r.step for r in manifest_snapshots(pma)] == [8]
    assert (mine / "model.safetensors").read_text() == "weeks of work" and stray.read_text() == "mine too"
    assert not (pma / f"snapshot-{6 * TPS}").exists()  # entirely hf-pma's: deleted as before
    warnings = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert len(warnings) == 2 and "it holds the folder 'my-merge'" in warnings[0], warnings


def test_a_users_folder_named_like_a_snapshot_stops_training_at_the_start(tmp_path):
    pma = tmp_path / "run" / "pma"
    users = pma / f"snapshot-{2 * TPS}"
    users.mkdir(parents=True)
    (users / "mine.txt").write_text("keep")
    with pytest.raises(
        FileExistsError, match=rf"{users} is a folder without pma.json, not a snapshot"
    ) as info:
        train_small(tmp_path / "run", [PMACallback(interval_tokens=2 * TPS)], max_steps=4)
    assert "\n" not in str(info.value)
    assert (
        sorted(p.name for p in pma.iterdir()) == [users.name] and (users / "mine.txt").read_text() == "keep"
    )
    assert not (tmp_path / "run" / "checkpoint-2").exists()


def test_a_snapshot_never_replaces_a_folder_that_is_not_entirely_hf_pmas(tmp_path):
    pma = tmp_path / "pma"
    model = make_tiny_model(seed=1)

    def job(tokens):
        return prepare_snapshot(
            model, gather_full_state_dict(model), SnapshotRecord(f"snapshot-{tokens}", tokens, 1)
        )

    users = pma / "snapshot-10"
    users.mkdir(parents=True)
    (users / "mine.txt").write_text("keep")
    with pytest.raises(
        FileExistsError, match="will not replace .*snapshot-10 with a snapshot: it is not a snapshot folder"
    ):
        write_snapshot(job(10), pma)
    write_snapshot(job(20), pma)
    (pma / "snapshot-20" / "extra.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="it holds the file 'extra.txt'"):
        write_snapshot(job(20), pma)
    (pma / "snapshot-20" / "extra.txt").unlink()
    write_snapshot(job(20), pma)  # entirely hf-pma's: replaced
    assert (users / "mine.txt").read_text() == "keep"


def test_resume_sets_later_snapshots_aside_until_the_run_passes_them(resumable):
    pma = resumable / "pma"
    before = {p.name: (p / "model.safetensors").read_bytes() for p in pma.glob("snapshot-*")}
    # Interrupted right after resuming at step 4: nothing is lost, the gap is in the manifest.
    with pytest.raises(KeyboardInterrupt):
        train_small(
            resumable,
            [StopAt(5), PMACallback(interval_tokens=2 * TPS)],
            resume=str(resumable / "checkpoint-4"),
        )
    records = manifest_snapshots(pma)
    assert [(r.step, is_excluded(r), r.extra.get("set_aside_at")) for r in records] == [
        (2, False, None),
        (4, False, None),
        (6, True, 4 * TPS),
        (8, True, 4 * TPS),
    ]
    assert "past the resume point at 256 tokens" in records[2].extra["excluded_reason"]
    assert {p.name: (p / "model.safetensors").read_bytes() for p in pma.glob("snapshot-*")} == before
    # Resumed again and run to the end: each was replaced by the new snapshot at its tokens.
    train_small(resumable, [PMACallback(interval_tokens=2 * TPS)], resume=str(resumable / "checkpoint-4"))
    records = manifest_snapshots(pma)
    assert [(r.step, is_excluded(r), r.extra.get("set_aside_at")) for r in records] == [
        (2, False, None),
        (4, False, None),
        (6, False, None),
        (8, False, None),
    ]
    assert sorted(p.name for p in pma.iterdir() if p.name.startswith(".")) == []


def test_resume_drops_set_aside_snapshots_the_run_passed_without_retaking_them(resumable):
    pma = resumable / "pma"
    # The resumed run snapshots at other token counts (every 3 steps): 6 and 8 are passed, not retaken.
    train_small(resumable, [PMACallback(interval_tokens=3 * TPS)], resume=str(resumable / "checkpoint-4"))
    assert [r.step for r in manifest_snapshots(pma)] == [2, 4, 6]
    assert (
        json.loads((pma / f"snapshot-{6 * TPS}" / "pma.json").read_text())["extra"]["interval_tokens"]
        == 3 * TPS
    )
    assert not (pma / f"snapshot-{8 * TPS}").exists()


def test_start_up_cleanup_touches_only_hf_pmas_leftovers(tmp_path, caplog):
    pma = tmp_path / PMA_SUBDIR
    pma.mkdir()
    # Names that earlier development versions gave temporaries (no released version wrote them),
    # and hf-pma's sharded temporary name without the mark its ranks write first: the user's.
    users = [pma / ".tmp-notes", pma / ".deleting-draft", pma / ".tmp-snapshot-5-extra"]
    users += [pma / ".tmp-snapshot-32-99-0", pma / ".deleting-snapshot-32-99", pma / ".manifest.json.x1y2.tmp"]
    for path in users:
        path.write_text("the user's")
    unmarked = pma / ".tmp-snapshot-128"
    unmarked.mkdir()
    (unmarked / "notes.txt").write_text("the user's")
    ours = [sharded_tmp_dir(pma, "snapshot-64")]  # as a rank makes it, cut before its file was complete
    ours[0].mkdir()
    mark_sharded_tmp_dir(ours[0])
    (ours[0] / "shard-00001-model-00001-of-00001.safetensors.partial").write_text("half")
    odd = pma / ".tmp-snapshot-96"  # marked, but holding a folder of someone's: left
    (odd / "sub").mkdir(parents=True)
    mark_sharded_tmp_dir(odd)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        removed = clean_incomplete(pma)
    assert sorted(removed) == sorted(ours)
    assert all(p.read_text() == "the user's" for p in users) and odd.is_dir()
    assert (unmarked / "notes.txt").read_text() == "the user's"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(str(p) in logged for p in ours)
