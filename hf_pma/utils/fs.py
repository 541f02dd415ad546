"""Atomic, durable file and folder writes: the one write path of hf-pma.

Every file or folder hf-pma publishes is written under a temporary name beside its target,
fsynced, and renamed into place, so a reader sees either the old target or the complete new
one. Temporary names follow one scheme, ``.<target name>.<kind>-<host>-<pid>-<n>`` (``kind``
is ``tmp`` for something being written, ``deleting`` for something being removed), so that the
leftovers of a process that died (SIGKILL, power cut, OOM kill) are recognised and removed by
:func:`remove_stale_temporaries`, which runs before every folder publish and in
:func:`hf_pma.core.manifest.clean_incomplete`. A temporary is never removed while the process
that owns it may still be alive: on this host, while its pid is alive; from another host
(a shared filesystem), only once nothing in it changed for :data:`FOREIGN_STALE_AFTER_S`.

A name being replaced holds its old folder or its new one, whole, after a crash at any point
(:func:`publish_folder`: the two are swapped in one step where the filesystem can; elsewhere a
crash between two renames is completed by :func:`restore_interrupted`, which every writer and
reader of a name runs first).

A write that runs out of space (``ENOSPC``, or ``EDQUOT`` on a quota) raises
:class:`NoSpaceError`, which names the target, the bytes needed (when known) and the bytes
free; the temporary is removed first, so nothing half-written is left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from hf_pma.utils.parsing import is_int
from hf_pma.utils.read_files import listed_folder_among, output_place_problem
from hf_pma.utils.text import escape, shown

__all__ = [
    "FOREIGN_STALE_AFTER_S",
    "RUN_MANIFESTS",
    "NoSpaceError",
    "TEMP_KINDS",
    "atomic_write_file",
    "atomic_write_json",
    "atomic_write_text",
    "OutputBusyError",
    "OutputExistsError",
    "check_output_file",
    "check_output_folder",
    "CLAIM_WAIT_S",
    "FolderClaim",
    "FolderMovedError",
    "check_claimed_folder",
    "claim_file_of",
    "claim_output",
    "claim_path",
    "hold_claim",
    "holds_claim",
    "NoFileLocksError",
    "process_start_ticks",
    "read_claim",
    "recorded_holder_state",
    "confined_path",
    "embedded_name",
    "free_bytes",
    "fsync_dir",
    "fsync_tree",
    "is_confined",
    "is_library_folder",
    "is_stale_temporary",
    "listed_snapshot_of",
    "parse_temporary",
    "publish_folder",
    "raise_if_no_space",
    "remove_path",
    "remove_stale_temporaries",
    "remove_tree",
    "restore_interrupted",
    "temporary_path",
    "write_folder_atomically",
]

T = TypeVar("T")

# Kinds of temporaries: being written, being deleted.
TEMP_KINDS = ("tmp", "deleting")
# A temporary written from another host is only removed once nothing in it changed for this
# long: its pid cannot be checked from here, and a live writer touches its files far more often.
FOREIGN_STALE_AFTER_S = 6 * 3600
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_counter = itertools.count()
# Temporary and claim names embed the target's name in at most NAME_MAX less this many bytes:
# ".", ".deleting-", a host of at most _HOST_CHARS, "-", a pid, "-", a counter.
_HOST_CHARS = 64
_SUFFIX_RESERVE = 1 + 10 + _HOST_CHARS + 1 + 10 + 1 + 20
_HASH_CHARS = 12
# The largest pid a process can have (Linux's PID_MAX_LIMIT, 2^22): a record naming a larger one
# was not written by a process of this host (and os.kill would overflow on it).
_PID_MAX = 2**22


# DOTALL: a folder's name may hold a newline (its temporaries are still this library's).
_TEMP_RE = re.compile(
    r"\.(?P<name>.+)\.(?P<kind>tmp|deleting)-(?P<host>[A-Za-z0-9_.-]+)-(?P<pid>\d{1,12})-(?P<n>\d{1,20})", re.DOTALL
)


# ---------------------------------------------------------------- temporary names


def _logger() -> Any:
    # The project's helper: the same hf_pma logger, without importing transformers (the CLI's
    # parser and the torch-free merge load this module).
    from hf_pma.utils.logs import get_logger

    return get_logger(__name__)


def _host() -> str:
    return (re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost")[:_HOST_CHARS]


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the filesystem of ``folder`` (or its nearest existing parent) takes."""
    try:
        return min(255, int(os.pathconf(_existing_parent(folder.absolute()), "PC_NAME_MAX")))
    except (OSError, ValueError, TypeError):
        return 255


def embedded_name(target: str | os.PathLike[str]) -> str:
    """The form of ``target``'s name inside its temporary and claim names.

    The name itself when ``.<name>.deleting-<host>-<pid>-<n>`` fits the file-name limit of
    ``target``'s folder (``NAME_MAX``, 255 bytes on most filesystems) whatever the host, pid and
    counter; otherwise a prefix of it, ``~`` and 12 hex digits of its SHA-256 (recognisable, and
    the same for the same name, so :func:`remove_stale_temporaries` finds an earlier run's).
    """
    target = Path(target)
    name = target.name
    budget = max(_name_max(target.parent) - _SUFFIX_RESERVE, _HASH_CHARS + 1)
    if len(os.fsencode(name)) <= budget:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:_HASH_CHARS]
    prefix, size = "", 0
    for char in name:
        size += len(os.fsencode(char))
        if size > budget - _HASH_CHARS - 1:
            break
        prefix += char
    return f"{prefix}~{digest}"


def temporary_path(target: str | os.PathLike[str], kind: str = "tmp") -> Path:
    """A fresh temporary name beside ``target``: ``.<name>.<kind>-<host>-<pid>-<n>`` (``<name>``
    shortened to fit the file-name limit: :func:`embedded_name`)."""
    if kind not in TEMP_KINDS:
        raise ValueError(f"kind must be one of {TEMP_KINDS}, got {kind!r}")
    target = Path(target)
    return target.with_name(f".{embedded_name(target)}.{kind}-{_host()}-{os.getpid()}-{next(_counter)}")


def parse_temporary(name: str) -> dict[str, Any] | None:
    """``{"name", "kind", "host", "pid"}`` of a temporary name of this library; ``None`` otherwise."""
    match = _TEMP_RE.fullmatch(name)  # not "$": it matches before a trailing newline
    if match is None or not 0 < int(match["pid"]) <= _PID_MAX:
        return None
    return {"name": match["name"], "kind": match["kind"], "host": match["host"], "pid": int(match["pid"])}


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= _PID_MAX:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    except OSError:
        return True  # unknown: keep
    return True


def _last_change(path: Path) -> float:
    """The newest mtime of ``path`` and of the entries directly inside it (a live writer's files)."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    pass
    return newest


def is_stale_temporary(path: str | os.PathLike[str], now: float | None = None) -> bool:
    """Whether ``path`` is a temporary of this library whose owner is gone.

    Same host: its pid is no longer alive (a reused pid keeps it, which errs on the safe
    side). Another host: nothing in it changed for :data:`FOREIGN_STALE_AFTER_S` seconds.
    """
    path = Path(path)
    info = parse_temporary(path.name)
    if info is None:
        return False
    if info["host"] == _host():
        return not _pid_alive(info["pid"])
    try:
        age = (time.time() if now is None else now) - _last_change(path)
    except OSError:
        return False
    return age > FOREIGN_STALE_AFTER_S


def remove_path(path: str | os.PathLike[str]) -> None:
    """Remove a file or a whole folder (no error when it is already gone)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(folder: str | os.PathLike[str], name: str | None = None) -> list[Path]:
    """Remove the stale temporaries in ``folder`` (see :func:`is_stale_temporary`); returns them.

    With ``name``, only those of the target ``folder/name`` (``.<name>.tmp-*``,
    ``.<name>.deleting-*``). Other files and the temporaries of live processes are left alone.
    A target that an interrupted replacement left missing is restored first
    (:func:`restore_interrupted`), so what is removed is never the only copy of it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    wanted = embedded_name(folder / name) if name is not None else None
    with os.scandir(folder) as entries:
        candidates = sorted(Path(e.path) for e in entries if e.name.startswith("."))
    targets = {wanted} if wanted is not None else {i["name"] for p in candidates if (i := parse_temporary(p.name))}
    missing = set()  # targets still missing: a pair of theirs may be the only copy (a shortened name, a failed restore)
    for embedded in sorted(targets):
        target = folder / (name if embedded == wanted else embedded)
        if embedded != wanted and "~" in embedded:  # shortened (embedded_name): the target is not known from it
            missing.add(embedded)
        elif restore_interrupted(target) is None and not os.path.lexists(target):
            missing.add(embedded)
    removed = []
    for path in candidates:
        info = parse_temporary(path.name)
        if info is None or (name is not None and info["name"] != wanted) or not is_stale_temporary(path):
            continue
        if info["name"] in missing and _pair_of(path) is not None:
            continue  # never the only copy of a name: its next writer or reader restores it
        remove_path(path)
        _logger().info(f"hf-pma: removed {path}, left by an interrupted write")
        removed.append(path)
    return removed


def _pair_of(path: Path) -> Path | None:
    """The other half of an interrupted replacement that ``path`` (a ``tmp`` or ``deleting``
    temporary) belongs to: the same host, pid and counter under the other kind, when it exists.
    :func:`publish_folder` moves an old folder aside under its new one's numbers, so such a pair
    means the new one was complete when the old was moved."""
    match = _TEMP_RE.fullmatch(path.name)
    if match is None:
        return None
    other = "deleting" if match["kind"] == "tmp" else "tmp"
    pair = path.with_name(f".{match['name']}.{other}-{match['host']}-{match['pid']}-{match['n']}")
    return pair if os.path.lexists(pair) else None


def _own_folder(path: Path) -> bool:
    """A real folder (not a link) of this user: what a restore may rename into a name."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def restore_interrupted(target: str | os.PathLike[str]) -> Path | None:
    """Put back ``target`` when a replacement of it was interrupted between its two renames.

    :func:`publish_folder`, where the filesystem cannot swap two names at once, moves the old
    folder aside (``.<name>.deleting-<host>-<pid>-<n>``) and then renames the complete new one
    (``.<name>.tmp-<host>-<pid>-<n>``, the same numbers) to ``target``. A crash between the two
    leaves ``target`` missing; this renames the new one into place (rolls forward), removes the
    old one, and logs one warning saying so. Only a stale pair (its process is gone:
    :func:`is_stale_temporary`) of real folders owned by this user is touched, and only while
    ``target`` is missing. Returns ``target`` when it restored it, else ``None``. Every writer
    and reader of a name passes here first (:func:`remove_stale_temporaries`,
    :func:`check_output_folder`, :class:`FolderClaim`).
    """
    target = Path(target)
    if os.path.lexists(target) or not target.parent.is_dir():
        return None
    prefix = f".{embedded_name(target)}.tmp-"
    try:
        with os.scandir(target.parent) as entries:
            news = sorted(Path(e.path) for e in entries if e.name.startswith(prefix))
    except OSError:
        return None
    found = [(new, old) for new in news if parse_temporary(new.name) and (old := _pair_of(new)) is not None]
    pairs = [(new, old) for new, old in found if _own_folder(new) and is_stale_temporary(new) and is_stale_temporary(old)]
    if not pairs:
        if found:  # another host's, another user's or a live job's: said, never touched
            _logger().warning(
                f"hf-pma: {escape(target)} is missing while a replacement of it is in its two renames or was "
                f"interrupted there ({escape(found[-1][0].name)} holds its new version): once no job replaces "
                f"it, rename that folder to {escape(target.name)}"
            )
        return None
    new, old = max(pairs, key=lambda pair: pair[0].lstat().st_mtime)  # the latest, should there be more
    try:
        os.rename(new, target)  # onto nothing: fails if another process restored it meanwhile
    except OSError:
        return None
    fsync_dir(target.parent)
    remove_path(old)
    _logger().warning(
        f"hf-pma: restored {escape(target)}: a replacement of it was interrupted between its two renames; "
        f"its new version is in place and the old one ({escape(old.name)}) removed"
    )
    return target


# ---------------------------------------------------------------- confinement


def is_confined(
    path: str | os.PathLike[str], folder: str | os.PathLike[str], allow_self: bool = False
) -> bool:
    """Whether ``path`` resolves, after every symlink, strictly inside ``folder`` (or is ``folder``
    itself, with ``allow_self``). A path that cannot be resolved (a symlink loop) is not confined."""
    try:
        resolved = Path(path).resolve()
        root = Path(folder).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    if resolved == root:
        return allow_self
    return resolved.is_relative_to(root)


def confined_path(folder: str | os.PathLike[str], relative: Any) -> Path:
    """``folder / relative`` for a path read from a file, when it stays inside ``folder``.

    ``relative`` must be a non-empty relative path string without ``..`` components or control
    characters, naming something strictly inside ``folder`` after every symlink. Otherwise ``ValueError`` says why
    in a few words (the caller adds which file and entry it came from). Nothing is read.
    """
    if not isinstance(relative, str) or not relative.strip():
        raise ValueError(f"expected a non-empty relative path, got {shown(relative)}")
    if re.search(r"[\x00-\x1f\x7f]", relative):  # a newline would split a one-line error, an escape the terminal
        raise ValueError(f"the path {shown(relative)} holds a control character")
    parts = relative.replace("\\", "/").split("/")
    if relative.startswith(("/", "\\")) or os.path.isabs(relative) or re.match(r"^[A-Za-z]:", relative):
        raise ValueError(f"the path {shown(relative)} is absolute; it must be relative to {folder}")
    if ".." in parts:
        raise ValueError(f"the path {shown(relative)} leaves {folder} ('..')")
    path = Path(folder) / relative
    try:
        target, root = path.resolve(), Path(folder).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, an unencodable name
        raise ValueError(f"the path {shown(relative)} cannot be resolved ({err})") from None
    if target == root:
        raise ValueError(f"the path {shown(relative)} names {folder} itself, not a folder inside it")
    if not target.is_relative_to(root):
        raise ValueError(f"the path {shown(relative)} resolves to {target}, outside {folder} (a symlink)")
    return path


def is_library_folder(
    path: str | os.PathLike[str],
    marker: str | tuple[str, ...],
    within: str | os.PathLike[str] | None = None,
    name_pattern: str | re.Pattern[str] | None = None,
) -> bool:
    """Whether ``path`` is a folder that hf-pma created, as far as its files can tell.

    It must be a real folder (not a symlink), hold ``marker`` (or one of several) as a regular
    file (not a symlink), have a name matching ``name_pattern`` (a full match) when one is given,
    and lie strictly inside ``within`` (after symlinks) when that is given. What deletes or
    replaces folders asks this first: anything else is the user's and stays as it is.
    """
    path = Path(path)
    markers = (marker,) if isinstance(marker, str) else tuple(marker)
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        if name_pattern is not None and re.fullmatch(name_pattern, path.name) is None:
            return False
        if within is not None and not is_confined(path, within):
            return False
        return any((path / m).is_file() and not (path / m).is_symlink() for m in markers)
    except OSError:
        return False


# ---------------------------------------------------------------- no space left


class NoSpaceError(OSError):
    """The filesystem is full (or a quota is reached) while writing ``path``.

    The message names the target, the bytes it needs (when known) and the bytes free there.
    """

    def __init__(self, path: str | os.PathLike[str], needed: int | None = None, free: int | None = None) -> None:
        self.path, self.needed, self.free = Path(path), needed, free
        parts = [f"no space left on the device to write {self.path}"]
        if needed is not None:
            parts.append(f"it needs {_sized(needed)}")
        if free is not None:
            parts.append(f"{_sized(free)} free in {_existing_parent(self.path)}")
        super().__init__(errno.ENOSPC, "; ".join(parts) + " (free some space or choose another folder)")

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent between ranks (hf_pma.utils.distributed.run_on_main_process) as it was built.
        return type(self), (self.path, self.needed, self.free)


def _sized(n: int) -> str:
    from hf_pma.utils.formatting import format_bytes

    return f"{format_bytes(n)} ({n:,} bytes)"


def _existing_parent(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free for this user on the filesystem of ``path`` (or of its nearest existing parent)."""
    path = Path(path)
    try:
        return shutil.disk_usage(_existing_parent(path.absolute())).free
    except OSError:
        return None


def raise_if_no_space(path: str | os.PathLike[str], needed: int | None) -> None:
    """:class:`NoSpaceError` now when the filesystem of ``path`` has less than ``needed`` bytes free
    (checked before a long write; the write itself still handles a disk that fills up meanwhile)."""
    if needed is None:
        return
    free = free_bytes(Path(path))
    if free is not None and free < needed:
        raise NoSpaceError(path, needed, free)


@contextmanager
def no_space_errors(target: Path, needed: int | None) -> Iterator[None]:
    """Turn ``ENOSPC`` / ``EDQUOT`` raised inside the block into :class:`NoSpaceError`."""
    try:
        yield
    except NoSpaceError:
        raise
    except OSError as err:
        if err.errno not in _NO_SPACE_ERRNOS:
            raise
        raise NoSpaceError(target, needed, free_bytes(target)) from err


# ---------------------------------------------------------------- durable writes


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


def _new_temporary_file(target: Path) -> Path:
    """Create an empty temporary file beside ``target``, exclusively and never through a link
    (``O_CREAT | O_EXCL | O_NOFOLLOW``): something already at a temporary name (a link planted
    there) is never written through; the next name is tried."""
    for _ in range(100):
        tmp = temporary_path(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"cannot create a temporary file beside {escape(target)}: every name tried exists")


def atomic_write_file(path: str | os.PathLike[str], write: Callable[[Path], T], needed: int | None = None) -> T:
    """Run ``write(tmp)`` on a temporary file name beside ``path``, fsync it, rename it into place.

    ``write`` writes the file (a plot's ``savefig``, ...), which already exists, empty: created
    exclusively and never through a symbolic link (a link planted at a temporary name is never
    followed; see :func:`temporary_path` for the names). On any error the temporary is
    removed; running out of space raises :class:`NoSpaceError`. The file is readable by others
    (mode 0644 less the umask), like a file that ``open()`` creates. Returns ``write``'s result.
    """
    path = Path(path)
    tmp: Path | None = None
    try:
        with no_space_errors(path, needed):
            tmp = _new_temporary_file(path)
            result = write(tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:  # Ctrl-C included: no temporary is left behind
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return result


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write text to ``path`` atomically (see :func:`atomic_write_file`)."""
    data = text.encode("utf-8")
    atomic_write_file(path, lambda tmp: tmp.write_bytes(data), needed=len(data))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON to ``path`` atomically (see :func:`atomic_write_file`), with every access token
    redacted first (:func:`hf_pma.utils.secrets.redact_obj`: by name and by value)."""
    from hf_pma.utils.secrets import redact_obj

    atomic_write_text(path, json.dumps(redact_obj(obj), indent=2, sort_keys=False) + "\n")


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a folder by renaming it aside first, so a crash never leaves half a snapshot."""
    path = Path(path)
    if not path.exists():
        return
    doomed = temporary_path(path, "deleting")
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def publish_folder(
    tmp: str | os.PathLike[str],
    final_dir: str | os.PathLike[str],
    replace: bool = True,
    check_replaced: Callable[[Path], None] | None = None,
) -> Path:
    """Rename the complete folder ``tmp`` to ``final_dir`` durably; an old ``final_dir`` is deleted
    only after the new one is in place, and a crash at any point leaves ``final_dir`` whole.

    The two are swapped in one step where the filesystem can (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``): ``final_dir`` never goes missing, and the old one, left under the
    temporary name by a crash, is removed as a stale temporary. Elsewhere (a filesystem that
    refuses the swap, such as NFS; other systems) the old one is moved aside under the new one's
    numbers first; a crash between the two renames leaves that pair, and the next command that touches ``final_dir`` renames the
    new one into place (:func:`restore_interrupted`).

    With ``replace=False`` an existing non-empty ``final_dir`` is never replaced: the rename
    fails (the kernel refuses to rename a folder onto a non-empty one, atomically) and
    :class:`OutputExistsError` names it; ``tmp`` is left for the caller to remove.
    ``check_replaced(final_dir)`` runs just before an existing ``final_dir`` is replaced, and
    raises to keep it: what ``--overwrite`` may replace was checked before a work of minutes or
    hours, while which the user may have put a file into it
    (:func:`hf_pma.core.outputs.check_overwrite_target`, again).
    """
    tmp, final_dir = Path(tmp), Path(final_dir)
    fsync_tree(tmp)
    if replace and check_replaced is not None and os.path.lexists(final_dir):
        check_replaced(final_dir)
    if not replace:
        try:
            os.rename(tmp, final_dir)  # onto nothing or an empty folder; never onto a non-empty one
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise OutputExistsError(
                f"output folder {final_dir} was created by another process while this one was writing it; "
                "it was left as it is (pass overwrite=True / --overwrite to replace it)"
            ) from None
        fsync_dir(final_dir.parent)
        return final_dir
    if not os.path.lexists(final_dir):
        os.replace(tmp, final_dir)
        fsync_dir(final_dir.parent)
        return final_dir
    tmp = _paired_temporary(tmp, final_dir)  # whatever a crash leaves is then a temporary of this library
    if not _exchange(tmp, final_dir):
        _replace_by_two_renames(tmp, final_dir)
        return final_dir
    fsync_dir(final_dir.parent)  # one step: the name never went missing; the old one is now at tmp
    remove_path(tmp)
    return final_dir


def _paired_temporary(tmp: Path, final_dir: Path) -> Path:
    """``tmp`` under a temporary name of this process beside ``final_dir`` (renamed to one if it
    has another name, such as the folder the ranks write a sharded snapshot into), so that the old
    folder moved aside can take its numbers (:func:`_pair_of`), and the old one swapped to it is
    removed as a stale temporary after a crash."""
    info = parse_temporary(tmp.name)
    mine = info is not None and info["kind"] == "tmp" and info["host"] == _host() and info["pid"] == os.getpid()
    if mine and tmp.parent == final_dir.parent and info["name"] == embedded_name(final_dir):
        return tmp
    named = temporary_path(final_dir)
    os.rename(tmp, named)
    fsync_dir(final_dir.parent)
    return named


def _replace_by_two_renames(tmp: Path, final_dir: Path) -> None:
    """Replace ``final_dir`` by the complete folder ``tmp`` where names cannot be swapped at once:
    the old one is moved aside under the new one's numbers (``.<name>.deleting-<host>-<pid>-<n>``
    beside ``.<name>.tmp-<host>-<pid>-<n>``), then the new one is renamed into place. A crash
    between the two leaves that pair, which :func:`restore_interrupted` completes."""
    old = _pair_name(tmp)
    if os.path.lexists(old):
        raise FileExistsError(f"cannot move {escape(final_dir)} aside: {escape(old)} exists; remove it and try again")
    os.rename(final_dir, old)
    try:
        _rename_into_place(tmp, final_dir)
    except BaseException:  # Ctrl-C or an error between the two renames: the old folder goes back
        if os.path.lexists(old) and not os.path.lexists(final_dir):
            os.rename(old, final_dir)
        raise
    fsync_dir(final_dir.parent)
    remove_path(old)


def _rename_into_place(tmp: Path, final_dir: Path) -> None:
    """The second rename of :func:`_replace_by_two_renames` (a function of its own: tests stop a
    process right before it)."""
    os.rename(tmp, final_dir)


def _pair_name(tmp: Path) -> Path:
    """The ``deleting`` temporary name with the numbers of the ``tmp`` temporary ``tmp``."""
    match = _TEMP_RE.fullmatch(tmp.name)
    assert match is not None and match["kind"] == "tmp", tmp  # _paired_temporary made it so
    return tmp.with_name(f".{match['name']}.deleting-{match['host']}-{match['pid']}-{match['n']}")


# Linux's renameat2() flag that swaps two names in one step (ext4, xfs, btrfs, tmpfs; NFS and
# other filesystems refuse it, other systems have no renameat2: :func:`_replace_by_two_renames`).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSWAPPABLE_ERRNOS = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


@functools.lru_cache(maxsize=1)
def _renameat2() -> Callable[..., int] | None:
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, ImportError):  # no libc symbol (not glibc >= 2.28, not Linux)
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def _exchange(first: Path, second: Path) -> bool:
    """Swap the names ``first`` and ``second`` atomically; ``False`` (nothing done) where the system
    or the filesystem cannot."""
    function = _renameat2()
    if function is None:
        return False
    import ctypes

    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSWAPPABLE_ERRNOS:
        return False
    raise OSError(err, os.strerror(err), str(first), None, str(second))


def write_folder_atomically(
    final_dir: str | os.PathLike[str],
    write: Callable[[Path], Any],
    needed: int | None = None,
    *,
    overwrite: bool | None = None,
    check_replaced: Callable[[Path], None] | None = None,
) -> Path:
    """Run ``write(tmp)`` on a temporary folder beside ``final_dir``, fsync it, rename it into place.

    ``final_dir`` either does not exist or is complete: a crash leaves at most a temporary
    folder, removed by the next write to ``final_dir`` (:func:`remove_stale_temporaries`), never a
    half-written ``final_dir``; a replacement killed between its two renames is completed first
    (:func:`restore_interrupted`). ``needed`` (bytes, when known) is checked against the free space
    first; running out of space raises :class:`NoSpaceError` and leaves nothing behind.

    ``overwrite=None`` (the library's own folders: snapshots, caches): an existing ``final_dir``
    is replaced. ``True`` / ``False`` (a user's output): the folder is claimed exclusively while
    it is written (:func:`claim_output`: a second job stops with :class:`OutputBusyError`), and
    an existing non-empty ``final_dir`` is replaced only with ``overwrite=True``, and only when
    ``check_replaced(final_dir)`` (:func:`publish_folder`) raises nothing just before.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with claim_output(final_dir, overwrite) if overwrite is not None else contextlib.nullcontext():
        remove_stale_temporaries(final_dir.parent, final_dir.name)
        raise_if_no_space(final_dir, needed)
        tmp = temporary_path(final_dir)
        try:
            with no_space_errors(final_dir, needed):
                tmp.mkdir()
                write(tmp)
                publish_folder(tmp, final_dir, replace=overwrite is not False, check_replaced=check_replaced)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final_dir


# ---------------------------------------------------------------- exclusive outputs


class OutputExistsError(FileExistsError):
    """The output folder exists (not empty) and may not be replaced."""


class OutputBusyError(FileExistsError):
    """Another live process is writing the same output folder (named with its host and pid)."""


def claim_path(final_dir: str | os.PathLike[str]) -> Path:
    """The claim file of an output folder: ``.<name>.claim`` beside it (``<name>`` shortened to
    fit the file-name limit: :func:`embedded_name`), after every link and ``..``: a folder named
    through a link to it (``latest``) or as ``M/sub/..`` has the claim of the folder itself, not
    a second one that a writer of the folder would not meet."""
    final_dir = Path(os.path.realpath(final_dir))
    return final_dir.with_name(f".{embedded_name(final_dir)}.claim")


class NoFileLocksError(OSError):
    """The filesystem of a claim file gives no file locks (``flock`` fails with ``ENOLCK``,
    ``EOPNOTSUPP``...: Lustre without ``-o flock``, NFS without lockd). Claims no longer raise it
    (the claim file itself is the lock there: :func:`_take_file_lock`); kept for callers that
    catch it."""

    def __init__(self, path: Path, what: str, final_dir: Path, why: str) -> None:
        self.path = path
        super().__init__(
            errno.ENOLCK,
            f"cannot claim {what} {escape(final_dir)}: the filesystem of {escape(path)} gives no file locks ({why}), "
            "so hf-pma cannot keep two writers apart there; use a filesystem with locks (Lustre with -o flock, "
            "NFS with lockd) or another folder",
        )

    def __str__(self) -> str:
        return str(self.strerror)


# flock errors that mean "this filesystem has no file locks", not "held by another process".
_NO_LOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


# ---------------------------------------------------------------- who holds a claim


def _boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): a pid recorded before a reboot names no process of now."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, field 22 of ``/proc/<pid>/stat``);
    ``None`` when it does not exist or this cannot be read. A pid and its start time name one
    process of a boot: a pid reused by another process has another start time."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])  # after "(comm)", which may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _claim_identity() -> dict[str, Any]:
    """What a claim records of its holder: host, pid, the pid's start time and the boot id."""
    pid = os.getpid()
    return {"host": _host(), "pid": pid, "start_ticks": process_start_ticks(pid), "boot_id": _boot_id(), "started": time.time()}


def recorded_holder_state(info: dict[str, Any]) -> str:
    """Whether the process a claim records (``{"host", "pid", "start_ticks", "boot_id"}``) is
    ``"alive"``, ``"gone"`` (ended, or its pid now belongs to another process, or recorded before
    this boot) or ``"unknown"`` (another host, or a record without a start time)."""
    state = _holder_state(info)
    return "gone" if state == "other boot" else state


def _holder_state(info: dict[str, Any]) -> str:
    """:func:`recorded_holder_state`, telling ``"other boot"`` apart: a boot id other than this
    one's is a reboot since, or another machine of the same host name, which only a lock can tell."""
    if info.get("host") != _host():
        return "unknown"
    pid = info.get("pid")
    if not is_int(pid) or not 0 < pid <= _PID_MAX:
        return "unknown"
    boot = _boot_id()
    if isinstance(info.get("boot_id"), str) and boot is not None and info["boot_id"] != boot:
        return "other boot"
    ticks = process_start_ticks(pid)
    if ticks is None:
        return "gone" if not _pid_alive(pid) else "unknown"
    if is_int(info.get("start_ticks")):
        return "alive" if info["start_ticks"] == ticks else "gone"
    return "unknown"


def _claim_record(fd: int) -> dict[str, Any] | None:
    """The holder a claim file records (``{"host", "pid", ...}``), ``None`` when it records none."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
        return None
    if not isinstance(info, dict) or not isinstance(info.get("host"), str) or "pid" not in info:
        return None
    return info


def _claim_holder(fd: int, path: Path) -> str:
    """Who holds the claim file open on ``fd`` (locked by another process), for an error."""
    return _holder_words(_claim_record(fd), path)


def _holder_words(info: dict[str, Any] | None, path: Path, file_lock: bool = False) -> str:
    """Who holds the claim file ``path`` by its record ``info``, for an error: the recorded holder
    when it is alive; otherwise (gone, or it cannot be told) the claim file to remove once no
    process of that job is left. ``file_lock``: the claim is the file itself (no ``flock`` there)."""
    if info is None:
        if file_lock:
            return f"a process that has not said which yet: if no job of yours is running there, remove {escape(path)}"
        return "processes reading it, or one that has not said which yet"
    who = f"host {escape(info['host'])}, pid {escape(info['pid'])}"
    state = _holder_state(info)
    if state == "alive":
        return who
    if info["host"] != _host():
        return f"{who}, on another host, which hf-pma cannot check: if that process is gone, remove {escape(path)}"
    if state == "other boot":  # it is held now, so not simply "ended": a machine of the same name?
        return (
            f"{who}, recorded by another boot of this host name (a reboot since, or another machine named so), "
            f"which hf-pma cannot check: if that process is gone, remove {escape(path)}"
        )
    if state == "gone" and file_lock:  # taken over at once, unless another process is doing so
        guard = path.with_name(f"{path.name}.takeover")
        return f"{who}, which has ended; another process is taking its lock over: if none is, remove {escape(guard)}"
    if state == "gone":
        return (
            f"{who}, which has ended (its pid may now be another process's), yet a process it started still holds "
            f"the lock: once none is left, remove {escape(path)}"
        )
    return f"{who}, which hf-pma cannot check: if that process is gone, remove {escape(path)}"


# Whether to wait for a claim: the output claims (a merge's or consolidation's output folder, a
# training's snapshot folder) are refused at once, because their holders work for minutes to
# hours and a second job would replace, or be mixed into, the first one's result. The short
# read-modify-write sections (a manifest entry, the eval record, the card) and the readers of a
# folder (a model being loaded, a folder being pushed) wait up to CLAIM_WAIT_S: their holders
# finish in milliseconds (a reader in seconds), and refusing would throw away what the waiting
# command computed (an evaluation of hours); a holder still there after the wait (a merge
# writing that folder, a training) is named in the error.
CLAIM_WAIT_S = 30.0
# A waiter says why it waits once it has waited this long.
_ANNOUNCE_WAIT_S = 0.5

# The claims this process holds, by claim file: {key: [fd, count, shared, file_lock, folder]}
# (``folder``: a pinned claim's folder identity, (st_dev, st_ino), or False before it is made;
# None for a claim that is not pinned). A claim taken again
# by this process while it holds it (a manifest entry written by the training that holds its run
# folder, the card of a merge being written) goes on at once.
_HELD: dict[str, list[Any]] = {}
_HELD_LOCK = threading.Lock()
# Why a claim file cannot be made beside a folder where nothing of hf-pma's could race either.
_UNCLAIMABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR)


def _forget_claims_in_child() -> None:
    """In a forked child (a DataLoader worker, a ``fork`` pool): close the claim files it inherited.
    The parent keeps its locks; a child that outlives a killed parent no longer holds them."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()  # another thread may have held it at the fork
    for fd, *_ in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_claims_in_child)


def _release_lock_files_at_exit() -> None:
    """At a normal exit, remove the lock files this process still holds (no ``flock`` there: the
    kernel releases nothing). A killed process leaves them, naming itself: taken over next time."""
    with _HELD_LOCK:
        held = [(key, entry) for key, entry in _HELD.items() if entry[3]]
        for key, _ in held:
            del _HELD[key]
    for key, entry in held:
        _release_file_lock(Path(key), entry[0])


atexit.register(_release_lock_files_at_exit)


def _claim_key(path: Path) -> str:
    try:
        return os.path.join(os.path.realpath(path.parent), path.name)
    except (OSError, ValueError):
        return os.path.abspath(path)


def _write_claim_record(fd: int) -> None:
    # Written over, then cut to its length: never truncated to 0 first, which makes ext4 flush
    # the file at close (its guard for files replaced by truncation), milliseconds per claim.
    # On a full disk the lock holds without it (a waiter is told "one that has not said which").
    data = json.dumps(_claim_identity()).encode()
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError as err:
        if err.errno not in _NO_SPACE_ERRNOS:
            raise
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)


def _is_current_claim(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (its holder may remove it between our open and our lock)."""
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return mine.st_nlink > 0 and (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _release_claim(path: Path, fd: int, shared: bool = False, file_lock: bool = False) -> None:
    """Unlock and close ``fd``, removing the claim file first when no other process holds it: an
    exclusive holder is the only one; a shared one removes it only when it can lock it exclusively
    at once (the last reader). A waiter that opened the removed file sees it gone and opens anew.
    A lock file (``file_lock``: no ``flock`` there) goes only while it is still this process's."""
    import fcntl

    if file_lock:
        _release_file_lock(path, fd)
        return
    try:
        if shared:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another reader holds it: it stays
        if _is_current_claim(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def _register(key: str, fd: int, shared: bool, file_lock: bool = False) -> None:
    with _HELD_LOCK:
        _HELD[key] = [fd, 1, shared, file_lock, None]


def _unregister(key: str, fd: int) -> bool:
    """Forget ``fd`` as this process's claim ``key``; whether it was (a forked child's is not)."""
    with _HELD_LOCK:
        if _HELD.get(key, [None])[0] != fd:
            return False
        del _HELD[key]
        return True


@contextmanager
def claim_output(final_dir: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Hold an exclusive claim on the output folder ``final_dir`` while it is written.

    Two jobs aiming at the same output never both succeed: the claim is an exclusive
    ``flock`` on ``.<name>.claim`` beside ``final_dir`` (released by the kernel when its process
    dies, so a killed job never blocks the next one), which records the holder's host, pid, the
    pid's start time and the boot id. A second job does not wait: it stops at once with
    :class:`OutputBusyError` naming the folder and the holder (a merge can take hours, and its
    result would replace or be replaced by the other's). On a filesystem without ``flock`` the
    claim file, made exclusively, is the lock (:func:`_take_file_lock`), never interleaving.
    Once claimed, :func:`check_output_folder` runs again (a job that finished meanwhile left a
    non-empty folder). Publish with ``publish_folder(tmp, final_dir, replace=overwrite)`` inside
    the block. The claim file is removed on release. Yields ``final_dir``. The same claim guards
    the folder's records (:func:`hold_claim`) and its readers (:func:`read_claim`): a card, an
    eval record or a model load meanwhile waits.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    path = claim_path(final_dir)
    key = _claim_key(path)
    # Never re-entrant: a second claim in this process is refused too.
    fd, file_lock = _acquire_claim(path, final_dir)
    try:
        if not file_lock:  # a lock file recorded its holder as it was made
            _write_claim_record(fd)
        _register(key, fd, False, file_lock)
    except BaseException:
        _release_claim(path, fd, file_lock=file_lock)
        raise
    try:
        check_output_folder(final_dir, overwrite)
        yield final_dir
    finally:
        if _unregister(key, fd):
            _release_claim(path, fd, file_lock=file_lock)


class FolderClaim:
    """A claim on ``folder`` held by this process: the claim of :func:`claim_output` (an
    ``flock`` on ``.<name>.claim`` beside the folder, recording host, pid, the pid's start time
    and the boot id), taken for as long as a job works on the folder, not only while it is written.

    Exclusive (the default) for a writer: a training holds its snapshot folder's
    (:class:`hf_pma.PMACallback`, from train begin to train end); every read-modify-write of a
    record in a folder (manifest, eval record, card) holds it for that section
    (:func:`hold_claim`). Shared (``shared=True``) for a reader of a whole folder (a model
    loaded for evaluation, a folder pushed: :func:`read_claim`): readers go on together, and see
    one version of the folder, since a writer replacing it waits for them or they for it.
    Within one process the claim is re-entrant (threads of a process share it: they order their
    own writes); another process waits up to ``wait`` seconds, then gets
    :class:`OutputBusyError` naming the folder and the holder (its host and pid; when that
    process is gone or cannot be checked, the claim file to remove). The kernel releases the
    ``flock`` when the holder dies (and a forked child does not keep it: it closes the claims
    it inherited). On a filesystem without ``flock`` the claim file itself is the lock, made
    exclusively (:func:`_take_file_lock`: a dead holder on this host is taken over, any other
    named with the file to remove); a reader there waits for a writer and goes on without
    holding it. A writable folder whose parent cannot be written keeps its claim in this user's
    private folder under ``/tmp`` (:func:`claim_file_of`), said once. A folder that cannot be
    written itself is not claimed: nothing could race there that hf-pma writes.

    Args:
        folder: the folder to claim.
        what: how an error names it (``"snapshot folder"``).
        busy: what the holder is doing, for the error (``"is in use by another training"``).
        shared: a reader's claim, held together with other readers' (not with a writer's).
        pin: record the folder's identity (``st_dev``, ``st_ino``) when claimed, or when first
            seen once claimed: :meth:`check`, and every re-entry of the claim (a manifest entry
            of the training holding it), stop with :class:`FolderMovedError` once the folder at
            that path is another one, or none (moved, removed).
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        what: str = "folder",
        busy: str = "is being written by another process",
        shared: bool = False,
        pin: bool = False,
    ) -> None:
        self.folder = Path(folder).absolute()
        self.path = claim_path(self.folder)
        self.what = what
        self.busy = busy
        self.shared = shared
        self.pin = pin
        self._key = _claim_key(self.path)
        self._held = False

    @property
    def held(self) -> bool:
        """Whether this object holds the claim now."""
        return self._held

    def acquire(self, wait: float = 0.0) -> FolderClaim:
        """Take the claim, waiting up to ``wait`` seconds for another process to release it."""
        if self._held:
            return self
        restore_interrupted(self.folder)  # a reader or writer never meets a name a crash left missing
        self.path = claim_file_of(self.folder)  # beside it, or away from a read-only parent
        self._key = _claim_key(self.path)
        with _HELD_LOCK:
            entry = _HELD.get(self._key)
            if entry is not None:
                if entry[2] and not self.shared:  # an upgrade would let a writer in between: a bug of ours
                    raise RuntimeError(f"hf-pma: {escape(self.folder)} is read under a shared claim; it cannot be written meanwhile")
                _check_pinned(entry, self.folder, self.what)
                entry[1] += 1
                self._held = True
                return self
        try:
            fd, file_lock = _acquire_claim(
                self.path, self.folder, wait=wait, what=self.what, busy=self.busy, shared=self.shared
            )
        except OSError as err:
            if isinstance(err, FileExistsError) or err.errno not in _UNCLAIMABLE_ERRNOS:
                raise  # held by another process, a planted claim file: refused
            _logger().debug(f"hf-pma: no claim on {escape(self.folder)} ({escape(err)})")
            return self  # not held: a folder in a place that cannot be written, or not there yet
        if self.shared and file_lock:
            # Without flock a reader waited for any writer, and goes on without holding the file:
            # readers of a folder do not queue behind one another (a model load takes minutes).
            _release_claim(self.path, fd, file_lock=True)
            return self
        try:
            if file_lock:
                pass  # the lock file recorded its holder as it was made
            elif not self.shared:
                _write_claim_record(fd)
            elif os.fstat(fd).st_size:
                with contextlib.suppress(OSError):  # readers record no one: a holder that died is not named
                    os.ftruncate(fd, 0)
        except BaseException:
            _release_claim(self.path, fd, self.shared)
            raise
        _register(self._key, fd, self.shared, file_lock)
        if self.pin:
            with _HELD_LOCK:
                _HELD[self._key][4] = _folder_identity(self.folder) or False
        self._held = True
        return self

    def check(self) -> None:
        """Raise :class:`FolderMovedError` when the folder at this claim's path is no longer the
        one claimed (``pin``: moved or removed while held); nothing when unpinned or not held."""
        if not self._held:
            return
        with _HELD_LOCK:
            entry = _HELD.get(self._key)
            if entry is not None:
                _check_pinned(entry, self.folder, self.what)

    def release(self) -> None:
        """Give the claim back (the claim file is removed when this was its last holder)."""
        if not self._held:
            return
        self._held = False
        with _HELD_LOCK:
            entry = _HELD.get(self._key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _HELD[self._key]
        _release_claim(self.path, entry[0], entry[2], entry[3])

    def __enter__(self) -> FolderClaim:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a job that never reached its end (an exception in training)
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the kernel releases it anyway
            pass


@contextmanager
def hold_claim(
    folder: str | os.PathLike[str], wait: float = CLAIM_WAIT_S, what: str = "folder"
) -> Iterator[Path]:
    """Hold ``folder``'s claim (:class:`FolderClaim`) for a short read-modify-write of a record in it,
    waiting up to ``wait`` seconds for another process's section (or job) to end. Yields the folder."""
    claim = FolderClaim(folder, what=what).acquire(wait)
    try:
        yield claim.folder
    finally:
        claim.release()


@contextmanager
def read_claim(
    folder: str | os.PathLike[str], wait: float = CLAIM_WAIT_S, what: str = "folder"
) -> Iterator[Path]:
    """Hold ``folder``'s claim shared while reading the whole folder (loading a model, pushing it):
    other readers go on, a writer replacing it (``merge --overwrite``) waits, and a reader that
    meets one waits up to ``wait`` seconds. Yields the folder."""
    claim = FolderClaim(folder, what=what, shared=True).acquire(wait)
    try:
        yield claim.folder
    finally:
        claim.release()


def holds_claim(folder: str | os.PathLike[str]) -> bool:
    """Whether this process holds ``folder``'s claim now."""
    folder = Path(folder).absolute()
    with _HELD_LOCK:
        return _claim_key(claim_path(folder)) in _HELD or _claim_key(claim_file_of(folder)) in _HELD


def check_claimed_folder(folder: str | os.PathLike[str], what: str = "snapshot folder") -> None:
    """Before writing into ``folder``: :class:`FolderMovedError` when this process holds its claim,
    pinned (a training's snapshot folder), and the folder at that path is no longer the one
    claimed. Nothing otherwise (not held here, not pinned)."""
    folder = Path(folder).absolute()
    if not _HELD:
        return
    # The claim as it was taken, by the folder's name: a link put at that name since resolves elsewhere.
    by_name = Path(os.path.realpath(folder.parent)) / f".{embedded_name(folder)}.claim"
    keys = (_claim_key(claim_path(folder)), _claim_key(claim_file_of(folder)), _claim_key(by_name))
    with _HELD_LOCK:
        entry = next((_HELD[key] for key in keys if key in _HELD), None)
        if entry is not None:
            _check_pinned(entry, folder, what)


class FolderMovedError(RuntimeError):
    """The folder a job claimed (a training's snapshot folder) is no longer at its path: moved or
    removed while held, or another folder there now. Writing on would start a new run there."""


def _folder_identity(folder: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(folder)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


def _check_pinned(entry: list[Any], folder: Path, what: str) -> None:
    """A pinned claim's folder check (``entry``: its :data:`_HELD` entry; ``_HELD_LOCK`` held):
    unpinned (``None``) passes; the first sight of the folder (``False``: not made when claimed)
    records its identity; later, another folder or none stops the job."""
    if entry[4] is None:
        return
    now = _folder_identity(folder)
    if entry[4] is False:
        entry[4] = now or False
        return
    if now != entry[4]:
        how = "is gone" if now is None else "is another folder now"
        raise FolderMovedError(
            f"{what} {escape(folder)} {how}: it was moved or removed while this job held it; hf-pma stops rather than "
            "start over there: move it back (then resume), or start a new run"
        )


# Folders whose claim is kept away from them (a read-only parent), said once each.
_PLACES_SAID: set[str] = set()


def claim_file_of(folder: str | os.PathLike[str]) -> Path:
    """Where ``folder``'s claim file is: :func:`claim_path`, beside it; but for a writable folder
    whose parent is not writable (its records can be written, no file beside it can), this user's
    private ``/tmp/hf-pma-claims-<uid>/<st_dev>-<st_ino>.claim``, keyed by the folder's identity
    (not its name). Processes on other hosts do not see that one: said once per folder."""
    folder = Path(folder).absolute()
    beside = claim_path(folder)
    if os.access(beside.parent, os.W_OK | os.X_OK) or not os.access(folder, os.W_OK | os.X_OK):
        return beside
    identity = _folder_identity(Path(os.path.realpath(folder)))
    if identity is None:
        return beside
    place = _private_claims_dir() / f"{identity[0]:x}-{identity[1]:x}.claim"
    if str(folder) not in _PLACES_SAID:
        _PLACES_SAID.add(str(folder))
        _logger().warning(
            f"hf-pma: {escape(beside.parent)} is read-only, so the claim of {escape(folder)} is kept in {escape(place)}: "
            "jobs on other hosts writing that folder are not kept apart"
        )
    return place


def _private_claims_dir() -> Path:
    """This user's folder of claims kept away from their folders: ``/tmp/hf-pma-claims-<uid>``
    (``/tmp``, not ``$TMPDIR``: every job of the host must find the same one), 0700, its own."""
    place = Path("/tmp") / f"hf-pma-claims-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        place.mkdir(mode=0o700)
    info = os.lstat(place)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"refusing {escape(place)} as the folder of claims: it is not a private folder of this user (a link, "
            "another owner, or open to others); remove it"
        )
    return place


def _open_claim(path: Path, final_dir: Path, what: str = "output folder", shared: bool = False) -> tuple[int, bool] | None:
    """Open (creating it) the claim file ``path`` of ``final_dir``, never through a symbolic link,
    and only when it is a regular file of its own (one link): the claim is truncated and written,
    so anything else (a link or a hard link to another file, a FIFO, a folder) is refused in one
    line naming it. The open file, and whether this open made it (exclusively: it is then this
    process's alone, a lock by itself where there is no ``flock``). ``None`` when its holder
    removed it meanwhile (no links left: open it anew). A reader in a place it cannot write
    opens an existing claim file read-only."""
    refused = (
        f"the claim file {escape(path)} of {what} {escape(final_dir)} is not a regular file that hf-pma "
        "made ({}); remove it or choose another output folder"
    )
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    created = False
    try:
        try:
            # Readable by its owner only: another user could otherwise lock it (even read-only) and hold it.
            try:
                fd, created = os.open(path, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                fd = os.open(path, flags | os.O_RDWR)
        except FileNotFoundError:
            if path.parent.is_dir():
                return None  # removed by its holder between our two opens: open anew
            raise
        except OSError as err:
            if not shared or err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            fd = os.open(path, flags | os.O_RDONLY)  # ENOENT: no claim there, none could be made
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(path) and os.access(path.parent, os.W_OK | os.X_OK):
            # Not a read-only place: another user's claim file, which this job must not go around.
            raise OutputBusyError(
                f"{what} {escape(final_dir)}: its claim file {escape(path)} belongs to another user ({err.strerror}); "
                f"that user's job holds it or left it: once it is done, remove {escape(path)}, or choose another folder"
            ) from None
        if err.errno == errno.ELOOP or (err.errno == errno.EMLINK and path.is_symlink()):
            raise FileExistsError(refused.format("a symbolic link")) from None
        if err.errno in (errno.EISDIR, errno.ENXIO):
            raise FileExistsError(refused.format("a folder" if err.errno == errno.EISDIR else "a special file")) from None
        raise
    info = os.fstat(fd)
    why = None if stat.S_ISREG(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a special file"
    if why is None and info.st_nlink == 0:
        os.close(fd)
        return None
    if why is None and info.st_nlink != 1:
        why = f"a file with {info.st_nlink} hard links"
    if why is not None:
        os.close(fd)
        raise FileExistsError(refused.format(why))
    return fd, created


def _acquire_claim(
    path: Path,
    final_dir: Path,
    wait: float = 0.0,
    what: str = "output folder",
    busy: str = "is being written by another process",
    shared: bool = False,
) -> tuple[int, bool]:
    """Open and lock the claim file ``path`` of ``final_dir`` (shared or exclusive): the open file
    once locked, and whether the lock is the file itself (no ``flock`` on that filesystem).

    Waits up to ``wait`` seconds for a holder to release it (in the kernel's queue of waiters:
    :func:`_lock_within`), then raises :class:`OutputBusyError`: ``<what> <final_dir> <busy>
    (<holder>)``. A claim file that its holder removed between our open and our lock is opened
    anew, so a waiter only ever holds the file at ``path``. Where ``flock`` fails (``ENOLCK``...:
    Lustre without ``-o flock``, NFS without lockd) the claim file, made exclusively, is the lock
    (:func:`_take_file_lock`); a holder of that kind is respected here too (mixed mounts)."""
    import fcntl

    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    waiter = _ClaimWait(wait, what, final_dir, busy)
    while True:
        opened = _open_claim(path, final_dir, what, shared)
        if opened is None:
            continue  # removed by its holder just now: the next open makes or finds the current one
        fd, created = opened
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = _claim_holder(fd, path)
            now = time.monotonic()
            if now >= waiter.deadline:
                os.close(fd)
                raise OutputBusyError(waiter.message(holder)) from None
            waiter.announce(holder, now)
            until = waiter.deadline if waiter.announce_at is None else min(waiter.deadline, waiter.announce_at)
            try:
                locked = _lock_within(fd, mode, until - now)
            except OSError as err:
                _refuse_lock_error(fd, path, what, final_dir, err)
            if not locked:
                continue  # the wait's thread owns fd now; look again (and announce, or give up)
        except OSError as err:
            if err.errno not in _NO_LOCK_ERRNOS:
                _refuse_lock_error(fd, path, what, final_dir, err)
            return _without_flock(fd, created, path, final_dir, waiter), True
        if not _is_current_claim(fd, path):
            os.close(fd)  # the holder released (and removed) it between our open and our lock: retry
            continue
        info = _claim_record(fd)
        if _is_file_lock(info) and _holder_state(info) != "gone":
            os.close(fd)  # held by a process whose mount has no flock: the file is its lock
            waiter.pause(_holder_words(info, path, file_lock=True))
            continue
        return fd, False


class _ClaimWait:
    """A claim's wait for another holder: its deadline, one line saying why once it lasts, and
    (where the claim is polled: a lock file) a pause that doubles up to :data:`_POLL_MAX_S`."""

    def __init__(self, wait: float, what: str, final_dir: Path, busy: str) -> None:
        start = time.monotonic()
        self.wait, self.what, self.final_dir, self.busy = wait, what, final_dir, busy
        self.start, self.deadline, self.announce_at = start, start + wait, start + _ANNOUNCE_WAIT_S
        self.delay = _POLL_FIRST_S

    def message(self, holder: str) -> str:
        return _busy_message(self.what, self.final_dir, self.busy, holder, self.wait)

    def announce(self, holder: str, now: float) -> None:
        if self.announce_at is not None and now >= self.announce_at:  # a wait that may be long says why, once
            self.announce_at = None
            _logger().warning(
                f"hf-pma: {self.what} {escape(self.final_dir)} {self.busy} ({holder}); waiting up to {self.wait:g}s"
            )

    def pause(self, holder: str, grace: float = 0.0) -> None:
        """Wait a little for ``holder``; :class:`OutputBusyError` once the wait (at least ``grace``) is over."""
        now = time.monotonic()
        until = max(self.deadline, self.start + grace)
        if now >= until:
            raise OutputBusyError(self.message(holder))
        self.announce(holder, now)
        time.sleep(min(self.delay, until - now))
        self.delay = min(2 * self.delay, _POLL_MAX_S)


# ---------------------------------------------------------------- a claim without flock: the file is the lock

# Polling a lock file: the first pause, and the longest (a holder's section lasts milliseconds).
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05
# A takeover of a dead holder's lock file takes microseconds: another taker gives it this long.
_TAKEOVER_GRACE_S = 2.0
# An empty lock file or takeover guard this old was left by a process killed between making it
# and writing its record (microseconds apart).
_EMPTY_FILE_STALE_S = 10.0


def _is_file_lock(info: dict[str, Any] | None) -> bool:
    """Whether a claim record is a lock file's (made where ``flock`` fails): the file is the lock."""
    return isinstance(info, dict) and info.get("lock") == "file"


def _without_flock(fd: int, created: bool, path: Path, final_dir: Path, waiter: _ClaimWait) -> int:
    """The claim where ``flock`` fails on ``fd``: the claim file itself, made exclusively. The
    file this open made is already this process's (it records so now); another one is waited
    for, or taken over from a dead holder (:func:`_take_file_lock`)."""
    if created:
        _write_file_lock_record(fd, path)
        return fd
    os.close(fd)
    return _take_file_lock(path, final_dir, waiter)


def _take_file_lock(path: Path, final_dir: Path, waiter: _ClaimWait) -> int:
    """Take the lock file ``path`` (as git's ``index.lock``): made with ``O_CREAT|O_EXCL|O_NOFOLLOW``
    (0600), recording host, pid, the pid's start time and the boot id. A live holder is waited
    for (polled) and then named; a holder on another host, of another boot or unknown is named
    with the file to remove; a dead holder on this host is taken over (:func:`_take_over`)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    while True:
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            found = _read_lock_file(path, waiter)
            if found is None:
                continue  # released meanwhile: make it anew
            info, identity = found
            words = _holder_words(info, path, file_lock=True)
            if (info is not None and _holder_state(info) == "gone") or (info is None and _left_empty(path, identity)):
                if not _take_over(path, identity, info):
                    waiter.pause(words, grace=_TAKEOVER_GRACE_S)  # another process is taking it over
                continue
            waiter.pause(words)
            continue
        _write_file_lock_record(fd, path)
        return fd


def _read_lock_file(path: Path, waiter: _ClaimWait) -> tuple[dict[str, Any] | None, tuple[int, int]] | None:
    """The record and ``(st_dev, st_ino)`` of the lock file at ``path``; ``None`` when it is gone.
    Anything but a regular file of one link is refused in one line (never read through a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise FileExistsError(_not_claim_file(path, waiter, "a symbolic link")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            raise FileExistsError(_not_claim_file(path, waiter, "not a regular file of one link"))
        return _claim_record(fd), (info.st_dev, info.st_ino)
    finally:
        os.close(fd)


def _not_claim_file(path: Path, waiter: _ClaimWait, why: str) -> str:
    return (
        f"the claim file {escape(path)} of {waiter.what} {escape(waiter.final_dir)} is not a regular file that "
        f"hf-pma made ({why}); remove it or choose another output folder"
    )


def _write_file_lock_record(fd: int, path: Path) -> None:
    """Record this process in the lock file it just made; on failure (a full disk) remove it again."""
    data = json.dumps({**_claim_identity(), "lock": "file"}).encode()
    try:
        os.pwrite(fd, data, 0)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise


def _left_empty(path: Path, identity: tuple[int, int]) -> bool:
    """Whether the lock file at ``path`` (``identity``: its device and inode) is empty and older
    than :data:`_EMPTY_FILE_STALE_S`: its maker was killed between making it and writing its record."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == identity and info.st_size == 0 and time.time() - info.st_mtime > _EMPTY_FILE_STALE_S


def _take_over(path: Path, identity: tuple[int, int], info: dict[str, Any] | None) -> bool:
    """Remove the lock file of a dead holder on this host (``info``: its record; ``None``: an empty
    file its maker left, :func:`_left_empty`), if it is still that file: same inode and
    same record (an inode number is reused at once). Two takers never both remove: the removal
    happens under a guard made exclusively (``<claim>.takeover``), and re-reads the file under
    it. ``False`` when another taker holds the guard (try again shortly)."""
    guard = path.with_name(f"{path.name}.takeover")
    try:
        gfd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        _remove_stale_guard(guard)
        return False
    try:
        os.pwrite(gfd, json.dumps(_claim_identity()).encode(), 0)
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            try:
                now = os.fstat(fd)
                same = _claim_record(fd) == info and (info is not None or now.st_size == 0)
                if (now.st_dev, now.st_ino) == identity and same:
                    os.unlink(path)
                    whose = f"pid {escape(info['pid'])}, which has ended" if info else "a process killed before it wrote its record"
                    _logger().info(f"hf-pma: took over {escape(path)} from {whose}")
            finally:
                os.close(fd)
    finally:
        os.close(gfd)
        with contextlib.suppress(OSError):
            os.unlink(guard)
    return True


def _remove_stale_guard(guard: Path) -> None:
    """Remove a takeover guard whose taker was killed mid-takeover (it lives microseconds):
    its recorded taker is gone, or it is empty and old."""
    with contextlib.suppress(OSError):
        fd = os.open(guard, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            info, size, age = _claim_record(fd), os.fstat(fd).st_size, time.time() - os.fstat(fd).st_mtime
        finally:
            os.close(fd)
        if (info is not None and _holder_state(info) == "gone") or (size == 0 and age > _EMPTY_FILE_STALE_S):
            os.unlink(guard)


def _release_file_lock(path: Path, fd: int) -> None:
    """Close the lock file ``fd``, removing it only while it is still this process's: the file at
    ``path`` (same inode) recording this very process (removed by hand and made anew: left alone)."""
    try:
        info = _claim_record(fd)
        ours = _is_file_lock(info) and info["host"] == _host() and info["pid"] == os.getpid()
        if ours and info.get("start_ticks") == process_start_ticks(os.getpid()) and _is_current_claim(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refuse_lock_error(fd: int, path: Path, what: str, final_dir: Path, err: OSError) -> NoReturn:
    """Close ``fd`` and raise ``flock``'s error: :class:`NoFileLocksError` where the filesystem
    has no locks, after removing the claim file when it records no holder (made by this open)."""
    try:
        if err.errno in _NO_LOCK_ERRNOS and os.fstat(fd).st_size == 0 and _is_current_claim(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
    if err.errno in _NO_LOCK_ERRNOS:
        raise NoFileLocksError(path, what, final_dir, f"flock: {err.strerror or err}") from None
    raise err


def _lock_within(fd: int, mode: int, timeout: float) -> bool:
    """Lock ``fd`` (blocking ``flock``: the kernel wakes waiters as the holder lets go, where
    polling would let the holder take it again every time), giving up after ``timeout`` seconds.

    ``True`` once locked. ``False`` on time out, a signal included: ``fd`` then belongs to the
    waiting thread, which closes it when its ``flock`` returns. ``OSError`` from ``flock``
    (no file locks) is raised, ``fd`` still the caller's."""
    import fcntl

    locked, guard = threading.Event(), threading.Lock()
    state: dict[str, Any] = {"given_up": False, "error": None}

    def take() -> None:
        try:
            fcntl.flock(fd, mode)
        except OSError as err:
            state["error"] = err
        with guard:
            if state["given_up"]:
                os.close(fd)
                return
            locked.set()

    threading.Thread(target=take, name="hf-pma-claim-wait", daemon=True).start()
    try:
        locked.wait(max(0.0, timeout))
    finally:
        with guard:
            state["given_up"] = not locked.is_set()
    if state["given_up"]:
        return False
    if state["error"] is not None:
        raise state["error"]
    return True


def _busy_message(what: str, final_dir: Path, busy: str, holder: str, wait: float) -> str:
    waited = f" (waited {wait:g}s)" if wait > 0 else ""
    return f"{what} {escape(final_dir)} {busy} ({holder}){waited}; wait for it to finish or choose another folder"


def check_output_file(path: str | os.PathLike[str], what: str = "output file", *, record: bool = False) -> None:
    """Check, before any work, that the file ``path`` can be written (atomically replaced) later.

    The one check of every output file (``-o``, ``--plot`` of every command, and the records
    hf-pma keeps in a folder). ``FileExistsError`` when ``path`` is a folder, a symbolic link (it
    would be replaced by a regular file, and what it names left as it was) or another special
    file, or lies inside a snapshot folder listed in a run's manifest (:func:`listed_snapshot_of`:
    rotation deletes such a folder, or keeps it forever once it holds a file that is not
    hf-pma's); unless ``record`` (a record hf-pma keeps in the folder it describes, under its own
    name: the eval record, the model card and its plot), also when ``path`` takes a name that
    hf-pma or transformers reads, or goes into a model, checkpoint, run-record or tasks folder
    (:func:`hf_pma.utils.read_files.output_place_problem`);
    ``FileNotFoundError`` when its folder does not exist; ``PermissionError`` when its folder is
    not writable (read-only permissions or a read-only filesystem). An existing regular file is
    fine: it is replaced. ``what`` names the path in the error (``"--output"``).
    """
    path = Path(path)
    shown_path = escape(path)
    if path.is_symlink():
        raise FileExistsError(
            f"{what} {shown_path} is a symbolic link: give the path of a new or regular file"
        )
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise FileExistsError(f"{what} {shown_path} is {kind}: give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"the folder of {what} {shown_path} does not exist")
    listed = listed_snapshot_of(parent)
    if listed is not None:
        snapshot, manifest = listed
        raise FileExistsError(
            f"refusing {what} {shown_path}: it lies inside {escape(snapshot)}, a snapshot listed in "
            f"{escape(manifest)}, which hf-pma replaces or deletes as its run goes on (keep_last, resume); "
            "choose a place outside it"
        )
    if not record:
        _refuse_read_place(path, what, file=True)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"cannot write {what} {shown_path}: its folder {escape(parent)} is not writable"
        )


def check_output_folder(output_dir: str | os.PathLike[str], overwrite: bool) -> None:
    """Check, before any work, that the output folder ``output_dir`` can be written.

    The one check of every command that writes an output folder (merge, consolidate, make-tasks,
    sweep's best merge...), run again once the folder is claimed (:func:`claim_output`). Raises,
    in one line naming the path:

    * ``FileExistsError`` when ``output_dir`` is a symbolic link (even to an empty folder:
      outputs are never written through a link), a file or another non-folder, or lies inside
      (or is) a snapshot folder listed in a run's manifest (:func:`listed_snapshot_of`: rotation
      and resume replace or delete such folders);
    * :class:`OutputExistsError` (a ``FileExistsError``) when it is a non-empty folder and
      ``overwrite`` is false (what ``overwrite`` may replace is
      :func:`hf_pma.core.outputs.check_overwrite_target`'s check);
    * ``PermissionError`` when the folder it goes in is not writable (permissions, or a
      read-only filesystem).

    Nothing is created. Signature: ``(output_dir, overwrite)``, both positional.
    """
    output_dir = Path(output_dir)
    shown_dir = escape(output_dir)
    restore_interrupted(output_dir)  # before anything is judged: a replacement killed midway is completed
    if output_dir.is_symlink():
        raise FileExistsError(
            f"output path {shown_dir} is a symbolic link; hf-pma never writes an output through a link: give the "
            "folder it points to, or another"
        )
    if output_dir.exists():
        if not output_dir.is_dir():
            raise FileExistsError(f"output path {shown_dir} exists and is not a folder")
        if any(output_dir.iterdir()) and not overwrite:
            raise OutputExistsError(f"output folder {shown_dir} is not empty; pass overwrite=True (--overwrite) to replace it")
    listed = listed_snapshot_of(output_dir)
    if listed is not None:
        snapshot, manifest = listed
        where = "it is" if snapshot == _resolved(output_dir) else f"it lies inside {escape(snapshot)},"
        raise FileExistsError(
            f"refusing output folder {shown_dir}: {where} a snapshot listed in {escape(manifest)}, which hf-pma "
            "replaces or deletes as its run goes on (keep_last, resume); choose a folder outside it"
        )
    _refuse_read_place(output_dir, "output folder", file=False)
    parent = _existing_parent(output_dir.absolute().parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write to {escape(output_dir.parent)}: the folder is not writable")


def _refuse_read_place(path: Path, what: str, file: bool) -> None:
    """``FileExistsError`` (one line) when an output at ``path`` would replace or join what a model,
    a run or a task folder is made of (:func:`hf_pma.utils.read_files.output_place_problem`)."""
    problem = output_place_problem(path, file=file)
    if problem is not None:
        raise FileExistsError(
            f"refusing {what} {escape(path)}: {escape(problem)}; an output never replaces or joins what a model or "
            "a run is made of: choose another name or folder"
        )


# Where a run keeps its manifest, relative to a folder: hf_pma.core.manifest's MANIFEST_NAME,
# and PMA_SUBDIR / MANIFEST_NAME (utils imports nothing above it; a test keeps them the same).
RUN_MANIFESTS = ("manifest.json", "pma/manifest.json")


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def listed_snapshot_of(path: str | os.PathLike[str]) -> tuple[Path, Path] | None:
    """The snapshot folder that ``path`` is or lies inside, and the manifest that lists it, if any.

    Looks, after symbolic links, in every folder above ``path`` for a run manifest
    (:data:`RUN_MANIFESTS`) whose ``snapshots`` list names ``path`` or a folder above it. The
    manifests are read leniently and bounded (:func:`hf_pma.utils.read_files.listed_folder_among`: this
    only looks for a reason to refuse, so one that cannot be read, or is larger than
    :data:`~hf_pma.utils.read_files.PEEK_MAX_BYTES` or lists more than
    :data:`~hf_pma.utils.read_files.PEEK_MAX_ENTRIES` snapshots, lists nothing). Nothing is written.
    """
    target = _resolved(Path(path))
    if target is None:
        return None
    chain = [target, *target.parents]  # deepest first: what lies strictly inside chain[i] is chain[:i]
    depth = {folder: i for i, folder in enumerate(chain)}
    for folder in target.parents:  # linear in the depth: an output 2,000 folders deep is checked at once
        for relative in RUN_MANIFESTS:
            manifest = folder / relative
            if not os.path.lexists(manifest):
                continue
            base = _resolved(manifest.parent)
            if base not in depth:  # its run is not above the path: nothing of the path is inside it
                continue
            snapshot = listed_folder_among(manifest, set(chain[: depth[base]]))  # bounded: anyone may have put it there
            if snapshot is not None:
                return snapshot, manifest
    return None
