"""scripts/pretrain_no_trainer.py, the loop users copy (docs/without-trainer.md), run for real and
short: an uninterrupted run, and one stopped after its state at step 8 and resumed from it, take
the same snapshots (same tokens, same weights: this loop's resume is exact on CPU); the run's
pma/ folder merges with the run's tokenizer; and what the loop logs speaks of a loop."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import run_cli
from tests.helpers.pretrain_runs import script_env
from tests.helpers.repo import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "pretrain_no_trainer.py"
STEPS, SAVE_EVERY, STOPPED_AT = 16, 8, 12  # warmup 10 steps, then a snapshot each step


def _run(tmp_path, out, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--output_dir", str(out), "--save_every", str(SAVE_EVERY), *extra],
        cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _snapshots(run) -> dict[int, dict]:
    manifest = json.loads((run / "pma" / "manifest.json").read_text())
    return {r["tokens"]: load_file(run / "pma" / r["path"] / "model.safetensors") for r in manifest["snapshots"]}


@pytest.mark.slow
def test_the_loop_resumes_to_the_same_snapshots_and_merges_with_its_tokenizer(tmp_path):
    whole = _run(tmp_path, tmp_path / "whole", "--max_steps", str(STEPS))
    assert "held-out loss at step 16: live" in whole.stdout and "merge of the last 4" in whole.stdout
    _run(tmp_path, tmp_path / "resumed", "--max_steps", str(STOPPED_AT))  # as if killed after step 12
    resumed = _run(tmp_path, tmp_path / "resumed", "--max_steps", str(STEPS), "--resume")  # from step 8's state
    expected, got = _snapshots(tmp_path / "whole"), _snapshots(tmp_path / "resumed")
    assert sorted(got) == sorted(expected) and len(got) == STEPS - 10
    for tokens, weights in expected.items():
        assert weights.keys() == got[tokens].keys()
        assert all((weights[k] == got[tokens][k]).all() for k in weights), f"snapshot at {tokens} tokens differs"

    # The merge of OUTPUT_DIR/pma, as the page says: the tokenizer comes from the run folder.
    merged = tmp_path / "merged-loop"
    done = run_cli("merge", tmp_path / "resumed" / "pma", "--last", "4", "-o", merged, "-q")
    assert done.returncode == 0, done.stderr
    assert (merged / "tokenizer.json").read_bytes() == (tmp_path / "resumed" / "tokenizer.json").read_bytes()

    # A loop's logs speak of a loop: no Trainer checkpoint, no waits that print as 0.00 s as warnings.
    for logs in (whole.stderr, resumed.stderr):
        assert "Trainer" not in logs and "finish evaluating" not in logs
        assert "waited 0.00s" not in logs
