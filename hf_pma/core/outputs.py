"""What ``overwrite`` may replace: only an output that hf-pma wrote, never the user's data.

A merge, consolidate or make-tasks output is replaced (``overwrite=True``, ``--overwrite``) only
when it is a folder this library wrote (a real folder holding the command's record, see
:func:`hf_pma.utils.fs.is_library_folder`), and never when it is a Trainer ``checkpoint-*``
folder or a snapshot that a manifest in a folder above it lists (the manifest would then name
a merge as a snapshot). An empty or missing folder is always fine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from hf_pma.core.manifest import MANIFEST_NAME, PMA_SUBDIR, SNAPSHOT_RECORD_NAME
from hf_pma.io.guarded import read_json
from hf_pma.utils.fs import is_library_folder
from hf_pma.utils.parsing import parameter_error
from hf_pma.utils.text import escape

__all__ = ["TRAINER_CHECKPOINT_PATTERN", "check_overwrite_target", "listing_manifest"]

# The folders Trainer saves checkpoints in.
TRAINER_CHECKPOINT_PATTERN = r"checkpoint-\d+"


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def _listed_paths(manifest: Path) -> list[str]:
    # Read leniently: this only looks for a reason to refuse, a malformed manifest is no reason to allow.
    try:
        data = read_json(manifest)
    except (OSError, ValueError):
        return []
    entries = data.get("snapshots") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return []
    return [
        e["path"] for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str) and e["path"]
    ]


def listing_manifest(folder: str | os.PathLike[str]) -> Path | None:
    """The manifest (``manifest.json`` or ``pma/manifest.json`` in ``folder``'s parents) that
    lists ``folder`` as a snapshot, if any."""
    target = _resolved(Path(folder))
    if target is None:
        return None
    for parent in target.parents:
        for manifest in (parent / MANIFEST_NAME, parent / PMA_SUBDIR / MANIFEST_NAME):
            if not manifest.is_file():
                continue
            for relative in _listed_paths(manifest):
                if _resolved(manifest.parent / relative) == target:
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
    else:
        return
    # In library words ("overwrite refuses ..."); the command shows the parameter as --overwrite.
    raise parameter_error("overwrite", f"refuses to replace {escape(output_dir)}: {why}", FileExistsError)
