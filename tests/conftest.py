"""Shared fixtures. Nothing here touches the network (see ``tests/testing_utils.py``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.testing_utils import REPO_ROOT, launch, train_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Scripts launched by the tests (torchrun, accelerate, python) import ``tests.*`` like the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
torch.set_num_threads(1)


def _fail_skip(report, when: str) -> None:
    """Turn a skipped report into a failure that says what was skipped and why."""
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped ({when}) while HF_PMA_FAIL_ON_SKIP=1 (CI installs every extra): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With HF_PMA_FAIL_ON_SKIP=1 (set by .ci/run), a skipped test fails instead."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("HF_PMA_FAIL_ON_SKIP") == "1" and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report, report.when)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """With HF_PMA_FAIL_ON_SKIP=1, a module skipped at import (``pytest.importorskip``) fails too."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("HF_PMA_FAIL_ON_SKIP") == "1" and report.skipped:
        _fail_skip(report, "collection")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A session-wide tiny byte-level BPE tokenizer (vocab 512)."""
    return train_tiny_tokenizer()


@pytest.fixture
def small_filesystem(tmp_path):
    """A folder on a freshly mounted 256 kB tmpfs (unmounted afterwards): writes there run out
    of space for real. Needs root (CI runs as root)."""
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


# The multi-process scenarios that several test modules read (tests/dist/scenarios.py): one
# torchrun launch per world size serves them all.
SHARED_SCENARIOS = {
    2: ("ddp", "fsdp_gather", "merged_eval", "two_nodes"),
    4: ("sharded", "merged_eval"),
}


@pytest.fixture(scope="session")
def scenario_runs(tmp_path_factory):
    """``scenario_runs(world)``: the folder of the shared launch at that world size, launched on
    first use; each scenario's files are in ``<folder>/<scenario>/``. A failed launch fails every
    test that reads it, each with the first failing rank's traceback."""
    runs: dict[int, Path] = {}
    failures: dict[int, str] = {}

    def get(world: int):
        if world in failures:
            pytest.fail(failures[world], pytrace=False)
        if world not in runs:
            out = tmp_path_factory.mktemp(f"world{world}")
            done = launch("scenarios.py", "--out", out, *SHARED_SCENARIOS[world], nproc=world, check=False)
            if done.returncode != 0 or done.timed_out:
                failures[world] = done.report()
                pytest.fail(failures[world], pytrace=False)
            done.discard_logs()
            runs[world] = out
        return runs[world]

    return get
