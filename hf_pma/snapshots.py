"""The on-disk contract of a PMA run: snapshot records, the manifest, atomic file operations.

Layout (see ``shared/DESIGN.md``)::

    <output_dir>/pma/manifest.json          {"format_version": 1, "snapshots": [record, ...], ...}
    <output_dir>/pma/snapshot-<tokens>/     a plain HF model folder + pma.json (its record)
    <output_dir>/pma/merged/                merged model + pma_merge.json

The manifest is only ever replaced atomically (temporary file, fsync, rename, fsync of the
folder), and a snapshot is listed only after its folder is complete, so a crash at any moment
leaves a manifest that lists complete snapshots only. Paths in the manifest are relative to the
manifest's folder so a run can be moved or uploaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_NAME",
    "SNAPSHOT_RECORD_NAME",
    "MERGE_RECORD_NAME",
    "PMA_SUBDIR",
    "FORMAT_VERSION",
    "SnapshotRecord",
    "snapshot_dirname",
    "atomic_write_json",
    "fsync_tree",
    "fsync_dir",
    "read_json",
    "read_manifest",
    "write_manifest",
    "manifest_snapshots",
    "find_manifest",
    "remove_tree",
]

MANIFEST_NAME = "manifest.json"
SNAPSHOT_RECORD_NAME = "pma.json"
MERGE_RECORD_NAME = "pma_merge.json"
PMA_SUBDIR = "pma"
FORMAT_VERSION = 1

PHASES = ("warmup", "stable", "decay")


@dataclasses.dataclass
class SnapshotRecord:
    """What is known about one snapshot: where it is and when in training it was taken.

    ``path`` is relative to the manifest's folder. ``tokens`` is the global number of input
    tokens seen (over all processes) when the snapshot was taken; ``lr`` the learning rate of
    the last optimizer step before it; ``phase`` one of ``warmup``, ``stable``, ``decay``.
    """

    path: str
    tokens: int
    step: int
    lr: float | None = None
    loss: float | None = None
    phase: str | None = None
    dtype: str | None = None
    time: float = dataclasses.field(default_factory=time.time)
    num_bytes: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``extra`` keys are kept under ``extra``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SnapshotRecord:
        """Build a record from a manifest entry; unknown keys go to ``extra``."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        unknown = {k: v for k, v in data.items() if k not in names}
        if "path" not in known or "tokens" not in known or "step" not in known:
            raise ValueError(f"snapshot record needs 'path', 'tokens' and 'step', got keys {sorted(data)}")
        record = cls(**known)
        record.extra = {**record.extra, **unknown}
        return record


def snapshot_dirname(tokens: int) -> str:
    """Folder name of the snapshot taken at ``tokens`` global tokens."""
    return f"snapshot-{int(tokens)}"


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


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON to ``path`` atomically: a temporary file beside it, fsync, rename, fsync dir."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, sort_keys=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file, with an error that names the file when it is not valid JSON."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def find_manifest(path: str | os.PathLike[str]) -> Path | None:
    """The manifest of a run: ``path/manifest.json`` or ``path/pma/manifest.json``, if any."""
    path = Path(path)
    for candidate in (path / MANIFEST_NAME, path / PMA_SUBDIR / MANIFEST_NAME):
        if candidate.is_file():
            return candidate
    return None


def read_manifest(pma_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest in ``pma_dir`` as a dict; an empty manifest when there is none yet."""
    path = Path(pma_dir) / MANIFEST_NAME
    if not path.exists():
        return {"format_version": FORMAT_VERSION, "snapshots": []}
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("snapshots"), list):
        raise ValueError(f"{path} is not a PMA manifest: expected an object with a 'snapshots' list")
    return data


def manifest_snapshots(pma_dir: str | os.PathLike[str]) -> list[SnapshotRecord]:
    """The snapshot records of the manifest in ``pma_dir``, ordered by tokens (oldest first)."""
    records = [SnapshotRecord.from_dict(d) for d in read_manifest(pma_dir)["snapshots"]]
    return sorted(records, key=lambda r: (r.tokens, r.step))


def write_manifest(
    pma_dir: str | os.PathLike[str],
    snapshots: Iterable[SnapshotRecord | dict[str, Any]],
    **fields: Any,
) -> dict[str, Any]:
    """Replace the manifest in ``pma_dir`` atomically; ``fields`` update its top-level keys."""
    data = read_manifest(pma_dir)
    data.update(fields)
    data["format_version"] = FORMAT_VERSION
    data["snapshots"] = [s.to_dict() if isinstance(s, SnapshotRecord) else dict(s) for s in snapshots]
    atomic_write_json(Path(pma_dir) / MANIFEST_NAME, data)
    return data


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a folder by renaming it aside first, so a crash never leaves half a snapshot."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(f".deleting-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)
