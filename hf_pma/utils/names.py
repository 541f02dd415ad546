"""What users name, checked before any request: a Hub id (:func:`parse_hub_id`,
:func:`is_hub_id`) or a local path (:func:`looks_local`), a branch, tag or pull-request ref
(:func:`check_revision_name`), a learning-rate schedule (:func:`scheduler_name`). Torch-free."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hf_pma.utils.text import is_printable

__all__ = [
    "FILE_SUFFIXES",
    "check_revision_name",
    "is_hub_id",
    "looks_local",
    "parse_hub_id",
    "scheduler_name",
]

# ``org/model@REV``: the revision is any text without white space or ``@`` (checked by
# :func:`check_revision_name` where it is used).
_HUB_SPEC = re.compile(r"(?P<repo>[^@\s]+)(?:@(?P<rev>[^\s@]+))?")
# Names that end like these are files ("data/train.jsonl"), never a Hub id, although the Hub's
# rule would take them.
FILE_SUFFIXES = (
    *(".jsonl", ".json", ".csv", ".parquet", ".arrow"),
    *(".txt", ".text", ".md", ".rst", ".py", ".gz", ".zst"),
)

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


def parse_hub_id(text: Any, bare: bool = False) -> tuple[str, str | None] | None:
    """The one reading of a Hub id: ``"org/model@REV"`` -> ``("org/model", "REV")``,
    ``"org/model"`` -> ``("org/model", None)``; with ``bare``, a name without an organisation
    (``"gpt2"``, ``"wikitext"``) too. ``None`` for anything else: not a string, a path (it starts
    with ``.``, ``/`` or ``~``, or holds a ``\\``), a file name (ending in one of
    :data:`FILE_SUFFIXES`), or a name the Hub refuses (``huggingface_hub``'s
    ``validate_repo_id``: at most one ``/``; letters, digits, ``-``, ``_``, ``.``; no ``--`` or
    ``..``). Whether a local folder of that name exists is the caller's question
    (:func:`looks_local`)."""
    if not isinstance(text, str) or text.startswith((".", "/", "~")) or "\\" in text:
        return None
    match = _HUB_SPEC.fullmatch(text)
    if match is None:
        return None
    repo = match.group("repo")
    if ("/" not in repo and not bare) or repo.lower().endswith(FILE_SUFFIXES):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, match.group("rev")


def is_hub_id(text: Any, bare: bool = False) -> bool:
    """Whether ``text`` is a Hub repo id without a revision: ``"org/model"`` (and, with
    ``bare``, ``"gpt2"``), as :func:`parse_hub_id` reads it."""
    spec = parse_hub_id(text, bare)
    return spec is not None and spec[1] is None


def scheduler_name(args: Any) -> str:
    """The ``lr_scheduler_type`` of training arguments as a plain string (``"cosine"``): the
    field holds a ``transformers.SchedulerType`` enum after ``TrainingArguments.__post_init__``
    and a string before it (or on any other object)."""
    value = getattr(args, "lr_scheduler_type", None)
    return str(getattr(value, "value", value))
