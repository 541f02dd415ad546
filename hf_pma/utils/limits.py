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

# Files a command holds open besides the ones it counts: the interpreter's and libraries' own
# (torch, tokenizers), an output being written, a claim, a record or card read meanwhile.
OPEN_FILES_MARGIN = 256


def allow_open_files(count: int, needs: str, remedy: str) -> None:
    """Let this process hold ``count`` files open at once (plus :data:`OPEN_FILES_MARGIN`).

    The soft limit is raised toward the hard one when it is lower; when the hard limit is lower
    still, ``ValueError``: ``<needs>, more than this process may open at once (ulimit -n N):
    raise the limit or <remedy>``. Call it before the first file is opened. No-op where there are
    no such limits (not POSIX) or they are unlimited."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    wanted = count + OPEN_FILES_MARGIN
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

