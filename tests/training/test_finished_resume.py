"""A finished run resumed (``--resume`` after the last step, as after a kill that came late): it
says so, evaluates the merge of the snapshots on disk and exits 0, with nothing trained or
written again; a resume with no saved state is refused in one line. And a quiet start: the first
line of a run without DeepSpeed is not DeepSpeed's accelerator detection, and a short run says
what its snapshots cost in one line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import torch
from accelerate import Accelerator
from transformers import Trainer

from hf_pma.core.manifest import manifest_snapshots
from hf_pma.merging.engine import merge_state_dict
from hf_pma.training.loop import PMASnapshots
from tests.dist.loop_snapshots import BATCH, INTERVAL, LR, SEQ, STEPS, batches
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model
from tests.helpers.pretrain_runs import script_env
from tests.helpers.repo import REPO_ROOT
from tests.helpers.training import make_args

SCRIPT = REPO_ROOT / "scripts" / "pretrain_no_trainer.py"
KWARGS = {"interval_tokens": INTERVAL, "phases": ("warmup", "stable", "decay"), "max_steps": STEPS}


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hf_pma")]


def _loop(out, steps, resume: bool) -> tuple[torch.nn.Module, PMASnapshots]:
    """The loop of run_clm_no_trainer.py on a tiny Llama, saving its state after its last step."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    pma = PMASnapshots(model, accelerator, optimizer=optimizer, output_dir=out, **KWARGS)
    accelerator.register_for_checkpointing(pma)
    if resume:
        accelerator.load_state(out / "state")
    data = batches()
    for step in steps:
        loss = model(**data[step]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        pma.step(batch=data[step])
    if steps:
        accelerator.save_state(out / "state")
    return model, pma


def test_a_finished_loop_resumed_swaps_in_the_merge_of_its_snapshots(tmp_path, caplog):
    _, done = _loop(tmp_path, range(STEPS), resume=False)
    done.end()
    manifest = (tmp_path / "pma" / "manifest.json").read_bytes()
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        model, pma = _loop(tmp_path, range(0), resume=True)  # no step left
    assert pma.finished and pma.global_step == STEPS and pma.tokens == STEPS * BATCH * SEQ
    assert any("the resumed run had finished (step" in m and "nothing left to train" in m for m in messages(caplog))
    taken = [tmp_path / "pma" / r.path for r in manifest_snapshots(tmp_path / "pma")]
    expected = merge_state_dict(taken[-2:])
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with pma.swapped(model, last=2):
        assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
    assert all(torch.equal(model.state_dict()[k], live[k]) for k in live)
    pma.end()
    assert (tmp_path / "pma" / "manifest.json").read_bytes() == manifest  # nothing taken again


def _script(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--output_dir", str(tmp_path / "loop"), *argv],
        cwd=tmp_path, env=script_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_loop_script_resumed_after_its_end_says_so_and_exits_0(tmp_path):
    first = _script(tmp_path, "--max_steps", "12", "--save_every", "6")
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((tmp_path / "loop" / "pma" / "manifest.json").read_text())
    again = _script(tmp_path, "--max_steps", "12", "--save_every", "6", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert "the resumed run had finished (step 12 of max_steps 12): nothing left to train" in again.stderr
    assert "held-out loss at step 12: live" in again.stdout and "merge of the last 4" in again.stdout
    assert json.loads((tmp_path / "loop" / "pma" / "manifest.json").read_text()) == manifest


def test_a_resume_without_saved_state_is_one_line(tmp_path):
    done = _script(tmp_path, "--resume")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"pretrain_no_trainer.py: error: --resume: no saved state in {tmp_path / 'loop' / 'state'}; run without "
        "--resume to start"
    ]
    assert not (tmp_path / "loop").exists()


_TRAINER_START = """
import sys
from hf_pma import PMATrainer, PMATrainingArguments
from tests.helpers.models import make_tiny_model
args = PMATrainingArguments(output_dir=sys.argv[1], use_cpu=True, max_steps=2, report_to="none",
                            pma_interval_tokens=64)
PMATrainer(make_tiny_model(seed=0), args)
print("deepspeed" in sys.modules)
"""


def test_a_trainer_without_deepspeed_starts_without_its_accelerator_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _TRAINER_START, str(tmp_path / "run")],
        cwd=REPO_ROOT, env=script_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Setting accelerator" not in done.stdout + done.stderr
    # hf-pma itself imports DeepSpeed only where a run uses it (accelerate may, when installed).
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, hf_pma.cli, hf_pma.training.trainer; print('deepspeed' in sys.modules)"],
        cwd=REPO_ROOT, env=script_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert imported.stdout.strip() == "False", imported.stderr[-2000:]


def test_a_widened_automatic_interval_says_its_cost_in_one_line(tmp_path, caplog, slow_copy):
    from hf_pma.snapshots.callback import PMACallback

    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=make_args(tmp_path, max_steps=60, logging_steps=10, lr_scheduler_type="constant"),
        train_dataset=TokenDataset(n=240, min_len=16, max_len=16), data_collator=pad_collate,
        callbacks=[PMACallback()],
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        trainer.train()
    cost = [m for m in messages(caplog) if "snapshots cost" in m]
    assert len(cost) == 1 and "widened interval_tokens" in cost[0], cost
