"""Real client libraries' trainers with ``PMACallback``, written the way their users write them,
then the run folder they leave merged with the ``hf-pma`` command.

TRL's ``SFTTrainer`` (like transformers' example scripts) saves the final model at the top of
``output_dir`` with ``trainer.save_model()``, beside ``checkpoint-*`` and hf-pma's ``pma/``: the
merge of that folder must take the snapshots, not the final model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.markers import require_trl
from tests.helpers.models import make_tiny_model

STEPS = 24
INTERVAL_TOKENS = 512  # 2 steps of 4 rows x 64 tokens: 12 snapshots


def _rows(n: int = 48, lines_per_row: int = 6) -> list[str]:
    lines = [line for line in sample_text().splitlines() if line.strip()]
    return ["\n".join(lines[i : i + lines_per_row]) for i in range(0, n * lines_per_row, lines_per_row)]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_tokenizer) -> Path:
    """A TRL SFT run as a TRL user writes it: SFTConfig, SFTTrainer, train, save_model."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_pma import PMACallback

    output_dir = tmp_path_factory.mktemp("trl") / "sft-run"
    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=8,
        per_device_train_batch_size=4,
        max_length=64,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=8,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=make_tiny_model(),
        args=args,
        train_dataset=Dataset.from_dict({"text": _rows()}),
        processing_class=tiny_tokenizer,
        callbacks=[PMACallback(interval_tokens=INTERVAL_TOKENS)],
    )
    trainer.train()
    trainer.save_model()
    return output_dir


def _merge(*argv: str):
    return run_cli("merge", *argv)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@require_trl
def test_sft_trainer_run_folder_leaves_snapshots_checkpoints_and_final_model(sft_run):
    manifest = json.loads((sft_run / "pma" / "manifest.json").read_text())
    tokens = [entry["tokens"] for entry in manifest["snapshots"]]
    assert tokens == [INTERVAL_TOKENS * k for k in range(1, STEPS // 2 + 1)]
    assert sorted(p.name for p in sft_run.glob("checkpoint-*")) == [
        "checkpoint-16",
        "checkpoint-24",
        "checkpoint-8",
    ]
    assert (sft_run / "model.safetensors").is_file()  # trainer.save_model(): the final model at the top


@require_trl
def test_merge_of_sft_run_folder_is_the_mean_of_the_last_snapshots(sft_run, tmp_path):
    from transformers import AutoModelForCausalLM

    merged = tmp_path / "merged"
    done = _merge(str(sft_run), "--last", "3", "-o", str(merged))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((sft_run / "pma" / "manifest.json").read_text())
    last3 = [sft_run / "pma" / entry["path"] for entry in manifest["snapshots"][-3:]]
    assert [p.name for p in last3] == ["snapshot-5120", "snapshot-5632", "snapshot-6144"]
    output = done.stdout + done.stderr
    assert "snapshot-5120" in output and "snapshot-6144" in output, output  # says what it merged

    record = json.loads((merged / "pma_merge.json").read_text())
    assert [s["tokens"] for s in record["sources"]] == [5120, 5632, 6144]
    snapshots = [_weights(p) for p in last3]
    result = _weights(merged)
    assert set(result) == set(snapshots[0])
    for name, tensor in result.items():
        expected = torch.stack([s[name] for s in snapshots]).mean(dim=0)
        torch.testing.assert_close(tensor, expected, msg=name)  # float32 sums in another order
    final = _weights(sft_run)  # the final model is the last snapshot's weights, not the merge
    assert any(not torch.equal(result[name], final[name]) for name in result)

    model = AutoModelForCausalLM.from_pretrained(merged)
    loaded = model.state_dict()
    for name, tensor in result.items():
        assert torch.equal(loaded[name], tensor), name


@require_trl
def test_include_final_without_trainer_state_is_the_newest_source_and_says_so(sft_run, tmp_path):
    """TRL's scripts call ``save_model()`` but not ``save_state()``: the final model's point is
    unknown, so --include-final merges it after the last snapshot and warns that the last point
    may count twice (run folders with ``trainer_state.json`` are covered in tests/merging)."""
    merged = tmp_path / "merged"
    done = _merge(str(sft_run), "--last", "3", "--include-final", "-o", str(merged))
    assert done.returncode == 0, done.stderr
    assert "has no trainer_state.json beside it" in done.stderr and "after snapshot-6144" in done.stderr
    record = json.loads((merged / "pma_merge.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["snapshot-5632", "snapshot-6144", "final"]
    parts = [_weights(sft_run / "pma" / f"snapshot-{t}") for t in (5632, 6144)] + [_weights(sft_run)]
    for name, tensor in _weights(merged).items():
        torch.testing.assert_close(tensor, torch.stack([p[name] for p in parts]).mean(dim=0), msg=name)
