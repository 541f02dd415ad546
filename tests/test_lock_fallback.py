"""One writer on every filesystem: where ``flock`` fails (Lustre without ``-o flock``, NFS without
lockd) the claim file itself is the lock, made exclusively (as git's ``index.lock``); a writable
folder in a read-only place is claimed elsewhere; a training whose folder is moved away stops.

A filesystem without locks is a real child process whose ``fcntl.flock`` fails with ENOLCK, as
the kernel answers there; every file operation is real. Barriers are files, never sleeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import Trainer, TrainerCallback

from hf_pma.core.manifest import PMA_SUBDIR, manifest_snapshots
from hf_pma.snapshots.callback import PMACallback
from hf_pma.utils.fs import (
    FolderClaim,
    FolderMovedError,
    _host,
    claim_file_of,
    claim_path,
    process_start_ticks,
)
from tests.helpers.barriers import release_together, wait_for
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.mounts import read_only
from tests.helpers.repo import REPO_ROOT
from tests.helpers.training import make_args
from tests.helpers.two_trainings import check_second_refused, second_training_meanwhile

TRAIN = REPO_ROOT / "tests" / "dist" / "one_writer_train.py"
# Prefixed to a child's code: its flock fails as on a filesystem without locks.
NO_FLOCK = """
import errno, fcntl, os
def _no_locks(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
fcntl.flock = _no_locks
"""
RUN_SCRIPT = (
    NO_FLOCK
    + "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def child(code: str, *args: object, no_flock: bool = True, **kwargs) -> subprocess.Popen:
    """A real Python process running ``code`` (without file locks unless ``no_flock=False``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", (NO_FLOCK if no_flock else "") + code, *map(str, args)],
        env=env,
        cwd=REPO_ROOT,
        text=True,
        **kwargs,
    )


# ---------------------------------------------------------------- a training without flock


def test_a_training_without_flock_trains_and_a_second_one_there_is_refused_naming_it(tmp_path):
    """``Trainer(callbacks=[PMACallback()])`` where flock fails: it trains (rc 0, every snapshot),
    holding the claim file as its lock; a second training into the same folder meanwhile stops at
    its start naming the first (host and pid); the lock file goes with the first one's end."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    first, second, second_err, record = second_training_meanwhile(
        [sys.executable, "-c", RUN_SCRIPT, TRAIN, out],
        tmp_path,
        while_first_holds=lambda: json.loads(claim_path(out / PMA_SUBDIR).read_text()),
        env=env,
    )
    assert (record["lock"], record["pid"], record["host"]) == ("file", first.pid, _host())
    check_second_refused(first, second, second_err, out, tmp_path)


# ---------------------------------------------------------------- holders of a lock file

HOLD = """
import sys, time
from pathlib import Path
from hf_pma.utils.fs import FolderClaim
claim = FolderClaim(sys.argv[1], what="merged folder").acquire()
Path(sys.argv[2]).touch()
while not Path(sys.argv[3]).exists():
    time.sleep(0.005)
"""

TAKE = """
import json, sys
from hf_pma.utils.fs import FolderClaim, OutputBusyError, claim_path
try:
    with FolderClaim(sys.argv[1], what="merged folder").acquire(float(sys.argv[2])):
        print(claim_path(sys.argv[1]).read_text())
except OutputBusyError as err:
    print(f"BUSY {err}")
"""


def take(folder: Path, wait: float = 0.0, no_flock: bool = True) -> str:
    """What a process without locks gets when it claims ``folder``: the record it wrote, or ``BUSY <error>``."""
    proc = child(TAKE, folder, wait, no_flock=no_flock, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.strip()


def test_a_live_holder_without_flock_is_refused_to_every_kind_of_mount(tmp_path):
    """A live holder of the lock file is named (after the wait) by another process without locks,
    and by a process whose mount has flock (mixed mounts of one filesystem): neither goes around it."""
    out, ready, go = tmp_path / "merged", tmp_path / "ready", tmp_path / "go"
    holder = child(HOLD, out, ready, go)
    try:
        wait_for(ready, holder)
        expected = (
            f"BUSY merged folder {out} is being written by another process (host {_host()}, pid {holder.pid}) "
            "(waited 0.1s); wait for it to finish or choose another folder"
        )
        assert take(out, 0.1) == expected
        assert take(out, 0.1, no_flock=False) == expected
    finally:
        go.touch()
        holder.wait(timeout=60)
    assert holder.returncode == 0 and not claim_path(out).exists()


def test_a_killed_holders_lock_file_is_taken_over_by_the_next_claim(tmp_path):
    """SIGKILL leaves the lock file naming a dead process of this host: the next claim takes it
    over at once (no wait), records itself, and removes it at its end."""
    out, ready, go = tmp_path / "merged", tmp_path / "ready", tmp_path / "go"
    holder = child(HOLD, out, ready, go)
    try:
        wait_for(ready, holder)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert json.loads(claim_path(out).read_text())["pid"] == holder.pid
    record = json.loads(take(out))
    assert record["lock"] == "file" and record["pid"] != holder.pid
    assert sorted(os.listdir(tmp_path)) == ["ready"]


@pytest.mark.parametrize("where", ["another host", "another boot"])
def test_a_lock_file_that_cannot_be_checked_is_named_with_the_file_to_remove(tmp_path, where):
    """A holder on another host cannot be checked from here, nor one recorded by another boot of
    this host name (a reboot since, or another machine named so): it is named, never said to
    have ended, and its lock file is left as it was."""
    out = tmp_path / "merged"
    me = os.getpid()
    record = {"host": "node-b", "pid": me, "lock": "file"}
    if where == "another boot":
        record = {
            "host": _host(),
            "pid": me,
            "start_ticks": process_start_ticks(me),
            "boot_id": "0" * 32,
            "lock": "file",
        }
    claim = claim_path(out)
    claim.write_text(json.dumps(record))
    what = (
        "on another host, which hf-pma cannot check"
        if where == "another host"
        else "recorded by another boot of this host name (a reboot since, or another machine named so), which "
        "hf-pma cannot check"
    )
    assert take(out) == (
        f"BUSY merged folder {out} is being written by another process (host {record['host']}, pid {me}, {what}: "
        f"if that process is gone, remove {claim}); wait for it to finish or choose another folder"
    )
    assert json.loads(claim.read_text()) == record


# What the counting children run first: their arguments, then all start together (a barrier file).
COUNTER_START = """
import os, sys, time
from pathlib import Path
from hf_pma.utils.fs import hold_claim
folder, counter, ready, go, cycles = sys.argv[1:6]
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.001)
"""

CRASHING_WRITER = COUNTER_START + """
for _ in range(int(cycles)):
    pid = os.fork()
    if pid == 0:  # takes the claim, writes, and dies holding it: its lock file names a dead pid
        with hold_claim(folder, what="counter folder"):
            value = int(Path(counter).read_text()) + 1
            Path(counter).write_text(str(value))
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
"""


def test_racing_takers_of_dead_holders_lock_files_lose_no_update(tmp_path):
    """Four processes, each cycle a child that writes under the claim and dies holding it: every
    next claim takes over a dead holder's lock file, racing the others. A takeover removes only
    the dead file it read (under a guard), never another taker's new one: no update is lost."""
    folder, counter, go = tmp_path / "folder", tmp_path / "counter", tmp_path / "go"
    folder.mkdir()
    counter.write_text("0")
    names = [f"w{i}" for i in range(4)]
    procs = [
        child(CRASHING_WRITER, folder, counter, tmp_path / f"ready-{n}", go, 50, stderr=subprocess.PIPE)
        for n in names
    ]
    errors = release_together(procs, [tmp_path / f"ready-{n}" for n in names], go)
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert counter.read_text() == str(4 * 50)
    leftovers = sorted(os.listdir(tmp_path))
    assert leftovers in (
        sorted(["counter", "folder", "go", *(f"ready-{n}" for n in names)]),
        sorted(["counter", "folder", "go", ".folder.claim", *(f"ready-{n}" for n in names)]),
    )


# ---------------------------------------------------------------- a writable folder in a read-only place

RMW = COUNTER_START + """
for _ in range(int(cycles)):
    with hold_claim(folder, what="counter folder"):
        value = int(Path(counter).read_text()) + 1
        Path(counter).write_text(str(value))
"""


def test_a_writable_folder_whose_parent_is_read_only_is_still_claimed(tmp_path):
    """No claim file can be made beside such a folder, yet its records are written: the claim is
    kept in this user's private folder, keyed by the folder's identity, said once per process;
    4 x 100 read-modify-writes of one record lose nothing (unclaimed, hundreds were lost)."""
    place, scratch = tmp_path / "place", tmp_path / "scratch"
    (place / "folder").mkdir(parents=True)
    scratch.mkdir()
    (scratch / "counter").write_text("0")
    go = tmp_path / "go"
    with read_only(place):
        subprocess.run(["mount", "--bind", str(scratch), str(place / "folder")], check=True)
        try:
            folder = place / "folder"
            claim = claim_file_of(folder)
            assert claim.parent == Path(f"/tmp/hf-pma-claims-{os.getuid()}") and claim.name.endswith(".claim")
            names = [f"w{i}" for i in range(4)]
            procs = [
                child(
                    RMW,
                    folder,
                    folder / "counter",
                    tmp_path / f"ready-{n}",
                    go,
                    100,
                    no_flock=False,
                    stderr=subprocess.PIPE,
                )
                for n in names
            ]
            errors = release_together(procs, [tmp_path / f"ready-{n}" for n in names], go)
            assert [p.returncode for p in procs] == [0] * 4, errors
            assert (folder / "counter").read_text() == "400"
            for err in errors:
                said = [line for line in err.splitlines() if "is read-only, so the claim of" in line]
                assert said == [
                    f"hf-pma: {place} is read-only, so the claim of {folder} is kept in {claim}: jobs on other hosts "
                    "writing that folder are not kept apart"
                ], err
            assert not claim.exists()
        finally:
            subprocess.run(["umount", "-l", str(place / "folder")], check=False)


# ---------------------------------------------------------------- a run folder moved while it trains


class MoveAway(TrainerCallback):
    """After optimizer step 3 is logged (its snapshot written): move the run folder away, as
    ``mv`` from a shell; ``replace``: and make a new folder at the snapshot folder's path."""

    def __init__(self, out: Path, moved: Path, replace: bool) -> None:
        self.out, self.moved, self.replace = out, moved, replace

    def on_log(self, args, state, control, **kwargs):
        if state.global_step == 3:
            os.rename(self.out, self.moved)
            if self.replace:
                (self.out / PMA_SUBDIR).mkdir(parents=True)


@pytest.mark.parametrize("replace", [False, True], ids=["moved", "moved-and-recreated"])
def test_a_run_folder_moved_while_training_stops_it_at_the_next_snapshot(tmp_path, replace):
    """The folder claimed is followed by its identity, not its name: the next snapshot after the
    move stops the training in one line, and nothing is written at the old path (no new manifest
    starting over); the moved folder keeps its snapshots and manifest."""
    out, moved = tmp_path / "run", tmp_path / "moved"
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(out, max_steps=6, per_device_train_batch_size=4),
        train_dataset=TokenDataset(n=64, min_len=16, max_len=16),
        data_collator=pad_collate,
        callbacks=[PMACallback(interval_tokens=64, async_write=False), MoveAway(out, moved, replace)],
    )
    with pytest.raises(FolderMovedError) as stopped:
        trainer.train()
    how = "is another folder now" if replace else "is gone"
    assert str(stopped.value) == (
        f"snapshot folder {out / PMA_SUBDIR} {how}: it was moved or removed while this job held it; hf-pma stops "
        "rather than start over there: move it back (then resume), or start a new run"
    )
    assert trainer.state.global_step == 4
    assert [r.step for r in manifest_snapshots(moved / PMA_SUBDIR)] == [1, 2, 3]
    if replace:  # the new folder stays as it was made: nothing of the run's written into it
        assert os.listdir(out) == [PMA_SUBDIR] and os.listdir(out / PMA_SUBDIR) == []
    else:
        assert not out.exists()


def test_a_run_folder_replaced_by_a_link_to_it_is_not_the_folder_claimed(tmp_path):
    """A link put at the claimed folder's name is not the folder claimed, even when it leads to it
    (its inode by ``stat`` unchanged): a write into it stops with the moved-folder line (the
    background writer wrote on and failed with a raw FileExistsError)."""
    from hf_pma.utils.fs import check_claimed_folder

    pma = tmp_path / "run" / PMA_SUBDIR
    pma.mkdir(parents=True)
    with FolderClaim(pma, what="snapshot folder", pin=True):
        check_claimed_folder(pma)  # the folder claimed: nothing to say
        os.rename(pma, tmp_path / "run" / "elsewhere")
        os.symlink(tmp_path / "run" / "elsewhere", pma)
        with pytest.raises(FolderMovedError, match=f"snapshot folder {pma} is gone: it was moved or removed"):
            check_claimed_folder(pma)


def test_a_claim_pinned_before_its_folder_exists_follows_the_folder_made_under_it(tmp_path):
    """A training claims its snapshot folder before making it: the folder made under the claim is
    the one followed; removing it afterwards is noticed by the holder's check."""
    folder = tmp_path / "pma"
    claim = FolderClaim(folder, what="snapshot folder", pin=True).acquire()
    try:
        folder.mkdir()
        claim.check()  # first sight: pinned now
        claim.check()
        folder.rmdir()
        with pytest.raises(FolderMovedError):
            claim.check()
    finally:
        claim.release()


@pytest.mark.parametrize("no_flock", [True, False], ids=["without flock", "with flock"])
@pytest.mark.parametrize("planted", ["huge pid", "deep json"])
def test_a_planted_claim_file_is_one_line_with_or_without_flock(tmp_path, no_flock, planted):
    """A lock file naming a pid no process can have (2**70: os.kill would overflow) cannot be
    checked: one line naming the file to remove, with or without flock (a mount without it may
    hold it), the file left as it was. A claim file nested past the JSON parser's depth records no
    holder: without flock it is named the same way; with flock, which no one holds on it, it is taken."""
    out = tmp_path / "merged"
    claim = claim_path(out)
    text = json.dumps({"host": _host(), "pid": 2**70, "lock": "file"}) if planted == "huge pid" else "[" * 5000
    claim.write_text(text)
    said = take(out, 0.05, no_flock=no_flock)
    if planted == "deep json" and not no_flock:
        assert json.loads(said)["pid"] != 2**70 and not claim.exists()
        return
    assert said.startswith(f"BUSY merged folder {out} is being written by another process (") and "\n" not in said
    assert "which hf-pma cannot check" in said or "has not said which yet" in said, said
    assert claim.read_text() == text


def test_an_empty_lock_file_left_by_a_killed_maker_is_taken_over_once_old(tmp_path):
    """A process killed between making its lock file and writing its record leaves it empty: once
    older than the few seconds that takes, the next claim takes it over; a fresh one is waited for."""
    from hf_pma.utils import fs

    out = tmp_path / "merged"
    claim = claim_path(out)
    claim.touch()
    assert take(out, 0.05).startswith("BUSY ")  # just made: its maker may be writing its record
    old = time.time() - 2 * fs._EMPTY_FILE_STALE_S
    os.utime(claim, (old, old))
    record = json.loads(take(out))
    assert record["lock"] == "file" and record["host"] == _host()
    assert not claim.exists()


def test_a_dead_holder_whose_lock_another_process_is_taking_over_is_said_so(tmp_path):
    """A dead holder's lock file while another (live) taker holds the takeover guard: the waiter
    says the lock is being taken over and names the guard, never that the dead holder's
    processes still hold it."""
    from hf_pma.utils.fs import _claim_identity

    out = tmp_path / "merged"
    claim = claim_path(out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim.write_text(json.dumps({"host": _host(), "pid": dead.pid, "start_ticks": 1, "lock": "file"}))
    guard = claim.with_name(claim.name + ".takeover")
    guard.write_text(json.dumps(_claim_identity()))  # this test's process: a live taker
    said = take(out, 0.05)
    assert said == (
        f"BUSY merged folder {out} is being written by another process (host {_host()}, pid {dead.pid}, which has "
        f"ended; another process is taking its lock over: if none is, remove {guard}) (waited 0.05s); wait for it to "
        "finish or choose another folder"
    )
