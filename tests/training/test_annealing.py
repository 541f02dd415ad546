"""The annealing check as a library feature (hf_pma.training.annealing): a fork from a Trainer
checkpoint is the same training as a WSD run from the start, PMATrainer forks at the end of
training, and the paired comparison lands in the merged folder's record and card."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.analysis.comparison import read_anneal_record
from hf_pma.training.annealing import (
    SaveCheckpointAt,
    anneal_from_checkpoint,
    checkpoint_state,
)
from tests.helpers.training import lm_setup, quiet_args

STEPS, FORK_AT, WARMUP = 10, 6, 2


@pytest.fixture(scope="module")
def setup():
    return lm_setup()


def _trainer(setup, out, cls=Trainer, args_cls=TrainingArguments, callbacks=None, **overrides):
    model, tokenizer, train, _evaluation, collator = setup
    args = args_cls(output_dir=str(out), **quiet_args(max_steps=STEPS, warmup_steps=WARMUP, **overrides))
    fresh = type(model)(model.config)
    fresh.load_state_dict(model.state_dict())
    return cls(
        fresh,
        args,
        train_dataset=train,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def test_the_fork_is_the_wsd_run_from_the_start_bit_for_bit(tmp_path, setup):
    # A constant-LR run that saves a checkpoint at step 6, forked there with a cosine decay over 4 steps...
    run = _trainer(
        setup,
        tmp_path / "run",
        lr_scheduler_type="constant_with_warmup",
        callbacks=[SaveCheckpointAt(step=FORK_AT)],
    )
    run.train()
    annealed = anneal_from_checkpoint(
        run, tmp_path / "run" / f"checkpoint-{FORK_AT}", steps=STEPS - FORK_AT, decay_type="cosine"
    )
    assert annealed == tmp_path / "run" / "annealed"
    # ...is the run trained with that WSD schedule from the start: same data, same weights, bit for bit.
    wsd = _trainer(
        setup,
        tmp_path / "wsd",
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": STEPS - FORK_AT, "decay_type": "cosine", "min_lr_ratio": 0.0},
    )
    wsd.train()
    forked = load_file(annealed / "model.safetensors")
    reference = {k: v for k, v in wsd.model.state_dict().items() if k in forked}
    assert forked.keys() == reference.keys() and all(torch.equal(forked[k], reference[k]) for k in forked)
    assert not torch.equal(forked["model.norm.weight"], run.model.state_dict()["model.norm.weight"])
    record = json.loads((annealed / "pma_anneal.json").read_text())
    per_step = checkpoint_state(tmp_path / "run" / f"checkpoint-{FORK_AT}")["tokens"] // FORK_AT
    assert record["checkpoint"] == f"checkpoint-{FORK_AT}" and record["decay_type"] == "cosine"
    assert (record["start_step"], record["end_step"], record["steps"]) == (FORK_AT, STEPS, STEPS - FORK_AT)
    assert (record["start_tokens"], record["end_tokens"]) == (FORK_AT * per_step, STEPS * per_step)
    assert record["learning_rate"] == 3e-3 and record["snapshot"] is None  # a plain Trainer: no snapshots

    # Bad input: one line, before any training.
    checkpoint = tmp_path / "run" / f"checkpoint-{FORK_AT}"
    # a plain Trainer counts no tokens: give steps
    with pytest.raises(ValueError, match="counted no input tokens"):
        anneal_from_checkpoint(run, checkpoint, tokens=1000)
    with pytest.raises(ValueError, match="as steps or as tokens"):
        anneal_from_checkpoint(run, checkpoint, steps=2, tokens=100)
    with pytest.raises(ValueError, match="decay_type must be linear, cosine or 1-sqrt, got 'exp'"):
        anneal_from_checkpoint(run, checkpoint, steps=2, decay_type="exp")
    with pytest.raises(FileNotFoundError, match="checkpoint-99 is not a folder"):
        anneal_from_checkpoint(run, tmp_path / "run" / "checkpoint-99", steps=2)
    with pytest.raises(FileExistsError, match="holds no pma_anneal.json"):
        anneal_from_checkpoint(
            run, checkpoint, steps=2, output_dir=tmp_path / "run" / f"checkpoint-{FORK_AT}"
        )
    with pytest.raises(ValueError, match="needs a constant-LR run"):
        anneal_from_checkpoint(wsd, checkpoint, steps=2)
    for path in checkpoint.glob("optimizer*"):  # a checkpoint saved with save_only_model
        path.unlink()
    with pytest.raises(ValueError, match="holds no optimizer state"):
        anneal_from_checkpoint(run, checkpoint, steps=2)


def test_pma_trainer_forks_at_the_end_and_the_check_lands_in_the_record_and_card(tmp_path, setup):
    model, tokenizer, train, evaluation, collator = setup
    per_step = 4 * len(train[0]["input_ids"])
    trainer = _trainer(
        setup,
        tmp_path / "run",
        cls=PMATrainer,
        args_cls=PMATrainingArguments,
        lr_scheduler_type="constant_with_warmup",
        pma_interval_tokens=2 * per_step,
        pma_window=3,
        pma_eval=False,
        pma_async_write=False,
        pma_anneal_tokens=4 * per_step,
        pma_anneal_decay="1-sqrt",
    )
    trainer.train()
    out = tmp_path / "run"
    # the fork's checkpoint was ours: deleted
    assert trainer.pma_annealed_dir == out / "annealed" and not (out / "checkpoint-6").exists()
    assert trainer.optimizer is None  # the finished run's moments were freed for the fork
    record = json.loads((out / "annealed" / "pma_anneal.json").read_text())
    assert (record["start_step"], record["steps"], record["decay_type"]) == (6, 4, "1-sqrt")
    assert record["snapshot"] == f"snapshot-{STEPS * per_step}"  # at the tokens of the last snapshot

    texts = [tokenizer.decode(block["input_ids"]) for block in evaluation[:4]]
    trainer.annealing_check(texts, block_size=32)
    comparison = json.loads((out / "pma" / "merged" / "pma_eval.json").read_text())["comparison"]
    assert set(comparison["models"]) == {"last snapshot", "PMA merge", "annealed"}
    assert comparison["anneal"] == {"steps": 4, "tokens": 4 * per_step, "decay_type": "1-sqrt"}
    assert comparison["tokens"] == comparison["models"]["annealed"]["tokens"] == STEPS * per_step
    card = (out / "pma" / "merged" / "README.md").read_text()
    assert f"(all at {STEPS * per_step:,} tokens)" in card and "1-sqrt decay to 0 over the last" in card
    # the fork's record may come from anywhere: a count that is not one is a one-line error, before evaluating
    record["end_tokens"] = {"a": 1}
    (out / "annealed" / "pma_anneal.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"pma_anneal.json: end_tokens should be a count, got \{'a': 1\}"):
        read_anneal_record(out / "annealed")


def test_the_options_are_checked_when_parsed(tmp_path):
    def args(**kw):
        return PMATrainingArguments(
            output_dir=str(tmp_path), **quiet_args(max_steps=STEPS, warmup_steps=WARMUP, **kw)
        )

    with pytest.raises(ValueError, match="pma_anneal_steps needs a constant-LR run"):
        args(pma_anneal_steps=4, lr_scheduler_type="cosine")
    with pytest.raises(ValueError, match=r"pma_anneal_steps \(9\) must be shorter than the constant-LR part"):
        args(pma_anneal_steps=9)
    with pytest.raises(ValueError, match="not both"):
        args(pma_anneal_steps=4, pma_anneal_tokens=100)
    with pytest.raises(ValueError, match="pma_anneal_decay must be"):
        args(pma_anneal_decay="step")
    with pytest.raises(ValueError, match="pma_anneal_steps must be a non-negative integer, got -1"):
        args(pma_anneal_steps=-1)
    with pytest.raises(ValueError, match="needs save_only_model=False"):
        args(pma_anneal_steps=4, save_only_model=True)
    assert args(pma_anneal_steps=4).pma_anneal_steps == 4


def test_the_check_of_a_trainer_script_saves_the_live_model_it_compares(tmp_path, setup):
    """A user's PMATrainer script (no ``final/`` of its own) whose last snapshot is not at the
    end: the check saves the live model itself and compares it; a bad input is refused before
    anything is saved."""
    model, tokenizer, train, evaluation, collator = setup
    per_step = 4 * len(train[0]["input_ids"])
    trainer = _trainer(
        setup, tmp_path / "run", cls=PMATrainer, args_cls=PMATrainingArguments,
        lr_scheduler_type="constant_with_warmup", pma_interval_tokens=3 * per_step, pma_window=2,
        pma_eval=False, pma_async_write=False, pma_anneal_steps=4,
    )  # fmt: skip
    trainer.train()
    out = tmp_path / "run"
    texts = [tokenizer.decode(block["input_ids"]) for block in evaluation[:4]]
    with pytest.raises(ValueError, match="texts must be a list"):
        trainer.annealing_check("one string")
    with pytest.raises(ValueError, match="live=.* is not a folder"):
        trainer.annealing_check(texts, live=tmp_path / "nowhere")
    assert not (out / "final").exists() and not (out / "pma" / "merged" / "pma_eval.json").exists()
    trainer.annealing_check(texts, block_size=32)  # the last snapshot is at step 9 of 10
    assert (out / "final" / "model.safetensors").is_file()
    comparison = json.loads((out / "pma" / "merged" / "pma_eval.json").read_text())["comparison"]
    assert set(comparison["models"]) == {"live model at the end", "PMA merge", "annealed"}


def test_a_fork_stopped_between_its_weights_and_its_record_is_redone_not_refused(tmp_path, setup, monkeypatch):
    """The fork marks its folder as its own (an in-progress pma_anneal.json) before its first byte:
    stopped after its weights, before its record (SIGKILL there runs no clean-up either), the next
    fork redoes it instead of refusing a folder hf-pma wrote; no reader takes it for a finished fork."""
    import hf_pma.training.annealing as annealing

    run = _trainer(
        setup, tmp_path / "run", lr_scheduler_type="constant_with_warmup", callbacks=[SaveCheckpointAt(step=FORK_AT)]
    )
    run.train()
    checkpoint, out = tmp_path / "run" / f"checkpoint-{FORK_AT}", tmp_path / "run" / "annealed"
    saved = annealing.save_full_model

    def stopped_after_the_weights(trainer, folder):
        saved(trainer, folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(annealing, "save_full_model", stopped_after_the_weights)
    with pytest.raises(KeyboardInterrupt):
        anneal_from_checkpoint(run, checkpoint, steps=STEPS - FORK_AT)
    assert (out / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="the annealed fork in .* did not finish .*: fork again"):
        read_anneal_record(out)
    monkeypatch.setattr(annealing, "save_full_model", saved)
    assert anneal_from_checkpoint(run, checkpoint, steps=STEPS - FORK_AT) == out
    record = read_anneal_record(out)
    assert (record["start_step"], record["end_step"]) == (FORK_AT, STEPS) and "in_progress" not in record
