"""Outputs are created exclusively: two jobs aiming at the same new folder never both succeed
(real processes: two ``hf-pma merge`` at once, a live holder, a killed holder; the merge that
meets them runs in this process, ``tests.helpers.cli.run_cli``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from hf_pma.utils.fs import (
    OutputBusyError,
    OutputExistsError,
    claim_output,
    claim_path,
    publish_folder,
    temporary_path,
)
from tests.helpers.cli import hf_pma_command, run_cli
from tests.helpers.data import corpus
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.paused_merge import child_env, paused_merge, resume
from tests.helpers.snapshot_runs import noise_deviation, write_run

# A process that claims an output folder, says so, and holds the claim until its stdin closes.
HOLDER = """
import sys
from hf_pma.utils.fs import claim_output
with claim_output(sys.argv[1]):
    print("claimed", flush=True)
    sys.stdin.read()
"""


def _merge_cmd(*args) -> list[str]:
    """``hf-pma merge ARGS -q`` as a process of its own (two merges racing each other)."""
    return [hf_pma_command(), "merge", *map(str, args), "-q"]


def _error_line(stderr: str) -> str:
    """The one error line of a failed command (and no traceback)."""
    errors = [line for line in stderr.splitlines() if line.startswith("hf-pma merge: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.fixture()
def sources(tmp_path):
    return [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(3)]


def _holder(target):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_two_merges_into_the_same_new_folder_never_both_succeed(tmp_path, sources):
    out = tmp_path / "merged"
    # Different strategies, so the folder tells which one won.
    jobs = {
        "sma": subprocess.Popen(
            _merge_cmd(*sources, "-o", out, "--strategy", "sma"),
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        ),
        "wma": subprocess.Popen(
            _merge_cmd(*sources, "-o", out, "--strategy", "wma"),
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        ),
    }
    results = {name: (job.wait(timeout=300), job.stderr.read()) for name, job in jobs.items()}
    winners = [name for name, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    (loser,) = set(results) - set(winners)
    code, err = results[loser]
    line = _error_line(err)
    assert code == 2 and str(out) in line
    # Whichever moment the loser stopped at: the winner was writing (named), had written, or published first.
    assert any(
        s in line
        for s in ("being written by another process (", "is not empty", "created by another process")
    ), line
    assert json.loads((out / "pma_merge.json").read_text())["strategy"] == winners[0]
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    )  # no temporary, no claim left


def test_a_merge_into_a_folder_another_merge_is_writing_stops_and_the_first_one_wins(tmp_path, sources):
    out = tmp_path / "merged"
    with paused_merge(*sources, "-o", out, "-q", "--strategy", "sma") as first:
        second = run_cli("merge", *sources, "-o", out, "--strategy", "wma", "-q")
        assert resume(first) == 0, first.stderr.read()
    assert second.returncode == 2
    assert (
        f"{out} is being written by another process (host {socket.gethostname()}, pid {first.pid})"
        in _error_line(second.stderr)
    )
    assert json.loads((out / "pma_merge.json").read_text())["strategy"] == "sma"  # the first one's, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_merge_stops_at_once_naming_the_process_that_writes_the_folder(tmp_path, sources):
    out = tmp_path / "merged"
    holder = _holder(out)
    try:
        busy = run_cli("merge", *sources, "-o", out, "-q")
        busy_overwrite = run_cli("merge", *sources, "-o", out, "--overwrite", "-q")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    for result in (busy, busy_overwrite):
        assert result.returncode == 2
        host = socket.gethostname()
        assert (
            f"output folder {out} is being written by another process (host {host}, pid {holder.pid})"
            in _error_line(result.stderr)
        )
    assert not out.exists() and not claim_path(out).exists()
    # Released: the next merge goes through.
    done = run_cli("merge", *sources, "-o", out, "-q")
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors").is_file() and not claim_path(out).exists()


def test_a_killed_holder_never_blocks_the_next_job(tmp_path, sources):
    out = tmp_path / "merged"
    holder = _holder(out)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    assert claim_path(out).exists()  # left behind by the kill, with the dead holder's pid inside
    done = run_cli("merge", *sources, "-o", out, "-q")
    assert done.returncode == 0, done.stderr
    assert not claim_path(out).exists()


def test_claim_rechecks_the_folder_and_publish_never_replaces_without_overwrite(tmp_path):
    out = tmp_path / "out"
    # A job that finished between our first check and our claim left a non-empty folder.
    out.mkdir()
    (out / "theirs.txt").write_text("theirs")
    with pytest.raises(OutputExistsError, match="is not empty"):
        with claim_output(out, overwrite=False):
            pass
    assert not claim_path(out).exists()
    # Without a lock (a filesystem without flock): the rename itself refuses a non-empty folder.
    tmp = temporary_path(out)
    tmp.mkdir()
    (tmp / "mine.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="created by another process"):
        publish_folder(tmp, out, replace=False)
    assert (out / "theirs.txt").read_text() == "theirs" and not (out / "mine.txt").exists()
    # An empty folder (made by the user beforehand) is taken.
    empty = tmp_path / "empty"
    empty.mkdir()
    publish_folder(tmp, empty, replace=False)
    assert (empty / "mine.txt").read_text() == "mine"


def test_claims_exclude_each_other_within_one_process_too(tmp_path):
    out = tmp_path / "out"
    with claim_output(out):
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()}"):
            with claim_output(out):
                pass
    with claim_output(out):  # released
        pass


# ---------------------------------------------------------------- what --overwrite may replace


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_overwrite_never_replaces_a_listed_snapshot_a_checkpoint_or_a_user_folder(tmp_path, sources):
    run, _ = write_run(tmp_path / "run", 3, noise_deviation())
    pma = run / "pma"
    snapshots = sorted(
        (p for p in pma.iterdir() if p.name.startswith("snapshot-")), key=lambda p: int(p.name.split("-")[1])
    )
    checkpoint = save_model_folder(tmp_path / "trainer" / "checkpoint-10", make_tiny_model(seed=7))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    cases = {
        snapshots[
            -1
        ]: f"it is a snapshot listed in {pma / 'manifest.json'}",  # and a source of this merge (--last 2)
        snapshots[0]: f"it is a snapshot listed in {pma / 'manifest.json'}",  # listed, not merged now
        checkpoint: "it is a Trainer checkpoint",
        user: "hf-pma did not write it",
    }
    before = {folder: _files(folder) for folder in cases}
    for folder, reason in cases.items():
        result = run_cli("merge", run, "--last", "2", "-o", folder, "--overwrite", "-q")
        assert result.returncode == 2 and reason in _error_line(result.stderr), (folder, result.stderr)
        if folder in (checkpoint, user):  # the library says "overwrite refuses ..."; the command names its flag
            assert _error_line(result.stderr).startswith(f"hf-pma merge: error: --overwrite refuses to replace {folder}: ")
        assert _files(folder) == before[folder], folder
    # a symlink to a merge hf-pma wrote is not replaced either (nor followed)
    merged = tmp_path / "merged"
    assert run_cli("merge", *sources, "-o", merged, "-q").returncode == 0
    link = tmp_path / "link"
    link.symlink_to(merged)
    refused = run_cli("merge", *sources, "-o", link, "--overwrite", "-q")
    assert refused.returncode == 2 and "is a symbolic link" in _error_line(refused.stderr)
    # a merge hf-pma wrote that is a source of this merge is not replaced
    before = _files(merged)
    refused = run_cli("merge", merged, sources[0], "-o", merged, "--overwrite", "-q")
    assert refused.returncode == 2 and "overlaps source" in _error_line(refused.stderr)
    assert _files(merged) == before
    # an earlier merge is replaced
    again = run_cli("merge", *sources, "-o", merged, "--overwrite", "--strategy", "wma", "-q")
    assert again.returncode == 0, again.stderr
    assert json.loads((merged / "pma_merge.json").read_text())["strategy"] == "wma" and link.is_symlink()


def test_make_tasks_overwrite_replaces_only_a_task_folder(tmp_path):
    source = tmp_path / "corpus"
    source.mkdir()
    for i, doc in enumerate(corpus()):
        (source / f"doc{i:03d}.py").write_text(doc)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    args = [source, "--eval-fraction", "0.3", "--num-items", "10", "--overwrite", "-q"]
    refused = run_cli("make-tasks", *args[:1], "-o", user, *args[1:])
    assert refused.returncode == 2 and "hf-pma did not write it (no tasks_info.json" in refused.stderr
    assert _files(user) == {"notes.txt": b"my notes"}
    tasks = tmp_path / "tasks"
    assert (
        run_cli(
            "make-tasks", source, "-o", tasks, "--eval-fraction", "0.3", "--num-items", "10", "-q"
        ).returncode
        == 0
    )
    replaced = run_cli("make-tasks", *args[:1], "-o", tasks, *args[1:])
    assert replaced.returncode == 0, replaced.stderr


def test_the_overwrite_refusal_is_one_line_whatever_the_folder_is_named(tmp_path):
    """A folder named with a line break and an escape sequence, holding a Trainer checkpoint's
    trainer_state.json: the library's refusal shows the name escaped, on one line."""
    from hf_pma.core.outputs import check_overwrite_target

    folder = tmp_path / "out\nlast must\x1b[31m"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    with pytest.raises(FileExistsError, match="^overwrite refuses to replace ") as err:
        check_overwrite_target(folder, ["pma_merge.json"])
    assert "\n" not in str(err.value) and "\x1b" not in str(err.value)
    assert err.value.parameter == "overwrite"
