"""scripts/pretrain.py as the tests run it: the embedded default run shortened to a few seconds,
and the shared 2-process launch of it under ``accelerate launch``."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.launcher import Launch, launch, shared_launch_job
from tests.helpers.repo import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "pretrain.py"

# The embedded default run, shortened: same code path, a few seconds of training.
SHORT = [
    "--max_steps", "24",
    "--warmup_steps", "2",
    "--anneal_steps", "6",
    "--default_corpus_bytes", "600000",
    "--eval_fraction", "0.25",
    "--vocab_size", "512",
    "--config_overrides", "hidden_size=64,intermediate_size=128,num_hidden_layers=2",
    "--block_size", "64",
    "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "8",
    "--pma_interval_tokens", "512",
    "--pma_window", "4",
    "--eval_steps", "8",
    "--logging_steps", "4",
    "--task_items", "16",
    "--max_eval_texts", "4",
    "--max_eval_blocks", "8",
    "--dataloader_num_workers", "0",
]


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment for a run of the script: its own HF_HOME, one thread, unbuffered output."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


@shared_launch_job("pretrain-accelerate")
def two_processes(tmp_path: Path) -> Launch:
    """The quickstart's 2-process run (``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu
    --num_processes 2``), shortened: read by tests/training/test_pretrain_*.py."""
    return launch(
        SCRIPT, *SHORT, "--output_dir", tmp_path / "run2", "--per_device_train_batch_size", "2", "--make_tasks", "false",
        launcher="accelerate", env=script_env(tmp_path), cwd=tmp_path, check=False,
    )


def docs_default_run(root: Path, steps: int = 50, block_size: int = 64) -> Path:
    """``runs/pma-tiny`` in ``root`` as the embedded default run leaves it, made by the script
    itself: the default's names (its V, its kept snapshots and window, its total tokens, so its
    last snapshot is the one the pages name) in ``steps`` steps of a smaller model. Returns the
    run folder."""
    import subprocess
    import sys

    import yaml

    config = yaml.safe_load((REPO_ROOT / "scripts" / "configs" / "tiny.yaml").read_text())
    total = config["max_steps"] * config["per_device_train_batch_size"] * config["block_size"]
    args = [
        "--output_dir", config["output_dir"], "--max_steps", str(steps), "--warmup_steps", "2",
        "--anneal_steps", str(config["anneal_steps"] * steps // config["max_steps"]),
        "--block_size", str(block_size), "--per_device_train_batch_size", str(total // (steps * block_size)),
        "--default_corpus_bytes", "600000", "--vocab_size", "512",
        "--config_overrides", "hidden_size=32,intermediate_size=64,num_hidden_layers=1",
        "--eval_steps", str(steps), "--logging_steps", "10", "--task_items", "16",
        "--max_eval_texts", "4", "--max_eval_blocks", "8", "--per_device_eval_batch_size", "32",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=root, env=script_env(root), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return root / config["output_dir"]
