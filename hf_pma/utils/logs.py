"""How hf-pma's log records reach a user, the way transformers shows its own.

hf-pma's modules log to loggers named ``hf_pma.*`` (through ``transformers.utils.logging``, or
:func:`get_logger` in the modules that must not import transformers: the same loggers), which
are not children of the ``transformers`` logger, so ``transformers.logging.set_verbosity_info()``
alone does not show them. The CLI, the scripts and :class:`hf_pma.PMATrainer` call
:func:`enable_logging`; a library user can too, or configure the ``hf_pma`` logger themselves.

* :func:`notice`: what a user must see (where the snapshots go, what they cost) reaches a plain
  script, whose logging shows warnings only (transformers' default verbosity).
* :func:`quiet_info`: the INFO lines of ``save_pretrained`` ("Configuration saved in ...") are
  dropped while hf-pma writes its own folders, in the writing thread only.
* :func:`set_cli_verbosity`: the ``-q``/``-v`` levels of the ``hf-pma`` command.
* :func:`progress_bar`: every progress bar of hf-pma (a ``tqdm``): redrawn often on a terminal,
  rarely into a file or a pipe, where each redraw is one more carriage-return update in a log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "RedactingFilter",
    "enable_logging",
    "get_logger",
    "notice",
    "progress_bar",
    "quiet_info",
    "set_cli_verbosity",
    "set_transformers_verbosity",
]

_HANDLER_NAME = "hf_pma_default_handler"


class RedactingFilter(logging.Filter):
    """Replace access tokens in a log record's message (by name and by value, see
    :func:`hf_pma.utils.secrets.redact`; passwords in URLs too) and escape its control, bidi and
    line-breaking characters (:func:`hf_pma.utils.text.escape`: a folder name or a record field
    holding a newline or a terminal escape shows as ``\\n``, ``\\x1b``) before a handler writes it.

    Every message is one line: hf-pma logs no message that is multi-line by design (what spans
    lines, a table, is written to stdout by the command that shows it). The traceback of
    ``logger.exception`` is not part of the message and is left as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        from hf_pma.utils.secrets import redact
        from hf_pma.utils.text import escape

        message = record.getMessage()
        clean = escape(redact(message))
        if clean != message:
            record.msg, record.args = clean, None
        return True


# The level the last ``enable_logging()`` without a level set: a level the user set (their own
# ``enable_logging(level)`` or ``logging.getLogger("hf_pma").setLevel``) is any other one.
_default_level: int | None = None


def enable_logging(level: int | None = None) -> None:
    """Send ``hf_pma`` log records to stderr at ``level`` (default: transformers' verbosity).

    Without ``level`` (what :class:`hf_pma.PMATrainer` calls), a level the user gave the
    ``hf_pma`` logger before is kept: a script's ``enable_logging(logging.INFO)`` is not undone
    by the Trainer it builds next. Adds one handler, once, unless handlers are already
    configured (on ``hf_pma`` or the root logger); records still propagate, so ``logging``
    setups and test captures see them. The handler redacts access tokens and escapes control
    characters (:class:`RedactingFilter`).
    """
    global _default_level
    logger = logging.getLogger("hf_pma")
    if level is not None:
        _default_level = None
        logger.setLevel(level)
    elif logger.level in (logging.NOTSET, _default_level):
        from transformers.utils import logging as hf_logging

        _default_level = hf_logging.get_verbosity()
        logger.setLevel(_default_level)
    if logger.handlers or logging.getLogger().handlers:
        return  # the user configured logging: records propagate to their handlers
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(logging.Formatter("[%(levelname)s|%(name)s] %(asctime)s >> %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` without importing transformers (the one
    ``transformers.utils.logging.get_logger(name)`` returns for an ``hf_pma.*`` name); for the
    modules of the torch-free merge path."""
    return logging.getLogger(name)


def notice(logger: logging.Logger, message: str) -> None:
    """Log information a user must see: at INFO where ``logger`` shows INFO, else at WARNING.

    A plain script shows warnings only (Python's and transformers' default), so what a user must
    know (where the snapshots go, what the first one cost) passes there at WARNING's level, but
    is named what it is: the record's ``levelname`` stays ``INFO`` (no ``[WARNING|...]`` line
    for news that is no warning). Once the user shows hf-pma's INFO (:func:`enable_logging`,
    ``logging.basicConfig(level=logging.INFO)``) it is an INFO line like the others. Nothing is
    logged when transformers' verbosity is above WARNING (``set_verbosity_error()``: quiet).
    """
    from transformers.utils import logging as hf_logging

    if logger.isEnabledFor(logging.INFO):
        logger.info(message, stacklevel=2)
    elif hf_logging.get_verbosity() <= logging.WARNING and logger.isEnabledFor(logging.WARNING):
        path, line, function, _ = logger.findCaller(stacklevel=2)
        record = logger.makeRecord(logger.name, logging.WARNING, path, line, message, None, None, function)
        record.levelname = logging.getLevelName(logging.INFO)
        logger.handle(record)


# Seconds between redraws of a progress bar whose output is not a terminal (a log file, a pipe).
PROGRESS_INTERVAL_NOT_A_TERMINAL_S = 60.0


def progress_bar(iterable: Any = None, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` progress bar (same arguments) that writes to a log as well as to a
    terminal: into a file or a pipe (stderr, or ``file=``, not a terminal) it redraws at most
    every :data:`PROGRESS_INTERVAL_NOT_A_TERMINAL_S` seconds instead of ten times a second, so a
    long job leaves a few updates in its log, not thousands. The one way hf-pma makes a bar."""
    from tqdm.auto import tqdm

    stream = kwargs.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        kwargs.setdefault("mininterval", PROGRESS_INTERVAL_NOT_A_TERMINAL_S)
        kwargs.setdefault("maxinterval", max(PROGRESS_INTERVAL_NOT_A_TERMINAL_S, kwargs["mininterval"]))
    return tqdm(iterable, **kwargs)


class _QuietThreadFilter(logging.Filter):
    """Drops records below WARNING that a thread logs inside :func:`quiet_info`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not getattr(_QUIET, "depth", 0)


_QUIET = threading.local()
_FILTER = _QuietThreadFilter()
_FILTER_LOCK = threading.Lock()


def _module_loggers(obj: Any) -> Iterator[logging.Logger]:
    """The module-level ``logger`` of every module defining a class of ``obj`` (its MRO)."""
    for cls in type(obj).__mro__:
        module_logger = getattr(sys.modules.get(cls.__module__), "logger", None)
        if isinstance(module_logger, logging.Logger):
            yield module_logger


@contextlib.contextmanager
def quiet_info(*objects: Any) -> Iterator[None]:
    """Drop the INFO (and DEBUG) records that the ``save_pretrained`` of ``objects`` log, in this thread.

    Configs, generation configs and tokenizers log one "... saved in <file>" line per file at
    INFO; for snapshots written every few steps that is noise, even for a user who turned
    transformers' verbosity up. The records are filtered on the loggers of the modules that
    define the objects' classes, and only those logged by the calling thread inside the block:
    the training thread's own records (a Trainer checkpoint) pass. Warnings always pass.
    """
    with _FILTER_LOCK:
        for obj in objects:
            if obj is None:
                continue
            for module_logger in _module_loggers(obj):
                if _FILTER not in module_logger.filters:
                    module_logger.addFilter(_FILTER)
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


def set_cli_verbosity(quiet: bool = False, verbose: bool = False) -> None:
    """The levels of the ``hf-pma`` command.

    Default: hf-pma's INFO (what a command does) and transformers' warnings. ``quiet``: warnings
    only, and no progress bars. ``verbose`` (wins over ``quiet``): DEBUG for both, tracebacks on
    errors. transformers is not imported for this (a torch-free merge never imports it).
    """
    if verbose:
        hf_level, level = logging.DEBUG, logging.DEBUG
    else:
        hf_level, level = logging.WARNING, logging.WARNING if quiet else logging.INFO
    set_transformers_verbosity(hf_level, progress_bars=not quiet or verbose, explicit_format=True)
    enable_logging(level)


def set_transformers_verbosity(level: int, progress_bars: bool = True, explicit_format: bool = False) -> None:
    """Set transformers' log level (and turn its progress bars off) without importing it.

    If transformers is loaded, through its API; else through the environment variables it reads
    when it is first imported (``TRANSFORMERS_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS``), so
    that a command that never needs transformers (a torch-free merge) does not import it.
    ``explicit_format``: transformers' "[LEVEL|file:line]" format (only once it is loaded).
    """
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(level)
        if explicit_format:
            hf_logging.enable_default_handler()
            hf_logging.enable_explicit_format()
        if not progress_bars:
            hf_logging.disable_progress_bar()
        return
    os.environ["TRANSFORMERS_VERBOSITY"] = logging.getLevelName(level).lower()
    if not progress_bars:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
