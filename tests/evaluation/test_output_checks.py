"""Every check before the work: ``hf-pma eval`` and ``hf-pma sweep`` check where their results go
(``-o``, ``--record``, ``--plot``) before a model is loaded, so hours of evaluation are never
lost to a folder, a symbolic link or a read-only folder at the end."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.mounts import read_only
from tests.helpers.snapshot_runs import noise_deviation, write_run


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("outputs")
    folder = save_model_folder(root / "merged", make_tiny_model(seed=0), tiny_tokenizer)
    (root / "heldout.txt").write_text(sample_text(1500))
    return folder


def _eval(model, *args):
    return run_cli("eval", model, "--eval-file", model.parent / "heldout.txt", "--limit", "1", "-q", *args)


def _one_error_line(done, command, *fragments):
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith(f"hf-pma {command}: error:")]
    assert len(lines) == 1, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_eval_output_that_is_a_folder_or_a_link_is_refused_before_evaluating(model, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    _one_error_line(_eval(model, "-o", folder), "eval", f"--output {folder} is a folder")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("kept")
    link = tmp_path / "link.json"
    link.symlink_to(elsewhere)
    _one_error_line(_eval(model, "-o", link), "eval", f"--output {link} is a symbolic link")
    assert elsewhere.read_text() == "kept" and link.is_symlink()


def test_eval_record_in_a_read_only_folder_is_refused_before_evaluating(model, tmp_path):
    out = tmp_path / "out.json"
    with read_only(model):
        done = _eval(model, "-o", out, "--record", model)
    _one_error_line(done, "eval", f"cannot write --record {model / 'pma_eval.json'}", "not writable")
    assert not out.exists() and not (model / "pma_eval.json").exists()


def test_eval_record_that_is_malformed_is_refused_before_evaluating(model, tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    (record / "pma_eval.json").write_text(json.dumps({"results": {"merge": {"lm": {"loss": "low"}}}}))
    out = tmp_path / "out.json"
    done = run_cli(
        "eval",
        model,
        "--eval-file",
        model.parent / "heldout.txt",
        "--limit",
        "1",
        "-o",
        out,
        "--record",
        record,
    )
    _one_error_line(done, "eval", "is 'low', not a number")
    assert "evaluating" not in done.stderr and not out.exists()  # nothing was evaluated


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("sweep-outputs")
    folder, _ = write_run(root / "run", 2, noise_deviation(), tokenizer=tiny_tokenizer)
    (root / "heldout.txt").write_text(sample_text(1500))
    return folder


def _sweep(run, *args):
    return run_cli(
        "sweep",
        run,
        "--eval-file",
        run.parent / "heldout.txt",
        "--window",
        "2",
        "--every",
        "1",
        "--strategy",
        "sma",
        "--limit",
        "1",
        "-q",
        *args,
    )


def test_sweep_outputs_are_checked_before_evaluating(run, tmp_path):
    folder = tmp_path / "taken"
    folder.mkdir()
    _one_error_line(_sweep(run, "-o", folder), "sweep", f"--output {folder} is a folder")
    link = tmp_path / "s.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    _one_error_line(_sweep(run, "-o", link), "sweep", f"--output {link} is a symbolic link")
    plot_folder = tmp_path / "plot.png"
    plot_folder.mkdir()
    _one_error_line(
        _sweep(run, "-o", tmp_path / "ok.json", "--plot", plot_folder),
        "sweep",
        f"--plot {plot_folder} is a folder",
    )
    assert not (tmp_path / "ok.json").exists()
    # The default output (RUN/sweep.json) in a read-only run folder.
    with read_only(run):
        done = _sweep(run)
    _one_error_line(done, "sweep", f"cannot write --output {run / 'sweep.json'}")
