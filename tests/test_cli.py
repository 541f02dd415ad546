"""The ``hf-pma`` command starts fast: building its parser and printing help import no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "huggingface_hub", "safetensors", "yaml")

_PROBE = """
import contextlib, io, json, sys
from hf_pma.cli import build_parser, main
build_parser()
argv = sys.argv[1:]
if argv:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: hf-pma" in out.getvalue(), out.getvalue()
heavy = {heavy!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


@pytest.mark.parametrize(
    "argv", [[], ["--help"], ["merge", "--help"], ["make-tasks", "--help"], ["eval", "--help"]]
)
def test_parser_and_help_import_no_heavy_module(argv):
    # A fresh interpreter: this one has torch loaded already.
    probe = _PROBE.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


_MERGE_PROBE = """
import json, sys
from hf_pma.cli import main
assert main(sys.argv[1:]) == 0
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))))
"""


def test_merge_and_consolidate_of_safetensors_import_neither_torch_nor_transformers(tmp_path):
    from hf_pma.io.sharded import rank_file_name
    from tests.helpers.models import make_tiny_model, save_model_folder

    folders = [
        save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i), max_shard_size="20KB")
        for i in range(3)
    ]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((folders[0] / "config.json").read_bytes())
    for rank, shard in enumerate(sorted(folders[0].glob("model-*.safetensors"))):
        (sharded / rank_file_name(rank)).write_bytes(shard.read_bytes())  # whole tensors, no DCP offsets
    commands = {
        "merge": ["merge", *map(str, folders), "-o", str(tmp_path / "merged"), "-q"],
        "consolidate": [
            "consolidate",
            str(sharded),
            "-o",
            str(tmp_path / "plain"),
            "--dtype",
            "bfloat16",
            "-q",
        ],
    }
    for name, argv in commands.items():
        out = subprocess.run(
            [sys.executable, "-c", _MERGE_PROBE, *argv], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1]) == [], name
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "plain" / "config.json").is_file()


def test_run_cli_in_process_puts_back_what_the_command_changes(tmp_path, monkeypatch):
    """The in-process runner (tests.helpers.cli.run_cli) leaves no state for the next test:
    loggers, environment, current folder, torch's threads, progress bars."""
    import logging
    import os

    import torch
    from transformers.utils import logging as hf_logging

    from tests.helpers.cli import run_cli

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    loggers = [logging.getLogger(), logging.getLogger("hf_pma"), hf_logging.get_logger()]
    before = [(lg.level, list(lg.handlers), [h.formatter for h in lg.handlers]) for lg in loggers]
    env, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    bars = hf_logging.is_progress_bar_enabled()
    done = run_cli(
        "merge", "-v", tmp_path / "missing", "-o", tmp_path / "m", cwd=tmp_path, env={"HF_PMA_X": "1"}
    )
    assert done.returncode == 1 and "Traceback" in done.stderr and "does not exist" in done.stderr
    quiet = run_cli("merge", tmp_path / "missing", "-o", tmp_path / "m", "-q")
    assert quiet.returncode == 2 and quiet.stderr.count("\n") == 1 and "Traceback" not in quiet.stderr
    usage = run_cli("merge", "--strategy", "median")
    assert usage.returncode == 2 and usage.stderr.startswith("hf-pma merge: error: argument --strategy: invalid choice")
    assert run_cli("--help").returncode == 0
    assert [(lg.level, list(lg.handlers), [h.formatter for h in lg.handlers]) for lg in loggers] == before
    assert dict(os.environ) == env and os.getcwd() == cwd and torch.get_num_threads() == threads
    assert hf_logging.is_progress_bar_enabled() == bars


def test_library_errors_name_parameters_and_the_command_shows_their_flags():
    """A library function says ``window_tokens must ...``; the command says ``--window-tokens
    must ...`` (hf_pma.cli.flag_words, the one place that maps parameters to flags)."""
    from hf_pma.cli import build_parser, flag_words
    from hf_pma.utils.parsing import check_int, parameter_error

    parser = build_parser()
    with pytest.raises(ValueError) as info:
        check_int(0, "window_tokens")
    assert str(info.value) == "window_tokens must be a positive integer, got 0"
    assert flag_words(info.value, parser, "merge") == "--window-tokens must be a positive integer, got 0"
    assert flag_words(info.value, parser, "push") == str(info.value)  # push has no such flag: as it is
    named_otherwise = parameter_error("x_values", "names zz, which is not one of the runs")
    assert flag_words(named_otherwise, parser, "compare") == "--x names zz, which is not one of the runs"
    refused = parameter_error("overwrite", "refuses to replace out: it is a Trainer checkpoint", FileExistsError)
    assert isinstance(refused, FileExistsError)
    assert flag_words(refused, parser, "merge").startswith("--overwrite refuses to replace out")
    # An error that names no parameter is shown as it is, even when it starts like one.
    assert flag_words(ValueError("last snapshot missing"), parser, "merge") == "last snapshot missing"


def test_library_messages_that_name_a_flag_name_the_parameter_too():
    """A library function called from Python says what to pass in Python: every error or log
    line outside hf_pma/commands and hf_pma/cli.py that names an ``hf-pma`` flag (``--revisions``)
    names the parameter that flag sets too (``revisions=, --revisions``, ``name (--flag)``)."""
    import argparse
    import ast
    import re
    from pathlib import Path

    import hf_pma
    from hf_pma.cli import PARAMETER_DESTS, build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    dests: dict[str, set[str]] = {}
    for sub in subparsers.choices.values():
        for action in sub._actions:
            for option in action.option_strings:
                dests.setdefault(option, set()).add(action.dest)
    names_of = {
        dest: {dest} | {p for p, d in PARAMETER_DESTS.items() if d == dest}
        for ds in dests.values()
        for dest in ds
    }
    root = Path(hf_pma.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "commands" or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                message = node.exc
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                "warning",
                "info",
                "error",
                "debug",
            ):
                message = node
            else:
                continue
            text = " ".join(
                n.value for n in ast.walk(message) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            )
            if "accelerate launch" in text:  # accelerate's and torchrun's own flags
                continue
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
                names = set().union(*(names_of[d] for d in dests.get(flag, ()))) or {
                    flag[2:].replace("-", "_")
                }
                said = "|".join(re.escape(n) for n in names)
                if not re.search(rf"(?<![\w-])(?:{said})s?(?:=|\s*\(--|,\s*--| or \w+, --)", text):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {flag}")
    assert bad == [], bad


def test_a_bad_hub_timeout_is_named_by_its_flag_on_the_command_line(tmp_path):
    from hf_pma.utils.hub_client import set_hub_timeout
    from tests.helpers.cli import run_cli

    with pytest.raises(ValueError, match="^hub timeout '0' is not a timeout"):
        set_hub_timeout("0")
    done = run_cli("merge", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "m", "--hub-timeout", "0")
    assert done.returncode == 2 and "--hub-timeout '0' is not a timeout" in done.stderr, done.stderr


def test_library_keyword_forms_are_shown_as_the_commands_flags():
    """``overwrite=True (--overwrite)`` and the like, written for library users and command users
    at once, reach a command user as the command's flag alone (hf_pma.cli.flag_words)."""
    from hf_pma.cli import build_parser, flag_words

    parser = build_parser()

    def shown(text: str, command: str = "merge") -> str:
        return flag_words(ValueError(text), parser, command)

    assert shown("x is not empty; pass overwrite=True (--overwrite) to replace it") == "x is not empty; pass --overwrite to replace it"
    assert shown("left as it is (pass overwrite=True / --overwrite to replace it)").endswith("(pass --overwrite to replace it)")
    assert shown("pass --include-final (include_final=True) or name it") == "pass --include-final or name it"
    assert shown("leave include_final (--include-final) off") == "leave --include-final off"
    assert shown("found 3, fewer than last=5: pass last=3") == "found 3, fewer than --last 5: pass --last 3"
    assert shown("give the window in steps (--window-steps, window_steps=)") == "give the window in steps (--window-steps)"
    assert shown("no tokenizer: pass one (tokenizer=, --tokenizer)", "eval") == "no tokenizer: pass one (--tokenizer)"
    # Names the command has no flag for, and plain words, stay as they are.
    assert shown("above max_overhead=1.0% (a=b)") == "above max_overhead=1.0% (a=b)"
    assert shown("pass overwrite=True (--overwrite)", "inspect") == "pass overwrite=True (--overwrite)"
