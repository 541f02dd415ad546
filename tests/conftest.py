"""Shared fixtures. Nothing here touches the network (see ``tests/helpers/``)."""

from __future__ import annotations

import os
import subprocess

import huggingface_hub.constants  # noqa: F401  (read HF_HUB_OFFLINE now: see below)
import hypothesis
import pytest
import torch

from tests.helpers.launcher import SharedLaunches, launch, shared_launch_job
from tests.helpers.models import make_tiny_model, train_tiny_tokenizer
from tests.helpers.repo import REPO_ROOT

# The processes the tests start are offline. huggingface_hub reads HF_HUB_OFFLINE once, when it is
# imported (above, before this line): this process keeps the machine's setting, so that code run
# here (the docs' dry push) reaches the local Hub stand-in.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Scripts launched by the tests (torchrun, accelerate, python) import ``tests.*`` like the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
torch.set_num_threads(1)

# CI decides whether work lands, so the property tests draw the same examples on every run
# ("fixed"); HF_PMA_HYPOTHESIS=random draws new ones each run, to look for new failures.
hypothesis.settings.register_profile("fixed", derandomize=True)
hypothesis.settings.register_profile("random", derandomize=False)
hypothesis.settings.load_profile(os.environ.get("HF_PMA_HYPOTHESIS", "fixed"))


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


@pytest.fixture(scope="session")
def model_files(tmp_path_factory, tiny_tokenizer):
    """A tiny model folder's files, by name: what the local Hub stand-in's repos hold."""
    folder = tmp_path_factory.mktemp("model")
    make_tiny_model(seed=0).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def small_filesystem(tmp_path):
    """A folder on a freshly mounted 256 kB tmpfs (unmounted afterwards): writes there run out
    of space for real. Needs root (CI runs as root)."""
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


# The shared launches of the multi-process tests (tests/dist/scenarios.py runs several scenarios
# in one launch); test modules register their own with ``shared_launch_job`` too. World size 2
# runs under `accelerate launch` (the quickstart's launcher), world size 4 under torchrun.
for _name, (_scenarios, _options) in {
    "world2": (
        ("ddp", "fsdp_gather", "merged_eval", "eval", "compare", "online", "two_nodes"),
        {"launcher": "accelerate"},
    ),
    "world4": (("sharded", "merged_eval"), {"nproc": 4}),
}.items():
    shared_launch_job(_name)(
        lambda out, scenarios=_scenarios, options=_options: launch(
            "scenarios.py", "--out", out, *scenarios, check=False, **options
        )
    )
shared_launch_job("zero3")(lambda out: launch("sharded_zero3.py", "--out", out, check=False))


def _launches_needed(items) -> list[str]:
    """The shared launches the selected tests read (``@pytest.mark.shared_launch(name, ...)``)."""
    names: list[str] = []
    for item in items:
        for mark in item.iter_markers("shared_launch"):
            names += [n for n in mark.args if n not in names]
    return names


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory):
    """``shared_launch(name)``: the output folder of the shared launch ``name`` once it is done
    (``shared_launch.result(name)``: the :class:`~tests.helpers.launcher.Launch`);
    ``shared_launch(name, scenario)``: the folder of one scenario of a ``tests/dist/scenarios.py``
    launch, failing only if that scenario failed (:class:`~tests.helpers.launcher.SharedLaunches`).
    Every shared launch a selected test is marked to read starts as the session starts, in the
    background."""
    launches = SharedLaunches(tmp_path_factory)
    for name in _launches_needed(request.session.items):
        launches.start(name)
    yield launches
    launches.close()


@pytest.fixture(scope="session", autouse=True)
def _start_shared_launches(request):
    """Start the shared launches of the selected tests at the beginning of the session."""
    if _launches_needed(request.session.items):
        request.getfixturevalue("shared_launch")


def _untracked_files() -> set[str] | None:
    """Files in the working tree that git neither tracks nor ignores (``None`` without git)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--others", "--exclude-standard"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return set(listed.stdout.splitlines())


def pytest_sessionstart(session):
    session.config._untracked_at_start = _untracked_files()


def pytest_sessionfinish(session, exitstatus):
    """A test that writes into the working tree (a command run without its output option, say)
    fails the run, naming the files: the suite writes only under its temporary folders."""
    before = getattr(session.config, "_untracked_at_start", None)
    after = _untracked_files()
    if before is None or after is None or hasattr(session.config, "workerinput"):
        return
    left = sorted(after - before)
    if left:
        session.config.get_terminal_writer().line(
            f"tests left files in the working tree: {', '.join(left[:10])}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def slow_copy(monkeypatch):
    """Every snapshot blocks the training thread 1 s more: far above 1% of a tiny model's steps, and
    above it surely (the low end of the measured interval) even when another job makes the steps
    noisy, so that the automatic interval is widened whatever the machine's load."""
    import time

    from hf_pma.snapshots import sinks

    real = sinks.gather_full_state_dict

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(sinks, "gather_full_state_dict", slow)


@pytest.fixture
def no_trainer_objects(monkeypatch):
    """Building a TrainerState, TrainerControl, TrainingArguments or TrainerCallback raises: what
    runs under this fixture is proven to need no ``Trainer`` object."""
    from transformers import trainer_callback, training_args

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"a {type(self).__name__} was built")

    for cls in (
        trainer_callback.TrainerState,
        trainer_callback.TrainerControl,
        trainer_callback.TrainerCallback,
        training_args.TrainingArguments,
    ):
        monkeypatch.setattr(cls, "__init__", refuse)


@pytest.fixture(scope="session")
def pristine_run(tmp_path_factory):
    """A run of three snapshots, written once: tests that change it work on a copy
    (:func:`tests.helpers.snapshot_runs.copy_run`)."""
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    run, _ = write_run(tmp_path_factory.mktemp("pristine") / "run", 3, noise_deviation())
    return run
