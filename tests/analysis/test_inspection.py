"""``hf_pma.analysis.inspection``: what ``hf-pma inspect`` does, called from Python (no command line)."""

from __future__ import annotations

import io
import json

import pytest

from hf_pma.analysis.inspection import diagnose_window, list_snapshots, run_window
from hf_pma.merging.sources import resolve_sources
from hf_pma.merging.windows import apply_window
from hf_pma.utils.text import write_lines
from tests.helpers.cli import run_cli
from tests.helpers.snapshot_runs import noise_deviation, write_run


def test_the_library_gives_what_the_command_prints(tmp_path):
    run, _ = write_run(tmp_path / "run", 5, noise_deviation(), excluded=[1])
    rows, hub = list_snapshots(run)
    assert hub is None and [r["name"] for r in rows] == [f"snapshot-{1000 * (i + 1)}" for i in range(5)]
    assert [r["excluded"] for r in rows] == [False, True, False, False, False]
    assert run_window(run) == (None, None, None)  # the run records no merge window

    report = diagnose_window(run, window=3, strategy="wma", progress=False)
    assert report.origin == "--window" and report.strategy == "wma"
    assert [report.gram.names[i] for i in report.window.indices] == [
        "snapshot-3000",
        "snapshot-4000",
        "snapshot-5000",
    ]
    assert report.window.weights == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    assert len(report.series) == 2 and report.series_x == [4000, 5000] and report.x_label == "tokens"
    data = json.loads(json.dumps(report.to_dict()))  # JSON-ready
    assert data["reading"] == report.reading and data["window"]["every"] == 1

    out = run_cli("inspect", run, "--window", "3", "--strategy", "wma", "-q", "-o", tmp_path / "r.json")
    assert out.returncode == 0, out.stderr
    text = io.StringIO()
    write_lines(report.text(), text)
    assert text.getvalue() in out.stdout  # the command prints the library's text
    printed = json.loads((tmp_path / "r.json").read_text())
    assert printed["window"]["distances_to_merge"] == pytest.approx(data["window"]["distances_to_merge"])


def test_window_defaults_and_errors_in_library_words(tmp_path):
    run, _ = write_run(tmp_path / "run", 3, noise_deviation())
    report = diagnose_window(run, progress=False)  # the automatic window: the loss still falls
    assert len(report.window.indices) == 1 and report.origin.startswith("auto window: the last snapshot alone")
    with pytest.raises(FileNotFoundError, match="reference model .*nowhere does not exist"):
        diagnose_window(run, reference=tmp_path / "nowhere", progress=False)
    with pytest.raises(ValueError, match="unknown merge strategy 'median'"):
        diagnose_window(run, strategy="median", progress=False)
    with pytest.raises(ValueError, match="needs? at least 2"):
        diagnose_window(run, last=1, progress=False)


def test_with_a_stride_the_window_is_the_one_merge_takes(tmp_path):
    """``every=2`` chooses the automatic window over every 2nd snapshot, as ``hf-pma merge
    --every 2`` does (flat losses: the cap, a quarter of the 9,000 tokens, holds 2 of them)."""
    run, _ = write_run(tmp_path / "run", 9, noise_deviation(), losses=[4.0] * 9)
    report = diagnose_window(run, progress=False, every=2)
    merged, choice = apply_window(resolve_sources([run]), last="auto", every=2)
    assert [s.name for s in merged] == ["snapshot-7000", "snapshot-9000"] and choice.count == 2
    assert [report.gram.names[i] for i in report.window.indices] == [s.name for s in merged]
    assert report.origin == choice.describe() and report.every == 2
    for bad in (None, 0, True, 2.0):
        with pytest.raises(ValueError, match="^every must be a positive integer"):
            diagnose_window(run, progress=False, every=bad)
