"""The on-disk contract of a PMA run: snapshot records, the manifest, the names of record files.

Layout::

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
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hf_pma.utils.fs import (
    LEGACY_PREFIXES,
    atomic_write_json,
    is_library_folder,
    read_json,
    remove_path,
    remove_stale_temporaries,
    remove_tree,
)

__all__ = [
    "MANIFEST_NAME",
    "SNAPSHOT_RECORD_NAME",
    "MERGE_RECORD_NAME",
    "PMA_SUBDIR",
    "FORMAT_VERSION",
    "EVAL_RECORD_NAME",
    "TRAINING_RECORD_NAME",
    "PLOT_NAME",
    "CARD_NAME",
    "MODEL_SUPPORT_FILES",
    "ManifestError",
    "SnapshotRecord",
    "SNAPSHOT_DIR_PATTERN",
    "snapshot_dirname",
    "is_snapshot_folder",
    "read_manifest",
    "write_manifest",
    "manifest_snapshots",
    "find_manifest",
    "EXCLUDED_KEY",
    "is_excluded",
    "snapshot_path",
    "included_snapshots",
    "add_snapshot",
    "exclude_snapshots",
    "drop_snapshots_after",
    "clean_incomplete",
    "orphan_snapshots",
]

MANIFEST_NAME = "manifest.json"
SNAPSHOT_RECORD_NAME = "pma.json"
MERGE_RECORD_NAME = "pma_merge.json"
PMA_SUBDIR = "pma"
FORMAT_VERSION = 1
# Records beside a merged model (read by the card and the plot).
EVAL_RECORD_NAME = "pma_eval.json"
TRAINING_RECORD_NAME = "pma_training.json"
PLOT_NAME = "pma_training.png"
CARD_NAME = "README.md"
# The files of a model folder besides its weights (config, tokenizer, processor): what a merge
# copies from its newest source, and what is downloaded with a Hub revision's weights.
MODEL_SUPPORT_FILES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

PHASES = ("warmup", "stable", "decay")
# The name of a snapshot folder that this library writes (see :func:`snapshot_dirname`).
SNAPSHOT_DIR_PATTERN = r"snapshot-\d+"

# A record whose ``extra[EXCLUDED_KEY]`` is true stays on disk but is left out of merges
# (for example a snapshot taken during a loss spike).
EXCLUDED_KEY = "excluded"


class ManifestError(ValueError):
    """A manifest or snapshot record that hf-pma refuses to use: the one-line message names the
    file, the entry and the field (the CLI reports it and exits with status 2)."""


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


def is_snapshot_folder(path: str | os.PathLike[str], pma_dir: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a snapshot folder that hf-pma wrote in ``pma_dir``: a real folder (not a
    symlink) directly inside it, named ``snapshot-<tokens>``, holding its record ``pma.json``.

    Only such folders are ever deleted (``keep_last``, resume); anything else that a manifest
    names stays on disk.
    """
    path = Path(path)
    try:
        direct_child = path.parent.resolve() == Path(pma_dir).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return direct_child and is_library_folder(
        path, SNAPSHOT_RECORD_NAME, within=pma_dir, name_pattern=SNAPSHOT_DIR_PATTERN
    )


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


def is_excluded(record: SnapshotRecord) -> bool:
    """Whether a record was marked as excluded from merges (see :func:`exclude_snapshots`)."""
    return bool(record.extra.get(EXCLUDED_KEY, False))


def snapshot_path(pma_dir: str | os.PathLike[str], record: SnapshotRecord) -> Path:
    """The absolute folder of a snapshot listed in the manifest of ``pma_dir``."""
    return (Path(pma_dir) / record.path).resolve()


def included_snapshots(pma_dir: str | os.PathLike[str]) -> list[SnapshotRecord]:
    """The records of ``pma_dir`` that are not excluded, oldest first: what a merge should use."""
    return [r for r in manifest_snapshots(pma_dir) if not is_excluded(r)]


def _sorted(records: Iterable[SnapshotRecord]) -> list[SnapshotRecord]:
    return sorted(records, key=lambda r: (r.tokens, r.step))


def add_snapshot(
    pma_dir: str | os.PathLike[str],
    record: SnapshotRecord,
    keep_last: int | None = None,
    **fields: Any,
) -> list[SnapshotRecord]:
    """List a complete snapshot in the manifest; with ``keep_last``, delete the oldest beyond it.

    The snapshot folder must already be durable (renamed into place). A record with the same
    path replaces the old one. Older snapshots are deleted only after the manifest that no
    longer lists them is durable, so a crash leaves at worst an unlisted folder. Returns the
    records that were deleted.
    """
    records = [r for r in manifest_snapshots(pma_dir) if r.path != record.path]
    records = _sorted([*records, record])
    doomed: list[SnapshotRecord] = []
    if keep_last is not None and len(records) > keep_last:
        doomed, records = records[: len(records) - keep_last], records[len(records) - keep_last :]
    write_manifest(pma_dir, records, **fields)
    for old in doomed:
        remove_tree(Path(pma_dir) / old.path)
    return doomed


def exclude_snapshots(
    pma_dir: str | os.PathLike[str], tokens: Iterable[int], reason: str = "excluded"
) -> list[SnapshotRecord]:
    """Mark the snapshots taken at ``tokens`` as excluded from merges (they stay on disk).

    Raises ``ValueError`` naming the token counts that the manifest does not list.
    """
    wanted = {int(t) for t in tokens}
    records = manifest_snapshots(pma_dir)
    missing = wanted - {r.tokens for r in records}
    if missing:
        raise ValueError(f"{Path(pma_dir) / MANIFEST_NAME} lists no snapshot at tokens {sorted(missing)}")
    changed = []
    for record in records:
        if record.tokens in wanted:
            record.extra = {**record.extra, EXCLUDED_KEY: True, "excluded_reason": reason}
            changed.append(record)
    write_manifest(pma_dir, records)
    return changed


def drop_snapshots_after(pma_dir: str | os.PathLike[str], tokens: int) -> list[SnapshotRecord]:
    """Remove the snapshots with more than ``tokens`` tokens from the manifest, then from disk.

    Used when a run resumes from a checkpoint taken before them: the resumed run will take
    them again, so the manifest ends as the one of an uninterrupted run.
    """
    records = manifest_snapshots(pma_dir)
    keep = [r for r in records if r.tokens <= tokens]
    dropped = [r for r in records if r.tokens > tokens]
    if dropped:
        write_manifest(pma_dir, keep)
        for record in dropped:
            remove_tree(Path(pma_dir) / record.path)
    return dropped


def clean_incomplete(pma_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete the leftovers of interrupted writes and deletes in ``pma_dir``; returns them.

    Removes the stale temporaries of this library (snapshot and merge folders, the manifest's
    temporary file; see :func:`hf_pma.utils.fs.is_stale_temporary`: never one that a live
    process still owns) and the names that earlier versions gave their temporaries
    (``.tmp-*``, ``.deleting-*``, ``.manifest.json.*.tmp``).
    """
    pma_dir = Path(pma_dir)
    removed = remove_stale_temporaries(pma_dir)
    if pma_dir.is_dir():
        for child in sorted(pma_dir.glob(".*")):
            legacy_manifest_tmp = child.name.startswith(f".{MANIFEST_NAME}.") and child.name.endswith(".tmp")
            if child.name.startswith(LEGACY_PREFIXES) or legacy_manifest_tmp:
                remove_path(child)
                removed.append(child)
    return removed


def orphan_snapshots(pma_dir: str | os.PathLike[str]) -> list[tuple[Path, SnapshotRecord | None]]:
    """Snapshot folders in ``pma_dir`` that the manifest does not list, with their record.

    A folder only gets its final ``snapshot-<tokens>`` name once complete, so an orphan is
    either a snapshot whose manifest update was interrupted (record readable) or a folder
    left by something else (record ``None``).
    """
    pma_dir = Path(pma_dir)
    listed = {r.path for r in manifest_snapshots(pma_dir)}
    orphans: list[tuple[Path, SnapshotRecord | None]] = []
    for child in sorted(pma_dir.glob("snapshot-*")):
        if not child.is_dir() or child.name in listed:
            continue
        record = None
        try:
            record = SnapshotRecord.from_dict(read_json(child / SNAPSHOT_RECORD_NAME))
            record.path = child.name
        except (OSError, ValueError, TypeError):
            record = None
        orphans.append((child, record))
    return orphans
