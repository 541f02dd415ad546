"""Text from a run folder, a record or a name cannot reach a terminal, a card or code as it is:
hostile names and record fields are escaped in every output, a record value is never a template,
names in the card's code are Python literals, name patterns match whole names, and Ctrl-C is one
line and exit 130."""

from __future__ import annotations

import ast
import json
import re
import signal
import subprocess
import sys

import pytest

from hf_pma.io.sharded import sharded_weight_files
from hf_pma.merging.hub_revisions import parse_progress
from hf_pma.merging.sources import run_layout
from hf_pma.publishing.card import build_model_card
from hf_pma.publishing.records import FolderRecords
from hf_pma.utils.fs import parse_temporary
from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.pma_records import merge_record
from tests.helpers.repo import REPO_ROOT
from tests.helpers.snapshot_runs import noise_deviation, write_run

# A clear screen, a forged line, a right-to-left override, a line separator.
HOSTILE = "\x1b[2J\nhf-pma merge: merged OK\u202e\u2028"


def unprintable(text: str) -> list[str]:
    """The lines of ``text`` (split at the line ends the tool writes: newlines, and the carriage
    returns of progress bars) holding a character that is not printable: a control, bidi or
    separator character that came through."""
    return [line for line in re.split("[\r\n]", text) if not line.isprintable()]


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of a markdown text in ``language`` (any fence of 3+ backticks)."""
    return [m.group(2) for m in re.finditer(rf"^(`{{3,}}){language}\n(.*?)\n\1$", text, re.S | re.M)]


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """A run folder whose name, and whose snapshots' ``phase``, hold control and bidi characters."""
    root = tmp_path_factory.mktemp("hostile") / f"run{HOSTILE}"
    run, _ = write_run(root, 3, noise_deviation())
    manifest = run / "pma" / "manifest.json"
    data = json.loads(manifest.read_text())
    for entry in data["snapshots"]:
        entry["phase"] = f"stable{HOSTILE}"
    manifest.write_text(json.dumps(data))
    return run


def test_inspect_merge_and_card_of_a_hostile_run_write_no_control_character(hostile_run):
    run = hostile_run
    inspect = run_cli("inspect", run, "--window", "3")
    assert inspect.returncode == 0, inspect.stderr
    assert "stable\\x1b[2J\\nhf-pma merge: merged OK\\u202e\\u2028" in inspect.stdout
    merged = run / "pma" / "merged"
    merge = run_cli("merge", run, "--last", "all", "-o", merged)
    assert merge.returncode == 0, merge.stderr
    card = run_cli("card", merged, "--no-plot")
    assert card.returncode == 0, card.stderr
    for done in (inspect, merge, card):
        assert unprintable(done.stdout) == [] and unprintable(done.stderr) == [], (
            done.argv,
            done.stdout,
            done.stderr,
        )
        assert "\nhf-pma merge: merged OK" not in done.stdout + done.stderr  # no forged line
    assert (
        merge.stdout.startswith("merged 3 source(s)")
        and "run\\x1b[2J\\nhf-pma merge: merged OK" in merge.stdout
    )
    text = (merged / "README.md").read_text()
    assert unprintable(text) == []
    assert "| stable\\x1b[2J\\nhf-pma merge: merged OK\\u202e\\u2028 |" in text
    (code,) = code_blocks(text, "python")[-1:]
    ast.parse(code)


def test_error_lines_are_one_line_whatever_the_name(tmp_path):
    missing = tmp_path / f"gone{HOSTILE}"
    done = run_cli("merge", missing, "-o", tmp_path / "out")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and unprintable(done.stderr) == [], done.stderr
    assert (
        done.stderr.startswith("hf-pma merge: error: ")
        and "gone\\x1b[2J\\nhf-pma merge: merged OK" in done.stderr
    )


# ---------------------------------------------------------------- the card


def _records(strategy: str = "sma", **changes) -> FolderRecords:
    merge = merge_record("ema" if strategy == "ema" else "sma", alpha=0.2 if strategy == "ema" else None)
    merge["strategy"] = strategy
    for i, src in enumerate(merge["sources"]):
        src.update({k: v(i) if callable(v) else v for k, v in changes.items()})
    return FolderRecords(merge=merge, name="merged", run_name="run")


@pytest.mark.parametrize(
    "strategy", ["{0}", "{0.__class__.__mro__}", "{:200000000}", "{alpha}", f"x{HOSTILE}"]
)
def test_a_record_value_is_never_a_template(tmp_path, strategy):
    text = build_model_card(tmp_path, records=_records(strategy)).text
    assert len(text) < 50_000 and unprintable(text) == []
    assert "object" not in text and "<class" not in text
    shown = (
        strategy.replace("\n", "\\n")
        .replace("\x1b", "\\x1b")
        .replace("\u202e", "\\u202e")
        .replace("\u2028", "\\u2028")
    )
    assert f"| strategy | {shown}: explicit weights |" in text


def test_names_land_in_the_cards_code_as_python_literals(tmp_path):
    evil = 'x", __import__("os").system("touch PWNED"), "'
    records = _records(path=lambda i: f"../{evil}{i}", name=evil)
    records.name, records.run_name = "m'); __import__('os').system('touch PWNED'); ('", None
    records.training = {"command": "python train.py\n```\n[fake](http://x)\n```"}
    text = build_model_card(tmp_path, records=records).text
    assert unprintable(text) == []
    blocks = code_blocks(text, "python")
    assert len(blocks) == 2
    load, merge = (ast.parse(code) for code in blocks)
    calls = [node for tree in (load, merge) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    names = {ast.unparse(call.func) for call in calls}
    assert names == {"AutoModelForCausalLM.from_pretrained", "merge_checkpoints"}, names
    for call in calls:  # every argument is a literal: a name cannot become code
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            assert all(isinstance(n, (ast.Constant, ast.List, ast.Load)) for n in ast.walk(arg)), ast.unparse(
                arg
            )
    (command,) = code_blocks(text, "bash")
    assert command == "python train.py\\n```\\n[fake](http://x)\\n```"


# ---------------------------------------------------------------- name patterns


def test_name_patterns_match_whole_names_only(tmp_path):
    run = tmp_path / "run"
    for name in ("checkpoint-5\n", "checkpoint-10"):
        save_model_folder(run / name, make_tiny_model())
    assert [p.name for p in run_layout(run).checkpoints] == ["checkpoint-10"]
    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "shard-00001-model-00001-of-00001.safetensors\n").write_bytes(b"")
    assert sharded_weight_files(shards) is None
    assert (
        parse_temporary(".merged.tmp-host-1-0\n") is None
        and parse_temporary(".merged.tmp-host-1-0") is not None
    )
    assert parse_progress("step100\n")["step"] is None and parse_progress("step100")["step"] == 100


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_during_a_merge_is_one_line_exit_130_and_leaves_nothing(tmp_path):
    sources = [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(2)]
    out = tmp_path / "out" / "merged"
    out.parent.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "dist" / "merge_pause.py"),
            *map(str, sources),
            "-o",
            str(out),
            "-q",
            "--workers",
            "1",  # the pause, and so the signal, in the main thread: no race with a worker
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PAUSED "), line + proc.stderr.read()
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hf-pma merge: interrupted", err
    assert list(out.parent.iterdir()) == []  # no temporary folder, no claim, no output


# ---------------------------------------------------------------- plots


def test_plot_labels_from_records_are_text_not_mathtext(tmp_path):
    from hf_pma.publishing.plot import plot_training

    log = [{"step": s, "loss": 5.0 - s / 100} for s in range(1, 11)]
    name = "run$\\undefinedcommand{$\x1b[2J\n"  # bad mathtext: matplotlib would fail to draw it
    records = FolderRecords(training={"log_history": log}, name=name, run_name=name)
    path = plot_training(records, tmp_path / "plot.png")
    assert path.read_bytes().startswith(b"\x89PNG")
