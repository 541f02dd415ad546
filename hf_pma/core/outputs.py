"""What ``overwrite`` may replace: only an output that hf-pma wrote, never the user's data.

A merge, consolidate or make-tasks output is replaced (``overwrite=True``, ``--overwrite``) only
when it is a folder this library wrote (a real folder holding the command's record, see
:func:`hf_pma.utils.fs.is_library_folder`) and everything in it is hf-pma's by that record: the
files the record lists (:data:`OWN_FILES_KEY`, written by :func:`record_own_files`) and the
records hf-pma adds to an output later (:data:`LATER_RECORDS`: the eval record, the training
record, the card and its plot). A folder holding anything else (a LoRA adapter, notes) is the
user's too and is refused in one line listing what is foreign. Never a Trainer ``checkpoint-*``
folder or a snapshot that a manifest in a folder above it lists (the manifest would then name
a merge as a snapshot). An empty or missing folder is always fine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from hf_pma.core.manifest import (
    CARD_MARK,
    CARD_NAME,
    EVAL_RECORD_NAME,
    MANIFEST_NAME,
    PLOT_NAME,
    PMA_SUBDIR,
    SNAPSHOT_FILES_KEY,
    SNAPSHOT_RECORD_NAME,
    TRAINING_RECORD_NAME,
)
from hf_pma.io.guarded import read_bytes, read_json
from hf_pma.utils.fs import is_library_folder
from hf_pma.utils.parsing import parameter_error
from hf_pma.utils.read_files import listed_folder_among
from hf_pma.utils.text import escape

__all__ = [
    "TRAINER_CHECKPOINT_PATTERN",
    "OWN_FILES_KEY",
    "LATER_RECORDS",
    "LATER_RECORD_MARKS",
    "bears_mark",
    "check_overwrite_target",
    "not_all_own",
    "foreign_entries",
    "listing_manifest",
    "record_own_files",
    "recorded_files",
]

# The folders Trainer saves checkpoints in.
TRAINER_CHECKPOINT_PATTERN = r"checkpoint-\d+"
# Where an output's record lists the files hf-pma wrote in it (top level of a merge or tasks
# record; ``extra.files`` of a snapshot record, as the snapshot writer writes it).
OWN_FILES_KEY = "files"
# Records hf-pma adds to an output folder after writing it (``eval --record``, a training's
# record of its merge, ``hf-pma card`` and its plot): hf-pma's by name.
LATER_RECORDS = (EVAL_RECORD_NAME, TRAINING_RECORD_NAME, CARD_NAME, PLOT_NAME)
# A later record under a name others use too is hf-pma's only when it holds hf-pma's mark (within
# its first _MARK_WITHIN bytes): a README.md the user wrote is the user's.
LATER_RECORD_MARKS = {CARD_NAME: CARD_MARK}
_MARK_WITHIN = 1 << 20
_SHOWN_FOREIGN = 5


def record_own_files(folder: str | os.PathLike[str], record: dict, marker: str) -> dict:
    """``record`` with the files of the output being written in ``folder`` (a temporary folder,
    before its record is written: every regular file in it, as relative POSIX paths, and the
    record ``marker`` itself) listed where :func:`recorded_files` reads them."""
    folder = Path(folder)
    files = sorted(
        {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()} | {marker}
    )
    if marker == SNAPSHOT_RECORD_NAME:
        return {**record, "extra": {**(record.get("extra") or {}), SNAPSHOT_FILES_KEY: files}}
    return {**record, OWN_FILES_KEY: files}


def recorded_files(folder: str | os.PathLike[str], marker: str) -> set[str] | None:
    """The files that the record ``marker`` in ``folder`` says hf-pma wrote there (with the record
    itself), or ``None`` when it lists none (or cannot be read)."""
    try:
        data = read_json(Path(folder) / marker)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    files = data.get(OWN_FILES_KEY)
    if files is None and isinstance(data.get("extra"), dict):
        files = data["extra"].get(SNAPSHOT_FILES_KEY)
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return {*files, marker}


def foreign_entries(folder: str | os.PathLike[str], own: set[str]) -> list[str]:
    """What in ``folder`` is not hf-pma's: relative paths of the files (and links, and other
    entries) not in ``own`` nor :data:`LATER_RECORDS`, and of the folders holding none of ``own``;
    in order."""
    folder = Path(folder)
    own = own | {name for name in LATER_RECORDS if name not in LATER_RECORD_MARKS or bears_mark(folder / name)}
    parents = {parent.as_posix() for name in own for parent in Path(name).parents if parent.as_posix() != "."}
    foreign: list[str] = []
    for root, dirs, files in os.walk(folder):
        base = Path(root).relative_to(folder)
        for name in sorted(dirs):
            relative = (base / name).as_posix()
            if relative not in parents or (Path(root) / name).is_symlink():
                foreign.append(relative + "/")
        dirs[:] = sorted(d for d in dirs if (base / d).as_posix() in parents and not (Path(root) / d).is_symlink())
        for name in sorted(files):
            relative = (base / name).as_posix()
            path = Path(root) / name
            if relative not in own or path.is_symlink() or not path.is_file():
                foreign.append(relative)
    return foreign


def bears_mark(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (not a link) of at most :data:`_MARK_WITHIN` bytes
    holding hf-pma's mark for its name (:data:`LATER_RECORD_MARKS`)."""
    path = Path(path)
    try:
        head = read_bytes(path, max_bytes=_MARK_WITHIN)
    except (OSError, ValueError):  # a link, a FIFO, too large: not one hf-pma wrote
        return False
    return LATER_RECORD_MARKS[path.name].encode() in head


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def listing_manifest(folder: str | os.PathLike[str]) -> Path | None:
    """The manifest (``manifest.json`` or ``pma/manifest.json`` in ``folder``'s parents) that
    lists ``folder`` as a snapshot, if any. Each is read bounded in bytes and entries
    (:func:`hf_pma.utils.read_files.listed_folder_among`): a manifest above an output may be anyone's."""
    target = _resolved(Path(folder))
    if target is None:
        return None
    for parent in target.parents:
        for manifest in (parent / MANIFEST_NAME, parent / PMA_SUBDIR / MANIFEST_NAME):
            if listed_folder_among(manifest, {target}) is not None:
                return manifest
    return None


def check_overwrite_target(
    output_dir: str | os.PathLike[str], markers: Sequence[str], what: str = "output"
) -> None:
    """Refuse (``FileExistsError``, one line naming the folder and why) to replace ``output_dir``
    unless it is missing, empty, or a folder hf-pma wrote (a real folder holding one of
    ``markers``, e.g. ``pma_merge.json``) that is neither a Trainer ``checkpoint-*`` folder nor a
    snapshot listed in a manifest above it. Call it before the first byte, with overwrite on."""
    output_dir = Path(output_dir)
    if not output_dir.exists() and not output_dir.is_symlink():
        return
    if output_dir.is_dir() and not output_dir.is_symlink() and not any(output_dir.iterdir()):
        return
    choose = f"choose another {what} folder"
    if re.fullmatch(TRAINER_CHECKPOINT_PATTERN, output_dir.name) or (output_dir / "trainer_state.json").is_file():
        why = f"it is a Trainer checkpoint; {choose}"
    elif (manifest := listing_manifest(output_dir)) is not None:
        why = f"it is a snapshot listed in {escape(manifest)}; {choose}"
    elif (output_dir / SNAPSHOT_RECORD_NAME).is_file() and (output_dir.parent / MANIFEST_NAME).is_file():
        why = f"it is a snapshot of the run in {escape(output_dir.parent)}; {choose}"
    elif not is_library_folder(output_dir, tuple(markers)):
        why = f"hf-pma did not write it (no {' or '.join(markers)} inside, or it is a link); remove it yourself or {choose}"
    elif (problem := not_all_own(output_dir, markers)) is not None:
        why = f"{problem}; {choose}"
    else:
        return
    # In library words ("overwrite refuses ..."); the command shows the parameter as --overwrite.
    raise parameter_error("overwrite", f"refuses to replace {escape(output_dir)}: {why}", FileExistsError)


def not_all_own(output_dir: str | os.PathLike[str], markers: Sequence[str]) -> str | None:
    """Why not everything in ``output_dir`` (a folder holding one of the records ``markers``) is
    hf-pma's by that record (:func:`recorded_files`, :data:`LATER_RECORDS`), in a few words that
    name what is foreign; ``None`` when everything is."""
    output_dir = Path(output_dir)
    marker = next((m for m in markers if (output_dir / m).is_file()), None)
    if marker is None:
        return f"it holds no {' or '.join(markers)}, so anything in it may be the user's: remove it yourself"
    own = recorded_files(output_dir, marker)
    if own is None:
        return f"its record {marker} does not list the files hf-pma wrote, so anything in it may be the user's: remove it yourself"
    foreign = foreign_entries(output_dir, own)
    if not foreign:
        return None
    shown_names = ", ".join(escape(name) for name in foreign[:_SHOWN_FOREIGN])
    more = f" and {len(foreign) - _SHOWN_FOREIGN} more" if len(foreign) > _SHOWN_FOREIGN else ""
    return f"it holds what hf-pma did not write ({shown_names}{more}): move them out"
