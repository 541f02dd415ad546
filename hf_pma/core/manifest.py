"""The on-disk contract of a PMA run: snapshot records, the manifest, the names of record files.

Layout::

    <output_dir>/pma/manifest.json          {"format_version": 1, "snapshots": [record, ...], ...}
    <output_dir>/pma/snapshot-<tokens>/     a plain HF model folder + pma.json (its record)
    <output_dir>/pma/merged/                merged model + pma_merge.json

The manifest is only ever replaced atomically (temporary file, fsync, rename, fsync of the
folder), every read-modify-write of it (:func:`write_manifest`, :func:`add_snapshot`, ...) runs
under the snapshot folder's claim (:func:`hf_pma.utils.fs.hold_claim`: a training holds it for
its whole run, another process waits for it), and a snapshot is listed only after its folder is complete, so a crash at any moment
leaves a manifest that lists complete snapshots only. Paths in the manifest are relative to the
manifest's folder so a run can be moved or uploaded.

A run folder may come from anywhere, so the manifest and the records are untrusted input: one
reader (:func:`read_manifest`) checks every field's type and range, and that every path stays,
after symlinks, inside the manifest's folder, before anything else uses them; a bad file is a
:class:`ManifestError` naming the file, the entry and the field. Only folders that this library
wrote (:func:`is_snapshot_folder`) are ever deleted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hf_pma.io.guarded import read_json
from hf_pma.utils.fs import (
    atomic_write_json,
    confined_path,
    hold_claim,
    is_library_folder,
    remove_path,
    remove_stale_temporaries,
    remove_tree,
)
from hf_pma.utils.parsing import is_int
from hf_pma.utils.text import escape, shown

__all__ = [
    "TOKENIZER_FILES",
    "tokenizer_candidates",
    "check_eval_comparison",
    "check_eval_results",
    "MANIFEST_NAME",
    "SNAPSHOT_RECORD_NAME",
    "MERGE_RECORD_NAME",
    "PMA_SUBDIR",
    "FORMAT_VERSION",
    "EVAL_RECORD_NAME",
    "TRAINING_RECORD_NAME",
    "ANNEALED_DIR",
    "ANNEAL_IN_PROGRESS",
    "ANNEAL_RECORD_NAME",
    "PLOT_NAME",
    "CARD_NAME",
    "MODEL_SUPPORT_FILES",
    "ManifestError",
    "SnapshotRecord",
    "SNAPSHOT_DIR_PATTERN",
    "snapshot_dirname",
    "is_snapshot_folder",
    "read_snapshot_record",
    "check_record",
    "validate_manifest",
    "read_manifest",
    "write_manifest",
    "manifest_snapshots",
    "find_manifest",
    "EXCLUDED_KEY",
    "is_excluded",
    "snapshot_row",
    "snapshot_path",
    "included_snapshots",
    "add_snapshot",
    "exclude_snapshots",
    "drop_snapshots_after",
    "SNAPSHOT_FILES_KEY",
    "SET_ASIDE_KEY",
    "is_set_aside",
    "set_aside_snapshots_after",
    "snapshot_files",
    "snapshot_folder_problem",
    "snapshot_name_problems",
    "remove_snapshot_folder",
    "clean_incomplete",
    "SHARDED_TMP_PREFIX",
    "SHARDED_TMP_MARKER",
    "orphan_snapshots",
    "missing_snapshot_error",
]

MANIFEST_NAME = "manifest.json"
SNAPSHOT_RECORD_NAME = "pma.json"
MERGE_RECORD_NAME = "pma_merge.json"
PMA_SUBDIR = "pma"
FORMAT_VERSION = 1
# Records beside a merged model (read by the card and the plot).
EVAL_RECORD_NAME = "pma_eval.json"
TRAINING_RECORD_NAME = "pma_training.json"
# The annealed fork of a run (the annealing check): <output_dir>/annealed/ and its record there.
ANNEALED_DIR = "annealed"
ANNEAL_RECORD_NAME = "pma_anneal.json"
# The key of the record a fork writes before its first byte (replaced by the whole record at its end).
ANNEAL_IN_PROGRESS = "in_progress"
PLOT_NAME = "pma_training.png"
CARD_NAME = "README.md"
# The files of a tokenizer: a merge copies them from one folder, named in its record.
TOKENIZER_FILES = (
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
)
# The files of a model folder besides its weights (config, tokenizer, processor): what a merge
# copies from its newest source, and what is downloaded with a Hub revision's weights.
MODEL_SUPPORT_FILES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    *TOKENIZER_FILES,
    "preprocessor_config.json",
    "processor_config.json",
)

PHASES = ("warmup", "stable", "decay")
# The name of a snapshot folder that this library writes (see :func:`snapshot_dirname`).
SNAPSHOT_DIR_PATTERN = r"snapshot-\d+"

# A snapshot's ``pma.json`` lists the files the writer wrote in the folder under ``extra.files``
# (only those, and nothing else in the folder, may be deleted with it).
SNAPSHOT_FILES_KEY = "files"
# A record whose ``extra.set_aside_at`` is set was past the point where the run resumed (that
# token count): kept, excluded, until the resumed run passes it.
SET_ASIDE_KEY = "set_aside_at"

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
    def from_dict(cls, data: Any, where: str = "snapshot record") -> SnapshotRecord:
        """Build a record from a manifest entry or a ``pma.json``; unknown keys go to ``extra``.

        Every field is checked (see :func:`validate_manifest`); a bad one raises
        :class:`ManifestError` starting with ``where`` (the file and entry). ``path`` is checked
        to be a non-empty string only: where it leads is the manifest reader's check.
        """
        check_record(data, where)
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        extra = {**known.get("extra", {}), **{str(k): v for k, v in data.items() if k not in names}}
        record = cls(**{k: v for k, v in known.items() if k != "extra"})
        record.extra = extra
        return record


def check_record(data: Any, where: str, required: Iterable[str] = ("path", "tokens", "step")) -> None:
    """Check a snapshot record (a manifest entry, a ``pma.json``): an object holding the
    ``required`` keys, each field of the right type and range (see :func:`validate_manifest`);
    :class:`ManifestError` starting with ``where`` (the file and entry) names the first bad one."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: expected an object, got {shown(data, 60)}")
    missing = [key for key in required if key not in data]
    if missing:
        raise ManifestError(
            f"{where}: '{missing[0]}' is missing (a snapshot record needs {', '.join(map(repr, required))})"
        )
    names = {f.name for f in dataclasses.fields(SnapshotRecord)}
    for key, value in data.items():
        if key in _RECORD_FIELDS:
            check, expected = _RECORD_FIELDS[key]
            if not check(value):
                raise ManifestError(f"{where}: '{key}' must be {expected}, got {_value_shown(value)}")
    extra = {**data.get("extra", {}), **{str(k): v for k, v in data.items() if k not in names}}
    for key, value in extra.items():
        if key in _EXTRA_FIELDS and not _EXTRA_FIELDS[key][0](value):
            raise ManifestError(
                f"{where}: 'extra.{key}' must be {_EXTRA_FIELDS[key][1]}, got {_value_shown(value)}"
            )


# Integers in records are counts, steps, sizes: int64 holds every real one, and a larger one
# (``10**400``) would only overflow whatever converts it (a float, a numpy or torch integer).
MAX_RECORD_INT = 2**63 - 1
# Times are seconds since the epoch that ``datetime`` can show: up to the end of the year 9999.
MAX_RECORD_TIME = 253402300799.0


def _is_int(value: Any, minimum: int) -> bool:
    return is_int(value, minimum, MAX_RECORD_INT)


def _is_number(value: Any) -> bool:
    """An int within int64, or any float (a diverged loss is recorded as NaN or Infinity)."""
    return isinstance(value, float) or _is_int(value, -MAX_RECORD_INT)


def _value_shown(value: Any) -> str:
    """A refused value as an error shows it (:func:`hf_pma.utils.text.shown`); an integer too
    large for a record by its size."""
    if is_int(value) and abs(value) > MAX_RECORD_INT:
        return f"an integer of {len(str(abs(value)))} digits (at most 2**63 - 1)"
    return shown(value, 60)


def _is_time(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and 0 <= value <= MAX_RECORD_TIME


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_count(value: Any) -> bool:
    return _is_int(value, 0)


def _is_positive(value: Any) -> bool:
    return _is_int(value, 1)


def _is_path_string(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip()) and "\x00" not in value


# Each field of a record: (check, what it must be).
_RECORD_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "path": (_is_path_string, "a non-empty relative path"),
    "tokens": (_is_count, "a non-negative integer"),
    "step": (_is_count, "a non-negative integer"),
    "lr": (_optional(_is_number), "a number or null"),
    "loss": (_optional(_is_number), "a number or null"),
    "phase": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "dtype": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "time": (_is_time, "a finite number of seconds since the epoch, up to the year 9999"),
    "num_bytes": (_optional(_is_count), "a non-negative integer or null"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
}
# The keys of ``extra`` that the library acts on; any other key is kept as it is.
_EXTRA_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "excluded": (lambda v: isinstance(v, bool), "true or false"),
    "excluded_reason": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "sharded": (lambda v: isinstance(v, bool), "true or false"),
    "world_size": (_is_positive, "a positive integer"),
    "layout": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "interval_tokens": (_optional(_is_positive), "a positive integer or null"),
}
# The top-level keys of a manifest that the library reads back.
_MANIFEST_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "interval_tokens": (_optional(_is_positive), "a positive integer or null"),
    "interval_choice": (_optional(lambda v: isinstance(v, dict)), "an object or null"),
    "keep_last": (_optional(_is_positive), "a positive integer or null"),
    "sharded": (lambda v: isinstance(v, bool), "true or false"),
    "world_size": (_optional(_is_positive), "a positive integer or null"),
    "recoveries": (lambda v: isinstance(v, list), "a list"),
}


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
    """The manifest in ``pma_dir`` as a dict, checked (:func:`validate_manifest`); an empty
    manifest when there is none yet. A malformed one raises :class:`ManifestError`."""
    return _read_checked(pma_dir)[0]


def _read_checked(pma_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], list[SnapshotRecord]]:
    path = Path(pma_dir) / MANIFEST_NAME
    if not path.exists() and not path.is_symlink():
        return {"format_version": FORMAT_VERSION, "snapshots": []}, []
    if not path.is_file():
        raise ManifestError(f"{path} is not a PMA manifest: not a readable file")
    try:
        data = read_json(path, kind="manifest")
    except ValueError as err:
        raise ManifestError(str(err)) from None
    return data, validate_manifest(data, path)


def validate_manifest(data: Any, path: str | os.PathLike[str]) -> list[SnapshotRecord]:
    """Check a manifest read from ``path``; returns its snapshot records (file order).

    Refuses, with a one-line :class:`ManifestError` naming ``path``, the entry and the field:
    a ``format_version`` that is not an integer or that this version does not know (a newer
    hf-pma's: upgrade), a ``snapshots`` that is not a list, an entry that is not an object, a
    field of the wrong type or range (``tokens`` and ``step`` non-negative integers, booleans
    true or false, ...), ``tokens`` and ``step`` that do not increase from entry to entry, and a
    ``path`` that is empty, absolute, holds ``..``, or resolves (after symlinks) outside the
    manifest's folder or onto another entry's folder. Nothing the entries name is read.
    """
    path = Path(path)
    if not isinstance(data, dict):
        raise ManifestError(
            f"{path} is not a PMA manifest: expected a JSON object, got {type(data).__name__}"
        )
    version = data.get("format_version", FORMAT_VERSION)
    if not _is_int(version, -(2**63)):
        raise ManifestError(f"{path}: 'format_version' must be an integer, got {_value_shown(version)}")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{path} was written by a newer hf-pma (format_version {version}; this one reads "
            f"{FORMAT_VERSION}): upgrade hf-pma (pip install -U hf-pma)"
        )
    if version < 1:
        raise ManifestError(
            f"{path}: unknown 'format_version' {version} (this hf-pma reads 1 to {FORMAT_VERSION})"
        )
    for key, (check, expected) in _MANIFEST_FIELDS.items():
        if key in data and not check(data[key]):
            raise ManifestError(f"{path}: '{key}' must be {expected}, got {_value_shown(data[key])}")
    entries = data.get("snapshots")
    if not isinstance(entries, list):
        raise ManifestError(
            f"{path}: 'snapshots' must be a list of snapshot records, got {shown(entries, 60)}"
        )
    records: list[SnapshotRecord] = []
    folders: dict[Path, str] = {}
    for i, entry in enumerate(entries):
        name = entry.get("path") if isinstance(entry, dict) else None
        where = f"{path}: snapshots[{i}]" + (f" ({shown(name, 200)})" if isinstance(name, str) else "")
        record = SnapshotRecord.from_dict(entry, where)
        try:
            folder = confined_path(path.parent, record.path).resolve()
        except ValueError as err:
            raise ManifestError(f"{where}: 'path' refused: {err}") from None
        if folder in folders:
            raise ManifestError(
                f"{where}: 'path' names the same folder as the entry {shown(folders[folder], 60)}"
            )
        folders[folder] = record.path
        if records:
            previous = records[-1]
            for key in ("tokens", "step"):
                if getattr(record, key) <= getattr(previous, key):
                    raise ManifestError(
                        f"{where}: '{key}' {getattr(record, key)} does not increase on the entry before it "
                        f"({getattr(previous, key)}); entries are listed oldest first, one per {key}"
                    )
        records.append(record)
    return records


def read_snapshot_record(
    folder: str | os.PathLike[str], required: Iterable[str] = ("tokens", "step")
) -> dict[str, Any] | None:
    """The record (``pma.json``) of a snapshot folder, checked (:func:`check_record`, with the
    ``required`` keys), with ``path`` set to the folder's name (where it is, not what it says);
    ``None`` when there is none. A malformed one raises :class:`ManifestError`."""
    folder = Path(folder)
    path = folder / SNAPSHOT_RECORD_NAME
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = read_json(path, folder)
    except ValueError as err:
        raise ManifestError(str(err)) from None
    check_record(data, str(path), required)
    return {**data, "path": folder.name}


def manifest_snapshots(pma_dir: str | os.PathLike[str]) -> list[SnapshotRecord]:
    """The snapshot records of the manifest in ``pma_dir``, oldest first, checked (see
    :func:`validate_manifest`): every ``path`` leads to a folder inside ``pma_dir``."""
    return _read_checked(pma_dir)[1]


T = TypeVar("T")


def _under_claim(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a read-modify-write of the manifest in ``pma_dir`` (the first argument) under that
    folder's claim: another process's write waits, none is lost (re-entrant in the process that
    holds it: the training holds it for its whole run)."""

    @functools.wraps(fn)
    def claimed(pma_dir: str | os.PathLike[str], *args: Any, **kwargs: Any) -> T:
        with hold_claim(pma_dir, what="snapshot folder"):
            return fn(pma_dir, *args, **kwargs)

    return claimed


@_under_claim
def write_manifest(
    pma_dir: str | os.PathLike[str],
    snapshots: Iterable[SnapshotRecord | dict[str, Any]],
    **fields: Any,
) -> dict[str, Any]:
    """Replace the manifest in ``pma_dir`` atomically; ``fields`` update its top-level keys.

    The new manifest is checked as :func:`read_manifest` checks it before anything is written
    (:class:`ManifestError` when it would be refused)."""
    data = read_manifest(pma_dir)
    data.update(fields)
    data["format_version"] = FORMAT_VERSION
    data["snapshots"] = [s.to_dict() if isinstance(s, SnapshotRecord) else dict(s) for s in snapshots]
    validate_manifest(data, Path(pma_dir) / MANIFEST_NAME)  # never write what would be refused on reading
    atomic_write_json(Path(pma_dir) / MANIFEST_NAME, data)
    return data


def is_excluded(record: SnapshotRecord) -> bool:
    """Whether a record was marked as excluded from merges (see :func:`exclude_snapshots`)."""
    return bool(record.extra.get(EXCLUDED_KEY, False))


def snapshot_row(
    name: str,
    tokens: int | None,
    step: int | None,
    *,
    lr: float | None = None,
    phase: str | None = None,
    loss: float | None = None,
    num_bytes: int | None = None,
    excluded: bool = False,
    excluded_reason: str | None = None,
    missing: bool = False,
) -> dict[str, Any]:
    """One snapshot as ``hf-pma inspect`` lists it (a row of its table, an entry of the
    ``snapshots`` of its JSON report): ``name``, ``tokens``, ``step``, ``lr``, ``phase``,
    ``loss``, ``bytes`` (its files' size; ``None``: unknown), whether it is ``excluded`` from
    merges (and the ``excluded_reason``), and whether its folder is ``missing``. What is not known
    (a Hub revision has no learning rate) stays ``None``."""
    return {
        "name": name,
        "tokens": tokens,
        "step": step,
        "lr": lr,
        "phase": phase,
        "loss": loss,
        "bytes": num_bytes,
        "excluded": excluded,
        "excluded_reason": excluded_reason,
        "missing": missing,
    }


def snapshot_path(pma_dir: str | os.PathLike[str], record: SnapshotRecord) -> Path:
    """The absolute folder of a snapshot listed in the manifest of ``pma_dir``."""
    return (Path(pma_dir) / record.path).resolve()


def included_snapshots(pma_dir: str | os.PathLike[str]) -> list[SnapshotRecord]:
    """The records of ``pma_dir`` that are not excluded, oldest first: what a merge should use."""
    return [r for r in manifest_snapshots(pma_dir) if not is_excluded(r)]


def _sorted(records: Iterable[SnapshotRecord]) -> list[SnapshotRecord]:
    return sorted(records, key=lambda r: (r.tokens, r.step))


@_under_claim
def add_snapshot(
    pma_dir: str | os.PathLike[str],
    record: SnapshotRecord,
    keep_last: int | None = None,
    **fields: Any,
) -> list[SnapshotRecord]:
    """List a complete snapshot in the manifest; with ``keep_last``, delete the oldest beyond it.

    The snapshot folder must already be durable (renamed into place). A record with the same
    path replaces the old one. Snapshots set aside by a resume (:func:`set_aside_snapshots_after`)
    that the run has now passed (at or before ``record``'s tokens or step) are dropped, and
    ``keep_last`` counts the others only. Older snapshots are deleted only after the manifest
    that no longer lists them is durable, so a crash leaves at worst an unlisted folder, and
    only when everything in them is hf-pma's (:func:`remove_snapshot_folder`). Returns the
    records that were deleted.
    """
    records = [r for r in manifest_snapshots(pma_dir) if r.path != record.path]
    passed = [r for r in records if is_set_aside(r) and (r.tokens <= record.tokens or r.step <= record.step)]
    records = _sorted([r for r in records if r not in passed] + [record])
    doomed: list[SnapshotRecord] = list(passed)
    kept = [r for r in records if not is_set_aside(r)]
    if keep_last is not None and len(kept) > keep_last:
        rotated = kept[: len(kept) - keep_last]
        doomed += rotated
        records = [r for r in records if r not in rotated]
    write_manifest(pma_dir, records, **fields)
    return [old for old in doomed if remove_snapshot_folder(pma_dir, old)]


@_under_claim
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


@_under_claim
def drop_snapshots_after(pma_dir: str | os.PathLike[str], tokens: int) -> list[SnapshotRecord]:
    """Remove the snapshots with more than ``tokens`` tokens from the manifest, then from disk.

    Used when a run resumes from a checkpoint taken before them: the resumed run will take
    them again, so the manifest ends as the one of an uninterrupted run. Only snapshot folders
    that hf-pma wrote are deleted (:func:`remove_snapshot_folder`); returns every record dropped
    from the manifest.
    """
    records = manifest_snapshots(pma_dir)
    keep = [r for r in records if r.tokens <= tokens]
    dropped = [r for r in records if r.tokens > tokens]
    if dropped:
        write_manifest(pma_dir, keep)
        for record in dropped:
            remove_snapshot_folder(pma_dir, record)
    return dropped


def remove_snapshot_folder(pma_dir: str | os.PathLike[str], record: SnapshotRecord) -> bool:
    """Delete the folder of ``record`` when everything in it is hf-pma's
    (:func:`snapshot_folder_problem`); anything else it names is left on disk with one warning
    naming it and why. Returns whether it was deleted (``False`` too when it is already gone)."""
    folder = Path(pma_dir) / record.path
    if not folder.exists() and not folder.is_symlink():
        return False
    problem = snapshot_folder_problem(folder, pma_dir)
    if problem is not None:
        _logger().warning(
            f"hf-pma: left {escape(folder)} on disk and dropped it from the manifest: {problem}; hf-pma deletes only "
            "snapshot folders that hold nothing but the files it wrote"
        )
        return False
    remove_tree(folder)
    return True


# The files of a snapshot folder that hf-pma writes (when its record does not list them: earlier
# versions): the record, the weights of every layout, and a model folder's support files.
_SNAPSHOT_FILE_PATTERN = re.compile(
    r"pma\.json|(model|adapter_model)(-\d{5}-of-\d{5})?\.safetensors|(model|adapter_model)\.safetensors\.index\.json"
    r"|shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors|"
    + "|".join(re.escape(name) for name in MODEL_SUPPORT_FILES)
)


def snapshot_files(folder: str | os.PathLike[str]) -> set[str] | None:
    """The file names the snapshot writer recorded in ``folder``'s ``pma.json`` (``extra.files``),
    or ``None`` when it recorded none (earlier versions) or the record cannot be read."""
    path = Path(folder) / SNAPSHOT_RECORD_NAME
    try:
        if path.is_symlink() or not path.is_file():
            return None
        data = read_json(path)
    except (OSError, ValueError, RecursionError):
        return None
    files = (data.get("extra") or {}).get(SNAPSHOT_FILES_KEY) if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return {*files, SNAPSHOT_RECORD_NAME}


def snapshot_folder_problem(path: str | os.PathLike[str], pma_dir: str | os.PathLike[str]) -> str | None:
    """Why ``path`` may not be deleted or replaced as a snapshot of ``pma_dir`` (a few words naming
    what is not hf-pma's), or ``None`` when everything in it is hf-pma's.

    It must be a snapshot folder hf-pma wrote (:func:`is_snapshot_folder`: a real folder named
    ``snapshot-<tokens>`` directly in ``pma_dir``, holding ``pma.json``) that holds only regular
    files whose names the snapshot writer wrote: those its record lists (``extra.files``), or for
    snapshots of earlier versions the names it writes (weights, record, config and tokenizer
    files). A folder, a link or any other file inside (a user's merge written there) keeps it.
    """
    path = Path(path)
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.is_dir():
        return "it is not a folder"
    if not is_snapshot_folder(path, pma_dir):
        return f"it is not a snapshot folder that hf-pma wrote (no {SNAPSHOT_RECORD_NAME} inside, or not in {escape(pma_dir)})"
    known = snapshot_files(path)
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                ours = known is not None and entry.name in known
                ours = ours or (known is None and _SNAPSHOT_FILE_PATTERN.fullmatch(entry.name) is not None)
                if not entry.is_file(follow_symlinks=False) or not ours:
                    kind = "folder" if entry.is_dir(follow_symlinks=False) else "file"
                    return f"it holds the {kind} {shown(entry.name)}, which hf-pma did not write there"
    except OSError as err:
        return f"it cannot be listed ({escape(err)})"
    return None


def snapshot_name_problems(pma_dir: str | os.PathLike[str]) -> list[str]:
    """One line for each entry of ``pma_dir`` named like a snapshot (``snapshot-<tokens>``) that is
    not a snapshot folder hf-pma wrote (a user's folder, a file, a link): a snapshot taken at those
    tokens would have to replace it. Checked when training starts, before anything is written."""
    pma_dir = Path(pma_dir)
    if not pma_dir.is_dir():
        return []
    problems = []
    for child in sorted(pma_dir.iterdir()):
        if re.fullmatch(SNAPSHOT_DIR_PATTERN, child.name) and not is_snapshot_folder(child, pma_dir):
            what = "a folder without pma.json" if child.is_dir() else "a file"
            what = "a symbolic link" if child.is_symlink() else what
            problems.append(f"{escape(child)} is {what}, not a snapshot that hf-pma wrote")
    return problems


def is_set_aside(record: SnapshotRecord) -> bool:
    """Whether a record was set aside by a resume from before it (:func:`set_aside_snapshots_after`)."""
    return record.extra.get(SET_ASIDE_KEY) is not None


@_under_claim
def set_aside_snapshots_after(
    pma_dir: str | os.PathLike[str], tokens: int
) -> tuple[list[SnapshotRecord], list[SnapshotRecord]]:
    """A run resumes at ``tokens``: set aside the snapshots past it; returns (set aside, deleted).

    Nothing is deleted that the resumed run has not passed: the snapshots listed past
    ``tokens`` stay on disk and in the manifest, excluded from merges, with
    ``extra.set_aside_at`` (the resume point) and a reason saying so; the manifest thus states
    the gap until the resumed run passes them. :func:`add_snapshot` drops each once the run
    has passed it (replaced by the new snapshot at the same tokens, or at a later snapshot).
    Snapshots set aside by an earlier resume that lie at or before ``tokens`` were passed by the
    run resumed then: they are dropped now (deleted when everything in them is hf-pma's).
    """
    records = manifest_snapshots(pma_dir)
    passed = [r for r in records if is_set_aside(r) and r.tokens <= tokens]
    newly = []
    for record in records:
        if record.tokens > tokens and not is_set_aside(record):
            reason = f"past the resume point at {tokens:,} tokens: kept until the resumed run passes it"
            record.extra = {**record.extra, SET_ASIDE_KEY: int(tokens)}
            if not is_excluded(record):
                record.extra.update({EXCLUDED_KEY: True, "excluded_reason": reason})
            newly.append(record)
    if newly or passed:
        write_manifest(pma_dir, [r for r in records if r not in passed])
    return newly, [r for r in passed if remove_snapshot_folder(pma_dir, r)]


def missing_snapshot_error(
    manifest: str | os.PathLike[str], name: str, folder: str | os.PathLike[str], seen: bool = False
) -> FileNotFoundError:
    """The one-line error for the snapshot ``name`` listed in ``manifest`` whose ``folder`` is not there.

    When this command had seen it (``seen``), or when the manifest no longer lists it (read again
    now), it was deleted while the command ran: a training's ``keep_last`` rotating it out, or a
    resume setting it aside; the error says so (such a path is never taken for a Hub id).
    Otherwise the manifest lists a folder that does not exist.
    """
    manifest, folder = Path(manifest), Path(folder)
    if not seen:
        try:
            seen = name not in {r.path for r in manifest_snapshots(manifest.parent)}
        except (OSError, ValueError):
            seen = False
    if seen:
        return FileNotFoundError(
            f"snapshot {escape(name)} listed in {escape(manifest)} was deleted while this command ran (keep_last "
            f"rotation?): {escape(folder)} is gone; run it again to use the snapshots listed now"
        )
    return FileNotFoundError(
        f"snapshot {escape(name)} listed in {escape(manifest)} does not exist at {escape(folder)}"
    )


def _logger() -> Any:
    # Imported on use: this module stays free of heavy imports (the CLI's parser loads it).
    from transformers.utils import logging

    return logging.get_logger(__name__)


# The folder the ranks write a sharded snapshot into (``.tmp-snapshot-<tokens>``: every rank
# finds it without talking to the others) and the mark each rank writes in it first: what marks
# the folder as hf-pma's temporary, since its name alone could be a user's.
SHARDED_TMP_PREFIX = ".tmp-"
SHARDED_TMP_MARKER = ".hf-pma-sharded-snapshot"
_SHARDED_TMP_PATTERN = re.compile(re.escape(SHARDED_TMP_PREFIX) + SNAPSHOT_DIR_PATTERN)


def clean_incomplete(pma_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete the leftovers of interrupted writes and deletes in ``pma_dir``; returns them.

    Touches only what hf-pma made there: the stale temporaries of this library
    (``.<name>.tmp-<host>-<pid>-<n>``, created exclusively under this host's name and a pid; see
    :func:`hf_pma.utils.fs.is_stale_temporary`: never one that a live process still owns), and
    the folders the ranks write sharded snapshots into (``.tmp-snapshot-<tokens>``) when they
    hold the mark every rank writes there first (:data:`SHARDED_TMP_MARKER`) and nothing but
    regular files. Nothing is recognised by a name alone: a user's ``.tmp-notes`` or
    ``.tmp-snapshot-5`` stays. Each removal is logged.
    """
    pma_dir = Path(pma_dir)
    removed = remove_stale_temporaries(pma_dir)
    if pma_dir.is_dir():
        for child in sorted(pma_dir.glob(".*")):
            if _SHARDED_TMP_PATTERN.fullmatch(child.name) is None or child.is_symlink() or not child.is_dir():
                continue
            marker = child / SHARDED_TMP_MARKER
            if marker.is_symlink() or not marker.is_file():
                continue  # not marked as hf-pma's: the user's, whatever its name
            with os.scandir(child) as entries:
                if not all(e.is_file(follow_symlinks=False) for e in entries):
                    continue
            remove_path(child)
            _logger().info(f"hf-pma: removed {escape(child)}, left by an interrupted write")
            removed.append(child)
    return removed


def orphan_snapshots(pma_dir: str | os.PathLike[str]) -> list[tuple[Path, SnapshotRecord | None]]:
    """Snapshot folders in ``pma_dir`` that the manifest does not list, with their record.

    A folder only gets its final ``snapshot-<tokens>`` name once complete, so an orphan is
    either a snapshot whose manifest update was interrupted (record readable) or a folder
    left by something else (record ``None``). Only real folders that hf-pma wrote count
    (:func:`is_snapshot_folder`): a symlink or a folder without a record is not an orphan.
    """
    pma_dir = Path(pma_dir)
    listed = {snapshot_path(pma_dir, r) for r in manifest_snapshots(pma_dir)}
    orphans: list[tuple[Path, SnapshotRecord | None]] = []
    for child in sorted(pma_dir.glob("snapshot-*")):
        if not is_snapshot_folder(child, pma_dir) or child.resolve() in listed:
            continue
        try:
            record = SnapshotRecord.from_dict(
                read_snapshot_record(child) or {}, str(child / SNAPSHOT_RECORD_NAME)
            )
            record.extra.pop(SNAPSHOT_FILES_KEY, None)  # what the folder holds: its own record's business
        except (OSError, ManifestError):
            record = None
        orphans.append((child, record))
    return orphans


def check_eval_results(results: Any, what: str = "results") -> None:
    """``ValueError`` unless ``results`` maps model labels to ``{task: {metric: number or null}}``
    (the ``results`` of ``pma_eval.json``); ``what`` names it in the one-line error."""
    if not isinstance(results, Mapping):
        raise ValueError(f"{what} should map a model label to its results, found {type(results).__name__}")
    for label, tasks in results.items():
        if not isinstance(tasks, Mapping):
            raise ValueError(
                f"{what}[{shown(label, 60)}] should map task names to metrics, found {type(tasks).__name__}"
            )
        for task, metrics in tasks.items():
            if not isinstance(metrics, Mapping):
                raise ValueError(
                    f"{what}[{shown(label, 60)}][{shown(task, 60)}] should map metric names to numbers"
                )
            for metric, value in metrics.items():
                if value is not None and not _is_number(value):
                    raise ValueError(
                        f"{what}[{shown(label, 60)}][{shown(task, 60)}][{shown(metric, 60)}] is {shown(value, 60)}, "
                        "not a number or null"
                    )


def check_eval_comparison(comparison: Any, what: str = "comparison") -> None:
    """``ValueError`` unless ``comparison`` (the ``comparison`` of ``pma_eval.json``, written by
    ``hf_pma.analysis.comparison.paired_comparison``) is absent (``None``) or an object whose
    labels are strings (they key the card's rows), counts and shares numbers, ``models`` an object
    of objects of numbers and ``anneal`` an object; ``what`` names it in the one-line error."""
    if comparison is None:
        return
    if not isinstance(comparison, Mapping):
        raise ValueError(f"{what} should be an object, found {shown(comparison, 60)}")
    checks = [
        (key, lambda v: isinstance(v, str), "a model label") for key in ("reference", "merge", "annealed")
    ]
    checks += [(key, _is_number, "a number") for key in ("documents", "tokens", "annealing_gain_recovered")]
    checks += [(key, lambda v: isinstance(v, Mapping), "an object") for key in ("models", "anneal")]
    for key, ok, expected in checks:
        value = comparison.get(key)
        if value is not None and not ok(value):
            raise ValueError(f"{what}[{shown(key, 60)}] should be {expected}, found {shown(value, 60)}")
    for label, row in (comparison.get("models") or {}).items():
        where = f"{what}['models'][{shown(label, 60)}]"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where} should be an object, found {shown(row, 60)}")
        for key in ("loss", "per_token_loss", "loss_diff", "paired_stderr", "tokens"):
            value = row.get(key)
            if value is not None and not _is_number(value):
                raise ValueError(f"{where}[{shown(key, 60)}] should be a number, found {shown(value, 60)}")


def tokenizer_candidates(folder: str | os.PathLike[str]) -> list[Path]:
    """Where the tokenizer of a model folder may be, in order: the folder itself, and, only for a
    folder of a run, the run folder (where the Trainer and ``scripts/pretrain.py`` save the
    tokenizer): ``<run>`` for ``<run>/pma/NAME`` (a snapshot, the run's merge), for ``<run>/NAME``
    beside the run's ``manifest.json``, and for a Trainer ``<run>/checkpoint-N``. Never a folder
    above otherwise: a ``tokenizer.json`` that someone put in the parent of a merged folder is not
    its tokenizer. The one rule of ``hf-pma merge`` (what it copies) and ``hf-pma eval`` (what it loads)."""
    folder = Path(folder)
    parent = folder.absolute().parent
    if parent.name == PMA_SUBDIR:
        return [folder, parent.parent]
    if (parent / MANIFEST_NAME).is_file() or re.fullmatch(r"checkpoint-\d+", folder.name):
        return [folder, parent]
    return [folder]
