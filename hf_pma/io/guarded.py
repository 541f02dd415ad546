"""The one way in: every file under a folder a user gave (a run, a merge source, a snapshot, a
folder to push) is opened here, and nowhere else.

A folder may come from anywhere (another cluster, a colleague, a Hub download, a shared
filesystem others write to), so what it holds is checked per file, when it is opened:

* **Confined after links.** ``folder/relative`` is resolved (every symbolic link followed) and
  must stay inside the resolved folder; a link that stays inside is allowed (a Hub cache's
  files are links, a run may link a snapshot's file to another's) and is read as the file it
  names. The opened file is checked again through ``/proc/self/fd`` where there is one, so a
  link swapped in between the check and the open is caught too. A Hub cache snapshot folder
  (``models--org--name/snapshots/<commit>``) is confined to its repository folder, whose
  ``blobs/`` its links point into (:func:`confinement_root`).
* **Regular files only.** The file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO must not
  hang the reader) and ``fstat``-ed: a FIFO, a socket, a device or a folder is refused.
* **Bounded.** A size limit per read; JSON is parsed with a byte limit per kind of file
  (:data:`JSON_LIMITS`) and a nesting limit (:data:`MAX_JSON_DEPTH`).
* **One line.** Every refusal is one line naming the file and why
  (:class:`UnsafeFileError`, a ``ValueError``, which the CLI reports with exit status 2).
* **One version.** Inside :func:`one_version` (a merge, a consolidation, an evaluation's load,
  a push), every file opened directly in a pinned folder (:func:`pin_folder`: a source, a model
  folder) is pinned: its identity (device, inode, size, ``mtime_ns``, ``ctime_ns``) is taken
  when it is first opened. Opening it again with another identity, or
  :meth:`OneVersion.check` finding its path or its folder's (device, inode) changed, is a
  :class:`SourceChangedError` naming it: a file rewritten in place, replaced, or a folder
  swapped under its name while it was read. A file deleted meanwhile is no change (the reader
  holds the version it opened; whoever opens it again fails on its absence).

Entry points: :func:`open_file` (a raw descriptor, for ``pread``), :func:`read_bytes`,
:func:`read_json` (records, configs, indexes), :func:`parse_json` (JSON text already in memory,
such as a safetensors header's metadata), :func:`check_file` (a path to hand to a library that
opens it itself), :func:`check_folder` (a subfolder, such as a run's ``pma/``, confined the same
way), :func:`copy_file` (a support file into a folder hf-pma is writing) and
:func:`regular_files` (every regular file under a folder: what a copy or an upload takes);
:func:`one_version` / :func:`reads_one_version` (a command's reads as one version),
:func:`pin_folder` and :func:`check_one_version` (after the last read, before publishing).
Torch-free; the files a folder names are never executed or imported here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import functools
import json
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from hf_pma.utils.text import escape, is_printable

__all__ = [
    "JSON_LIMITS",
    "MAX_JSON_DEPTH",
    "FileIdentity",
    "OneVersion",
    "SourceChangedError",
    "UnsafeFileError",
    "check_file",
    "check_folder",
    "confinement_root",
    "copy_file",
    "json_depth",
    "one_version",
    "check_one_version",
    "open_file",
    "opened",
    "parse_json",
    "pin_folder",
    "pin_folders",
    "read_bytes",
    "read_json",
    "reads_one_version",
    "regular_files",
]

# Byte limits of the JSON files hf-pma parses, by kind. Each is far above what a real file of
# that kind holds, and low enough that parsing one costs a bounded amount of memory (Python
# objects take about 10x the bytes of their JSON text):
# - "record": hf-pma's own records (pma.json, pma_merge.json, pma_eval.json): a merge record
#   lists ~300 bytes per source, so 16 MiB is over 50,000 sources.
# - "manifest": one ~300-byte entry per snapshot: 64 MiB is over 200,000 snapshots.
# - "config": config.json, generation_config.json, tokenizer_config.json, ...: the largest real
#   ones (tokenizer configs listing every added token) are a few MiB.
# - "index": model.safetensors.index.json, ~80 bytes per tensor: 64 MiB is 800,000 tensors.
# - "trainer_state": the Trainer's trainer_state.json grows with its log_history (~200 bytes per
#   logged step: a million logged steps is 200 MB).
JSON_LIMITS: dict[str, int] = {
    "record": 16 * 1024 * 1024,
    "manifest": 64 * 1024 * 1024,
    "config": 64 * 1024 * 1024,
    "index": 64 * 1024 * 1024,
    "trainer_state": 256 * 1024 * 1024,
}
# Deepest nesting of arrays and objects accepted in any JSON file: real configs and records
# nest fewer than 10 levels; deep nesting only costs (a recursive reader's stack).
MAX_JSON_DEPTH = 64

_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class UnsafeFileError(ValueError):
    """A file under a user's folder that hf-pma refuses to read: a symbolic link leading outside
    the folder, something that is not a regular file, a file over a size limit, JSON too large or
    too deep. The one-line message names the file and why."""


class SourceChangedError(UnsafeFileError):
    """A file or folder that changed while hf-pma read it (rewritten in place, replaced, or its
    folder swapped under its name): what was read may mix two versions, so the command stops
    before anything is published. The one-line message names it and says what to do."""


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """What tells one version of a file from another: a write changes ``size`` or the times
    (``ctime_ns`` even when ``mtime`` is set back), a replacement the device or inode."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        """The identity of what ``os.stat`` / ``os.fstat`` described."""
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _changed(path: str | os.PathLike[str], how: str) -> SourceChangedError:
    return SourceChangedError(
        f"{escape(path)} {how} while this command read it; run it again once nothing writes there"
    )


class OneVersion:
    """The folders pinned for one command and the files read from them, each with its identity
    when first seen (see :func:`one_version`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folders: dict[str, tuple[str, int, int]] = {}  # absolute path -> (as named, device, inode)
        self._trees: set[str] = set()  # folders whose every file below is pinned, not only the top
        self._files: dict[str, tuple[str, FileIdentity]] = {}  # absolute path -> (as named, identity)

    def pin_folder(self, folder: str | os.PathLike[str], *, tree: bool = False) -> None:
        """Pin ``folder`` (its device and inode) and, from now on, every file opened directly in
        it (``tree``: anywhere below it). A folder that is not there is left to its reader."""
        key = os.path.abspath(folder)
        try:
            info = os.stat(key)
        except OSError:
            return
        with self._lock:
            shown_as, *pinned = self._folders.setdefault(key, (os.fspath(folder), info.st_dev, info.st_ino))
            if tree:
                self._trees.add(key)
        if pinned != [info.st_dev, info.st_ino]:
            raise _changed(shown_as, "was replaced by another folder")

    def _covers(self, key: str) -> bool:
        parent = os.path.dirname(key)
        return parent in self._folders or any(key.startswith(t + os.sep) for t in self._trees)

    def pin_file(self, path: str | os.PathLike[str], info: os.stat_result) -> None:
        """Record what ``path`` was when opened (``info``: its ``fstat``), if its folder is
        pinned; a :class:`SourceChangedError` when it was opened before as another version."""
        key = os.path.abspath(path)
        identity = FileIdentity.of(info)
        with self._lock:
            if not self._covers(key):
                return
            shown_as, first = self._files.setdefault(key, (os.fspath(path), identity))
        if first != identity:
            raise _changed(shown_as, _how(first, identity))

    def check(self) -> None:
        """Every pinned folder and file is still the version first seen; else a
        :class:`SourceChangedError` naming the first that is not. Call it after the last read
        and before anything is published."""
        with self._lock:
            folders, files = dict(self._folders), dict(self._files)
        for key, (shown_as, dev, ino) in folders.items():
            now = _stat_or_none(key)
            if now is not None and (now.st_dev, now.st_ino) != (dev, ino):
                raise _changed(shown_as, "was replaced by another folder")
        for key, (shown_as, first) in files.items():
            now = _stat_or_none(key)
            if now is not None and FileIdentity.of(now) != first:
                raise _changed(shown_as, _how(first, FileIdentity.of(now)))


def _how(first: FileIdentity, now: FileIdentity) -> str:
    if (first.dev, first.ino) != (now.dev, now.ino):
        return "was replaced by another file"
    return (
        "was rewritten" if first.size == now.size else f"changed size ({first.size:,} to {now.size:,} bytes)"
    )


def _stat_or_none(path: str) -> os.stat_result | None:
    """What ``path`` is now (links followed, as it was opened), ``None`` when it is gone."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as err:  # a link loop, a folder made unreadable: not what was read
        raise SourceChangedError(
            f"{escape(path)} cannot be checked again ({escape(err.strerror)}); run the command again"
        ) from None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        return info  # a FIFO or a device now: another file, never opened
    # NFS revalidates what it caches of a file on open (close-to-open), not on every stat.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return info
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


_ONE_VERSION: contextvars.ContextVar[OneVersion | None] = contextvars.ContextVar(
    "hf_pma_one_version", default=None
)


@contextlib.contextmanager
def one_version(*folders: str | os.PathLike[str], tree: bool = False) -> Iterator[OneVersion]:
    """Read as one version: pin ``folders`` (see :meth:`OneVersion.pin_folder`) and every file
    opened directly in them (``tree``: below them) for the rest of the block, in this thread
    and context. Inside another ``one_version`` block, the same pins are shared. Call
    :meth:`OneVersion.check` (or :func:`check_one_version`) where the reading is done and
    before anything is published: nothing is checked on leaving."""
    session = _ONE_VERSION.get()
    token = None
    if session is None:
        session = OneVersion()
        token = _ONE_VERSION.set(session)
    try:
        for folder in folders:
            session.pin_folder(folder, tree=tree)
        yield session
    finally:
        if token is not None:
            _ONE_VERSION.reset(token)


_F = TypeVar("_F", bound=Callable[..., Any])


def reads_one_version(fn: _F) -> _F:
    """Run ``fn`` inside :func:`one_version` (a new one, or the caller's)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_version():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def pin_folder(folder: str | os.PathLike[str], *, tree: bool = False) -> None:
    """:meth:`OneVersion.pin_folder` in the current :func:`one_version` block; nothing outside one."""
    session = _ONE_VERSION.get()
    if session is not None:
        session.pin_folder(folder, tree=tree)


def pin_folders(folders: Iterable[str | os.PathLike[str] | None]) -> None:
    """:func:`pin_folder` for each of ``folders`` that is not ``None``."""
    for folder in folders:
        if folder is not None:
            pin_folder(folder)


def check_one_version() -> None:
    """:meth:`OneVersion.check` of the current :func:`one_version` block; nothing outside one."""
    session = _ONE_VERSION.get()
    if session is not None:
        session.check()


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def confinement_root(folder: str | os.PathLike[str]) -> Path:
    """The resolved folder that the files of ``folder`` must stay inside.

    ``folder`` itself, resolved; for a Hub cache snapshot folder
    (``.../models--org--name/snapshots/<commit>``, whose files are links into the repository's
    ``blobs/``), the repository folder.
    """
    root = Path(folder).resolve()
    repo = root.parent.parent
    if (
        root.parent.name == "snapshots"
        and repo.name.startswith(_HUB_REPO_PREFIXES)
        and (repo / "blobs").is_dir()
    ):
        return repo
    return root


def _resolve_inside(path: Path, folder: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """``path`` resolved, and the root it must stay in; :class:`UnsafeFileError` when it leaves it."""
    root = confinement_root(path.parent if folder is None else folder)
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        if path.is_symlink():
            raise UnsafeFileError(f"{escape(path)} is a symbolic link to nothing (a dangling link)") from None
        raise FileNotFoundError(f"{escape(path)} does not exist") from None
    except (OSError, RuntimeError) as err:  # a link loop, a name the filesystem refuses
        raise UnsafeFileError(f"{escape(path)} cannot be resolved ({escape(err)})") from None
    if resolved != root and not resolved.is_relative_to(root):
        raise UnsafeFileError(f"{escape(path)} is a symbolic link to outside the folder {escape(root)}")
    return resolved, root


def _opened_path(fd: int) -> Path | None:
    """Where an open descriptor really leads (Linux ``/proc/self/fd``), or ``None`` if unknown."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def open_file(
    path: str | os.PathLike[str],
    folder: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None = None,
) -> int:
    """Open ``path``, a file under ``folder``, for reading; returns a raw descriptor (close it).

    ``folder`` is the folder the user gave (a run, a source, a snapshot; default: the folder
    holding ``path``); ``path`` must resolve, after symbolic links, inside it
    (:func:`confinement_root`), and be a regular file of at most ``max_bytes`` bytes.
    ``FileNotFoundError`` when it does not exist; :class:`UnsafeFileError` (one line naming the
    file) otherwise: ``... is a symbolic link to outside the folder ...``, ``... is not a
    regular file (a FIFO)``, ``... is larger than N bytes``. Never blocks on a FIFO.
    """
    path = Path(path)
    resolved, root = _resolve_inside(path, folder)
    try:
        before = os.stat(resolved)
    except OSError as err:
        raise FileNotFoundError(f"{escape(path)} cannot be read ({escape(err.strerror)})") from None
    if not stat.S_ISREG(before.st_mode):  # refused unopened: opening a device may act on it
        raise UnsafeFileError(f"{escape(path)} is not a regular file ({_kind_of(before.st_mode)})")
    try:
        fd = os.open(resolved, _OPEN_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:  # the last component became a link after it was resolved
            raise UnsafeFileError(f"{escape(path)} changed into a symbolic link while being opened") from None
        if err.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(f"{escape(path)} cannot be read: permission denied") from None
        raise UnsafeFileError(f"{escape(path)} cannot be opened ({escape(err.strerror)})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{escape(path)} is not a regular file ({_kind_of(info.st_mode)})")
        real = _opened_path(fd)
        if real is not None and real != root and not real.is_relative_to(root):
            raise UnsafeFileError(f"{escape(path)} is a symbolic link to outside the folder {escape(root)}")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UnsafeFileError(
                f"{escape(path)} is larger than {max_bytes:,} bytes ({info.st_size:,} bytes)"
            )
        session = _ONE_VERSION.get()
        if session is not None:  # a file of a pinned folder: the version read is remembered
            session.pin_file(path, info)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(
    path: str | os.PathLike[str],
    folder: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None = None,
) -> Path:
    """Check ``path`` as :func:`open_file` does, without keeping it open; returns its resolved path
    (for a library that opens files by name itself, such as ``torch.load``)."""
    fd = open_file(path, folder, max_bytes=max_bytes)
    try:
        return _opened_path(fd) or Path(path).resolve()
    finally:
        os.close(fd)


def check_folder(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """``path``, a folder under ``folder`` (a run's ``pma/``, a ``checkpoint-N``), resolved: it
    must stay inside ``folder`` after symbolic links (:func:`confinement_root`), as every file
    read from it must. A link that leaves it is an :class:`UnsafeFileError` naming it: what such a
    folder holds (records, weights, a manifest) belongs to someone else's folder.
    ``FileNotFoundError`` when it does not exist, ``NotADirectoryError`` when it is no folder."""
    path = Path(path)
    resolved, _ = _resolve_inside(path, folder)
    if not resolved.is_dir():
        raise NotADirectoryError(f"{escape(path)} is not a folder")
    return resolved


def read_bytes(
    path: str | os.PathLike[str], folder: str | os.PathLike[str] | None = None, *, max_bytes: int
) -> bytes:
    """The content of ``path`` (checked as :func:`open_file` checks it), at most ``max_bytes``."""
    fd = open_file(path, folder, max_bytes=max_bytes)
    try:
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:  # the file grew while being read
                raise UnsafeFileError(f"{escape(path)} is larger than {max_bytes:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def json_depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


def parse_json(text: str | bytes, what: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text that came from ``what`` (a file, a metadata key: named in the error).

    ``ValueError``, one line naming ``what``, for text that is not JSON (or not UTF-8), numbers
    too long to convert, or nesting deeper than ``max_depth``.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is not valid JSON: nested deeper than {max_depth} levels") from None
    except (ValueError, TypeError) as err:  # bad JSON or UTF-8, an integer with too many digits
        raise ValueError(f"{what} is not valid JSON: {escape(str(err)[:200])}") from None
    if json_depth(value) > max_depth:
        raise ValueError(f"{what} is not valid JSON: nested deeper than {max_depth} levels")
    return value


def read_json(
    path: str | os.PathLike[str], folder: str | os.PathLike[str] | None = None, kind: str = "record"
) -> Any:
    """Parse the JSON file ``path`` under ``folder`` (default: the folder holding it), bounded.

    The file is opened as :func:`open_file` opens it (confined after links, regular, at most
    ``JSON_LIMITS[kind]`` bytes: ``kind`` is ``"record"``, ``"manifest"``, ``"config"``,
    ``"index"`` or ``"trainer_state"``) and parsed with :func:`parse_json` (nesting at most
    :data:`MAX_JSON_DEPTH`). Errors are one line naming the file: ``FileNotFoundError``, or a
    ``ValueError`` (:class:`UnsafeFileError` for what the file is, plain for what it holds). The
    value's type and fields are the caller's to check.
    """
    if kind not in JSON_LIMITS:
        raise ValueError(f"kind must be one of {sorted(JSON_LIMITS)}, got {kind!r}")
    data = read_bytes(path, folder, max_bytes=JSON_LIMITS[kind])
    return parse_json(data, escape(path))


def copy_file(
    src: str | os.PathLike[str], dest: str | os.PathLike[str], folder: str | os.PathLike[str] | None = None
) -> None:
    """Copy the regular file ``src`` (under ``folder``, checked as :func:`open_file` checks it) to
    ``dest``, a new file (``FileExistsError`` if anything is there, a link included). The copy
    is a plain file with the default mode: no link, no permission bits of the source."""
    fd = open_file(src, folder)
    try:
        out = os.open(
            dest,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
            0o644,
        )
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        finally:
            os.close(out)
    finally:
        os.close(fd)


def regular_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Every regular file under ``folder``, as paths relative to it, sorted; for copying or uploading.

    Walks without following links out of the folder: a symbolic link to a file or a folder
    inside ``folder`` is taken as what it names (a folder reached twice is walked once; the file
    is listed under the link's name, and its bytes are read through :func:`open_file`). Refused,
    with :class:`UnsafeFileError` naming the entry, before anything is returned: a link that
    leads outside ``folder`` (or nowhere), a FIFO, a socket or a device, and a name holding a
    control, format or separator character (a newline in a name would forge lines in a log).
    Hidden entries (``.git``, hf-pma's temporaries) are listed like the others: the caller
    decides what to leave out.
    """
    top = Path(folder)
    root = confinement_root(top)
    found: list[Path] = []
    seen: set[Path] = {top.resolve()}
    stack: list[tuple[Path, Path]] = [(top, Path())]
    while stack:
        here, rel_here = stack.pop()
        with os.scandir(here) as entries:
            listing = sorted(entries, key=lambda e: e.name)
        for entry in listing:
            rel = rel_here / entry.name
            shown_path = escape(top / rel)
            if not is_printable(entry.name):
                raise UnsafeFileError(f"{shown_path} has a control character in its name")
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                try:
                    target = Path(entry.path).resolve(strict=True)
                except (OSError, RuntimeError):
                    raise UnsafeFileError(
                        f"{shown_path} is a symbolic link to nothing (or a link loop)"
                    ) from None
                if target != root and not target.is_relative_to(root):
                    raise UnsafeFileError(
                        f"{shown_path} is a symbolic link to outside the folder {escape(root)}"
                    )
                mode = os.stat(target).st_mode
                if stat.S_ISDIR(mode):
                    if target not in seen:
                        seen.add(target)
                        stack.append((Path(entry.path), rel))
                    continue
            elif stat.S_ISDIR(mode):
                real = Path(entry.path).resolve()
                if real not in seen:
                    seen.add(real)
                    stack.append((Path(entry.path), rel))
                continue
            if not stat.S_ISREG(mode):
                raise UnsafeFileError(f"{shown_path} is not a regular file ({_kind_of(mode)})")
            found.append(rel)
    return sorted(found)


@contextlib.contextmanager
def opened(
    path: str | os.PathLike[str],
    folder: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None = None,
) -> Iterator[int]:
    """:func:`open_file` as a context manager: the descriptor is closed on leaving."""
    fd = open_file(path, folder, max_bytes=max_bytes)
    try:
        yield fd
    finally:
        os.close(fd)
