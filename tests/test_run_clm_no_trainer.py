"""transformers' own ``run_clm_no_trainer.py`` with exactly the lines docs/without-trainer.md gives.

The script is not installed with transformers and this project does not ship a copy (it is
transformers' code): the tests that run it are the ``client_script`` tier, deselected by default,
and read the script from ``HF_PMA_RUN_CLM_NO_TRAINER``::

    HF_PMA_RUN_CLM_NO_TRAINER=/path/to/examples/pytorch/language-modeling/run_clm_no_trainer.py \\
        python -m pytest -m client_script tests/test_run_clm_no_trainer.py

What runs everywhere: the docs' lines are found, each one's anchor is named, and each block
compiles at the anchor's indentation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.launcher import launch
from tests.helpers.models import tiny_llama_config
from tests.helpers.repo import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "without-trainer.md"
SCRIPT_ENV = "HF_PMA_RUN_CLM_NO_TRAINER"
STEPS = 12
CHECKPOINT_EVERY = 4
KILL_AFTER_STATE = 8  # the killed run dies right after saving step_8; it resumes from step_4

# "**N. Before the line `A`**" or "**N. Before the lines `A` / `B`**" (consecutive lines), then the block.
_INSERT = re.compile(
    r"\*\*\d\. Before the lines? `(?P<anchor>[^`]+)`(?: / `(?P<next>[^`]+)`)?\*\*.*?```python\n(?P<code>.*?)```", re.S
)


def docs_inserts() -> list[tuple[tuple[str, ...], str]]:
    """``(anchor lines, code as printed)`` for each "Before the line(s) `...`" block of the page's
    lines to add: the code keeps the indentation the page prints it with."""
    section = PAGE.read_text().split("## The lines to add", 1)[1].split("\n## ", 1)[0]
    return [(tuple(a for a in (m["anchor"], m["next"]) if a), m["code"]) for m in _INSERT.finditer(section)]


def _indent(text: str) -> str:
    first = next(line for line in text.splitlines() if line.strip())
    return first[: len(first) - len(first.lstrip())]


def apply_inserts(script: str, inserts: list[tuple[tuple[str, ...], str]]) -> str:
    """The script with each block pasted as printed before its anchor lines (found once, in a
    row); a block not printed at its anchor's indentation is an error: pasted as printed it
    would not run."""
    lines = script.splitlines(keepends=True)
    for anchors, code in inserts:
        found = [
            i for i in range(len(lines))
            if [line.strip() for line in lines[i : i + len(anchors)]] == list(anchors)
        ]  # fmt: skip
        if len(found) != 1:
            raise AssertionError(f"the anchor {anchors!r} is on {len(found)} lines of the script, not one")
        at = found[0]
        if _indent(code) != _indent(lines[at]):
            raise AssertionError(
                f"the block before {anchors[0]!r} is printed at {len(_indent(code))} spaces, the line at "
                f"{len(_indent(lines[at]))}"
            )
        lines[at:at] = [code]
    return "".join(lines)


def test_the_page_gives_three_blocks_each_before_named_lines_at_their_indentation():
    inserts = docs_inserts()
    assert [anchors for anchors, _ in inserts] == [
        ("# Potentially load in the weights and states from a previous save",),
        ("# Checks if the accelerator has performed an optimization step behind the scenes",),
        ("accelerator.end_training()",),
    ]
    # As printed: main()'s body, the training loop's body (for epoch, for batch: 12 spaces), main()'s body.
    assert [len(_indent(code)) for _, code in inserts] == [4, 12, 4]
    assert "PMASnapshots(" in inserts[0][1] and "register_for_checkpointing(pma)" in inserts[0][1]
    assert inserts[1][1].strip() == "pma.step(batch=batch)"
    assert inserts[2][1].strip() == "pma.end()"
    for anchors, code in inserts:
        compile(textwrap.dedent(code), anchors[0], "exec")  # each block is whole Python


def test_apply_inserts_pastes_each_block_as_printed_before_its_one_anchor():
    script = (
        "def main():\n    a = 1\n    for b in c:\n        # here\n        d()\n"
        "    if t:\n        accelerator.end_training()\n"
    )
    patched = apply_inserts(
        script, [(("# here",), "        x(b)\n"), (("if t:", "accelerator.end_training()"), "    y()\n")]
    )
    assert patched == (
        "def main():\n    a = 1\n    for b in c:\n        x(b)\n        # here\n        d()\n    y()\n"
        "    if t:\n        accelerator.end_training()\n"
    )
    with pytest.raises(AssertionError, match="on 0 lines"):
        apply_inserts(script, [(("# not there",), "x()\n")])
    with pytest.raises(AssertionError, match="printed at 0 spaces, the line at 8"):
        apply_inserts(script, [(("# here",), "x(b)\n")])


# ----------------------------------------------------------------------------- the real script


@pytest.fixture(scope="module")
def client_script(tmp_path_factory) -> Path:
    """The real script with the docs' lines in, beside the local inputs it trains on."""
    source = os.environ.get(SCRIPT_ENV)
    if not source or not Path(source).is_file():
        raise AssertionError(
            f"the client_script tier needs {SCRIPT_ENV}=PATH to transformers' "
            "examples/pytorch/language-modeling/run_clm_no_trainer.py"
        )
    folder = tmp_path_factory.mktemp("run_clm_no_trainer")
    patched = apply_inserts(Path(source).read_text(), docs_inserts())
    script = folder / "run_clm_no_trainer.py"
    script.write_text(patched)
    return script


@pytest.fixture(scope="module")
def client_inputs(client_script, tiny_tokenizer) -> dict[str, Path]:
    folder = client_script.parent
    tiny_tokenizer.save_pretrained(folder / "tokenizer")
    tiny_llama_config(vocab_size=len(tiny_tokenizer)).save_pretrained(folder / "config")
    text = sample_text()
    (folder / "train.txt").write_text(text)
    (folder / "valid.txt").write_text(text[: len(text) // 10])
    return {"folder": folder, "script": client_script}


def _script_args(inputs: dict[str, Path], output_dir: Path, *extra: str) -> list[str]:
    folder = inputs["folder"]
    return [
        "--config_name", str(folder / "config"),
        "--tokenizer_name", str(folder / "tokenizer"),
        "--train_file", str(folder / "train.txt"),
        "--validation_file", str(folder / "valid.txt"),
        "--block_size", "32",
        "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "4",
        "--max_train_steps", str(STEPS),
        "--learning_rate", "1e-3",
        "--lr_scheduler_type", "constant",
        "--checkpointing_steps", str(CHECKPOINT_EVERY),
        "--seed", "0",
        "--output_dir", str(output_dir),
        *extra,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(Path(extra.pop("cache"))),
        **extra,
    }


def _run_script(inputs, output_dir: Path, *extra: str, env_extra: dict[str, str] | None = None):
    env = _env(cache=str(inputs["folder"] / "datasets-cache"), **(env_extra or {}))
    return subprocess.run(
        [sys.executable, str(inputs["script"]), *_script_args(inputs, output_dir, *extra)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _manifest_rows(pma_dir: Path) -> list[tuple[int, int]]:
    manifest = json.loads((pma_dir / "manifest.json").read_text())
    return [
        (s["tokens"], s["step"])
        for s in manifest["snapshots"]
        if not (s.get("extra") or {}).get("set_aside_at")
    ]


def _merge_last_4(pma_dir: Path, out: Path) -> None:
    result = run_cli("merge", pma_dir, "--last", "4", "-o", out)
    assert result.returncode == 0, result.stderr
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))


@pytest.fixture(scope="module")
def one_process_run(client_inputs) -> Path:
    output_dir = client_inputs["folder"] / "one-process"
    done = _run_script(client_inputs, output_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    return output_dir


@pytest.mark.client_script
@pytest.mark.slow
def test_run_clm_no_trainer_in_one_process_then_merge(one_process_run):
    rows = _manifest_rows(one_process_run / "pma")
    assert len(rows) >= 4
    assert [step for _, step in rows] == sorted({step for _, step in rows})
    _merge_last_4(one_process_run / "pma", one_process_run.parent / "merged-one")


@pytest.mark.client_script
@pytest.mark.slow
@pytest.mark.distributed
def test_run_clm_no_trainer_under_accelerate_launch_two_processes_then_merge(client_inputs, one_process_run):
    output_dir = client_inputs["folder"] / "two-processes"
    launch(
        client_inputs["script"],
        *_script_args(client_inputs, output_dir),
        nproc=2,
        launcher="accelerate",
        env={
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(client_inputs["folder"] / "datasets-cache-2"),
        },
    )
    rows = _manifest_rows(output_dir / "pma")
    # Twice the tokens a step (two processes' batches): the snapshot count is that of one process.
    assert len(rows) == len(_manifest_rows(one_process_run / "pma"))
    _merge_last_4(output_dir / "pma", client_inputs["folder"] / "merged-two")


KILLER = """
import os, signal
from accelerate import Accelerator

_save_state = Accelerator.save_state

def save_state(self, output_dir=None, *args, **kwargs):
    result = _save_state(self, output_dir, *args, **kwargs)
    if str(output_dir).endswith("step_{step}"):
        os.kill(os.getpid(), signal.SIGKILL)  # as a preemption would: no end(), a write maybe in flight
    return result

Accelerator.save_state = save_state
"""


@pytest.mark.client_script
@pytest.mark.slow
def test_run_clm_no_trainer_killed_and_resumed_takes_the_same_snapshots(client_inputs, one_process_run):
    output_dir = client_inputs["folder"] / "killed"
    hook = client_inputs["folder"] / "kill-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILLER.format(step=KILL_AFTER_STATE))
    killed = _run_script(
        client_inputs, output_dir, env_extra={"PYTHONPATH": os.pathsep.join([str(hook), str(REPO_ROOT)])}
    )
    assert killed.returncode == -9, killed.stderr[-4000:]
    assert (output_dir / f"step_{KILL_AFTER_STATE}").is_dir()
    taken_before = _manifest_rows(output_dir / "pma")
    assert taken_before and max(step for _, step in taken_before) > CHECKPOINT_EVERY

    resumed = _run_script(
        client_inputs, output_dir, "--resume_from_checkpoint", str(output_dir / f"step_{CHECKPOINT_EVERY}")
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _manifest_rows(output_dir / "pma") == _manifest_rows(one_process_run / "pma")
    _merge_last_4(output_dir / "pma", client_inputs["folder"] / "merged-killed")
