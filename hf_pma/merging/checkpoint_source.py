"""One source of a merge: a folder of weights and what is known of its place in training.

:class:`CheckpointSource` holds the folder, its weight files (:mod:`hf_pma.merging.weight_files`),
its tokens, step and snapshot record, and the folder the user gave (every read stays inside it).
:func:`source_from_folder` makes one from a folder (its progress from its snapshot record or its
``trainer_state.json``), :func:`model_source` from the weights at a folder's top. :func:`open_all`
opens several at once; :func:`vanished_source_error` names a source deleted since it was resolved;
:func:`recorded_interval` and :func:`tokenizer_folder` read what a merge records and copies.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import (
    MAX_RECORD_INT,
    TOKENIZER_FILES,
    find_manifest,
    missing_snapshot_error,
    read_snapshot_record,
    tokenizer_candidates,
)
from hf_pma.io.guarded import UnsafeFileError, pin_folder, read_json
from hf_pma.io.safetensors import CheckpointFormatError
from hf_pma.io.sharded import sharded_weight_files
from hf_pma.merging.weight_files import CheckpointTensors, file_present, find_weight_files, open_weight_files
from hf_pma.utils.limits import allow_open_files
from hf_pma.utils.parsing import is_int
from hf_pma.utils.text import escape, shown

__all__ = [
    "CheckpointSource",
    "source_from_folder",
    "model_source",
    "open_all",
    "vanished_source_error",
    "recorded_interval",
    "tokenizer_folder",
]


@dataclasses.dataclass
class CheckpointSource:
    """One folder of weights and what is known about when in training it was taken."""

    path: Path
    prefix: str
    files: list[Path]
    tokens: int | None = None
    step: int | None = None
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    label: str | None = None
    # True for a sharded folder (one file per rank, DCP layout): read by global element ranges.
    sharded: bool = False
    # The folder the user gave (a run, a model folder): every file read stays inside it after
    # links (see hf_pma.io.guarded); ``None``: ``path`` itself.
    root: Path | None = None

    @property
    def confined_to(self) -> Path:
        """The folder this source's files must stay inside, after symbolic links."""
        return self.root if self.root is not None else self.path

    @property
    def name(self) -> str:
        """The folder's name, or the revision's name for a Hub revision."""
        return self.label or self.path.name

    @property
    def is_adapter(self) -> bool:
        """True for a PEFT adapter folder (``adapter_model.*``)."""
        return self.prefix == "adapter_model"

    def open(self) -> CheckpointTensors:
        """Open the weight files for reading as torch tensors (validates their headers; a sharded
        folder's slices must cover every tensor exactly once)."""
        return CheckpointTensors(self.files, self.sharded, self.confined_to)

    def open_raw(self) -> Any:
        """Open the weight files for reading the bytes of element ranges (torch-free for safetensors)."""
        return open_weight_files(self.files, self.sharded, self.confined_to)

    def num_bytes(self) -> int:
        """Total size of the weight files."""
        return sum(f.stat().st_size for f in self.files)


def _progress_of(folder: Path, root: Path | None = None) -> tuple[int | None, int | None, dict[str, Any]]:
    """Tokens and step of a folder from its snapshot record (checked) or Trainer state, if any."""
    record = read_snapshot_record(folder, required=())  # checked: a malformed one is a ManifestError
    if record is not None:
        return record.get("tokens"), record.get("step"), record
    state_path = folder / "trainer_state.json"
    if file_present(state_path):
        try:
            state = read_json(state_path, root or folder, kind="trainer_state")
        except UnsafeFileError:  # a link out of the folder, a FIFO, too large: refused, naming it
            raise
        except ValueError:  # not JSON: the progress is unknown, as without the file
            return None, None, {}
        if not isinstance(state, dict):
            raise CheckpointFormatError(
                f"{escape(state_path)} should hold a JSON object, got {type(state).__name__}"
            )
        step = state.get("global_step")
        tokens = state.get("num_input_tokens_seen") or None  # 0 means "not counted"
        for key, value in (("global_step", step), ("num_input_tokens_seen", tokens)):
            if value is not None and not is_int(value, 0, MAX_RECORD_INT):
                raise CheckpointFormatError(
                    f"{escape(state_path)}: '{key}' must be an integer from 0 to 2**63 - 1, got {shown(value, 60)}"
                )
        return tokens, step, {}
    return None, None, {}


def allow_open_sources(sources: Sequence[CheckpointSource]) -> None:
    """Raise the open-file limit to hold every weight file of ``sources`` open together (a merge
    reads them all at once); ``ValueError`` in one line when even the hard limit is too low
    (:func:`hf_pma.utils.limits.allow_open_files`). Call it before any work."""
    count = sum(len(source.files) for source in sources)
    allow_open_files(
        count, f"the {len(sources):,} sources hold {count:,} weight files to read together", "use fewer sources"
    )


def open_all(sources: Sequence[CheckpointSource], raw: bool = False) -> list[Any]:
    """Open every source (headers validated; ``raw``: torch-free, see :meth:`CheckpointSource.open_raw`);
    on a failure, close the ones already opened. The open-file limit is raised first to hold
    them all (:func:`allow_open_sources`)."""
    allow_open_sources(sources)
    opened: list[Any] = []
    try:
        for source in sources:
            opened.append(source.open_raw() if raw else source.open())
    except BaseException as err:
        for tensors in opened:
            tensors.close()
        gone = vanished_source_error(sources) if isinstance(err, (OSError, ValueError)) else None
        if gone is not None:
            raise gone from err
        raise
    return opened


def vanished_source_error(sources: Sequence[CheckpointSource]) -> FileNotFoundError | None:
    """The one-line error for the first of ``sources`` whose folder or weight files are gone since
    it was resolved (a training's ``keep_last`` rotating a snapshot out while a command runs):
    a snapshot from a manifest is named with it (:func:`hf_pma.core.manifest.missing_snapshot_error`);
    ``None`` when every source is still there."""
    for source in sources:
        # A file still there in any form (a FIFO, a link) is not gone: its own error names it.
        if source.path.is_dir() and all(os.path.lexists(f) for f in source.files):
            continue
        name = source.record.get("path")
        manifest = find_manifest(source.confined_to) if isinstance(name, str) else None
        if manifest is not None:
            return missing_snapshot_error(manifest, name, source.path, seen=True)
        return FileNotFoundError(
            f"source {escape(source.path)} was deleted while this command ran (a checkpoint rotation?); run it again"
        )
    return None


def _sharded_files(folder: Path) -> list[Path] | None:
    """A sharded folder's rank files; fails naming the ranks missing from its record's world size."""
    files = sharded_weight_files(folder)
    if files is None:
        return None
    record = read_snapshot_record(folder, required=()) or {}  # checked: world_size a positive integer
    world = (record.get("extra") or {}).get("world_size")
    if world is not None and len(files) != world:
        raise CheckpointFormatError(
            f"sharded snapshot {folder} was written by {world} ranks but holds {len(files)} rank files"
        )
    return files


def source_from_folder(
    folder: Path,
    tokens: int | None = None,
    step: int | None = None,
    record: dict[str, Any] | None = None,
    root: Path | None = None,
) -> CheckpointSource:
    """The source in ``folder``; ``root``: the folder the user gave, which every file read must
    stay inside after links (default ``folder``). Without ``tokens`` and ``step``, they (and the
    record) come from the folder's snapshot record or ``trainer_state.json``. Inside
    :func:`hf_pma.io.guarded.one_version`, the folder is pinned before its first file is read."""
    pin_folder(folder)
    found = find_weight_files(folder, root)
    sharded = found is None and (files := _sharded_files(folder)) is not None
    if sharded:
        found = ("model", files)
    if found is None:
        raise FileNotFoundError(
            f"{folder} holds no model weights (looked for model.safetensors, model.safetensors.index.json, "
            f"pytorch_model.bin, adapter_model.safetensors, per-rank shard-*-model-*.safetensors)"
        )
    prefix, files = found
    if tokens is None and step is None:
        tokens, step, record = _progress_of(folder, root)
    return CheckpointSource(
        folder, prefix, files, tokens, step, dict(record or {}), sharded=sharded, root=root
    )


def model_source(path: str | os.PathLike[str]) -> CheckpointSource:
    """The model whose weights lie at the top of ``path`` (a model folder, or a run's final
    model), whatever else the folder holds; a weight file names its folder."""
    path = Path(path)
    if path.is_file():
        path = _folder_of_weight_file(path)
    return source_from_folder(path)


def _folder_of_weight_file(path: Path) -> Path:
    """The folder of a weight file named as a source (``RUN/model.safetensors``: the model at
    RUN's top); ``ValueError`` for any other file."""
    found = find_weight_files(path.parent)
    files = found[1] if found else (sharded_weight_files(path.parent) or [])
    stems = ("model.", "pytorch_model.", "adapter_model.")
    if path.name in {f.name for f in files} or (
        files and path.name.endswith(".index.json") and path.name.startswith(stems)
    ):
        return path.parent
    raise ValueError(f"source {path} is a file; give the model folder that holds it, or its weight file")


def recorded_interval(source: Any) -> int | None:
    """The snapshot interval V (tokens) a source was taken at, as its record says: the snapshot's
    own (``extra.interval_tokens``), else its run manifest's; ``None`` when unknown."""
    record = getattr(source, "record", None) or {}
    extra = record.get("extra") if isinstance(record.get("extra"), dict) else {}
    for value in (extra.get("interval_tokens"), record.get("interval_tokens")):
        if is_int(value, 1):
            return value
    return None


def tokenizer_folder(
    sources: Sequence[CheckpointSource], tokenizer: str | os.PathLike[str] | None = None
) -> Path | None:
    """The folder whose tokenizer files a merge of ``sources`` copies: ``tokenizer`` when the user
    names one (``FileNotFoundError`` when it holds no tokenizer), else the newest source's own
    folder when it holds one, else the folder the user named that holds that source, else the
    run folder of that source by :func:`hf_pma.core.manifest.tokenizer_candidates` (``<run>`` for
    ``<run>/pma/snapshot-N``: ``hf-pma merge OUTPUT_DIR/pma`` finds the tokenizer the Trainer saved
    in ``OUTPUT_DIR``), the rule ``hf-pma eval`` loads by; ``None`` when none does."""
    if tokenizer is not None:
        folder = Path(tokenizer)
        if not folder.is_dir() or not any(file_present(folder / n) for n in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"tokenizer folder {escape(folder)} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...)"
            )
        return folder
    newest = sources[-1]
    for folder in (newest.path, newest.root, *tokenizer_candidates(newest.path)[1:]):
        if folder is not None and any(file_present(folder / n) for n in TOKENIZER_FILES):
            return folder
    return None
