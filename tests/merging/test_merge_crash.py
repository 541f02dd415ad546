"""``hf-pma merge`` killed mid-write, then run again; ``hf-pma merge`` onto a full disk."""

from __future__ import annotations

import signal
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.repo import REPO_ROOT


def _sources(tmp_path):
    return [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(2)]


def test_sigkilled_merge_then_rerun_leaves_no_temporary(tmp_path):
    sources = _sources(tmp_path)
    out = tmp_path / "out" / "merged"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "dist" / "merge_stall.py"),
            *map(str, sources),
            "-o",
            str(out),
            "-q",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("STALLED "), line + proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    # The killed merge left its half-written folder under this library's temporary name, and its
    # claim file (the kernel released the lock itself with the process).
    left = sorted(p.name for p in out.parent.iterdir() if p.name != ".merged.claim")
    assert len(left) == 1 and left[0].startswith(".merged.tmp-") and left[0].endswith(f"-{proc.pid}-0"), left
    assert (out.parent / left[0] / "model.safetensors").is_file() and not out.exists()
    assert f'"pid": {proc.pid}' in (out.parent / ".merged.claim").read_text()

    again = run_cli("merge", *sources, "-o", out, "-q", process=True)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged"]  # the killed run's folder is gone
    merged = load_file(out / "model.safetensors")
    states = [make_tiny_model(seed=i).state_dict() for i in range(2)]
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, (states[0][name] + states[1][name]) / 2)


def test_merge_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, small_filesystem):
    sources = [
        save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i, vocab_size=2048)) for i in range(2)
    ]
    out = small_filesystem / "merged"
    done = run_cli("merge", *sources, "-o", out, process=True)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    error = lines[0]
    assert error.startswith(f"hf-pma merge: error: no space left on the device to write {out}"), error
    weights = sum(t.numel() * t.element_size() for t in load_file(sources[0] / "model.safetensors").values())
    assert f"it needs {weights / 1024:.1f} KiB ({weights:,} bytes)" in error
    assert f"free in {small_filesystem}" in error
    assert list(small_filesystem.iterdir()) == []
