"""Turn what a user names (model folders, snapshots, Trainer checkpoints, runs) into checkpoints.

A *source* is one folder of weights with what is known of its place in training (tokens,
step, snapshot record). :func:`resolve_sources` expands run folders (a PMA manifest, or a
Trainer output folder with ``checkpoint-*``), orders everything by training progress when
that is known, and :meth:`CheckpointSource.open` gives tensor-level read access over all of a
folder's weight files (single-file or sharded safetensors, or ``.bin`` through
``torch.load(weights_only=True)``), or, for a folder of per-rank files (a sharded snapshot,
or what torch DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` writes), the same access
assembled from the ranks' slices (:mod:`hf_pma.io.sharded`). Hub sources (``org/model``,
``org/model@REV``, or a repo's revisions matching a pattern) are found, ordered and selected
before anything is downloaded (see :mod:`hf_pma.merging.hub_revisions`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_pma.core.manifest import (
    MANIFEST_NAME,
    MAX_RECORD_INT,
    PMA_SUBDIR,
    manifest_snapshots,
    missing_snapshot_error,
    read_manifest,
    read_snapshot_record,
)
from hf_pma.core.selection import WindowSpan, check_window, window_by_progress, window_span
from hf_pma.io.guarded import UnsafeFileError, check_file, read_json
from hf_pma.io.safetensors import CheckpointFormatError, SafetensorsCheckpoint, TensorInfo
from hf_pma.io.sharded import ShardedCheckpointTensors, sharded_weight_files
from hf_pma.merging.hub_revisions import (
    HubRevision,
    download_revisions,
    list_revisions,
    parse_hub_spec,
    resolve_revision,
)
from hf_pma.utils.logs import get_logger
from hf_pma.utils.names import check_revision_name, looks_local
from hf_pma.utils.text import escape, shown

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

__all__ = [
    "CheckpointSource",
    "CheckpointTensors",
    "FINAL_LABEL",
    "RunLayout",
    "run_layout",
    "model_source",
    "resolve_sources",
    "select_newest",
    "select_window",
    "sources_span",
    "describe_sources",
    "open_all",
    "open_weight_files",
    "find_weight_files",
    "WEIGHT_PREFIXES",
]

# "model" for full models, "adapter_model" for PEFT adapters.
WEIGHT_PREFIXES = ("model", "adapter_model")
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # fullmatch: "$" would pass "checkpoint-5\n"
# The name of a run's final model (the weights at the top of its folder) among merge sources.
FINAL_LABEL = "final"


def _is_file_name(name: object) -> bool:
    """A plain file name (what a shard index may list): no folder, no ``..``, nothing absolute."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    return not any(c in name for c in ("/", "\\", "\x00"))


def _present(path: Path) -> bool:
    """Whether something is at ``path`` (a file, a link, a FIFO, ...): what is there is then
    opened through :mod:`hf_pma.io.guarded`, which refuses anything but a regular file."""
    return not path.is_dir() and (path.exists() or path.is_symlink())


def find_weight_files(folder: Path, root: Path | None = None) -> tuple[str, list[Path]] | None:
    """The weight files of a model folder and their prefix, or ``None`` if it holds none.

    Prefers safetensors over ``.bin``; follows a shard index when there is one (its shards must
    be plain file names in ``folder``: a Hub cache's symlinked files are fine, a path is not).
    The index is read through :func:`hf_pma.io.guarded.read_json`, confined to ``root`` (the
    folder the user gave; default ``folder``).
    """
    for prefix in WEIGHT_PREFIXES:
        for suffix in ("safetensors", "bin"):
            stem = prefix if prefix == "adapter_model" or suffix == "safetensors" else "pytorch_model"
            index = folder / f"{stem}.{suffix}.index.json"
            single = folder / f"{stem}.{suffix}"
            if _present(index):
                data = read_json(index, root or folder, kind="index")
                weight_map = data.get("weight_map") if isinstance(data, dict) else None
                if not isinstance(weight_map, dict):
                    raise CheckpointFormatError(
                        f"{escape(index)} is not a valid shard index: no 'weight_map' object"
                    )
                names = list(dict.fromkeys(weight_map.values()))
                bad = next((n for n in names if not _is_file_name(n)), None)
                if bad is not None:
                    raise CheckpointFormatError(
                        f"{escape(index)} lists the shard {shown(bad)}: a shard must be a file name in {escape(folder)}, "
                        "without folders, '..' or an absolute path"
                    )
                files = [folder / name for name in names]
                missing = [escape(f.name) for f in files if not _present(f)]
                if missing:
                    raise CheckpointFormatError(
                        f"{escape(index)} lists shard(s) that do not exist: {', '.join(missing[:5])}"
                    )
                return prefix, files
            if _present(single):
                return prefix, [single]
    return None


class _BinCheckpoint:
    """``.bin`` state dicts loaded with ``torch.load(weights_only=True, mmap=True)``; ``read``
    gives raw bytes, as the safetensors readers do."""

    def __init__(self, files: Sequence[Path], root: Path | None = None) -> None:
        import torch

        from hf_pma.io.torch_adapters import safetensors_dtype

        self._state: dict[str, Any] = {}
        self._infos: dict[str, TensorInfo] = {}
        for path in files:
            real = check_file(path, root)  # confined, regular: torch.load opens the file it names
            try:
                state = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file
                raise CheckpointFormatError(
                    f"{path} could not be read as a PyTorch state dict: {err}"
                ) from err
            if not isinstance(state, dict):
                raise CheckpointFormatError(f"{path} does not hold a state dict (got {type(state).__name__})")
            for name, tensor in state.items():
                if not isinstance(tensor, torch.Tensor):
                    continue
                if name in self._state:
                    raise CheckpointFormatError(f"tensor {name!r} appears in two shards: {path} and another")
                dtype = safetensors_dtype(tensor.dtype, name)
                self._state[name] = tensor
                self._infos[name] = TensorInfo(
                    name, dtype, tuple(tensor.shape), 0, tensor.numel() * tensor.element_size()
                )

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def read(self, name: str, start: int = 0, stop: int | None = None, buffer: Any = None) -> Any:
        from hf_pma.io.torch_adapters import tensor_bytes

        return tensor_bytes(self._state[name].reshape(-1)[start:stop])

    def close(self) -> None:
        self._state = {}


def open_weight_files(files: Sequence[Path], sharded: bool = False, root: Path | None = None) -> Any:
    """Read access to weight files by the raw bytes of element ranges of tensors.

    ``sharded``: the files are one per rank (DCP layout). Safetensors files are read without
    torch; ``.bin`` files are loaded with ``torch.load(weights_only=True, mmap=True)``. Every
    file is opened through :mod:`hf_pma.io.guarded`, confined to ``root`` (the folder the user
    gave; default: each file's folder).
    """
    if sharded:
        return ShardedCheckpointTensors(files, root)
    if any(Path(f).suffix != ".safetensors" for f in files):
        return _BinCheckpoint([Path(f) for f in files], root)
    return SafetensorsCheckpoint(files, root)


class CheckpointTensors:
    """Read access to every tensor of one checkpoint folder, across its weight files, as torch tensors.

    The files are read as :func:`open_weight_files` reads them; :meth:`read` gives torch
    tensors (torch is imported when this class is first used).
    """

    def __init__(self, files: Sequence[Path], sharded: bool = False, root: Path | None = None) -> None:
        from hf_pma.io.torch_adapters import TorchTensors

        self.raw = open_weight_files([Path(f) for f in files], sharded, root)
        self._torch = TorchTensors(self.raw)

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype (a safetensors name), shape and location of every tensor."""
        return self.raw.infos

    def read(
        self, name: str, start: int = 0, stop: int | None = None, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name``, flattened (a view of ``buffer``, a uint8
        tensor, when given)."""
        return self._torch.read(name, start, stop, buffer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, loaded and reshaped (for small models and tests)."""
        return {n: self.read(n).clone().reshape(i.shape) for n, i in self.infos.items()}

    def close(self) -> None:
        """Close every file."""
        self.raw.close()

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    if _present(state_path):
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
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_RECORD_INT
            ):
                raise CheckpointFormatError(
                    f"{escape(state_path)}: '{key}' must be an integer from 0 to 2**63 - 1, got {shown(value, 60)}"
                )
        return tokens, step, {}
    return None, None, {}


def open_all(sources: Sequence[CheckpointSource], raw: bool = False) -> list[Any]:
    """Open every source (headers validated; ``raw``: torch-free, see :meth:`CheckpointSource.open_raw`);
    on a failure, close the ones already opened."""
    opened: list[Any] = []
    try:
        for source in sources:
            opened.append(source.open_raw() if raw else source.open())
    except BaseException:
        for tensors in opened:
            tensors.close()
        raise
    return opened


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


def _source_from_folder(
    folder: Path, tokens: int | None = None, step: int | None = None, record=None, root: Path | None = None
) -> CheckpointSource:
    """The source in ``folder``; ``root``: the folder the user gave, which every file read must
    stay inside after links (default ``folder``)."""
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

    Raises ``ValueError`` when the rule cannot settle it: two manifests.
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
    top = find_weight_files(path)
    top_files = top[1] if top is not None else (sharded_weight_files(path) or [])
    return RunLayout(
        path, manifests[0] if manifests else None, [p for _, p in sorted(found)], list(top_files)
    )


def model_source(path: str | os.PathLike[str]) -> CheckpointSource:
    """The model whose weights lie at the top of ``path`` (a model folder, or a run's final
    model), whatever else the folder holds; a weight file names its folder."""
    path = Path(path)
    if path.is_file():
        path = _folder_of_weight_file(path)
    return _source_from_folder(path)


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


def _expand_manifest(manifest: Path, layout: RunLayout) -> list[CheckpointSource]:
    pma_dir = manifest.parent
    interval = read_manifest(pma_dir).get("interval_tokens")
    sources = []
    for record in manifest_snapshots(pma_dir):
        if record.extra.get("excluded"):
            continue
        folder = pma_dir / record.path
        if not folder.is_dir():
            raise missing_snapshot_error(manifest, record.path, folder)  # or deleted since the manifest was read
        data = record.to_dict()
        data["interval_tokens"] = interval
        sources.append(_source_from_folder(folder, record.tokens, record.step, data, root=layout.path))
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
    source = _source_from_folder(layout.path, root=layout.path)
    source.label = FINAL_LABEL
    return source


def _same_point(a: CheckpointSource, b: CheckpointSource) -> bool:
    """True when two sources were saved at the same point of training (same tokens when both
    are known, else same step); a run's final model is often its last snapshot or checkpoint."""
    if a.tokens is not None and b.tokens is not None:
        return a.tokens == b.tokens
    return a.step is not None and a.step == b.step


def _expand_local(path: Path, include_final: bool) -> list[CheckpointSource]:
    if path.is_file():
        return [model_source(path)]
    layout = run_layout(path)
    if not layout.is_run:
        if layout.top_weights:
            return [_source_from_folder(path)]
        runs = sorted(
            p.name for p in path.iterdir() if p.is_dir() and (run_layout(p).is_run or find_weight_files(p))
        )
        hint = f"; its subfolders {', '.join(runs[:5])} do: name one" if runs else ""
        raise FileNotFoundError(
            f"{path} holds no model weights, no PMA manifest (manifest.json or pma/manifest.json) "
            f"and no Trainer checkpoint-* folders{hint}"
        )
    if layout.manifest is not None:
        sources = _expand_manifest(layout.manifest, layout)
        if layout.checkpoints:
            logger.info(
                f"{path}: merging the PMA snapshots of {layout.manifest}; its {len(layout.checkpoints)} checkpoint-* folder(s) are left out"
            )
    else:
        sources = [_source_from_folder(p, root=path) for p in layout.checkpoints]
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
                    "(if training ended there, that point counts twice: leave --include-final out)"
                )
            sources.append(final)
    elif layout.top_weights:
        logger.info(
            f"{path}: the final model at its top ({layout.top_weights[0].name}) is left out; "
            f"pass --include-final (include_final=True) or name {path / layout.top_weights[0].name} to use it"
        )
    return sources


def _expand(
    item: str | os.PathLike[str],
    revisions: str | None = None,
    endpoint: str | None = None,
    include_final: bool = False,
) -> list[Any]:
    """The checkpoints an item names: local sources now, Hub revisions still to download."""
    path = Path(item)
    if not path.exists():
        spec = parse_hub_spec(item) if isinstance(item, str) and not looks_local(item) else None
        if spec is None:
            raise FileNotFoundError(f"source {item} does not exist")
        repo_id, revision = spec
        if revision is not None:
            check_revision_name(revision, f"revision of {item}")  # before any request
        if revision is None and revisions is not None:
            return list_revisions(repo_id, revisions, endpoint=endpoint)
        return [resolve_revision(repo_id, revision, endpoint=endpoint)]
    return _expand_local(path, include_final)


def _download(
    items: list[Any], cache_dir: str | os.PathLike[str] | None, endpoint: str | None
) -> list[CheckpointSource]:
    """Download the selected Hub revisions (one disk-space check, one progress bar) into sources."""
    hub = [x for x in items if isinstance(x, HubRevision)]
    if not hub:
        return items
    folders = dict(zip(map(id, hub), download_revisions(hub, cache_dir=cache_dir, endpoint=endpoint)))
    out = []
    for x in items:
        if isinstance(x, HubRevision):
            source = _source_from_folder(folders[id(x)])
            source.tokens, source.step, source.record, source.label = x.tokens, x.step, x.record, x.name
            x = source
        out.append(x)
    return out


def _key(item: Any) -> Any:
    return (item.repo_id, item.commit) if isinstance(item, HubRevision) else item.path.resolve()


def select_newest(items: list[Any], last: int | None = None, every: int | None = None) -> list[Any]:
    """Every ``every``-th item counting back from the newest, then the newest ``last`` of those."""
    if every is not None and every > 1:
        items = items[::-1][::every][::-1]
    if last is not None:
        if len(items) < last:
            names = ", ".join(x.spec if isinstance(x, HubRevision) else str(x.path) for x in items)
            raise ValueError(f"asked for the last {last} sources but found only {len(items)}: {names}")
        items = items[-last:]
    return items


def _item_name(item: Any) -> str:
    return item.spec if isinstance(item, HubRevision) else item.name


def select_window(
    items: list[Any], window_tokens: int | None = None, window_steps: int | None = None
) -> list[Any]:
    """The items (oldest first) whose progress lies within the last ``window_tokens`` tokens or
    ``window_steps`` optimizer steps of the newest (see :func:`hf_pma.core.selection.window_by_progress`);
    every item unchanged when neither is given. ``ValueError`` naming the items without a count
    in that unit."""
    if window_tokens is None and window_steps is None:
        return items
    check_window(window_tokens, window_steps)
    unit, span = ("tokens", window_tokens) if window_tokens is not None else ("steps", window_steps)
    positions = [x.tokens if unit == "tokens" else x.step for x in items]
    try:
        chosen = window_by_progress(positions, span, unit)
    except ValueError:
        missing = [_item_name(x) for x, pos in zip(items, positions) if pos is None]
        hint = (
            " (Trainer checkpoints record tokens only with include_num_input_tokens_seen=True): "
            "give the window in steps (--window-steps, window_steps=)"
            if unit == "tokens"
            else ""
        )
        raise ValueError(
            f"a window of {span:,} {unit} needs every source's {unit[:-1]} count; {len(missing)} have none: "
            f"{', '.join(missing[:5])}{hint}"
        ) from None
    return [items[i] for i in chosen]


def sources_span(
    sources: Sequence[Any], requested: int | None = None, unit: str | None = None
) -> WindowSpan | None:
    """The progress the sources span (tokens when all know them, else steps), or ``None``."""
    return window_span([s.tokens for s in sources], [s.step for s in sources], requested, unit)


def describe_sources(sources: Sequence[Any], requested: int | None = None, unit: str | None = None) -> str:
    """One line saying which sources a merge takes: count, first and last name, progress span
    (in ``unit``, with the ``requested`` window when the window was asked in tokens or steps)."""
    if not sources:
        return "no sources"
    names = (
        _item_name(sources[0])
        if len(sources) == 1
        else f"{_item_name(sources[0])} ... {_item_name(sources[-1])}"
    )
    span = sources_span(sources, requested, unit)
    where = f", {span.describe()}" if span is not None else ", training progress unknown"
    return f"{len(sources)} source(s): {names}{where}"


def order_by_progress(sources: list[CheckpointSource]) -> list[CheckpointSource]:
    """Sort by tokens when every source knows them, else by step, else keep the given order
    (training stages, like OLMo's, first: their token and step counts restart)."""
    if all(s.tokens is not None for s in sources):
        return sorted(sources, key=lambda s: (s.record.get("stage") or 0, s.tokens, s.step or 0))
    if all(s.step is not None for s in sources):
        return sorted(sources, key=lambda s: (s.record.get("stage") or 0, s.step))
    if len(sources) > 1:
        logger.info(
            "Training progress is unknown for some sources: merging them in the order given (oldest first)."
        )
    return sources


def resolve_sources(
    inputs: Sequence[str | os.PathLike[str]],
    last: int | None = None,
    *,
    every: int | None = None,
    revisions: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    include_final: bool = False,
    window_tokens: int | None = None,
    window_steps: int | None = None,
) -> list[CheckpointSource]:
    """Expand and order what the user named, oldest first; keep every ``every``-th counting back
    from the newest, then the newest ``last`` (or those within the last ``window_tokens``
    tokens, or ``window_steps`` steps, of the newest).

    A local folder resolves in this order: a PMA manifest (``manifest.json`` or
    ``pma/manifest.json``: its usable snapshots), else ``checkpoint-*`` subfolders; weights at
    the top of a folder that holds either are the run's final model, taken (as the newest
    source, named ``final``) only with ``include_final`` or when its weight file is named
    (``RUN/model.safetensors``). A folder with neither is one model. Two manifests, or a
    manifest without usable snapshots, are errors naming what the folder holds.

    ``inputs`` may mix model folders, snapshot folders, Trainer ``checkpoint-*`` folders, run
    folders, a model's weight file, and Hub models: ``org/model`` (its default branch, or with ``revisions`` its branches and
    tags matching that glob or ``/regex/``) and ``org/model@REV``. Hub revisions are ordered
    and selected first and only the selected ones are downloaded (into ``cache_dir``, default
    the ``huggingface_hub`` cache, from ``endpoint``, default ``HF_ENDPOINT``).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no sources given")
    for flag, value in (("--last", last), ("--every", every)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    check_window(window_tokens, window_steps, last)
    if revisions is not None and not any(
        not Path(i).exists() and (spec := parse_hub_spec(i)) is not None and spec[1] is None for i in inputs
    ):
        raise ValueError(
            f"--revisions {revisions!r} applies to a Hub repo given as org/model, and no source is one"
        )
    items = [x for item in inputs for x in _expand(item, revisions, endpoint, include_final)]
    seen: dict[Any, Any] = {}
    for x in items:
        if _key(x) in seen:
            what = x.spec if isinstance(x, HubRevision) else x.path
            raise ValueError(
                f"source {what} is given twice (directly, through a run folder or as the same commit)"
            )
        seen[_key(x)] = x
    local_prefixes = {x.prefix for x in items if isinstance(x, CheckpointSource)}
    if len(local_prefixes) > 1:
        raise ValueError(
            "cannot merge full models with PEFT adapters: "
            + ", ".join(f"{x.path} ({x.prefix})" for x in items)
        )
    selected = select_window(
        select_newest(order_by_progress(items), last, every), window_tokens, window_steps
    )
    sources = _download(selected, cache_dir, endpoint)
    prefixes = {s.prefix for s in sources}
    if len(prefixes) > 1:
        raise ValueError(
            "cannot merge full models with PEFT adapters: "
            + ", ".join(f"{s.name} ({s.prefix})" for s in sources)
        )
    return sources
