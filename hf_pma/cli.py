"""The ``hf-pma`` command: a thin layer over the library, one module per sub-command.

Each module in :mod:`hf_pma.commands` exposes ``add_parser(subparsers)`` (which registers the
sub-command and sets ``func``) and does its heavy imports inside the function it runs, so
``hf-pma --help`` stays fast.

Errors are in library words (``last must be a positive integer, got 0``); the command shows the
parameter an error names as its flag (``--last must be ...``), in one place: :func:`flag_words`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from hf_pma.utils.version import __version__

# Sub-command name -> module under hf_pma.commands.
COMMANDS = {
    "merge": "merge",
    "eval": "eval",
    "make-tasks": "make_tasks",
    "card": "card",
    "push": "push",
    "sweep": "sweep",
    "compare": "compare",
    "inspect": "inspect",
    "consolidate": "consolidate",
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser of ``hf-pma``: a :class:`~hf_pma.utils.parsing.CommandLineParser`
    (no abbreviated options; an unknown one refused in one line naming the closest)."""
    from hf_pma.utils.parsing import CommandLineParser

    parser = CommandLineParser(
        prog="hf-pma",
        description="Pre-trained Model Averaging (PMA) for Hugging Face models: merge, evaluate and publish snapshots.",
    )
    parser.add_argument("--version", action="version", version=f"hf-pma {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(f"hf_pma.commands.{module}").add_parser(subparsers)
    for sub in subparsers.choices.values():
        _add_verbosity_flags(sub)
    return parser


VERBOSE_HELP = "debug logs of hf-pma and transformers, and tracebacks on errors"
QUIET_HELP = "warnings and errors only: no info logs, no progress bars"


def _add_verbosity_flags(sub: argparse.ArgumentParser) -> None:
    """``-v``/``-q`` after the sub-command too (``hf-pma merge -q``), as well as before it.

    Their default is ``SUPPRESS``, so that a flag given before the sub-command is not reset by
    the sub-command's own default (argparse copies a sub-parser's values over the parent's).
    """
    for short, long, text in (("-v", "--verbose", VERBOSE_HELP), ("-q", "--quiet", QUIET_HELP)):
        own = [action for action in sub._actions if long in action.option_strings]
        for action in own:
            action.default = argparse.SUPPRESS
        if not own:
            sub.add_argument(short, long, action="store_true", default=argparse.SUPPRESS, help=text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-pma``; returns the process exit code."""
    from hf_pma.utils.text import flush_out, prepare_standard_streams

    prepare_standard_streams()  # closed fds on /dev/null; stdout writes what it cannot encode escaped
    parser = build_parser()
    args = parser.parse_args(argv)
    from hf_pma.utils.logs import set_cli_verbosity

    set_cli_verbosity(quiet=bool(getattr(args, "quiet", False)), verbose=bool(getattr(args, "verbose", False)))
    from hf_pma.utils.threads import fit_cpu_threads

    fit_cpu_threads()  # a shared CPU: the cores others leave free (OMP_NUM_THREADS overrides)
    try:
        with stop_on_signals():
            status = int(args.func(args) or 0)
            flush_out()  # a reader of stdout that is gone (| head) costs nothing: the work is done
            return status
    except (ValueError, OSError, ConnectionError) as err:  # OSError: FileNotFound, FileExists, Permission, NoSpace, ELOOP ...
        # Bad input: one clear line, no traceback (use -v for the traceback).
        if getattr(args, "verbose", False):
            return write_traceback()
        write_error_line(args.command, f"error: {hub_error_line(err) or flag_words(err, parser, args.command)}")
        return 2
    except KeyboardInterrupt as err:
        # Ctrl-C, SIGTERM, SIGHUP: the ``finally`` blocks on the way up have removed what was half
        # written (temporaries, claims); the status is the shell's 128 + the signal's number.
        if getattr(args, "verbose", False):
            raise
        signum = getattr(err, "signum", signal.SIGINT)
        write_error_line(args.command, "interrupted" + ("" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"))
        return 128 + int(signum)
    except Exception as err:
        line = hub_error_line(err)
        if getattr(args, "verbose", False):
            return write_traceback()
        if line is None:
            raise
        write_error_line(args.command, f"error: {line}")
        return 2


# Library parameters named otherwise than the option that sets them (the rest have the same
# name: ``window_tokens`` is set by ``--window-tokens``, whose ``dest`` is ``window_tokens``).
PARAMETER_DESTS = {"x_values": "x"}


def flag_words(err: BaseException, parser: argparse.ArgumentParser, command: str) -> str:
    """The error's text in the words of ``command``'s flags: the library parameter it starts with
    (the ``parameter`` of :func:`hf_pma.utils.parsing.parameter_error`: ``last must be a positive
    integer, got 0``) as its flag (``--last must be ...``), and a keyword form that names a flag
    of the command (``pass overwrite=True (--overwrite)``, ``include_final (--include-final)``,
    ``last=16``) as that flag (``pass --overwrite``, ``--include-final``, ``--last 16``). Names
    the command has no flag for stay as they are."""
    flags = _command_flags(parser, command)
    text, name = str(err), getattr(err, "parameter", None)
    if isinstance(name, str) and text.startswith(name):
        flag = flags.get(PARAMETER_DESTS.get(name, name))
        text = flag + text[len(name) :] if flag else text
    return _KEYWORD_FORM.sub(lambda m: _as_flag(m, flags, text), text)


# ``name=True (--flag)``, ``name=True / --flag``, ``--flag (name=True)``, ``name=, --flag``,
# ``--flag, name=``, ``name (--flag)``, ``name=value (--flag)``, ``name=value``: the library's keyword forms that a command error shows
# as the command's flag (:func:`flag_words`).
_KEYWORD_FORM = re.compile(
    r"(?P<before>--[\w-]+) \((?P<kw>\w+)=True\)"
    r"|(?P<pair>\b[a-z_][a-z0-9_]*=, (?P<after>--[\w-]+)|(?P<first>--[\w-]+), [a-z_][a-z0-9_]*=(?=\)|\s|$))"
    r"|\b(?P<name>[a-z_][a-z0-9_]*)(?:=(?P<value>[^\s(),;]+))?"
    r"(?: \((?P<paren>--[\w-]+)\)| / (?P<slash>--[\w-]+))?"
)


def _as_flag(match: re.Match[str], flags: dict[str, str], text: str) -> str:
    """One keyword form as the command's flag; as it is when the command has no flag for it, or
    when ``text`` names the flag already (``dtype='float32', --dtype``)."""
    if match.group("before"):
        return match.group("before")
    if match.group("pair"):  # ``tokenizer=, --tokenizer``: the flag alone, where the command has it
        flag = match.group("after") or match.group("first")
        return flag if flag in flags.values() else match.group(0)
    name, value = match.group("name"), match.group("value")
    given = match.group("paren") or match.group("slash")
    flag = flags.get(PARAMETER_DESTS.get(name, name))
    if flag is None or (value is None and given is None) or (given is not None and given != flag):
        return match.group(0)
    if given is None and re.search(rf"{re.escape(flag)}\b", text):
        return match.group(0)  # a plain word, or a name this command has no (such) flag for
    return flag if value in (None, "True") else f"{flag} {value}"


def _command_flags(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """The ``dest`` of each option of ``command`` -> its longest flag (``overwrite`` -> ``--overwrite``)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = subparsers[0].choices.get(command) if subparsers else None
    flags: dict[str, str] = {}
    for action in sub._actions if sub else []:
        if action.option_strings:
            flags.setdefault(action.dest, max(action.option_strings, key=len))
    return flags


# The exit code of a command stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it.
INTERRUPTED = 130
# The signals that end a command the way Ctrl-C does: the terminal's, a job scheduler's (SLURM
# and Kubernetes send SIGTERM before SIGKILL), a closed terminal's.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A command stopped by ``signum`` (a ``KeyboardInterrupt``, so that every clean-up that
    runs on Ctrl-C runs on SIGTERM and SIGHUP too)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn :data:`STOP_SIGNALS` into :class:`Stopped` in the main thread while the block runs.

    Only the first one raises: a second signal (Ctrl-C pressed twice, a scheduler's repeated
    SIGTERM) is ignored, so that the clean-up it started (a temporary folder removed, a claim
    released) is not cut short; SIGKILL still ends the process at once. Outside the main thread
    (a command run by a library user's thread) the handlers are left as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if stopping:
            return
        stopping.append(signum)
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def write_error_line(command: str, text: str) -> None:
    """Write ``hf-pma COMMAND: TEXT`` to stderr as one line: secrets redacted
    (:func:`hf_pma.utils.secrets.redact`: tokens, passwords in URLs), then every control, bidi or
    line-breaking character the text holds (a name from a folder or a record) escaped
    (:func:`hf_pma.utils.text.escape`)."""
    from hf_pma.utils.secrets import redact
    from hf_pma.utils.text import escape

    if sys.stderr is None:  # closed at start (2>&-)
        return
    sys.stderr.write(escape(redact(f"hf-pma {command}: {text}")) + "\n")
    sys.stderr.flush()


def write_traceback() -> int:
    """Write the traceback of the exception being handled (``-v``) to stderr, each line as
    :func:`write_error_line` writes one: secrets redacted (a password in ``HF_ENDPOINT`` is in the
    URLs of a Hub error), control characters escaped (a name from a folder or a Hub answer).
    Returns 1, the exit code of an uncaught exception."""
    import traceback

    from hf_pma.utils.secrets import redact
    from hf_pma.utils.text import escape

    for line in traceback.format_exc().rstrip("\n").split("\n"):
        sys.stderr.write(escape(redact(line)) + "\n")
    sys.stderr.flush()
    return 1


def hub_error_line(err: BaseException) -> str | None:
    """One line for an HTTP or network error from the Hub (``HfHubHTTPError``: its status and
    first line; ``httpx`` / ``requests`` errors: what failed); ``None`` for anything else."""
    from huggingface_hub.errors import HfHubHTTPError

    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        return f"the Hub answered HTTP {status}: {first}" if status else f"the Hub request failed: {first}"
    if type(err).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "httpcore"):
        return f"the Hub cannot be reached: {first} ({type(err).__name__})"
    return None


if __name__ == "__main__":
    sys.exit(main())
