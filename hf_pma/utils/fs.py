"""Atomic, durable file and folder writes: the one write path of hf-pma."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames inside it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file and folder under ``path`` (before it is renamed into place)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write bytes to ``path`` atomically: a temporary file beside it, fsync, rename, fsync dir.
    The file is readable by others (0644), like every file hf-pma writes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; manifests, cards and plots are read by other tools and users
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 text to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON to ``path`` atomically (see :func:`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file, with an error that names the file when it is not valid JSON."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a folder by renaming it aside first, so a crash never leaves half a snapshot."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(f"{DELETING_PREFIX}{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)
