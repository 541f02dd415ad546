"""The snapshot count a run announces at its first step (and the disk plan built on it) is the
count it writes: with warmup and decay, a V that is not a whole number of steps, gradient
accumulation, PMATrainer, and a 2-process loop whose scheduler is scaled by the number of
processes and stepped by accelerate once per process (transformers' ``run_clm_no_trainer.py``).
Each case counts the manifest rows of a real run."""

from __future__ import annotations

import json
import logging
import re

import pytest
from transformers import Trainer

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.core.manifest import manifest_snapshots
from hf_pma.core.schedule import crossed_boundary, plan_run
from hf_pma.snapshots import planning
from hf_pma.snapshots.callback import PMACallback
from hf_pma.snapshots.lr_probe import planned_lrs, scheduler_steps_per_optimizer_step
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.launcher import launch
from tests.helpers.models import make_tiny_model
from tests.helpers.training import make_args, quiet_args

SEQ, BATCH, STEPS = 16, 4, 30
STEP_TOKENS = SEQ * BATCH
WSD = {"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": 5, "lr_scheduler_kwargs": {"num_decay_steps": 8}}


def said(caplog) -> int:
    """The count the run said last: the announce line's ("... disk: N snapshots of ..."), or the
    one of the line that widened an automatic V under the cost budget ("...; N snapshots in all)")."""
    messages = [r.getMessage() for r in caplog.records]
    announced = [int(m.group(1)) for m in (re.search(r"disk: (\d+) snapshots of", t) for t in messages) if m]
    assert len(announced) == 1, messages
    widened = [int(m.group(1)) for m in (re.search(r"; (\d+) snapshots in all\)", t) for t in messages) if m]
    return widened[-1] if widened else announced[0]


@pytest.mark.parametrize(
    "callback_options, overrides",
    [
        ({"max_overhead": None}, WSD),  # automatic V over warmup, stable and decay
        ({"interval_tokens": 5 * STEP_TOKENS // 2}, WSD),  # 2.5 steps: snapshots 2 or 3 steps apart
        ({"interval_tokens": 3 * STEP_TOKENS, "phases": ("warmup", "stable")}, {**WSD, "warmup_steps": 7}),
        (  # gradient accumulation: steps of two micro-batches
            {"interval_tokens": 2 * STEP_TOKENS},
            {"lr_scheduler_type": "cosine", "warmup_steps": 3, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        ),
        ({}, {"lr_scheduler_type": "constant"}),  # the zero-argument callback under its cost budget
    ],
)
def test_the_announced_count_is_what_the_trainer_writes(tmp_path, caplog, callback_options, overrides):
    callback = PMACallback(**callback_options)
    args = make_args(tmp_path, **{"max_steps": STEPS, "logging_steps": 10, "per_device_train_batch_size": BATCH, **overrides})
    trainer = Trainer(
        model=make_tiny_model(seed=0), args=args, train_dataset=TokenDataset(n=STEPS * BATCH), data_collator=pad_collate,
        callbacks=[callback],
    )
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        trainer.train()
    assert said(caplog) == len(manifest_snapshots(tmp_path / "pma")) > 0


def test_pmatrainer_announces_what_it_writes(tmp_path, caplog):
    kwargs = quiet_args(max_steps=STEPS, logging_steps=10, **WSD)
    kwargs.pop("data_seed")
    args = PMATrainingArguments(
        output_dir=str(tmp_path), pma_max_overhead=None, pma_eval=False, pma_merge_at_end=False, **kwargs
    )
    trainer = PMATrainer(
        model=make_tiny_model(seed=0), args=args, train_dataset=TokenDataset(n=STEPS * BATCH), data_collator=pad_collate
    )
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        trainer.train()
    assert said(caplog) == len(manifest_snapshots(tmp_path / "pma")) > 0


@pytest.mark.slow
def test_a_scheduler_scaled_by_the_processes_as_run_clm_no_trainer_builds_it(tmp_path):
    """2 processes (gloo), gradient accumulation 2, warmup 4 steps: the scheduler is built for
    8 warmup steps of 60 and stepped twice per optimizer step; warmup counted once."""
    launch("forecast_scaled.py", "--out", tmp_path, launcher="accelerate")
    report = json.loads((tmp_path / "forecast.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 30
    assert report["said"] == len(manifest_snapshots(tmp_path / "pma")) > 0


def brute_force(phases: list[str], selected: tuple[str, ...], interval: int, step_tokens: int, after: int, first: int) -> int:
    """Snapshots a run takes after step ``after``, step by step as the taker does."""
    count, tokens = 0, after * step_tokens
    for step in range(after + 1, len(phases) + 1):
        crossed = crossed_boundary(tokens, tokens + step_tokens, interval)
        tokens += step_tokens
        if crossed is not None and phases[step - 1] in selected and step >= first:
            count += 1
    return count


@pytest.mark.parametrize("interval", [64, 100, 128, 160, 200, 448, 1000])
@pytest.mark.parametrize("after, first", [(0, 0), (0, 4), (7, 0), (13, 0)])
def test_the_count_is_exact_for_any_interval_and_starting_point(interval, after, first):
    peak = 1.0
    lrs = [peak * (s + 1) / 6 for s in range(5)] + [peak] * 20 + [peak * (9 - s) / 10 for s in range(9)]
    for selected in (("stable", "decay"), ("warmup", "stable"), ("stable",)):
        plan = plan_run(len(lrs), selected, lrs, peak)
        phases = list(plan.phases)
        count, _ = planning.planned_snapshots(plan, interval, 64, after, first_step=first)
        assert count == brute_force(phases, selected, interval, 64, after, first), (selected, interval, after, first)


def test_a_scheduler_stepped_once_per_process_is_probed_per_optimizer_step():
    import torch
    from accelerate.scheduler import AcceleratedScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    from transformers import get_scheduler

    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=4 * 2, num_training_steps=10 * 2)
    wrapped = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=True, split_batches=False)
    assert scheduler_steps_per_optimizer_step(wrapped, 2) == 2 and scheduler_steps_per_optimizer_step(scheduler, 2) == 1
    lrs, stride = planned_lrs(wrapped, 10, num_processes=2)
    # Warmup over 4 optimizer steps (0, 0.25, 0.5, 0.75), then the decay: not 8 steps of warmup.
    assert stride == 1 and lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    split = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=True, split_batches=True)
    assert scheduler_steps_per_optimizer_step(split, 2) == 1
