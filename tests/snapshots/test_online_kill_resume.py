"""Online averages exact after any kill: a real Trainer child (tests/dist/online_save_killed.py)
SIGKILLed between the Trainer's checkpoint and the average's state, then resumed; its final
average must equal an uninterrupted run's bit for bit (``torch.equal``), or the resume refuses
in one line that names the checkpoint to resume from instead. Never silently fewer snapshots."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_pma.snapshots.online import OnlineAverage
from hf_pma.snapshots.sinks import (
    ONLINE_STATE_NAME,
    STAGED_STATE_DIR,
    OnlineAverageSink,
    ResumePoint,
    restore_staged_states,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist" / "online_save_killed.py"
KILL_STEP = 8
STAGED = f"step-{KILL_STEP}-{ONLINE_STATE_NAME}"


def child(out: Path, *options: str) -> subprocess.CompletedProcess:
    """Run the training child (no timeout: its own end, or its SIGKILL, ends it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(SCRIPT), "--out", str(out), *options]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


def killed(out: Path, where: str, *options: str) -> None:
    done = child(out, "--kill", where, *options)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]


def finished(out: Path, *options: str) -> subprocess.CompletedProcess:
    done = child(out, *options)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def final(out: Path, kind: str = "sma") -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """The run's final float32 average and the (tokens, step) of every snapshot in it."""
    record = json.loads((out / "pma" / f"online-{kind}" / "pma_merge.json").read_text())
    return load_file(out / "final.safetensors"), [(s["tokens"], s["step"]) for s in record["sources"]]


def assert_same(a: tuple, b: tuple) -> None:
    (wa, sa), (wb, sb) = a, b
    assert sa == sb  # the same snapshots, none lost
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple:
    """The uninterrupted run's average (12 snapshots, one a step)."""
    out = tmp_path_factory.mktemp("straight")
    finished(out)
    result = final(out)
    assert len(result[1]) == 12
    return result


@pytest.fixture(scope="module")
def killed_on_save(tmp_path_factory) -> Path:
    """A run killed once checkpoint-8 was whole, before PMACallback's on_save put the average in it."""
    out = tmp_path_factory.mktemp("killed") / "run"
    killed(out, "on_save")
    assert (out / "checkpoint-8" / "trainer_state.json").is_file()
    assert not (out / "checkpoint-8" / ONLINE_STATE_NAME).exists()
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


def test_killed_after_the_checkpoint_before_the_average_resumes_exactly(killed_on_save, straight, tmp_path):
    out = copy_of(killed_on_save, tmp_path)
    done = finished(out, "--resume")
    assert "lacked its online average" in done.stderr  # said once, and repaired
    assert_same(final(out), straight)
    # The checkpoint holds its average now, stamped with its step; nothing is left staged.
    restored = OnlineAverage.load_state(out / "checkpoint-8" / ONLINE_STATE_NAME)
    assert (restored.count, restored.saved_at) == (8, (8, 8 * 64))
    assert not (out / "pma" / STAGED_STATE_DIR / STAGED).exists()


def test_rotated_checkpoints_and_unaligned_logging_resume_exactly(tmp_path):
    """save_total_limit=1: the rotation removed checkpoint-4 before the kill (nothing earlier to go
    back to); logging every 5 steps: the state is staged at the step's end, not at its log."""
    options = ("--online", "1-sqrt-decay", "--window-steps", "6", "--logging-steps", "5", "--save-total-limit", "1")
    finished(tmp_path / "straight", *options)
    killed(tmp_path / "run", "on_save", *options)
    assert not (tmp_path / "run" / "checkpoint-4").exists()
    finished(tmp_path / "run", "--resume", *options)
    assert_same(final(tmp_path / "run", "1-sqrt-decay"), final(tmp_path / "straight", "1-sqrt-decay"))


def test_killed_with_the_state_staged_before_the_checkpoint_resumes_exactly(straight, tmp_path):
    out = tmp_path / "run"
    killed(out, "after_stage")
    assert not (out / "checkpoint-8").exists() and (out / "pma" / STAGED_STATE_DIR / STAGED).is_file()
    finished(out, "--resume")  # from checkpoint-4; the staged state of step 8 is written anew
    assert_same(final(out), straight)
    assert OnlineAverage.load_state(out / "checkpoint-8" / ONLINE_STATE_NAME).saved_at == (8, 8 * 64)


def test_a_lost_average_refuses_and_names_the_checkpoint_that_has_one(killed_on_save, straight, tmp_path):
    out = copy_of(killed_on_save, tmp_path)
    (out / "pma" / STAGED_STATE_DIR / STAGED).unlink()
    before = sorted(p.name for p in (out / "checkpoint-8").iterdir())
    done = child(out, "--resume")
    assert done.returncode == 1
    line = last_line(done)
    assert line.endswith("checkpoint-8 lacks the online average of 8 snapshots the run held (stopped before saving "
                         "it?): resume from checkpoint-4 beside it, which holds one")
    assert sorted(p.name for p in (out / "checkpoint-8").iterdir()) == before  # nothing written
    # What it says works: from checkpoint-4, the run ends with the uninterrupted average.
    finished(out, "--resume-from", str(out / "checkpoint-4"))
    assert_same(final(out), straight)


@pytest.mark.parametrize("stale", ["other-step", "garbage"])
def test_a_stale_or_foreign_average_is_never_resumed(killed_on_save, tmp_path, stale):
    out = copy_of(killed_on_save, tmp_path)
    staged = out / "pma" / STAGED_STATE_DIR / STAGED
    if stale == "other-step":  # checkpoint-4's average, put into checkpoint-8
        staged.unlink()
        shutil.copyfile(out / "checkpoint-4" / ONLINE_STATE_NAME, out / "checkpoint-8" / ONLINE_STATE_NAME)
        says = "holds the online average of step 4 (256 tokens), not of this checkpoint's step 8 (512 tokens)"
    else:  # the staged file is not an average: never moved in
        staged.write_bytes(b"\x00" * 64)
        says = "lacks the online average of 8 snapshots the run held"
    done = child(out, "--resume")
    assert done.returncode == 1 and says in last_line(done)
    assert "resume from" in last_line(done)


# --------------------------------------------------------------------------- the staging folder, planted


def test_a_link_planted_as_the_staging_folder_stops_the_run_before_it_starts(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "pma").mkdir()
    (tmp_path / "pma" / STAGED_STATE_DIR).symlink_to(elsewhere)
    with pytest.raises(FileExistsError, match=f"{STAGED_STATE_DIR} is a link or a file, not the folder") as err:
        OnlineAverageSink(tmp_path / "pma", online="sma").open(None)
    assert "\n" not in str(err.value) and list(elsewhere.iterdir()) == []


def test_only_a_regular_staged_file_with_the_checkpoints_stamp_is_moved_in(tmp_path):
    average = OnlineAverage("sma")
    average.update({"w": torch.ones(3)}, tokens=512)
    saved = tmp_path / "elsewhere.safetensors"
    average.save_state(saved, at=(8, 512))
    checkpoint = tmp_path / "checkpoint-8"
    checkpoint.mkdir()
    resume = ResumePoint(512, 8, checkpoint)
    staged = tmp_path / "pma" / STAGED_STATE_DIR / STAGED
    staged.parent.mkdir(parents=True)
    staged.symlink_to(saved)  # planted: a link is never followed, nor moved
    assert restore_staged_states(tmp_path / "pma", resume) == []
    assert not (checkpoint / ONLINE_STATE_NAME).exists() and saved.is_file()
    staged.unlink()
    shutil.copyfile(saved, staged)
    assert restore_staged_states(tmp_path / "pma", ResumePoint(576, 8, checkpoint)) == []  # other tokens
    assert restore_staged_states(tmp_path / "pma", resume) == [ONLINE_STATE_NAME]
    assert OnlineAverage.load_state(checkpoint / ONLINE_STATE_NAME).saved_at == (8, 512)
    assert not staged.exists()


def test_a_staged_state_whose_checkpoint_is_gone_is_removed_at_the_next_save(tmp_path):
    """Left by kills: step 4's (its checkpoint rotated away) goes at the next save; step 12's
    (its checkpoint there, lacking the average) stays for the resume from it."""
    sink = OnlineAverageSink(tmp_path / "pma", online="sma", async_write=False)
    sink.open(None)
    staging = tmp_path / "pma" / STAGED_STATE_DIR
    for step in (4, 12, 8):
        sink.average.update({"w": torch.full((3,), float(step))}, tokens=step * 64)
        sink.stage_checkpoint(step, step * 64)
    (tmp_path / "checkpoint-12").mkdir()
    (tmp_path / "checkpoint-8").mkdir()
    sink.save_checkpoint(tmp_path / "checkpoint-8")
    assert sorted(p.name for p in staging.iterdir()) == [f"step-12-{ONLINE_STATE_NAME}"]
    moved = OnlineAverage.load_state(tmp_path / "checkpoint-8" / ONLINE_STATE_NAME)
    assert (moved.count, moved.saved_at) == (3, (8, 512))
