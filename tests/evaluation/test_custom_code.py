"""No code from a folder runs: a model or tokenizer folder that names custom code (``auto_map``)
is refused in one line, even when the user answers "y" to a prompt; every load in the library
passes ``trust_remote_code=False``; a config that is too deep, truncated or linked out of its
folder is one line naming the file, before anything is loaded."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import hf_pma
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.models import make_tiny_model, save_model_folder

CODE = """open({marker!r}, "w").write("the folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = "evil_model"


class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("custom-code")
    (root / "heldout.txt").write_text(sample_text(1500))
    return save_model_folder(root / "good", make_tiny_model(seed=0), tiny_tokenizer)


def _copy(good: Path, dest: Path) -> Path:
    dest.mkdir()
    for path in good.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    return dest


def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _evil(good: Path, tmp_path: Path, where: str = "config.json") -> tuple[Path, Path]:
    """A copy of ``good`` whose ``where`` names the custom code in ``evil.py``, which writes a marker."""
    folder = _copy(good, tmp_path / "evil")
    marker = tmp_path / "MARKER"
    (folder / "evil.py").write_text(CODE.format(marker=str(marker)))
    if where == "config.json":
        _edit_json(
            folder / "config.json",
            model_type="evil_model",
            auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
        )
    else:
        _edit_json(folder / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    return folder, marker


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def test_eval_of_a_folder_with_custom_code_runs_none_even_when_the_user_says_yes(good, tmp_path):
    folder, marker = _evil(good, tmp_path)
    out = tmp_path / "out.json"
    done = run_cli(
        "eval",
        folder,
        "--eval-file",
        good.parent / "heldout.txt",
        "-o",
        out,
        input="y\n",  # the answer transformers' prompt would take: there must be no prompt
        env={"OMP_NUM_THREADS": "1"},
        process=True,
    )
    assert not marker.exists(), "the folder's Python ran"
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert _error_lines(done.stderr) == [
        f"hf-pma eval: error: {folder} (config.json has auto_map) needs custom code (auto_map) that hf-pma does not "
        "run: it loads only models and tokenizers that transformers itself implements"
    ]
    assert not out.exists()


def test_a_tokenizer_with_custom_code_is_refused(good, tmp_path):
    folder, marker = _evil(good, tmp_path, where="tokenizer_config.json")
    done = run_cli(
        "eval", folder, "--eval-file", good.parent / "heldout.txt", "-o", tmp_path / "out.json", "-q"
    )
    assert done.returncode == 2 and not marker.exists()
    assert "(tokenizer_config.json has auto_map) needs custom code" in done.stderr
    # A separate --tokenizer folder is checked the same way.
    done = run_cli("eval", good, "--tokenizer", folder, "--eval-file", good.parent / "heldout.txt", "-q")
    assert done.returncode == 2 and "(tokenizer_config.json has auto_map) needs custom code" in done.stderr


@pytest.mark.parametrize(
    "damage, message",
    [
        ("deep", "config.json is not valid JSON: nested deeper than"),
        ("truncated", "config.json is not valid JSON"),
        ("link-out", "config.json is a symbolic link to outside the folder"),
        ("weights-link-out", "model.safetensors is a symbolic link to outside the folder"),
        ("fifo", "config.json is not a regular file (a FIFO)"),
    ],
)
def test_a_hostile_config_is_one_line_naming_the_file_before_loading(good, tmp_path, damage, message):
    import os

    folder = _copy(good, tmp_path / "model")
    config = folder / "config.json"
    if damage == "deep":
        config.write_text("[" * 200_000 + "]" * 200_000)
    elif damage == "truncated":
        config.write_text(config.read_text()[:40])
    elif damage == "link-out":
        (tmp_path / "config.json").write_bytes(config.read_bytes())
        config.unlink()
        config.symlink_to(tmp_path / "config.json")
    elif damage == "weights-link-out":
        (tmp_path / "elsewhere.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    else:
        config.unlink()
        os.mkfifo(config)
    results = tmp_path / "results"  # not beside the files planted outside, which look like a model there
    results.mkdir()
    done = run_cli(
        "eval", folder, "--eval-file", good.parent / "heldout.txt", "-o", results / "out.json", "-q"
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = _error_lines(done.stderr)
    assert len(lines) == 1 and message in lines[0] and len(lines[0]) < 500, done.stderr


def _load_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("from_pretrained", "from_config"):
                yield node


def _passes_no_remote_code(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "trust_remote_code":
            return isinstance(keyword.value, ast.Constant) and keyword.value.value is False
        if keyword.arg is None and isinstance(keyword.value, ast.Name) and keyword.value.id == "LOAD_KWARGS":
            return True
    return False


def test_every_load_in_the_library_passes_trust_remote_code_false():
    from hf_pma.evaluation.model_checks import LOAD_KWARGS

    assert LOAD_KWARGS == {"trust_remote_code": False}
    package = Path(hf_pma.__file__).parent
    found, missing = 0, []
    for path in sorted(package.rglob("*.py")):
        for call in _load_calls(ast.parse(path.read_text(), str(path))):
            found += 1
            if not _passes_no_remote_code(call):
                missing.append(f"{path.relative_to(package)}:{call.lineno}")
    assert found >= 5 and missing == []


TASK_YAML = """task: code_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
process_docs: !function utils.process_docs
doc_to_text: "{{{{text}}}}"
doc_to_target: 0
doc_to_choice: ["a", "b"]
metric_list:
  - metric: acc
"""


def test_a_task_folder_that_names_python_code_is_said_to_run_it(tmp_path, caplog):
    from hf_pma.evaluation.harness import load_task_manager

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text('{"text": "x"}\n')
    (tasks / "code_task.yaml").write_text(TASK_YAML.format(data=tasks / "data.jsonl"))
    (tasks / "utils.py").write_text("def process_docs(docs):\n    return docs\n")
    with caplog.at_level("WARNING"):
        names, _ = load_task_manager("code_task", tasks)
    assert names == ["code_task"]
    warnings = [r.getMessage() for r in caplog.records if "!function" in r.getMessage()]
    assert warnings == [
        f"task folder {tasks}: code_task.yaml names Python code (!function), which lm-eval runs when the task "
        "loads: use only task folders you trust"
    ]
    # The command's help says it too, for --tasks and --include-path.
    done = run_cli("eval", "--help")
    text = "".join(done.stdout.split())  # argparse wraps lines, at hyphens too
    assert "a task's YAML can run Python (lm-eval's !function)".replace(" ", "") in text
    assert (
        "A task folder is code: lm-eval runs the Python its YAML names (!function)".replace(" ", "") in text
    )


def test_sweep_of_a_run_whose_snapshot_names_custom_code_runs_none(tmp_path, tiny_tokenizer):
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    run, _ = write_run(tmp_path / "run", 2, noise_deviation(), tokenizer=tiny_tokenizer)
    newest = sorted((run / "pma").glob("snapshot-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    marker = tmp_path / "MARKER"
    (newest / "evil.py").write_text(CODE.format(marker=str(marker)))
    _edit_json(
        newest / "config.json",
        model_type="evil_model",
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    )
    (tmp_path / "heldout.txt").write_text(sample_text(1500))
    done = run_cli(
        "sweep",
        run,
        "--eval-file",
        tmp_path / "heldout.txt",
        "--window",
        "2",
        "--every",
        "1",
        "--strategy",
        "sma",
        "-o",
        tmp_path / "s.json",
        "-q",
    )
    assert not marker.exists()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "(config.json has auto_map) needs custom code (auto_map) that hf-pma does not run" in done.stderr
    assert not (tmp_path / "s.json").exists()
