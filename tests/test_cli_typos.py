"""The command line as users type it (hf_pma.utils.parsing.CommandLineParser): a misspelt option
is refused with the closest one named, an abbreviated one is refused (never taken for another),
and every refusal is one short line in the command's words, for every ``hf-pma`` sub-command and
every script under ``scripts/``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pma.cli import COMMANDS, build_parser
from hf_pma.utils.parsing import ERROR_LINE_CHARS, closest_options
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
PROG = build_parser().prog
SCRIPTS = sorted((REPO / "scripts").glob("*.py"))
# Options every sub-command shares: the test takes each command's own.
SHARED = {"--help", "--verbose", "--quiet", "--version"}
# A keyword form of the library (``overwrite=True``) where a command should name its flag.
KEYWORD_FORM = re.compile(r"\b[a-z_]+=(True\b|False\b|None\b|,|\))")


def _sub(name: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.option_strings == [] and hasattr(a, "choices") and a.choices)
    return action.choices[name]


def _own_option(parser) -> str:
    """The command's longest own option: the one misspelt and abbreviated below."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o not in SHARED]
    return max(options, key=len)


def _misspelt(option: str) -> str:
    """``option`` with two neighbouring letters swapped near its middle (``--learnig_rate``-like)."""
    i = len(option) // 2
    return option[:i] + option[i + 1] + option[i] + option[i + 2 :]


def assert_one_line_refusal(stderr: str, prog: str, paths: dict[str, str] | None = None) -> str:
    """The refusal as the standard says: one line, short (counted with the ``paths`` the user gave
    written as their short names: their length is the user's), the command's own words, no
    traceback."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith(f"{prog}: error: "), line
    counted = line
    for name, path in (paths or {}).items():
        counted = counted.replace(path, name)
    assert len(counted) <= ERROR_LINE_CHARS, (len(counted), line)
    assert "Traceback" not in stderr and not KEYWORD_FORM.search(line), line
    return line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_misspelt_option_names_the_closest(command, tmp_path):
    option = _own_option(_sub(command))
    typo = _misspelt(option)
    done = run_cli(command, str(tmp_path / "x"), typo, "1", cwd=tmp_path)
    assert done.returncode == 2
    line = assert_one_line_refusal(done.stderr, f"hf-pma {command}")
    assert f"unknown option {typo}" in line and f"did you mean {option}" in line, line
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_abbreviated_option_is_refused_not_taken(command, tmp_path):
    option = _own_option(_sub(command))
    done = run_cli(command, str(tmp_path / "x"), option[:-2], "1", cwd=tmp_path)
    assert done.returncode == 2
    line = assert_one_line_refusal(done.stderr, f"hf-pma {command}")
    assert "(options are not abbreviated)" in line and option in line, line
    assert list(tmp_path.iterdir()) == []


def test_the_issues_examples(tmp_path):
    compare = run_cli("compare", "a", "b", "--eval_file", "x", cwd=tmp_path)
    line = assert_one_line_refusal(compare.stderr, "hf-pma compare")
    assert line == "hf-pma compare: error: unknown option --eval_file; did you mean --eval-file?"
    # An option that takes a value, typed with it (--opt=value), is named without it.
    eq = run_cli("merge", "run", "-o", "m", "--strategie=sma", cwd=tmp_path)
    assert "unknown option --strategie; did you mean --strategy?" in eq.stderr
    sub = run_cli("mrege", "run", cwd=tmp_path)
    assert assert_one_line_refusal(sub.stderr, PROG).endswith("invalid choice 'mrege'; did you mean merge?")
    # A typo is named before an argument that is missing: fixing one does not reveal the other.
    first = run_cli("merge", "--lst", "3", cwd=tmp_path)
    assert "unknown option --lst; did you mean --last?" in first.stderr


def test_closest_options_prefer_what_is_abbreviated_and_never_hidden_ones():
    import argparse

    from hf_pma.utils.parsing import CommandLineParser

    parser = CommandLineParser(prog="p")
    parser.add_argument("--max_steps")
    parser.add_argument("--max_grad_norm")
    parser.add_argument("--learning_rate")
    parser.add_argument("--pma_anneal_steps", help=argparse.SUPPRESS)
    assert closest_options("--max_step", parser) == ["--max_steps"]
    assert closest_options("--learnig_rate", parser) == ["--learning_rate"]
    assert closest_options("--Learning-Rate", parser) == ["--learning_rate"]  # another spelling
    assert closest_options("--pma_anneal_step", parser) == []  # hidden: never suggested
    assert closest_options("--zzz", parser) == []


def _run_script(script: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *argv], capture_output=True, text=True, timeout=300, cwd=cwd
    )


SCRIPT_CASES = {
    "pretrain.py": ("--learnig_rate", "--learning_rate", "--max_step", "--max_steps"),
    "pretrain_no_trainer.py": ("--save_evry", "--save_every", "--max_step", "--max_steps"),
}


def test_every_script_has_a_case():
    assert sorted(SCRIPT_CASES) == sorted(s.name for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_a_script_names_the_closest_option_and_refuses_an_abbreviation(script, tmp_path):
    typo, meant, abbreviated, whole = SCRIPT_CASES[script.name]
    done = _run_script(script, "--output_dir", str(tmp_path / "run"), typo, "1e-3", cwd=tmp_path)
    assert done.returncode == 2
    line = assert_one_line_refusal(done.stderr, script.name)
    assert line == f"{script.name}: error: unknown option {typo}; did you mean {meant}?"
    short = _run_script(script, "--output_dir", str(tmp_path / "run"), abbreviated, "5", cwd=tmp_path)
    assert short.returncode == 2
    line = assert_one_line_refusal(short.stderr, script.name)
    assert line == f"{script.name}: error: unknown option {abbreviated} (options are not abbreviated); did you mean {whole}?"
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


def test_a_config_file_key_misspelt_names_the_closest(tmp_path):
    from hf_pma.training.arguments import PMATrainingArguments, parse_with_config
    from hf_pma.utils.parsing import hf_argument_parser

    config = tmp_path / "run.yaml"
    config.write_text("output_dir: out\nlearnig_rate: 0.001\n")
    parser = hf_argument_parser((PMATrainingArguments,))
    with pytest.raises(ValueError, match=r"unknown argument\(s\) learnig_rate; did you mean learning_rate\?"):
        parse_with_config(parser, [str(config)])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A run of 3 snapshots, an empty folder, a non-empty one, a path that does not exist."""
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    root = tmp_path_factory.mktemp("refusals")
    run, _ = write_run(root / "run", 3, noise_deviation())
    (root / "empty").mkdir()
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("mine\n")
    (root / "text.txt").write_text("held-out text\n")
    return {"RUN": str(run), "EMPTY": str(root / "empty"), "FULL": str(root / "full"),
            "MISSING": str(root / "missing"), "OUT": str(root / "out"), "TEXT": str(root / "text.txt"),
            "SNAPSHOT": str(run / "pma" / "snapshot-1000")}  # fmt: skip


# The refusals the suite exercises (each elsewhere, for what it checks), walked here for their form.
REFUSALS = [
    *[[command] for command in COMMANDS],  # a required argument missing
    ["mrege", "RUN"],
    ["merge", "RUN", "-o", "OUT", "--last", "50"],
    ["merge", "RUN", "-o", "OUT", "--last", "0"],
    ["merge", "RUN", "-o", "OUT", "--strategy", "median"],
    ["merge", "RUN", "-o", "FULL"],
    ["merge", "EMPTY", "-o", "OUT"],
    ["merge", "MISSING", "-o", "OUT"],
    ["merge", "RUN", "-o", "OUT", "--window-tokens", "0"],
    ["compare", "RUN", "--eval_file", "x"],
    ["sweep", "RUN"],
    ["eval", "EMPTY"],
    ["eval", "EMPTY", "--eval-file", "TEXT"],
    ["eval", "SNAPSHOT", "--eval-file", "TEXT"],  # no tokenizer: pass one
    ["inspect", "EMPTY"],
    ["inspect", "MISSING"],
    ["consolidate", "EMPTY", "-o", "OUT"],
    ["card", "EMPTY"],
    ["push", "EMPTY", "--repo-id", "bad id!"],
    ["make-tasks", "MISSING", "-o", "OUT"],
    ["make-tasks", "TEXT", "-o", "OUT", "--num-items", "0"],
    ["merge", "RUN", "-o", "OUT", "--max-shard-size", "1XB"],
]


@pytest.mark.parametrize("argv", REFUSALS, ids=lambda a: " ".join(a))
def test_every_refusal_is_one_short_line_in_the_commands_words(argv, folders):
    done = run_cli(*[folders.get(a, a) for a in argv])
    assert done.returncode == 2, done.stderr
    prog = PROG if argv[0] not in COMMANDS else f"{PROG} {argv[0]}"
    assert_one_line_refusal(done.stderr, prog, folders)
    assert not Path(folders["OUT"]).exists()


def test_the_library_words_become_the_commands(folders):
    full = run_cli("merge", folders["RUN"], "-o", folders["FULL"])
    assert "is not empty; pass --overwrite to replace it" in full.stderr
    many = run_cli("merge", folders["RUN"], "-o", folders["OUT"], "--last", "50")
    line = assert_one_line_refusal(many.stderr, "hf-pma merge")
    assert line.endswith("found 3 sources (snapshot-1000 .. snapshot-3000), fewer than --last 50: pass --last 3 to merge them all")
    empty = run_cli("merge", folders["EMPTY"], "-o", folders["OUT"])
    assert "give a run's output_dir" in empty.stderr
    # a library check's parameter is said as the command's flag, whichever check made it
    shard = run_cli("merge", folders["RUN"], "-o", folders["OUT"], "--max-shard-size", "1XB")
    assert assert_one_line_refusal(shard.stderr, "hf-pma merge").endswith("--max-shard-size '1XB' cannot be parsed: use bytes or a value like '5GB' or '500MiB'")
    items = run_cli("make-tasks", folders["TEXT"], "-o", folders["OUT"], "--num-items", "0")
    assert assert_one_line_refusal(items.stderr, "hf-pma make-tasks").endswith("--num-items must be at least 1, got 0")


def test_the_command_line_page_shows_what_the_commands_print(tmp_path):
    """docs/cli.md's example of typos: each ``$ hf-pma ...`` line run here prints the line under it."""
    import shlex

    page = (REPO / "docs" / "cli.md").read_text()
    block = page.split("<!-- quoted: tests/test_cli_typos.py", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    assert len(lines) >= 4 and all(line.startswith("$ hf-pma ") for line in lines[::2])
    for command, said in zip(lines[::2], lines[1::2]):
        done = run_cli(*shlex.split(command.removeprefix("$ hf-pma ")), cwd=tmp_path)
        assert (done.returncode, done.stderr.strip()) == (2, said), command


@pytest.mark.parametrize(
    "name, text, said",
    [
        ("broken.yaml", "a: [1, 2\n", "is not valid YAML (line 2)"),
        ("unsafe.yaml", "!!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
        ("keys.yaml", "1: 2\n", "expected a mapping of argument names to values"),
        ("list.yaml", "- a\n", "expected a mapping of argument names to values"),
        ("broken.json", '{"a": 1,}', "is not valid JSON"),
        ("deep.json", "[" * 100_000, "nested deeper than"),
    ],
)
def test_a_config_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, name, text, said):
    """A script's config file that is not a mapping of names (broken, nested past any sense, a
    tag that would build a Python object) is one ValueError line naming the file, never a parser's traceback."""
    import dataclasses

    from transformers import HfArgumentParser

    from hf_pma.training.arguments import parse_with_config

    @dataclasses.dataclass
    class Options:
        a: int = 0

    config = tmp_path / name
    config.write_text(text)
    with pytest.raises(ValueError) as err:
        parse_with_config(HfArgumentParser([Options]), [str(config)])
    assert said in str(err.value) and str(config) in str(err.value) and "\n" not in str(err.value)
