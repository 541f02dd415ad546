"""PMASnapshots in a plain ``accelerate`` loop (no Trainer): the same snapshots as PMACallback,
bit-identical training, resume through ``save_state`` / ``load_state``, the swap context manager."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from transformers import Trainer, TrainingArguments, get_scheduler

from hf_pma.core.manifest import manifest_snapshots, read_manifest
from hf_pma.merging.engine import merge_state_dict
from hf_pma.snapshots.callback import PMACallback
from hf_pma.training.loop import PMASnapshots
from tests.dist.loop_snapshots import BATCH, INTERVAL, LR, SEQ, STEPS, batches
from tests.helpers.cli import run_cli
from tests.helpers.data import pad_collate
from tests.helpers.launcher import launch, rank_reports
from tests.helpers.models import make_tiny_model
from tests.helpers.training import quiet_args


def train(
    out, pma_kwargs: dict | None = None, steps=range(STEPS), resume_from=None, save_at=None, swap_at=None
):
    """The loop of run_clm_no_trainer.py, on a tiny Llama: with PMASnapshots when ``pma_kwargs``."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    pma = None
    if pma_kwargs is not None:
        pma = PMASnapshots(model, accelerator, optimizer=optimizer, output_dir=out, **pma_kwargs)
        accelerator.register_for_checkpointing(pma)
    if resume_from is not None:
        accelerator.load_state(resume_from)
    data = batches()
    swaps = []
    for step in steps:
        batch = data[step]
        model.train()
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if pma is not None:
            pma.step(batch=batch)
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(out / "ckpt")
        if swap_at is not None and step + 1 == swap_at:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with pma.swapped(model, last=2):
                swaps.append({k: v.clone() for k, v in model.state_dict().items()})
            swaps.append((before, {k: v.clone() for k, v in model.state_dict().items()}))
    if pma is not None:
        pma.end()
    return model, pma, swaps


def tokens(folder) -> list[int]:
    return [r.tokens for r in manifest_snapshots(folder)]


def test_loop_snapshots_merge_and_bit_identical_training(tmp_path):
    plain, _, _ = train(tmp_path / "plain")
    model, pma, _ = train(
        tmp_path / "run", {"interval_tokens": INTERVAL, "phases": ("warmup", "stable", "decay")}
    )
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))
    pma_dir = tmp_path / "run" / "pma"
    assert pma.pma_dir == pma_dir
    assert tokens(pma_dir) == [INTERVAL, 2 * INTERVAL, 3 * INTERVAL]
    assert read_manifest(pma_dir)["interval_tokens"] == INTERVAL
    last = manifest_snapshots(pma_dir)[-1]
    assert last.step == STEPS and last.loss is not None
    result = run_cli("merge", pma_dir, "--last", "2", "-o", tmp_path / "merged")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "merged" / "config.json").is_file()


def test_loop_takes_the_trainers_snapshots(tmp_path):
    """The same batches through a Trainer with the zero-argument PMACallback and through a loop
    with PMASnapshots, on a warmup-stable-decay schedule: the same automatic interval, and
    snapshots at the same tokens, steps, LRs and phases."""
    steps, schedule = 2 * STEPS, {"num_warmup_steps": 2, "scheduler_specific_kwargs": {"num_decay_steps": 4}}
    data = batches() * 2
    rows = [{"input_ids": row} for b in data for row in b["input_ids"]]
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=steps,
        **quiet_args(
            per_device_train_batch_size=BATCH,
            learning_rate=LR,
            lr_scheduler_type="warmup_stable_decay",
            warmup_steps=schedule["num_warmup_steps"],
            lr_scheduler_kwargs=schedule["scheduler_specific_kwargs"],
        ),
    )
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=rows,
        data_collator=pad_collate,
        callbacks=[PMACallback()],
    )
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(rows)
    trainer.train()

    accelerator = Accelerator(cpu=True)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    lr_scheduler = get_scheduler("warmup_stable_decay", optimizer, num_training_steps=steps, **schedule)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    pma = PMASnapshots(
        model,
        accelerator,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        max_steps=steps,
        output_dir=tmp_path / "loop",
    )
    for batch in data:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        pma.step(batch=batch)
    pma.end()
    ours, theirs = read_manifest(tmp_path / "loop" / "pma"), read_manifest(tmp_path / "trainer" / "pma")
    assert ours["interval_choice"] and ours["interval_tokens"] == theirs["interval_tokens"]
    ours, theirs = (
        manifest_snapshots(tmp_path / "loop" / "pma"),
        manifest_snapshots(tmp_path / "trainer" / "pma"),
    )
    assert {r.phase for r in ours} == {"stable", "decay"}
    assert [(r.tokens, r.step, r.lr, r.phase) for r in ours] == [
        (r.tokens, r.step, r.lr, r.phase) for r in theirs
    ]


def test_loop_resume_through_accelerate_state(tmp_path):
    kwargs = {"interval_tokens": INTERVAL, "phases": ("warmup", "stable", "decay")}
    full, _, _ = train(tmp_path / "full", kwargs)
    # A run that saves its state at step 3 and goes on to step 5 before it dies (its snapshot at
    # step 4 lies past the saved state), then resumes from the state of step 3.
    train(tmp_path / "cut", kwargs, steps=range(5), save_at=3)
    assert tokens(tmp_path / "cut" / "pma") == [INTERVAL, 2 * INTERVAL]
    resumed, pma, _ = train(
        tmp_path / "cut", kwargs, steps=range(3, STEPS), resume_from=tmp_path / "cut" / "ckpt"
    )
    assert pma.tokens == STEPS * BATCH * SEQ and pma.global_step == STEPS
    assert tokens(tmp_path / "cut" / "pma") == tokens(tmp_path / "full" / "pma")
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), resumed.state_dict().values()))
    for ours, theirs in zip(
        manifest_snapshots(tmp_path / "cut" / "pma"), manifest_snapshots(tmp_path / "full" / "pma")
    ):
        assert ours.step == theirs.step
    a = merge_state_dict([tmp_path / "cut" / "pma"], last=2)
    b = merge_state_dict([tmp_path / "full" / "pma"], last=2)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_swapped_puts_the_merge_in_and_the_live_weights_back(tmp_path):
    kwargs = {"interval_tokens": INTERVAL, "phases": ("warmup", "stable", "decay")}
    _, _, swaps = train(tmp_path / "run", kwargs, swap_at=5)
    inside, (before, after) = swaps
    taken = [tmp_path / "run" / "pma" / r.path for r in manifest_snapshots(tmp_path / "run" / "pma")]
    merged = merge_state_dict(taken[:2])  # the two taken by step 5 (steps 2 and 4)
    assert all(torch.equal(inside[k], merged[k]) for k in merged)
    assert not torch.equal(inside["model.norm.weight"], before["model.norm.weight"])
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_swapped_online_average_and_gradient_accumulation(tmp_path):
    """With ``online='sma'`` the swap puts the running average in; with gradient accumulation
    every micro-batch's tokens count, and only the steps that end an optimizer step advance."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    pma = PMASnapshots(
        model, accelerator, optimizer=optimizer, output_dir=tmp_path, interval_tokens=INTERVAL, online="sma"
    )
    for batch in batches():
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        pma.step(batch=batch)
    assert (pma.global_step, pma.tokens) == (STEPS // 2, STEPS * BATCH * SEQ)
    average = pma.callback.online_state_dict()
    assert pma.callback.online_count == STEPS // 2 and "model.norm.weight" in average
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pma.swapped(model):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(inside[k], average[k].to(inside[k].dtype)) for k in average)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    pma.end()
    assert (tmp_path / "pma" / "online-sma" / "config.json").is_file()


def test_two_processes_under_accelerate_launch(tmp_path):
    """DDP over 2 CPU processes: tokens summed over both, the same snapshots, a mergeable folder."""
    launch("loop_snapshots.py", "--out", tmp_path, launcher="accelerate")
    for report in rank_reports(tmp_path, 2):
        assert report["tokens"] == STEPS * BATCH * SEQ and report["steps"] == STEPS and report["restored"]
    assert tokens(tmp_path / "pma") == [INTERVAL, 2 * INTERVAL, 3 * INTERVAL]
    result = run_cli("merge", tmp_path / "pma", "--last", "2", "-o", tmp_path / "merged")
    assert result.returncode == 0, result.stderr


def test_plain_loop_without_accelerate_and_bad_calls(tmp_path):
    """No Accelerator: ``tokens=`` given by hand, the automatic interval from ``max_steps``;
    misuse is one ValueError line before anything is written."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="interval_tokens, or max_steps"):
        PMASnapshots(model, optimizer=optimizer, output_dir=tmp_path)
    with pytest.raises(ValueError, match="output_dir"):
        PMASnapshots(model, optimizer=optimizer, interval_tokens=INTERVAL)
    pma = PMASnapshots(model, optimizer=optimizer, output_dir=tmp_path, max_steps=STEPS, phases=("stable",))
    with pytest.raises(ValueError, match="exactly one of batch"):
        pma.step()
    assert not (tmp_path / "pma").exists()
    for batch in batches():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        pma.step(tokens=batch["input_ids"].numel())
    with pytest.raises(ValueError, match="before the first step"):
        pma.load_state_dict(pma.state_dict())
    pma.end()
    manifest = read_manifest(tmp_path / "pma")
    assert manifest["interval_choice"] and manifest["interval_tokens"] == pma.callback.interval_tokens
    assert tokens(tmp_path / "pma") and all(
        t % manifest["interval_tokens"] == 0 for t in tokens(tmp_path / "pma")
    )


def test_online_average_resumes_through_accelerate_state(tmp_path):
    """The online average is saved into the ``save_state`` folder and restored by ``load_state``."""
    kwargs = {"interval_tokens": INTERVAL, "phases": ("warmup", "stable", "decay"), "online": "sma"}
    train(tmp_path / "full", kwargs)
    train(tmp_path / "cut", kwargs, steps=range(5), save_at=3)
    _, pma, _ = train(tmp_path / "cut", kwargs, steps=range(3, STEPS), resume_from=tmp_path / "cut" / "ckpt")
    assert pma.callback.online_count == 3
    a = merge_state_dict([tmp_path / "cut" / "pma" / "online-sma"])
    b = merge_state_dict([tmp_path / "full" / "pma" / "online-sma"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_the_loop_builds_no_trainer_object(tmp_path, no_trainer_objects):
    """PMASnapshots drives the snapshot engine itself: no TrainerState, TrainerControl,
    TrainingArguments or callback is built (each raises here), and importing the loop does not
    import the Trainer callback module. Its ``snapshot_costs`` read-out matches the manifest."""
    import subprocess
    import sys

    _, pma, _ = train(tmp_path, {"interval_tokens": INTERVAL, "phases": ("warmup", "stable", "decay")})
    records = manifest_snapshots(tmp_path / "pma")
    assert [r.tokens for r in records] == [INTERVAL, 2 * INTERVAL, 3 * INTERVAL]
    costs = pma.snapshot_costs
    assert [(c.tokens, c.num_bytes) for c in costs] == [(r.tokens, r.num_bytes) for r in records]
    assert all(c.blocked_s > 0 and c.write_s is not None for c in costs)
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hf_pma.training.loop; "
            "print(sorted(m for m in sys.modules if m in ('hf_pma.snapshots.callback', 'transformers.trainer')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == "[]"


def test_bad_arguments_are_one_line_before_anything_is_written(tmp_path):
    """Each bad argument of the constructor, step() and load_state_dict() is one ValueError line
    naming it, raised before the snapshot folder (or its claim) is written."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def make(**kwargs):
        return PMASnapshots(
            kwargs.pop("model", model),
            kwargs.pop("accelerator", None),
            optimizer=kwargs.pop("optimizer", optimizer),
            output_dir=kwargs.pop("output_dir", tmp_path),
            interval_tokens=INTERVAL,
            **kwargs,
        )

    for kwargs, named in [
        ({"model": None}, "model"),
        ({"model": "m"}, "model"),
        ({"accelerator": "acc"}, "accelerator"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"output_dir": 5}, "output_dir"),
        ({"pma_dir": 5}, "pma_dir"),
    ]:
        with pytest.raises(ValueError, match=f"^{named} must"):
            make(**kwargs)
    for kwargs, named in [
        ({"tokens": True}, "tokens"),
        ({"tokens": -5}, "tokens"),
        ({"tokens": 1.5}, "tokens"),
        ({"tokens": "64"}, "tokens"),
        ({"tokens": float("nan")}, "tokens"),
        ({"tokens": 10**40}, "tokens"),
        ({"tokens": 64, "lr": "x"}, "lr"),
        ({"tokens": 64, "lr": -1.0}, "lr"),
        ({"tokens": 64, "lr": True}, "lr"),
        ({"tokens": 64, "lr": float("inf")}, "lr"),
        ({"tokens": 64, "loss": "x"}, "loss"),
        ({"tokens": 64, "loss": True}, "loss"),
        ({"tokens": 64, "model": "m"}, "model"),
    ]:
        with pytest.raises(ValueError, match=f"^{named} must"):
            make().step(**kwargs)
    with pytest.raises(ValueError, match="no learning rate is known for the first optimizer step"):
        make().step(tokens=64)  # the optimizer did not step: nothing reported its LR
    with pytest.raises(ValueError, match="no input tokens in optimizer step 1"):
        make().step(tokens=0, lr=LR)
    good = {"version": 1, "tokens": 128, "global_step": 2, "schedule": {}}
    for state, says in [
        ({**good, "version": True}, "not a state saved"),
        ({"version": 1}, "tokens must be"),
        ({**good, "tokens": "x"}, "tokens must be"),
        ({**good, "tokens": -5}, "tokens must be"),
        ({**good, "tokens": True}, "tokens must be"),
        ({**good, "tokens": float("nan")}, "tokens must be"),
        ({**good, "global_step": -1}, "global_step must be"),
        ({**good, "tokens": 0}, "tokens=0 after global_step=2"),
        ({**good, "schedule": "x"}, "schedule must be a dict"),
        ({**good, "schedule": None}, "schedule must be a dict"),
        (
            {**good, "schedule": {"interval_tokens": "abc"}},
            "schedule: interval_tokens must be a positive integer",
        ),
        (
            {**good, "schedule": {"interval_tokens": -5}},
            "schedule: interval_tokens must be a positive integer",
        ),
        ({**good, "schedule": {"phase": "x"}}, "schedule: phase must be a dict"),
        (
            {**good, "schedule": {"phase": {"previous_lr": "abc"}}},
            "phase.previous_lr must be a finite number",
        ),
        (
            {**good, "schedule": {"phase": {"peak_reached": "yes"}}},
            "phase.peak_reached must be True or False",
        ),
        ({**good, "schedule": {"interval_choice": 5}}, "interval_choice must be a dict"),
        ({**good, "options": {"online": "sma"}}, "online=None differs from the 'sma'"),
        ({**good, "options": {"token_count": "non_padding"}}, "token_count='all' differs"),
    ]:
        with pytest.raises(ValueError, match=says):
            make().load_state_dict(state)
    assert list(tmp_path.iterdir()) == []
    pma = make()
    pma.step(tokens=64, lr=LR)
    with pytest.raises(ValueError, match="^tokens must be"):
        pma.step(tokens=-64, lr=LR)  # after the first step too
    pma.end()
    pma.end()  # a second end() is a no-op (e.g. in a finally after an explicit one)
    with pytest.raises(ValueError, match=r"after end\(\)"):
        pma.step(tokens=64, lr=LR)
    ended = make()
    ended.end()
    with pytest.raises(ValueError, match=r"load_state_dict\(\) after end\(\)"):
        ended.load_state_dict(good)


def test_no_constant_phase_warning_in_loop_words(tmp_path, caplog):
    """A loop with a cosine schedule gets the one warning the Trainer gets, naming its scheduler
    and advising in the loop's words (``get_scheduler``), not a Trainer option it does not have."""
    import logging

    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    pma = PMASnapshots(
        model, optimizer=optimizer, lr_scheduler=lr_scheduler, max_steps=STEPS, output_dir=tmp_path
    )
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        for batch in batches()[:2]:
            model(**batch).loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            pma.step(batch=batch)
    pma.end()
    warnings = [r.getMessage() for r in caplog.records if "no constant-LR phase" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("hf-pma: the lr_scheduler (LambdaLR) has no constant-LR phase")
    assert "get_scheduler('warmup_stable_decay'" in warnings[0] and "lr_scheduler_type" not in warnings[0]


def test_gradient_accumulation_with_tokens_that_vary(tmp_path, caplog):
    """Gradient accumulation over micro-batches whose non-padding tokens vary, with the automatic
    interval: no crash, V a whole number of the first optimizer step's tokens, the tokens of every
    micro-batch counted, and one line saying the steps between snapshots vary."""
    import logging

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    pma = PMASnapshots(
        model,
        accelerator,
        optimizer=optimizer,
        max_steps=STEPS // 2,
        output_dir=tmp_path,
        token_count="non_padding",
        phases=("warmup", "stable", "decay"),
        max_overhead=None,  # the planned V, whatever these steps cost
    )
    data = batches()
    for i, batch in enumerate(data):
        batch = dict(batch, attention_mask=batch["attention_mask"].clone())
        batch["attention_mask"][:, SEQ - i :] = 0  # micro-batch i pads its last i positions
        data[i] = batch
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        for batch in data:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
            pma.step(batch=batch)
    pma.end()
    counted = [int(b["attention_mask"].sum()) for b in data]
    assert (pma.global_step, pma.tokens) == (STEPS // 2, sum(counted))
    assert pma.interval_tokens % (counted[0] + counted[1]) == 0
    lines = [r.getMessage() for r in caplog.records if "vary in tokens" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("hf-pma: optimizer steps vary in tokens (step 2: ")
    assert tokens(tmp_path / "pma")


def test_swapped_checks_its_arguments_first_and_restores_on_errors(tmp_path):
    """swapped(): a bad ``last`` or ``model`` is one line before anything moves (with an online
    average too, where ``last`` has no effect and is refused); an exception inside the block,
    and nested swaps, leave the live weights bit for bit."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    runs = {}
    for online in (None, "sma"):
        pma = PMASnapshots(
            model,
            optimizer=optimizer,
            output_dir=tmp_path / str(online),
            interval_tokens=64,
            phases=("warmup", "stable", "decay"),
            online=online,
        )
        for _ in range(3):
            pma.step(tokens=64, lr=LR)
        runs[online] = pma
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for pma in runs.values():
        for last in (0, -1, True, "2", 1.5):
            with pytest.raises(ValueError, match="^last must be 'auto' or a positive number of snapshots"):
                with pma.swapped(last=last):
                    pass
        with pytest.raises(ValueError, match="^model must be a torch.nn.Module"):
            with pma.swapped("m"):
                pass
    with pytest.raises(ValueError, match="last=2 has no effect with online='sma'"):
        with runs["sma"].swapped(last=2):
            pass
    with pytest.raises(KeyError):
        with runs[None].swapped(last=2):
            with runs["sma"].swapped():
                with runs[None].swapped(last=1):
                    raise KeyError("boom")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for pma in runs.values():
        pma.end()


def test_a_second_run_in_a_used_folder_is_told_how_a_loop_resumes(tmp_path):
    """A loop that forgot register_for_checkpointing / load_state starts over in a folder that
    lists snapshots: refused, in the words of both front doors (not only the Trainer's)."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    kwargs = {"optimizer": optimizer, "output_dir": tmp_path, "interval_tokens": 64, "phases": ("warmup",)}
    first = PMASnapshots(model, **kwargs, lr_scheduler=None)
    first.step(tokens=64, lr=0.0)  # warmup from 0
    first.step(tokens=64, lr=LR / 2)
    first.end()
    assert tokens(tmp_path / "pma")
    again = PMASnapshots(model, **kwargs)
    with pytest.raises(
        FileExistsError, match=r"in a loop: accelerator.load_state\(...\) with PMASnapshots registered"
    ):
        again.step(tokens=64, lr=0.0)


def test_non_padding_count_without_attention_mask_says_so_once(tmp_path, caplog):
    """token_count='non_padding' and batches without an attention mask: every position is
    counted, and one warning says so, as the Trainer's own count does."""
    import logging

    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    pma = PMASnapshots(
        model, optimizer=optimizer, output_dir=tmp_path, interval_tokens=INTERVAL, token_count="non_padding"
    )
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        for batch in batches()[:2]:
            pma.step(batch={"input_ids": batch["input_ids"]}, lr=LR)
    pma.end()
    assert pma.tokens == 2 * BATCH * SEQ
    said = [r.getMessage() for r in caplog.records if "no 'attention_mask'" in r.getMessage()]
    assert len(said) == 1 and "counting every 'input_ids' position" in said[0]
