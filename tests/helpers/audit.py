"""Python audit events as a test's witness: which files under a folder a block of code opened,
listed, renamed or deleted, and whether it started a process or imported a module from a folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Events that touch a path (their first two arguments may be paths).
PATH_EVENTS = (
    "open",
    "os.listdir",
    "os.scandir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "shutil.rmtree",
    "os.symlink",
)
# Events that start another program.
PROCESS_EVENTS = (
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "pty.spawn",
)


class AuditWatch:
    """Records, while active, every path event under ``folders`` (after symlinks), every process
    started (when ``processes``) and every module imported from a file under ``import_roots``.

    Python allows no removal of an audit hook: one hook is installed for the whole session and
    dispatches to the watches active at the time.
    """

    _installed = False
    _active: list[AuditWatch] = []

    def __init__(
        self,
        *folders: str | os.PathLike,
        processes: bool = False,
        import_roots: tuple[str | os.PathLike, ...] = (),
    ) -> None:
        self.folders = [os.path.realpath(f) for f in folders]
        self.import_roots = [os.path.realpath(f) for f in import_roots]
        self.processes = processes
        self.touched: list[tuple[str, str]] = []
        self.started: list[tuple[str, str]] = []
        self.imported: list[tuple[str, str]] = []

    def __enter__(self) -> AuditWatch:
        if not AuditWatch._installed:
            sys.addaudithook(AuditWatch._hook)
            AuditWatch._installed = True
        AuditWatch._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        AuditWatch._active.remove(self)

    @staticmethod
    def _inside(path: str, roots: list[str]) -> bool:
        return any(path == root or path.startswith(root + os.sep) for root in roots)

    @staticmethod
    def _hook(event: str, args: tuple) -> None:
        if not AuditWatch._active:
            return
        if event in PATH_EVENTS:
            for watch in AuditWatch._active:
                for arg in args[:2]:
                    if isinstance(arg, (str, bytes, os.PathLike)):
                        try:
                            resolved = os.path.realpath(os.fsdecode(arg))
                        except (ValueError, TypeError):
                            continue
                        if AuditWatch._inside(resolved, watch.folders):
                            watch.touched.append((event, resolved))
        elif event in PROCESS_EVENTS or event.startswith("os.exec") or event.startswith("os.spawn"):
            for watch in AuditWatch._active:
                if watch.processes:
                    watch.started.append((event, repr(args)[:200]))
        elif event == "import" and len(args) > 1 and args[1]:
            for watch in AuditWatch._active:
                try:
                    resolved = os.path.realpath(os.fsdecode(args[1]))
                except (ValueError, TypeError):
                    continue
                if AuditWatch._inside(resolved, watch.import_roots):
                    watch.imported.append((str(args[0]), resolved))


def tree(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (not following links) with its content."""
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                found[str(path.relative_to(folder))] = path.read_bytes()
    return found
