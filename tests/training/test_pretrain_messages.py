"""What scripts/pretrain.py tells a newcomer: no false "missing keys" warning when the annealed
fork (hf_pma.training.annealing) resumes a tied model, and a warning when ``accelerate launch --cpu --num_processes 2``
started one process (with the command that starts two)."""

from __future__ import annotations

import logging

import pytest
from transformers import Trainer, TrainingArguments

from tests.helpers.launcher import launch
from tests.helpers.output import CollectLogs
from tests.helpers.pretrain_runs import SCRIPT
from tests.helpers.repo import REPO_ROOT
from tests.helpers.training import lm_setup, quiet_args


def _resume_messages(tmp_path, model, train, collator, wrap) -> list[str]:
    trainer_logger = logging.getLogger("transformers.trainer")
    collect = CollectLogs()
    trainer_logger.addHandler(collect)
    try:
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=4, **quiet_args(save_strategy="steps", save_steps=2)
        )
        trainer = Trainer(model, args, train_dataset=train, data_collator=collator)
        with wrap(model):
            trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    finally:
        trainer_logger.removeHandler(collect)
    return [m for m in collect.messages if "missing keys" in m]


def test_the_fork_resumes_a_tied_model_without_a_missing_keys_warning(tmp_path):
    import contextlib

    from hf_pma.training import annealing
    model, _, train, _, collator = lm_setup()
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, **quiet_args(save_strategy="steps", save_steps=2)
    )
    Trainer(model, args, train_dataset=train, data_collator=collator).train()
    # Without the filter transformers' Trainer warns that the tied lm_head.weight is missing...
    plain = _resume_messages(tmp_path, lm_setup()[0], train, collator, lambda m: contextlib.nullcontext())
    assert plain == ["There were missing keys in the checkpoint model loaded: ['lm_head.weight']."]
    # ...which is not true: the fork resumes it silently, and the weights are the checkpoint's.
    fresh = lm_setup(seed=1)[0]
    assert _resume_messages(tmp_path, fresh, train, collator, annealing.tied_keys_not_missing) == []
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
    # A real missing key is still reported.
    keep = annealing._TiedKeysFilter({"lm_head.weight"})
    record = logging.LogRecord(
        "t", logging.WARNING, "", 0, keep.PREFIX + "['model.norm.weight'].", None, None
    )
    assert keep.filter(record)


def test_cpu_num_processes_that_starts_one_process_is_reported():
    # `accelerate launch --cpu --num_processes 2`: one process starts. Bad arguments stop the
    # script right after the launcher check, in every process it has.
    one = launch(
        SCRIPT, "--anneal_steps", "-1", launcher="accelerate", launcher_args=["--cpu"], cwd=REPO_ROOT, check=False
    )
    assert one.stderr.count("pretrain.py: error: anneal_steps") == 1  # one process only
    assert "accelerate launch was asked for 2 processes but this run has 1" in one.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in one.stderr


@pytest.mark.shared_launch("pretrain-accelerate")  # started with the session, in the background
def test_the_incantation_the_warning_gives_starts_two_processes_and_says_nothing(shared_launch):
    # the shared 2-process run of tests/helpers/pretrain_runs.py is started exactly that way
    two = shared_launch.result("pretrain-accelerate")
    assert two.nproc == 2 and "--multi_gpu" in two.command
    assert "was asked for" not in two.stderr + two.output(0, "stderr") + two.output(1, "stderr")
