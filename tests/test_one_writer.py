"""One writer per run folder: a training holds its snapshot folder for the whole run (a second one
stops at its start naming the first, on every rank); every read-modify-write of a record (the
manifest, the eval record, the card) happens under its folder's claim; a reader that meets a
snapshot deleted meanwhile says so. Real processes race; barriers are files, never sleeps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from transformers import Trainer

from hf_pma.analysis.sweep import run_sweep, write_best
from hf_pma.core.manifest import PMA_SUBDIR, manifest_snapshots
from hf_pma.evaluation.evaluator import read_eval_record
from hf_pma.merging.engine import merge_checkpoints
from hf_pma.merging.sources import resolve_sources
from hf_pma.snapshots.callback import PMACallback
from hf_pma.utils.fs import (
    FolderClaim,
    OutputBusyError,
    _host,
    claim_path,
    process_start_ticks,
    recorded_holder_state,
)
from tests.helpers.barriers import release_together, wait_for
from tests.helpers.cli import hf_pma_command, run_cli
from tests.helpers.data import TokenDataset, pad_collate, sample_text
from tests.helpers.launcher import launch
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.pma_records import merge_record
from tests.helpers.repo import REPO_ROOT
from tests.helpers.snapshot_runs import noise_deviation, write_run
from tests.helpers.training import make_args
from tests.helpers.two_trainings import check_second_refused, second_training_meanwhile

TRAIN = Path(__file__).parent / "dist" / "one_writer_train.py"
ROUNDS = 20


def python(code: str, *args: object, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], **kwargs)


def refusal(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("REFUSED")]


# ---------------------------------------------------------------- one training per snapshot folder


def test_a_second_training_in_the_same_output_dir_stops_at_its_start_naming_the_first(tmp_path):
    out = tmp_path / "run"
    # The second imports meanwhile, and starts training once the first holds its folder.
    first, second, second_err, _ = second_training_meanwhile([sys.executable, TRAIN, out], tmp_path)
    # The first run's manifest lists its own snapshots only; the claim went with its end.
    check_second_refused(first, second, second_err, out, tmp_path)


HOLD = """
import fcntl, json, os, sys, time
from pathlib import Path
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"host": sys.argv[2], "pid": 4242}).encode())
Path(sys.argv[3]).touch()
while not Path(sys.argv[4]).exists():
    time.sleep(0.005)
"""


def test_a_training_held_from_another_host_through_the_shared_filesystem_is_named(tmp_path):
    """The claim is a lock on the shared filesystem: a holder on another node (its lock and its
    record, as NFS shows them) stops this training before anything is written, saying so."""
    out = tmp_path / "run"
    out.mkdir()
    ready, go = tmp_path / "ready", tmp_path / "go"
    holder = python(HOLD, claim_path(out / PMA_SUBDIR), "node-b", ready, go)
    try:
        wait_for(ready, holder)
        trainer = tiny_trainer(out)
        with pytest.raises(FileExistsError) as refused:
            trainer.train()
    finally:
        go.touch()
        holder.wait(timeout=60)
    assert str(refused.value) == (
        f"snapshot folder {out / PMA_SUBDIR} is in use by another training (host node-b, pid 4242, on another "
        f"host, which hf-pma cannot check: if that process is gone, remove {claim_path(out / PMA_SUBDIR)}); wait for "
        "it to finish or choose another folder"
    )
    assert trainer.state.global_step == 0 and not (out / PMA_SUBDIR).exists()


KILLED = """
import sys, time
from pathlib import Path
from hf_pma.utils.fs import FolderClaim
claim = FolderClaim(sys.argv[1], what="snapshot folder").acquire()
Path(sys.argv[2]).touch()
time.sleep(600)
"""


def tiny_trainer(out: Path) -> Trainer:
    return Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(out, max_steps=2),
        train_dataset=TokenDataset(n=16),
        data_collator=pad_collate,
        callbacks=[PMACallback(interval_tokens=64)],
    )


def test_the_claim_goes_with_a_killed_training_and_with_the_end_of_one(tmp_path):
    out, ready = tmp_path / "run", tmp_path / "ready"
    out.mkdir()
    holder = python(KILLED, out / PMA_SUBDIR, ready)
    try:
        wait_for(ready, holder)
    finally:
        holder.kill()  # SIGKILL: no clean-up ran; its claim file stays, naming a dead pid
        holder.wait(timeout=60)
    assert json.loads(claim_path(out / PMA_SUBDIR).read_text())["pid"] == holder.pid
    tiny_trainer(out).train()  # the kernel released the lock with the process
    assert [r.step for r in manifest_snapshots(out / PMA_SUBDIR)] == [1, 2]
    assert sorted(os.listdir(out)) == [PMA_SUBDIR]  # released at train end
    with FolderClaim(out / PMA_SUBDIR) as claim:  # by another job, at once
        assert claim.held


def test_under_ddp_every_rank_stops_with_the_main_process_refusal(tmp_path):
    """Only rank 0 (the one that writes the manifest) takes the claim; its refusal reaches every
    rank, none waits in a collective."""
    out = tmp_path / "run"
    out.mkdir()
    with FolderClaim(out / PMA_SUBDIR, what="snapshot folder") as claim:  # this test process trains there
        assert claim.held
        result = launch(TRAIN, out, nproc=2, check=False, timeout=300)
    assert not result.timed_out and result.returncode != 0, result.report()
    expected = (
        f"snapshot folder {out / PMA_SUBDIR} is in use by another training (host {_host()}, pid {os.getpid()}); "
        "wait for it to finish or choose another folder"
    )
    for rank in (0, 1):
        assert refusal(result.output(rank, "stderr")) == [f"REFUSED rank {rank}: {expected}"], result.report()
    assert not (out / PMA_SUBDIR / "manifest.json").exists()


# ---------------------------------------------------------------- read-modify-writes of records

RECORD_WRITER = """
import sys, time
from pathlib import Path
from hf_pma.evaluation.evaluator import write_eval_record
folder, me, ready, go = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
ready.touch()
while not go.exists():
    time.sleep(0.002)
for j in range(int(sys.argv[5])):
    write_eval_record(folder, {f"{me}-{j}": {"lm": {"loss": float(j)}}}, eval_dataset="heldout.jsonl")  # one held-out set: one record
"""

MANIFEST_WRITER = """
import sys, time
from pathlib import Path
from hf_pma.core.manifest import SnapshotRecord, add_snapshot
pma, me, ready, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
ready.touch()
while not go.exists():
    time.sleep(0.002)
for j in range(int(sys.argv[5])):
    tokens = 2 * j + me
    add_snapshot(pma, SnapshotRecord(path=f"snapshot-{tokens}", tokens=tokens, step=tokens))
"""


def race(tmp_path: Path, code: str, target: Path, names: list[str]) -> None:
    """Start one writer per name, release them together, and wait for them to succeed."""
    go = tmp_path / "go"
    writers = [
        python(code, target, name, tmp_path / f"ready-{name}", go, ROUNDS, stderr=subprocess.PIPE)
        for name in names
    ]
    errors = release_together(writers, [tmp_path / f"ready-{name}" for name in names], go)
    assert [w.returncode for w in writers] == [0] * len(names), errors


def test_two_eval_record_writers_keep_every_result(tmp_path):
    folder = tmp_path / "merged"
    folder.mkdir()
    race(tmp_path, RECORD_WRITER, folder, ["a", "b"])
    record = read_eval_record(folder)
    assert sorted(record["results"]) == sorted(f"{me}-{j}" for me in "ab" for j in range(ROUNDS))
    assert sorted(os.listdir(tmp_path)) == ["go", "merged", "ready-a", "ready-b"]  # the claim is gone


def test_two_processes_appending_to_one_manifest_keep_every_snapshot(tmp_path):
    pma = tmp_path / "run" / PMA_SUBDIR
    pma.mkdir(parents=True)
    race(tmp_path, MANIFEST_WRITER, pma, ["0", "1"])
    assert [r.tokens for r in manifest_snapshots(pma)] == list(range(2 * ROUNDS))


MERGE_OVERWRITE = """
import sys, time
from pathlib import Path
from hf_pma.utils.fs import claim_output, publish_folder, temporary_path
out, record, ready, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
with claim_output(out, overwrite=True):  # as a merge does: claimed, written aside, published
    tmp = temporary_path(out)
    tmp.mkdir()
    (tmp / "pma_merge.json").write_text(record)
    ready.touch()
    while not go.exists():
        time.sleep(0.002)
    publish_folder(tmp, out, replace=True)
"""


def test_a_card_written_while_a_merge_overwrites_the_folder_describes_the_new_merge(tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "pma_merge.json").write_text(json.dumps(merge_record("sma")))
    ready, go = tmp_path / "ready", tmp_path / "go"
    merge = python(MERGE_OVERWRITE, out, json.dumps(merge_record("ema", alpha=0.3)), ready, go)
    try:
        wait_for(ready, merge)
        card = python(
            "import sys; from hf_pma.cli import main; sys.exit(main())",
            "card",
            out,
            "--no-plot",
            "--model-name",
            "racer",
            stderr=subprocess.PIPE,
            text=True,
        )
        # Released once the card waits for the merge's claim (or, without a claim, once it is done).
        waited = next((line for line in card.stderr if "waiting up to" in line), None)
    finally:
        go.touch()
        merge.wait(timeout=60)
    card.wait(timeout=120)
    assert merge.returncode == 0 and card.returncode == 0, card.stderr.read()
    assert waited is not None and (
        f"merged folder {out} is being written by another process (host {_host()}, pid {merge.pid}); waiting up to 30s"
        in waited
    )
    text = (out / "README.md").read_text()
    assert json.loads((out / "pma_merge.json").read_text())["strategy"] == "ema"
    assert "ema" in text.lower() and "sma" not in text.lower(), text


# ---------------------------------------------------------------- a snapshot deleted meanwhile


@pytest.fixture
def run_in_cwd(tmp_path, tiny_tokenizer, monkeypatch):
    """A run of 4 snapshots, its sources resolved from inside ``pma/`` (names without a folder:
    ``snapshot-4000``, which would be a valid Hub id)."""
    run, _ = write_run(tmp_path / "run", 4, noise_deviation(0.03), tokenizer=tiny_tokenizer)
    monkeypatch.chdir(run / PMA_SUBDIR)
    return run, resolve_sources(["."])


@pytest.mark.parametrize("gone", [0, 3], ids=["oldest", "newest"])
def test_a_sweep_that_meets_a_snapshot_rotated_out_says_so(run_in_cwd, gone):
    run, sources = run_in_cwd
    assert str(sources[gone].path) == f"snapshot-{1000 * (gone + 1)}"
    shutil.rmtree(run / PMA_SUBDIR / sources[gone].path)  # keep_last, between the listing and the reading
    with pytest.raises(FileNotFoundError) as err:
        run_sweep(
            sources, windows=[4], every=[1], strategies=["sma"], texts=[sample_text(2000)], progress=False
        )
    assert str(err.value) == (
        f"snapshot snapshot-{1000 * (gone + 1)} listed in manifest.json was deleted while this command ran "
        f"(keep_last rotation?): snapshot-{1000 * (gone + 1)} is gone; run it again to use the snapshots listed now"
    )


def test_writing_the_best_merge_after_its_snapshot_rotated_out_says_so(run_in_cwd, tmp_path):
    run, sources = run_in_cwd
    report = run_sweep(
        sources, windows=[2], every=[1], strategies=["sma"], texts=[sample_text(2000)], progress=False
    )
    assert report["best"] == "sma N=2 k=1"
    shutil.rmtree(run / PMA_SUBDIR / "snapshot-3000")  # keep_last, between the sweep and --best-output
    with pytest.raises(FileNotFoundError) as err:
        write_best(report, tmp_path / "best", progress=False)
    assert str(err.value) == (
        "snapshot snapshot-3000 of the sweep was deleted while this command ran (keep_last rotation?); run the "
        "sweep again to use the snapshots listed now"
    )
    assert not (tmp_path / "best").exists()


def test_a_merge_that_meets_a_snapshot_rotated_out_says_so(run_in_cwd, tmp_path):
    run, sources = run_in_cwd
    shutil.rmtree(run / PMA_SUBDIR / "snapshot-1000")  # keep_last, between resolving and opening
    with pytest.raises(FileNotFoundError) as err:
        merge_checkpoints(sources, tmp_path / "merged", progress=False)
    assert str(err.value) == (
        "snapshot snapshot-1000 listed in manifest.json was deleted while this command ran (keep_last rotation?): "
        "snapshot-1000 is gone; run it again to use the snapshots listed now"
    )
    assert not (tmp_path / "merged").exists()


# ---------------------------------------------------------------- the claim under contention

CYCLES = Path(__file__).parent / "dist" / "claim_cycles.py"


def race_on_claim(tmp_path: Path, roles: dict[str, int], *flags: str) -> tuple[list[subprocess.Popen], list[str]]:
    """Start one ``claim_cycles.py`` per role (``{"writer-0": cycles, "reader-0": cycles}``) on one
    counter folder, release them together; their processes (ended) and stderr."""
    folder, counter, go = tmp_path / "folder", tmp_path / "counter", tmp_path / "go"
    folder.mkdir()
    counter.write_text("0")
    procs = [
        python(
            CYCLES.read_text(), folder, counter, name.split("-")[0], cycles, tmp_path / f"ready-{name}", go, *flags,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, cycles in roles.items()
    ]
    return procs, release_together(procs, [tmp_path / f"ready-{name}" for name in roles], go)


def test_many_processes_taking_a_claim_thousands_of_times_lose_no_update(tmp_path):
    """Six writers take the claim 700 times each, exclusively, for a read-modify-write of a counter
    (written in two steps); two readers take it shared 700 times each and never see the first
    step. A waiter that opens the claim file as its holder removes it opens it anew (the crash
    was ``a file with 0 hard links``); no update is lost, and the claim file goes with the last holder."""
    roles = {**{f"writer-{i}": 700 for i in range(6)}, **{f"reader-{i}": 700 for i in range(2)}}
    procs, errors = race_on_claim(tmp_path, roles)
    assert [p.returncode for p in procs] == [0] * len(roles), errors
    assert (tmp_path / "counter").read_text() == str(6 * 700)
    assert sorted(os.listdir(tmp_path)) == sorted(["counter", "folder", "go", *(f"ready-{n}" for n in roles)])


def test_without_file_locks_the_claim_file_itself_keeps_writers_apart(tmp_path):
    """Where ``flock`` fails (ENOLCK: Lustre without -o flock, NFS without lockd) the claim file,
    made exclusively, is the lock: 4 x 100 read-modify-writes lose no update (unlocked, hundreds
    were lost), a reader never sees a write in progress, and the claim file goes with the last."""
    roles = {**{f"writer-{i}": 100 for i in range(4)}, "reader-0": 100}
    procs, errors = race_on_claim(tmp_path, roles, "--no-flock")
    assert [p.returncode for p in procs] == [0] * len(roles), errors
    assert (tmp_path / "counter").read_text() == str(4 * 100)
    assert not claim_path(tmp_path / "folder").exists()


NO_FLOCK_CLI = """
import errno, fcntl, os, sys
def no_locks(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
fcntl.flock = no_locks
from hf_pma.cli import main
sys.exit(main())
"""


def test_a_merge_on_a_filesystem_without_locks_claims_its_output_with_a_lock_file(tmp_path):
    sources = [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(2)]
    out = tmp_path / "merged"
    done = subprocess.run(
        [sys.executable, "-c", NO_FLOCK_CLI, "merge", *map(str, sources), "-o", str(out), "-q"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["merged", "s0", "s1"]  # the lock file went with the merge


# ---------------------------------------------------------------- a stale claim


def test_a_claim_file_naming_a_reused_pid_is_taken_at_once(tmp_path):
    """A claim file left by a killed job names a pid that now belongs to another process (here: this
    test's own parent): nothing holds its lock, so the next claim takes it and records itself."""
    out = tmp_path / "merged"
    claim = claim_path(out)
    claim.write_text(json.dumps({"host": _host(), "pid": os.getppid(), "start_ticks": 1, "boot_id": "x"}))
    assert recorded_holder_state(json.loads(claim.read_text())) == "gone"
    with FolderClaim(out) as taken:
        assert taken.held
        record = json.loads(claim.read_text())
        assert (record["pid"], record["start_ticks"]) == (os.getpid(), process_start_ticks(os.getpid()))
        assert recorded_holder_state(record) == "alive"
    assert not claim.exists()


HOLD_AS = """
import fcntl, json, os, sys, time
from pathlib import Path
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, sys.argv[2].encode())
Path(sys.argv[3]).touch()
while not Path(sys.argv[4]).exists():
    time.sleep(0.005)
"""


@pytest.mark.parametrize(
    "recorded", ["reused pid", "earlier boot", "no start time"], ids=["reused-pid", "earlier-boot", "old-record"]
)
def test_a_claim_held_by_a_process_it_does_not_name_is_refused_naming_the_file_to_remove(tmp_path, recorded):
    """The lock is held, but the record names a process that is not it (a pid now another process's,
    a pid of an earlier boot) or one that cannot be told apart (no start time recorded): the error
    names the claim file to remove once that job is gone, instead of waiting on a stranger."""
    out = tmp_path / "merged"
    claim, ready, go = claim_path(out), tmp_path / "ready", tmp_path / "go"
    record = {"host": _host(), "pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid()) + 1}
    if recorded == "earlier boot":
        record.update(start_ticks=record["start_ticks"] - 1, boot_id="0" * 32)
    if recorded == "no start time":
        del record["start_ticks"]
    holder = python(HOLD_AS, claim, json.dumps(record), ready, go)
    try:
        wait_for(ready, holder)
        with pytest.raises(OutputBusyError) as err:
            FolderClaim(out, what="merged folder").acquire()
    finally:
        go.touch()
        holder.wait(timeout=60)
    who = f"host {_host()}, pid {os.getpid()}"
    expected = {
        "no start time": f"{who}, which hf-pma cannot check: if that process is gone, remove {claim}",
        # Held now, so not "ended": a reboot since, or a machine of the same name holding it.
        "earlier boot": f"{who}, recorded by another boot of this host name (a reboot since, or another machine "
        f"named so), which hf-pma cannot check: if that process is gone, remove {claim}",
        "reused pid": f"{who}, which has ended (its pid may now be another process's), yet a process it started "
        f"still holds the lock: once none is left, remove {claim}",
    }[recorded]
    assert str(err.value) == (
        f"merged folder {out} is being written by another process ({expected}); wait for it to finish or choose "
        "another folder"
    )


FORK_AND_HOLD = """
import os, sys, time
from pathlib import Path
from hf_pma.utils.fs import FolderClaim
claim = FolderClaim(sys.argv[1]).acquire()
child = os.fork()
if child == 0:  # a DataLoader worker, a fork pool: outlives its parent here
    Path(sys.argv[3]).write_text(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
while not Path(sys.argv[3]).exists():
    time.sleep(0.005)
Path(sys.argv[2]).touch()
time.sleep(600)
"""


def test_a_forked_child_that_outlives_its_killed_parent_does_not_keep_the_claim(tmp_path):
    out, ready, child_pid = tmp_path / "merged", tmp_path / "ready", tmp_path / "child"
    parent = python(FORK_AND_HOLD, out, ready, child_pid)
    try:
        wait_for(ready, parent)
        parent.kill()
        parent.wait(timeout=60)
        with FolderClaim(out) as claim:  # the child lives on, yet does not hold it
            assert claim.held
    finally:
        if child_pid.exists():
            os.kill(int(child_pid.read_text()), signal.SIGKILL)


# ---------------------------------------------------------------- eval: readers and record writers


EVAL_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}


def _eval_command(model: Path, heldout: Path, label: str, out: Path, *extra: object) -> list[str]:
    return [
        hf_pma_command(), "eval", str(model), "--labels", label, "--eval-file", str(heldout), "--block-size", "32",
        "-o", str(out), "-q", *map(str, extra),
    ]


@pytest.mark.slow
def test_eval_record_writers_in_several_processes_keep_every_result(tmp_path, tiny_tokenizer):
    model = tmp_path / "model"
    save_model_folder(model, make_tiny_model(seed=1), tiny_tokenizer)
    record = tmp_path / "merged"
    record.mkdir()
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(400))
    labels = [f"run {i}" for i in range(3)]
    evals = [
        subprocess.Popen(
            _eval_command(model, heldout, label, tmp_path / f"{i}.json", "--record", record),
            stderr=subprocess.PIPE, text=True, env=EVAL_ENV,
        )
        for i, label in enumerate(labels)
    ]
    errors = [e.communicate(timeout=600)[1] for e in evals]
    assert [e.returncode for e in evals] == [0] * 3, errors
    assert sorted(read_eval_record(record)["results"]) == labels
    assert sorted(os.listdir(record)) == ["pma_eval.json"] and not claim_path(record).exists()


MERGE_REPLACING = """
import shutil, sys, time
from pathlib import Path
from hf_pma.utils.fs import claim_output, publish_folder, temporary_path
out, new, ready, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
with claim_output(out, overwrite=True):  # as merge --overwrite does: claimed, written aside, published
    tmp = temporary_path(out)
    shutil.copytree(new, tmp)
    ready.touch()
    while not go.exists():
        time.sleep(0.002)
    publish_folder(tmp, out, replace=True)
"""


@pytest.mark.slow
def test_an_eval_of_a_merge_being_replaced_reads_one_version_of_it(tmp_path, tiny_tokenizer):
    """The model folder is read under its shared claim: an eval that starts while a merge replaces
    the folder waits for it (saying so), then evaluates the new model, never a mix of the two."""
    out, new = tmp_path / "merged", tmp_path / "new"
    save_model_folder(out, make_tiny_model(seed=1), tiny_tokenizer)
    save_model_folder(new, make_tiny_model(seed=2), tiny_tokenizer)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(400))
    ready, go = tmp_path / "ready", tmp_path / "go"
    merge = python(MERGE_REPLACING, out, new, ready, go)
    try:
        wait_for(ready, merge)
        reader = subprocess.Popen(
            _eval_command(out, heldout, "merged", tmp_path / "during.json"),
            stderr=subprocess.PIPE, text=True, env=EVAL_ENV,
        )
        waited = next((line for line in reader.stderr if "waiting up to" in line), None)
    finally:
        go.touch()
        merge.wait(timeout=60)
    rest = reader.communicate(timeout=600)[1]
    assert merge.returncode == 0 and reader.returncode == 0, rest
    assert waited is not None and (
        f"model folder {out} is being written by another process (host {_host()}, pid {merge.pid}); waiting up to 30s"
        in waited
    )
    done = run_cli(*_eval_command(new, heldout, "merged", tmp_path / "new.json")[1:])
    assert done.returncode == 0, done.stderr
    during, direct = (json.loads((tmp_path / n).read_text())["results"] for n in ("during.json", "new.json"))
    assert during == direct


AS_ANOTHER_USER = """
import fcntl, os, sys
from hf_pma.utils.fs import FolderClaim, OutputBusyError  # imported first: the interpreter lives under /root
os.setgid(65534); os.setuid(65534)  # nobody
try:
    claim = FolderClaim(sys.argv[1], what="merged folder").acquire()
except OutputBusyError as err:
    print(err)
    sys.exit(3)
print("held" if claim.held else "not held")
"""


def test_another_users_claim_file_is_neither_gone_around_nor_lockable_by_them(tmp_path_factory):
    """A claim file is its owner's only (0600): another user can neither lock it (and hold the
    folder forever) nor take the folder as unclaimed; they are told the file to remove once the
    owner's job is done. Needs root, as CI runs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    shared = Path(tempfile.mkdtemp(prefix="hf-pma-shared-"))  # a group folder: everyone may write
    try:
        shared.chmod(0o777)
        folder = shared / "merged"
        with FolderClaim(folder, what="merged folder") as mine:
            assert mine.held and stat.S_IMODE(claim_path(folder).stat().st_mode) == 0o600
            done = subprocess.run(
                [sys.executable, "-c", AS_ANOTHER_USER, str(folder)], capture_output=True, text=True, timeout=120,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd="/",
            )
        assert done.returncode == 3, done.stdout + done.stderr
        assert done.stdout.strip() == (
            f"merged folder {folder}: its claim file {claim_path(folder)} belongs to another user (Permission "
            f"denied); that user's job holds it or left it: once it is done, remove {claim_path(folder)}, or choose "
            "another folder"
        )
        assert not claim_path(folder).exists()
    finally:
        shutil.rmtree(shared)
