"""Evaluation options as one dataclass (library, ``hf-pma eval``, ``hf-pma sweep``), and the
one-line error of an lm-eval task whose data is on an unreachable Hub."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from hf_pma.cli import build_parser
from hf_pma.evaluation.options import DEFAULT_BOOTSTRAP_ITERS, EvalOptions
from tests.helpers.cli import run_cli
from tests.helpers.markers import require_lm_eval
from tests.helpers.models import make_tiny_model, save_model_folder


def _subcommand(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def test_eval_and_sweep_take_the_same_flags_with_the_same_defaults():
    fields = {f.name: f for f in dataclasses.fields(EvalOptions)}
    for command in ("eval", "sweep"):
        actions = {a.dest: a for a in _subcommand(command)._actions}
        for name, field in fields.items():
            assert actions[name].option_strings == ["--" + name.replace("_", "-")], (command, name)
            assert actions[name].default == field.default, (command, name)
    args = build_parser().parse_args(
        [
            "eval",
            "m",
            "--tasks",
            "a,b",
            "--include-path",
            "x",
            "--include-path",
            "y",
            "--bootstrap-iters",
            "0",
            "--limit",
            "3",
        ]
    )
    options = EvalOptions.from_args(args)
    assert options == EvalOptions(tasks="a,b", include_path=["x", "y"], limit=3, bootstrap_iters=0)
    assert EvalOptions().bootstrap_iters == DEFAULT_BOOTSTRAP_ITERS == 1000  # one default, everywhere
    sweep = EvalOptions.from_args(build_parser().parse_args(["sweep", "run"]))
    assert sweep == EvalOptions()


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        EvalOptions(batch_size=0)
    with pytest.raises(ValueError, match="num_fewshot must be a non-negative integer or None, got -1"):
        EvalOptions(num_fewshot=-1)
    with pytest.raises(TypeError, match="unknown evaluation option.*batchsize"):
        EvalOptions.build(batchsize=4)
    assert EvalOptions.build(EvalOptions(limit=2), batch_size=4) == EvalOptions(limit=2, batch_size=4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "m", "--batch-size", "0"])


@require_lm_eval
def test_a_hub_task_offline_is_one_line_naming_task_and_dataset(tmp_path, tiny_tokenizer):
    """A real lm-eval task (its own arc_easy.yaml, data on the Hub) with the Hub unreachable."""
    import lm_eval.tasks

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(os.path.join(os.path.dirname(lm_eval.tasks.__file__), "arc", "arc_easy.yaml"), tasks)
    model = save_model_folder(tmp_path / "model", make_tiny_model(), tiny_tokenizer)
    # A process of its own: the datasets library reads HF_DATASETS_OFFLINE when it is imported.
    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    done = run_cli(
        "eval",
        model,
        "--tasks",
        "arc_easy",
        "--include-path",
        tasks,
        "--limit",
        "2",
        "-q",
        env=env,
        process=True,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("hf-pma eval: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "lm-eval task arc_easy needs the dataset 'allenai/ai2_arc' from the Hugging Face Hub" in errors[0]
    assert "--include-path" in errors[0] and "local copy" in errors[0]
