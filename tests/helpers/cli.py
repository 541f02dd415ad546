"""The ``hf-pma`` command in tests: :func:`run_cli`, the one way tests run it (in this process by
default, as a fresh process would), and :func:`run_cli_in_one_process`."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence

import torch


def hf_pma_command() -> str:
    """The ``hf-pma`` console script of the running Python."""
    return os.path.join(os.path.dirname(sys.executable), "hf-pma")


@dataclasses.dataclass
class CliResult:
    """What ``hf-pma ARGV`` did: its exit code and what it wrote to stdout and stderr."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


# Python's own warning filters at start-up (``python -W`` unset): what a user's terminal shows.
_STARTUP_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` of a plain interpreter: the warning to the current stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_cli(
    *argv: str | os.PathLike,
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    process: bool = False,
    timeout: float = 300,
    input: str | None = None,
) -> CliResult:
    """Run ``hf-pma ARGV``: the one way tests run the command.

    By default in this process (``hf_pma.cli.main``), as a fresh process would: stdout and stderr
    captured, hf-pma's and transformers' log lines written there in the command's format (not to
    pytest's log capture), Python's start-up warning filters, ``SystemExit`` (argparse, ``--help``)
    and an uncaught exception (its traceback, exit code 1) turned into the exit code. What the
    command changes in this process is put back afterwards: the environment (``env`` is applied
    on top; ``None`` unsets a variable), the current folder (``cwd``), torch's threads, the
    ``hf_pma`` and ``transformers`` loggers (levels, handlers, formats), the progress bars.

    ``process=True`` starts the installed console script instead, with ``env`` on top of this
    environment: for what only a real process shows (the entry point, the exit code the shell
    sees, what is imported, settings that libraries read once at import such as
    ``HF_ENDPOINT``, a process that another one races or kills). ``input`` is what that process
    reads on its standard input (a user answering a prompt).
    """
    args = [os.fspath(a) for a in argv]
    if process:
        done = subprocess.run(
            [hf_pma_command(), *args],
            capture_output=True,
            text=True,
            env=_process_env(env),
            cwd=cwd,
            timeout=timeout,
            input=input,
        )
        return CliResult(args, done.returncode, done.stdout, done.stderr)
    return _run_cli_here(args, env or {}, cwd)


def run_cli_in_one_process(
    *commands: Sequence[str | os.PathLike],
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300,
) -> list[CliResult]:
    """Run several ``hf-pma`` commands one after the other in one fresh process, each as
    :func:`run_cli` runs one in this process: for settings read once at import (``HF_ENDPOINT``)
    without paying the torch and transformers imports once per command."""
    argvs = [[os.fspath(a) for a in command] for command in commands]
    driver = (
        "import dataclasses, json, sys\n"
        "from tests.helpers.cli import _run_cli_here\n"
        "done = [dataclasses.asdict(_run_cli_here(argv, {}, None)) for argv in json.loads(sys.argv[1])]\n"
        "sys.stdout.write('\\n' + json.dumps(done))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", driver, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=_process_env(env),
        cwd=cwd,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"the process running {len(argvs)} hf-pma commands failed:\n{done.stderr[-6000:]}"
        )
    return [CliResult(**result) for result in json.loads(done.stdout.rsplit("\n", 1)[-1])]


def _process_env(env: dict[str, str | None] | None) -> dict[str, str]:
    """This environment, offline, with ``env`` on top (``None`` unsets a variable)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    return full_env


def _run_cli_here(args: list[str], env: dict[str, str | None], cwd) -> CliResult:
    import contextlib
    import io
    import traceback
    from unittest import mock

    from transformers.utils import logging as hf_logging

    from hf_pma.cli import main

    hf_tqdm = importlib.import_module(
        "huggingface_hub.utils.tqdm"
    )  # the module (the package exports a class so named)
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    root, ours, theirs = logging.getLogger(), logging.getLogger("hf_pma"), hf_logging.get_logger()
    saved_loggers = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in (root, ours, theirs)]
    saved_handlers = [(h, h.formatter, getattr(h, "stream", None)) for h in theirs.handlers]
    saved_bars = (dict(hf_tqdm.progress_bar_states), hf_logging._tqdm_active)
    out, err = io.StringIO(), io.StringIO()
    try:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if cwd is not None:
            os.chdir(cwd)
        # A fresh process: no handler on the root logger (pytest's capture lives there), the
        # transformers handler writes to this command's stderr.
        root.handlers, ours.handlers = [], []
        for handler in theirs.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(err)
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
            mock.patch.object(warnings, "showwarning", _show_warning),
        ):
            warnings.resetwarnings()
            for action, category, module in reversed(_STARTUP_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            try:
                code = main(args)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) or stop.code is None else 1
                if stop.code is not None and not isinstance(stop.code, int):
                    err.write(f"{stop.code}\n")
            except Exception:  # what the interpreter does with an uncaught exception
                err.write(traceback.format_exc())
                code = 1
        return CliResult(args, int(code or 0), out.getvalue(), err.getvalue())
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
        for handler in ours.handlers:  # the command's own (bound to its captured stderr)
            handler.close()
        for lg, level, handlers, propagate in saved_loggers:
            lg.setLevel(level)
            lg.handlers = handlers
            lg.propagate = propagate
        for handler, formatter, stream in saved_handlers:
            handler.setFormatter(formatter)
            if stream is not None:
                handler.setStream(stream)
        hf_tqdm.progress_bar_states.clear()
        hf_tqdm.progress_bar_states.update(saved_bars[0])
        hf_logging._tqdm_active = saved_bars[1]
