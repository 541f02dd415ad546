"""A run's snapshots as rows (tokens, step, learning rate, phase, loss, size, excluded or missing)
and as a plain-text table: what ``hf-pma inspect`` lists first, reading no weights."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import is_excluded, manifest_snapshots, snapshot_row
from hf_pma.io.sharded import sharded_weight_files
from hf_pma.merging.sources import CheckpointSource, find_weight_files, resolve_sources, run_layout
from hf_pma.utils.formatting import format_bytes, format_number, text_table

__all__ = ["snapshot_rows", "source_row", "snapshot_table"]


def _folder_bytes(folder: Path) -> int | None:
    try:
        found = find_weight_files(folder)
    except ValueError:
        return None
    files = found[1] if found else sharded_weight_files(folder)  # a sharded snapshot: its rank files
    # A size shown, never a file read: regular files only, links not followed (a link may lead
    # outside the run, or to itself), a file that vanished meanwhile not counted.
    sizes = []
    for f in files or []:
        try:
            info = os.lstat(f)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            sizes.append(info.st_size)
    return sum(sizes) if sizes else None


def snapshot_rows(run: str | os.PathLike[str], include_final: bool = False) -> list[dict[str, Any]]:
    """One row per snapshot of a run (a PMA manifest, else Trainer ``checkpoint-*`` folders, as
    :func:`hf_pma.merging.sources.resolve_sources` reads a run folder), oldest first: name,
    tokens, step, lr, phase, loss, size in bytes, and whether it is excluded from merges (with
    the reason); with ``include_final``, the final model at the run's top last."""
    run = Path(run)
    if not run.exists():
        raise FileNotFoundError(f"run folder {run} does not exist")
    manifest = run_layout(run).manifest if run.is_dir() else None
    if manifest is None:
        return [source_row(s) for s in resolve_sources([run], include_final=include_final)]
    rows = []
    for record in manifest_snapshots(manifest.parent):
        folder = manifest.parent / record.path
        rows.append(
            snapshot_row(
                Path(record.path).name,
                record.tokens,
                record.step,
                lr=record.lr,
                phase=record.phase,
                loss=record.loss,
                num_bytes=_folder_bytes(folder) if folder.is_dir() else None,
                excluded=is_excluded(record),
                excluded_reason=record.extra.get("excluded_reason"),
                missing=not folder.is_dir(),
            )
        )
    if not rows:
        raise ValueError(f"the manifest {manifest} lists no snapshots yet")
    if include_final:
        rows.append(source_row(resolve_sources([run], include_final=True)[-1]))
    return rows


def source_row(s: CheckpointSource) -> dict[str, Any]:
    """The row of one resolved source (a Trainer checkpoint, a final model, a Hub revision), as
    :func:`snapshot_rows` gives it: its record's learning rate, phase and loss when it has one."""
    record = s.record
    return snapshot_row(
        s.name,
        s.tokens,
        s.step,
        lr=record.get("lr"),
        phase=record.get("phase"),
        loss=record.get("loss"),
        num_bytes=s.num_bytes(),
    )


def snapshot_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of :func:`snapshot_rows`."""
    body = []
    for r in rows:
        note = (
            "excluded" + (f" ({r['excluded_reason']})" if r.get("excluded_reason") else "")
            if r["excluded"]
            else ""
        )
        if r.get("missing"):
            note = "missing folder"
        body.append(
            [
                r["name"],
                format_number(r["tokens"], ","),
                format_number(r["step"], ","),
                format_number(r["lr"], ".3g"),
                format_number(r["phase"]),
                format_number(r["loss"]),
                format_bytes(r["bytes"]),
                note,
            ]
        )
    return text_table(
        ["snapshot", "tokens", "step", "lr", "phase", "loss", "size", "note"], body, align="lrrrlrrl"
    )
