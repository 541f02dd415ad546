"""``eval_pma_loss`` from the online average: a PMATrainer given ``PMACallback(online=...)`` writes
no snapshot, and its merged evaluation swaps the running average into the live model."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_pma import PMACallback, PMATrainer, PMATrainingArguments
from tests.helpers.models import make_tiny_model
from tests.helpers.training import lm_setup, quiet_args


def test_eval_pma_loss_comes_from_the_online_average(tiny_tokenizer, tmp_path):
    _model, tokenizer, train, evaluation, collator = lm_setup(tiny_tokenizer)
    callback = PMACallback(interval_tokens=256, online="sma")
    args = PMATrainingArguments(
        output_dir=str(tmp_path / "out"), **quiet_args(max_steps=12, eval_strategy="steps", eval_steps=12)
    )
    trainer = PMATrainer(
        make_tiny_model(seed=0),
        args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    assert trainer.pma_callback is callback  # the one given, not a second one
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert evals and "eval_pma_loss" in evals[-1]  # the same log line as the live model's
    assert evals[-1]["eval_pma_num_snapshots"] == callback.online_count > 1
    assert evals[-1]["eval_pma_loss"] != evals[-1]["eval_loss"]
    pma_dir = tmp_path / "out" / "pma"
    assert not list(pma_dir.glob("snapshot-*"))  # nothing on disk during training
    # The average written at the end (the same snapshots) evaluated by a plain Trainer.
    plain = Trainer(
        AutoModelForCausalLM.from_pretrained(pma_dir / "online-sma", trust_remote_code=False),
        TrainingArguments(output_dir=str(tmp_path / "plain"), **quiet_args()),
        eval_dataset=evaluation,
        data_collator=collator,
    )
    assert plain.evaluate()["eval_loss"] == pytest.approx(evals[-1]["eval_pma_loss"], rel=1e-6)
    # and the live weights came back
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    # Written again on request: the same folder, replaced.
    assert callback.save_online_average(trainer.model) == pma_dir / "online-sma"
    assert sorted(p.name for p in pma_dir.iterdir() if p.name.startswith(".")) == []


def test_pma_online_arguments_evaluate_the_online_average_and_end_with_its_folder(tiny_tokenizer, tmp_path):
    """``PMATrainingArguments(pma_online="sma")``, no callback given: no snapshot on disk, yet
    ``eval_pma_loss`` is logged (the online average, here kept with ``pma_online_device="device"``),
    and the online folder written at the end is the merge (its record and card beside it)."""
    from hf_pma.core.manifest import TRAINING_RECORD_NAME

    _model, tokenizer, train, evaluation, collator = lm_setup(tiny_tokenizer)
    args = PMATrainingArguments(
        output_dir=str(tmp_path / "out"),
        **quiet_args(
            max_steps=8,
            eval_strategy="steps",
            eval_steps=8,
            pma_interval_tokens=256,
            pma_phases=["stable"],
            pma_online="sma",
            pma_online_device="device",
        ),
    )
    trainer = PMATrainer(
        make_tiny_model(seed=0),
        args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator,
        processing_class=tokenizer,
    )
    assert trainer.pma_callback.online == "sma" and trainer.pma_callback.online_device == "device"
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert evals and evals[-1]["eval_pma_num_snapshots"] == trainer.pma_callback.online_count > 1
    pma_dir = tmp_path / "out" / "pma"
    assert not list(pma_dir.glob("snapshot-*")) and not (pma_dir / "merged").exists()
    assert trainer.pma_merged_dir == pma_dir / "online-sma"
    assert (pma_dir / "online-sma" / TRAINING_RECORD_NAME).is_file() and (
        pma_dir / "online-sma" / "README.md"
    ).is_file()
    plain = Trainer(
        AutoModelForCausalLM.from_pretrained(pma_dir / "online-sma", trust_remote_code=False),
        TrainingArguments(output_dir=str(tmp_path / "plain"), **quiet_args()),
        eval_dataset=evaluation,
        data_collator=collator,
    )
    assert plain.evaluate()["eval_loss"] == pytest.approx(evals[-1]["eval_pma_loss"], rel=1e-6)
