"""Build a merged folder by hand for the card, plot and push tests.

The folder is laid out like a run's (``<root>/run/pma/merged`` beside ``manifest.json``) and
holds a real tiny model (saved with ``save_model_folder``) plus the three records, written here
with known values so the tests can look for them. The records deliberately carry an access
token and absolute local paths, which must never reach a card.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers.models import make_tiny_model, save_model_folder

TOKENS_PER_STEP = 4096
SNAPSHOT_STEPS = list(range(20, 220, 20))  # 10 snapshots in the run's manifest
MERGED_STEPS = SNAPSHOT_STEPS[-6:]  # the merge used the last 6
FAKE_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"  # shaped like a real token


def merge_record(strategy: str = "sma", phases: list[str] | None = None, alpha: float | None = None) -> dict[str, Any]:
    """A ``pma_merge.json`` for the snapshots at ``MERGED_STEPS`` with equal weights."""
    n = len(MERGED_STEPS)
    weights = [1.0 / n] * n
    sources = [
        {
            "name": f"snapshot-{s * TOKENS_PER_STEP}",
            "path": f"../snapshot-{s * TOKENS_PER_STEP}",
            "tokens": s * TOKENS_PER_STEP,
            "step": s,
            "lr": 0.003,
            "loss": round(5.0 - s / 100, 4),
            "phase": (phases or ["stable"] * n)[i],
            "weight": weights[i],
        }
        for i, s in enumerate(MERGED_STEPS)
    ]
    return {
        "hf_pma_version": "0.1.0",
        "strategy": strategy,
        "alpha": alpha,
        "weights": weights,
        "dtype": "float32",
        "accumulate_dtype": "float32",
        "created": 1_750_000_000.0,
        "interval_tokens": 20 * TOKENS_PER_STEP,
        "sources": sources,
    }


EVAL_RECORD = {
    "eval_dataset": "held-out stdlib files",
    "results": {
        "last snapshot": {
            "lm": {"loss": 4.1642, "perplexity": 64.35, "bits_per_byte": 1.7321},
            "py_syntax": {"acc,none": 0.4125, "acc_stderr,none": 0.0211},
        },
        "PMA merge": {
            "lm": {"loss": 4.0523, "perplexity": 57.55, "bits_per_byte": 1.6851},
            "py_syntax": {"acc,none": 0.4475, "acc_stderr,none": 0.0208},
        },
        "annealed": {"lm": {"loss": 4.0481, "perplexity": 57.31, "bits_per_byte": 1.6834}},
    },
}


def training_record(root: Path, with_tokens_in_log: bool = True, careless: bool = True) -> dict[str, Any]:
    """A ``pma_training.json`` with a log history of 200 steps and 4 PMA evaluations; with
    ``careless``, its command and datasets hold a token and absolute local paths."""
    log = []
    for s in range(1, 201):
        entry = {"step": s, "loss": 6.0 - s / 50 + (s % 7) / 20, "learning_rate": 0.003 * min(1.0, s / 20)}
        if with_tokens_in_log:
            entry["num_input_tokens_seen"] = s * TOKENS_PER_STEP
        log.append(entry)
    evals = [{"step": s, "tokens": s * TOKENS_PER_STEP, "eval_loss": 5.5 - s / 80, "eval_pma_loss": 5.4 - s / 80} for s in (50, 100, 150, 200)]
    log += [{"step": e["step"], "eval_loss": e["eval_loss"], "eval_pma_loss": e["eval_pma_loss"]} for e in evals]
    return {
        "log_history": log,
        "total_tokens": 200 * TOKENS_PER_STEP,
        "max_steps": 200,
        "lr_scheduler_type": "warmup_stable_decay",
        "lr_scheduler_kwargs": {"num_decay_steps": 20},
        "learning_rate": 0.003,
        "hardware": "2 CPU cores",
        "world_size": 2,
        "train_runtime_s": 185.3,
        "command": (
            f"accelerate launch scripts/pretrain.py --output_dir {root}/run --train_files /home/alice/data/train.jsonl "
            f"--hub_token {FAKE_TOKEN}"
            if careless
            else "accelerate launch scripts/pretrain.py --output_dir run --max_steps 200"
        ),
        "datasets": ["HuggingFaceFW/fineweb-edu"]
        + (["/home/alice/data/train.jsonl", "C:\\Users\\bob\\corpus.txt"] if careless else []),
        "base_model": "HuggingFaceTB/SmolLM2-135M",
        "pma_evals": evals,
    }


def write_merged_folder(
    root: Path,
    tokenizer=None,
    *,
    with_eval: bool = True,
    with_training: bool = True,
    with_manifest: bool = True,
    max_shard_size: str | int = "5GB",
    merge: dict[str, Any] | None = None,
    careless: bool = True,
) -> Path:
    """Write ``root/run/pma/merged`` (a tiny model and its records) and return its path."""
    folder = Path(root) / "run" / "pma" / "merged"
    folder.mkdir(parents=True)
    save_model_folder(folder, make_tiny_model(), tokenizer, max_shard_size=max_shard_size)
    (folder / "pma_merge.json").write_text(json.dumps(merge or merge_record(), indent=2))
    if with_eval:
        (folder / "pma_eval.json").write_text(json.dumps(EVAL_RECORD, indent=2))
    if with_training:
        (folder / "pma_training.json").write_text(json.dumps(training_record(Path(root), careless=careless), indent=2))
    if with_manifest:
        snapshots = [{"path": f"snapshot-{s * TOKENS_PER_STEP}", "tokens": s * TOKENS_PER_STEP, "step": s} for s in SNAPSHOT_STEPS]
        (folder.parent / "manifest.json").write_text(json.dumps({"format_version": 1, "snapshots": snapshots}))
    return folder
