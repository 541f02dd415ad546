"""The process's own limits, raised where a command needs more before it starts its work.

:func:`allow_open_files` is the one check of every command that holds many files open at once
(a merge of many snapshots, a consolidation of many ranks' shards, a push): the soft limit of
open files (``ulimit -n``, often 1024, or 64 in a container) is raised toward the hard limit
when it is too low, which any process may do; when even the hard limit is too low, one line
says so before any work. Torch-free.
"""

from __future__ import annotations

import contextlib

__all__ = ["OPEN_FILES_MARGIN", "allow_open_files"]

# Files a command opens besides the ones it counts and those it holds open already (counted
# where the system says: /proc/self/fd): an output being written, a claim, a record or card
# read meanwhile, a library's lazily opened file.
OPEN_FILES_MARGIN = 32
# What the files held open already are taken to be where they cannot be counted.
_UNCOUNTED_OPEN = 224


def _open_now() -> int:
    """How many files this process holds open now (``/proc/self/fd``, ``/dev/fd``), or a generous guess."""
    import os

    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return _UNCOUNTED_OPEN


def allow_open_files(count: int, needs: str, remedy: str) -> None:
    """Let this process hold ``count`` files open at once, besides those it holds open already
    (plus :data:`OPEN_FILES_MARGIN`): a 3-snapshot merge fits a container's ``ulimit -n 64``.

    The soft limit is raised toward the hard one when it is lower; when the hard limit is lower
    still, ``ValueError``: ``<needs>, more than this process may open at once (ulimit -n N):
    raise the limit or <remedy>``. Call it before the first file is opened. No-op where there are
    no such limits (not POSIX) or they are unlimited."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    wanted = count + _open_now() + OPEN_FILES_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    if soft < wanted:
        raise ValueError(
            f"{needs}, more than this process may open at once (ulimit -n {soft:,}): raise the limit or {remedy}"
        )

