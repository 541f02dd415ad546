"""How a local folder is read as sources: a PMA run, a Trainer output, or one model.

:func:`run_layout` says what a folder holds (a PMA manifest, Trainer ``checkpoint-*``
subfolders, weights at its top); :func:`run_sources` turns it into sources, oldest first: a
manifest's usable snapshots, else the ``checkpoint-*`` folders, and the run's final model (the
weights at its top, named :data:`FINAL_LABEL`) when asked; a folder with neither is one model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from hf_pma.core.manifest import (
    MANIFEST_NAME,
    PMA_SUBDIR,
    manifest_snapshots,
    missing_snapshot_error,
    read_manifest,
)
from hf_pma.io.guarded import check_folder
from hf_pma.io.sharded import sharded_weight_files
from hf_pma.merging.checkpoint_source import CheckpointSource, model_source, source_from_folder
from hf_pma.merging.weight_files import find_weight_files
from hf_pma.utils.logs import get_logger

logger = get_logger(__name__)

__all__ = ["FINAL_LABEL", "RunLayout", "run_layout", "run_sources"]

_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # fullmatch: "$" would pass "checkpoint-5\n"
# The name of a run's final model (the weights at the top of its folder) among merge sources.
FINAL_LABEL = "final"


@dataclasses.dataclass
class RunLayout:
    """What a local folder holds, as the sources resolve it: a PMA manifest, Trainer
    ``checkpoint-*`` subfolders, and weights at its top (a model folder, or a run's final model)."""

    path: Path
    manifest: Path | None
    checkpoints: list[Path]
    top_weights: list[Path]

    @property
    def is_run(self) -> bool:
        """True when the folder holds a manifest or ``checkpoint-*`` folders (its own weights,
        if any, are then the run's final model)."""
        return self.manifest is not None or bool(self.checkpoints)

    def found(self) -> str:
        """What the folder holds, in words (for error messages)."""
        parts = []
        if self.manifest is not None:
            parts.append(f"a PMA manifest ({self.manifest.relative_to(self.path)})")
        if self.checkpoints:
            names = [p.name for p in self.checkpoints]
            parts.append(
                f"{len(names)} checkpoint-* folder(s) ({names[0]} ... {names[-1]})"
                if len(names) > 1
                else names[0]
            )
        if self.top_weights:
            parts.append(f"model weights at its top ({self.top_weights[0].name})")
        return ", ".join(parts) or "nothing usable"


def run_layout(path: str | os.PathLike[str]) -> RunLayout:
    """How the sources read a local folder: a PMA manifest (``manifest.json`` or
    ``pma/manifest.json``) first, then ``checkpoint-*`` subfolders; weights at its top are a
    model folder when it holds neither, else the run's final model.

    Raises ``ValueError`` when the rule cannot settle it: two manifests; and
    :class:`~hf_pma.io.guarded.UnsafeFileError` (a ``ValueError``) for a ``pma/`` or a
    ``checkpoint-*`` folder that is a link leading out of ``path``.
    """
    path = Path(path)
    manifests = [c for c in (path / MANIFEST_NAME, path / PMA_SUBDIR / MANIFEST_NAME) if c.is_file()]
    if len(manifests) > 1:
        raise ValueError(
            f"{path} holds two PMA manifests, {manifests[0]} and {manifests[1]}: name the folder of the one to use"
        )
    found = [
        (int(m.group(1)), p) for p in path.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.fullmatch(p.name))
    ]
    # The run's pma/ and checkpoint-* folders must be inside it after links: a pma/ or a
    # checkpoint-N that links elsewhere would have its records and weights taken for the run's.
    for folder in [m.parent for m in manifests if m.parent != path] + [p for _, p in found]:
        check_folder(folder, path)
    top = find_weight_files(path)
    top_files = top[1] if top is not None else (sharded_weight_files(path) or [])
    return RunLayout(
        path, manifests[0] if manifests else None, [p for _, p in sorted(found)], list(top_files)
    )


def _expand_manifest(manifest: Path, layout: RunLayout) -> list[CheckpointSource]:
    pma_dir = manifest.parent
    interval = read_manifest(pma_dir).get("interval_tokens")
    sources = []
    for record in manifest_snapshots(pma_dir):
        if record.extra.get("excluded"):
            continue
        folder = pma_dir / record.path
        if not folder.is_dir():
            raise missing_snapshot_error(
                manifest, record.path, folder
            )  # or deleted since the manifest was read
        data = record.to_dict()
        data["interval_tokens"] = interval
        sources.append(source_from_folder(folder, record.tokens, record.step, data, root=layout.path))
    if not sources:
        others = [
            x
            for x in (
                f"{len(layout.checkpoints)} checkpoint-* folder(s)" if layout.checkpoints else "",
                f"a final model ({layout.top_weights[0].name})" if layout.top_weights else "",
            )
            if x
        ]
        hint = f"; the folder also holds {' and '.join(others)}: name them explicitly" if others else ""
        raise ValueError(f"the manifest {manifest} lists no usable snapshots yet{hint}")
    return sources


def _final(layout: RunLayout) -> CheckpointSource:
    """The run's final model (its top weights), named ``final``; its progress from the
    ``trainer_state.json`` beside it, when there is one."""
    source = source_from_folder(layout.path, root=layout.path)
    source.label = FINAL_LABEL
    return source


def _same_point(a: CheckpointSource, b: CheckpointSource) -> bool:
    """True when two sources were saved at the same point of training (same tokens when both
    are known, else same step); a run's final model is often its last snapshot or checkpoint."""
    if a.tokens is not None and b.tokens is not None:
        return a.tokens == b.tokens
    return a.step is not None and a.step == b.step


def run_sources(path: str | os.PathLike[str], include_final: bool = False) -> list[CheckpointSource]:
    """The sources a local folder or weight file stands for, oldest first (see the module
    docstring); ``include_final``: also the run's final model, as the newest (in place of the
    newest snapshot when both were saved at the same point). One-line errors say what the
    folder holds."""
    path = Path(path)
    if path.is_file():
        return [model_source(path)]
    layout = run_layout(path)
    if not layout.is_run:
        if layout.top_weights:
            return [source_from_folder(path)]
        runs = sorted(
            p.name for p in path.iterdir() if p.is_dir() and (run_layout(p).is_run or find_weight_files(p))
        )
        hint = f"; its subfolders {', '.join(runs[:5])} do: name one" if runs else ""
        raise FileNotFoundError(
            f"{path} holds no model weights, snapshots or checkpoints: give a run's output_dir (its pma/ "
            f"or checkpoint-* folders), a snapshot or a model folder{hint}"
        )
    if layout.manifest is not None:
        sources = _expand_manifest(layout.manifest, layout)
        if layout.checkpoints:
            logger.info(
                f"{path}: merging the PMA snapshots of {layout.manifest}; its {len(layout.checkpoints)} checkpoint-* folder(s) are left out"
            )
    else:
        sources = [source_from_folder(p, root=path) for p in layout.checkpoints]
    if include_final:
        if not layout.top_weights:
            raise ValueError(
                f"include_final: {path} has no final model at its top (it holds {layout.found()})"
            )
        final = _final(layout)
        if sources and _same_point(sources[-1], final):
            point = ", ".join(
                x
                for x in (
                    f"step {final.step}" if final.step is not None else "",
                    f"{final.tokens:,} tokens" if final.tokens is not None else "",
                )
                if x
            )
            logger.warning(
                f"{path}: the final model at its top was saved at the same point as {sources[-1].name} "
                f"({point}): it takes that source's place, so that point is merged once"
            )
            sources[-1] = final
        else:
            if final.tokens is None and final.step is None and sources:
                logger.warning(
                    f"{path}: the final model at its top has no trainer_state.json beside it, so the point it "
                    f"was saved at is unknown; it is merged as the newest source, after {sources[-1].name} "
                    "(if training ended there, that point counts twice: leave include_final (--include-final) "
                    "out)"
                )
            sources.append(final)
    elif layout.top_weights:
        logger.info(
            f"{path}: the final model at its top ({layout.top_weights[0].name}) is left out; "
            f"pass --include-final (include_final=True) or name {path / layout.top_weights[0].name} to use it"
        )
    return sources
