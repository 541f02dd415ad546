"""Multi-process launches: :func:`launch`, the one way tests start several processes
(``torchrun`` or ``accelerate launch``, gloo on CPU), what a finished launch left
(:class:`Launch`, :class:`RankLog`), and the launches shared by a whole session
(:func:`shared_launch_job`, :class:`SharedLaunches`, read through the ``shared_launch`` fixture
of tests/conftest.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.repo import DIST_DIR

# What a launcher prints when the port it was given was taken between choosing and binding.
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
# Errors a rank raises because another rank died first (never the root cause).
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL communicator was aborted"
)


@dataclasses.dataclass
class RankLog:
    """What one rank left in the launch's log folder."""

    rank: int
    folder: Path

    def read(self, stream: str = "stderr") -> str:
        path = self.folder / f"{stream}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    @property
    def error(self) -> dict | None:
        """The error file ``@record`` wrote (torch elastic), if any."""
        path = self.folder / "error.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None

    @property
    def traceback(self) -> str:
        """The rank's last Python traceback: from its error file, else from its stderr log."""
        error = self.error
        if error and isinstance(error.get("message"), dict):
            return (
                error["message"].get("message", "")
                + "\n"
                + error["message"].get("extraInfo", {}).get("py_callstack", "")
            )
        text = self.read("stderr")
        start = text.rfind("Traceback (most recent call last)")
        if start < 0:
            return ""
        return text[text.rfind("\n", 0, start) + 1 :]

    @property
    def failed_at(self) -> float:
        """When this rank failed: its error file's time, else when its stderr log was last written."""
        error = self.error
        stamp = None
        if error and isinstance(error.get("message"), dict):
            stamp = error["message"].get("extraInfo", {}).get("timestamp")
        log = self.folder / "stderr.log"
        mtime = log.stat().st_mtime if log.is_file() else float("inf")
        # Error files carry whole seconds: the log's time orders ranks that failed in the same second.
        return float(stamp) + (mtime % 1) if stamp is not None else mtime


@dataclasses.dataclass
class Launch:
    """A finished multi-process launch: its exit status, the launcher's own output and every
    rank's log (``log_dir/<rank>/{stdout,stderr}.log``, plus ``error.json`` for ranks that
    failed inside a function decorated with torch elastic's ``@record``)."""

    command: list[str]
    nproc: int
    returncode: int
    stdout: str
    stderr: str
    log_dir: Path
    timed_out: bool = False
    outputs: dict[tuple[int, str], str] = dataclasses.field(
        default_factory=dict
    )  # kept when the logs are deleted

    def rank_logs(self) -> list[RankLog]:
        """One :class:`RankLog` per rank (torchrun's layout: ``<run>/attempt_<k>/<rank>/``, last attempt)."""
        folders: dict[int, Path] = {}
        for folder in sorted(self.log_dir.glob("*/attempt_*/*")):
            if folder.is_dir() and folder.name.isdigit():
                folders[int(folder.name)] = folder  # later attempts sort last
        return [RankLog(rank, folders[rank]) for rank in sorted(folders)]

    def output(self, rank: int, stream: str = "stdout") -> str:
        """What ``rank`` printed to ``stream`` (``"stdout"`` or ``"stderr"``)."""
        if (rank, stream) in self.outputs:
            return self.outputs[rank, stream]
        return next((log.read(stream) for log in self.rank_logs() if log.rank == rank), "")

    def discard_logs(self) -> None:
        """Keep what every rank printed in memory (:meth:`output`) and delete the log folder."""
        for log in self.rank_logs():
            for stream in ("stdout", "stderr"):
                self.outputs[log.rank, stream] = log.read(stream)
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def first_failure(self) -> RankLog | None:
        """The rank that failed first: ranks with a traceback, those that only lost a peer last,
        then by time of failure."""
        failed = [log for log in self.rank_logs() if log.traceback]
        if not failed:
            return None
        return min(
            failed,
            key=lambda log: (bool(_PEER_GONE.search(log.traceback.strip().splitlines()[-1])), log.failed_at),
        )

    def report(self) -> str:
        """Why the launch failed, for an assertion message: the first failing rank's full
        traceback, where every log is, and the end of the launcher's own output."""
        what = "timed out (killed)" if self.timed_out else f"exited with {self.returncode}"
        lines = [f"{' '.join(self.command)}\n{what}; per-rank logs under {self.log_dir}"]
        first = None if self.timed_out else self.first_failure()
        if first is not None:
            lines.append(
                f"--- first failing rank: {first.rank} ({first.folder}) ---\n{first.traceback.rstrip()}"
            )
            others = [log.rank for log in self.rank_logs() if log.traceback and log.rank != first.rank]
            if others:
                lines.append(f"(ranks {others} failed after it)")
            return "\n".join(lines)
        # No rank raised (a hang, a signal, the launcher itself): every rank's end, then the launcher's.
        for log in self.rank_logs():
            lines.append(f"--- rank {log.rank} stderr (last 2000 characters) ---\n{log.read()[-2000:]}")
        lines.append(f"--- launcher stderr (last 3000 characters) ---\n{self.stderr[-3000:]}")
        return "\n".join(lines)

    def check(self) -> Launch:
        """Assert that the launch succeeded (the message is :meth:`report`); returns ``self``."""
        assert self.returncode == 0 and not self.timed_out, self.report()
        return self


def _port_for_accelerate() -> int:
    """A port free right now. ``accelerate launch`` needs a number; :func:`launch` retries with
    another one when the port is taken before the launcher binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_command(launcher: str, nproc: int, log_dir: Path, launcher_args: list[str]) -> list[str]:
    command = _launcher(launcher, nproc, log_dir)
    if launcher == "accelerate" and launcher_args:  # they replace the mode (--multi_gpu)
        command.remove("--multi_gpu")
    return [*command, *launcher_args]


def _launcher(launcher: str, nproc: int, log_dir: Path) -> list[str]:
    if launcher == "torchrun":
        # --standalone: the rendezvous store binds port 0 itself, so no port is ever chosen here.
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "--log-dir",
            str(log_dir),
            "--tee",
            "3",
        ]
    if launcher == "accelerate":
        # --cpu would start one process; ACCELERATE_USE_CPU with --multi_gpu starts nproc on gloo.
        # The console script, as users type it (the scripts read their parent's command line).
        accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
        return [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(nproc),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_port_for_accelerate()),
            "--log_dir",
            str(log_dir),
            "--tee",
            "3",
        ]
    raise ValueError(f"unknown launcher {launcher!r}: use 'torchrun' or 'accelerate'")


def _run(command: list[str], env: dict, cwd: Path | None, timeout: float) -> tuple[int, str, str, bool]:
    """Run in a session of its own: on timeout the launcher *and* its ranks are killed."""
    with subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return proc.returncode, out, err, True


def launch(
    script: str | Path,
    *args: str | Path,
    nproc: int = 2,
    launcher: str = "torchrun",
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 600,
    check: bool = True,
    launcher_args: list[str] | tuple[str, ...] = (),
) -> Launch:
    """Run ``script args`` in ``nproc`` processes (gloo on CPU) under ``torchrun`` or ``accelerate launch``.

    A relative ``script`` is looked up in ``tests/dist/``. Every rank's stdout and stderr go to
    its own log file; with ``check`` a failed launch fails the test with the first failing
    rank's full traceback (:meth:`Launch.report`). ``env`` is added to the test's environment;
    one thread per process. After a successful check the log folder is deleted (what the ranks
    printed stays readable through :meth:`Launch.output`). ``launcher_args`` go to the launcher
    after its usual flags; for accelerate they replace its mode flag ``--multi_gpu`` (``["--cpu"]``:
    the single-process mistake, whose one process writes to the launcher's own stdout and stderr).
    """
    script = Path(script)
    if not script.is_absolute():
        script = DIST_DIR / script
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    if launcher == "accelerate":
        full_env["ACCELERATE_USE_CPU"] = "1"
    full_env.update(env or {})
    for _ in range(3):
        log_dir = Path(tempfile.mkdtemp(prefix="hf-pma-launch-"))
        command = [
            *_launch_command(launcher, nproc, log_dir, list(launcher_args)),
            str(script),
            *map(str, args),
        ]
        returncode, out, err, timed_out = _run(command, full_env, Path(cwd) if cwd else None, timeout)
        result = Launch(command, nproc, returncode, out, err, log_dir, timed_out)
        if returncode == 0 or timed_out or not _PORT_TAKEN.search(out + err):
            break
        shutil.rmtree(log_dir, ignore_errors=True)  # the port was taken meanwhile: another one
    if check:
        result.check()
        result.discard_logs()
    return result


def rank_reports(out: str | Path, nproc: int, pattern: str = "result-rank{rank}.json") -> list[dict]:
    """The JSON report every rank of a launch wrote into ``out``, rank 0 first."""
    return [json.loads((Path(out) / pattern.format(rank=rank)).read_text()) for rank in range(nproc)]


# Launches that tests read, run once per session in the background (the ``shared_launch``
# fixture of tests/conftest.py): name -> job(out folder) -> Launch. Register with
# :func:`shared_launch_job` at import time (collection imports every test module first) and mark
# the tests that read it ``@pytest.mark.shared_launch(name)`` so that it starts with the session.
SHARED_LAUNCHES: dict[str, Callable[[Path], Launch]] = {}


def shared_launch_job(name: str) -> Callable[[Callable[[Path], Launch]], Callable[[Path], Launch]]:
    """Register ``job(out) -> Launch`` (launched with ``check=False``) as the shared launch ``name``."""

    def register(job: Callable[[Path], Launch]) -> Callable[[Path], Launch]:
        if name in SHARED_LAUNCHES and SHARED_LAUNCHES[name] is not job:
            raise ValueError(f"a shared launch named {name!r} is already registered")
        SHARED_LAUNCHES[name] = job
        return job

    return register


def scenario_failure(launch: Launch, folder: Path, scenario: str) -> str | None:
    """Why the scenario ``scenario`` of a ``tests/dist/scenarios.py`` launch failed, or None when
    every rank recorded it as done (``folder/scenario-rank<r>.json``): the first failing rank's
    traceback, or the launch's report when some rank recorded nothing."""
    records = {}
    for rank in range(launch.nproc):
        path = folder / f"scenario-rank{rank}.json"
        if path.is_file():
            records[rank] = json.loads(path.read_text())
    if len(records) == launch.nproc and all(r["ok"] for r in records.values()):
        return None
    where = f"per-rank logs under {launch.log_dir}"
    failed = [rank for rank, r in sorted(records.items()) if not r["ok"]]
    if failed:
        first = failed[0]
        others = f" (ranks {failed[1:]} failed too)" if failed[1:] else ""
        return (
            f"scenario {scenario!r} failed on rank {first}{others}; {where}\n"
            f"--- rank {first}: what it printed to stderr during the scenario (last 6000 characters) ---\n"
            f"{_scenario_log(launch, first, records[first])[-6000:].rstrip()}\n"
            f"--- rank {first}: the scenario's traceback ---\n{records[first]['traceback'].rstrip()}"
        )
    missing = sorted(set(range(launch.nproc)) - set(records))
    return f"scenario {scenario!r} was not recorded by ranks {missing}: the launch ended first\n{launch.report()}"


def _scenario_log(launch: Launch, rank: int, record: dict, stream: str = "stderr") -> str:
    """What ``rank`` printed to ``stream`` while the scenario of ``record`` ran (its byte range
    of the rank's log file); empty when the range or the log is not known."""
    start, end = record.get("log", {}).get(stream) or (None, None)
    log = next((r for r in launch.rank_logs() if r.rank == rank), None)
    if start is None or end is None or log is None or not (log.folder / f"{stream}.log").is_file():
        return ""
    with open(log.folder / f"{stream}.log", "rb") as file:
        file.seek(start)
        return file.read(end - start).decode(errors="replace")


class SharedLaunches:
    """The launches of :data:`SHARED_LAUNCHES`, each started once, one at a time, in a background
    thread (the ranks are processes; the tests go on meanwhile), and read by every test that
    needs it (the ``shared_launch`` fixture of tests/conftest.py).

    ``shared(name)`` is the output folder of the launch ``name``, ``shared.result(name)`` the
    :class:`Launch`; a failed launch fails the test with the first failing rank's traceback. For
    a launch of ``tests/dist/scenarios.py``, ``shared(name, scenario)`` and
    ``shared.result(name, scenario)`` fail only when that scenario failed (with its traceback):
    the tests of the other scenarios of the launch pass.
    """

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hf-pma-launch"
        )
        self._jobs: dict[str, tuple[Path, concurrent.futures.Future]] = {}

    def start(self, name: str) -> None:
        """Queue the launch ``name`` (once)."""
        if name not in self._jobs:
            out = self._tmp.mktemp(name)
            self._jobs[name] = (out, self._executor.submit(SHARED_LAUNCHES[name], out))

    def result(self, name: str, scenario: str | None = None) -> Launch:
        """The finished launch ``name``; fails the test if it failed (only if ``scenario`` failed,
        when one is named)."""
        self.start(name)
        out, future = self._jobs[name]
        done = future.result()
        failed = done.returncode != 0 or done.timed_out
        if scenario is not None:
            why = scenario_failure(done, out / scenario, scenario)
            if why is not None:
                pytest.fail(why, pytrace=False)
        elif failed:
            pytest.fail(done.report(), pytrace=False)
        if not failed and not done.outputs:
            done.discard_logs()
        return done

    def __call__(self, name: str, scenario: str | None = None) -> Path:
        """The output folder of the finished launch ``name`` (of its ``scenario``, when one is named)."""
        self.result(name, scenario)
        out = self._jobs[name][0]
        return out if scenario is None else out / scenario

    def close(self) -> None:
        """Drop the launches not started yet (a session stopped early); wait for the running one."""
        self._executor.shutdown(wait=True, cancel_futures=True)
