"""What users name, checked before any request: a local path or a Hub id (:func:`looks_local`),
a branch, tag or pull-request ref (:func:`check_revision_name`). Torch-free."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hf_pma.utils.text import is_printable

__all__ = ["check_revision_name", "looks_local"]

# git's rules for a ref name (``git check-ref-format``), which the Hub follows for branches and tags.
_BAD_REF_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def check_revision_name(revision: str, name: str = "revision") -> str:
    """``revision`` if it is a valid branch, tag, pull-request ref (``refs/pr/<number>``) or commit
    name; a ``ValueError`` naming it otherwise (checked before any request).

    git's ref-name rules (``git check-ref-format``): no ``..``, no ``@{``, no component that
    starts with ``.`` or ends with ``.lock``, no empty component or leading, trailing or double
    ``/``, no trailing ``.``, no control character, space, ``~ ^ : ? * [ \\``, and not ``@``.
    A name under ``refs/`` must be ``refs/pr/<number>``, ``refs/heads/<branch>`` or
    ``refs/tags/<tag>``.
    """
    problem = None
    if not isinstance(revision, str) or not revision:
        problem = "it is empty"
    elif _BAD_REF_CHARS.search(revision):
        problem = "it holds a space, a control character or one of ~ ^ : ? * [ \\"
    elif not is_printable(revision):
        problem = "it holds a bidi override or another character that does not show as it is"
    elif ".." in revision or "@{" in revision or revision == "@":
        problem = "it holds '..' or '@{' (or is '@')"
    elif revision.startswith("/") or revision.endswith(("/", ".")) or "//" in revision:
        problem = "it starts or ends with '/', ends with '.' or holds '//'"
    elif any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        problem = "a part of it starts with '.' or ends with '.lock'"
    elif revision.startswith("refs/") and not re.fullmatch(r"refs/(?:pr/\d+|heads/.+|tags/.+)", revision):
        problem = "a ref under refs/ must be refs/pr/<number>, refs/heads/<branch> or refs/tags/<tag>"
    if problem is not None:
        raise ValueError(f"invalid {name} {revision!r}: {problem} (git's rules for branch and tag names)")
    return revision


def looks_local(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` can only mean a local path, never a Hub id (``org/name``, ``name``,
    ``org/name@REV``): it is a path object (``pathlib.Path``: what hf-pma took from a run folder
    or manifest, which is never looked up on the Hub even once deleted), starts with ``.``, ``/``
    or ``~``, holds a ``\\`` or more than one ``/``, or its first part exists here
    (``run/snapshot-9`` where ``run/`` is a folder)."""
    if isinstance(name, os.PathLike):
        return True
    text = os.fspath(name)
    if text.startswith((".", "/", "~")) or "\\" in text or os.sep in text.replace("/", ""):
        return True
    parts = text.split("@", 1)[0].split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).exists())
