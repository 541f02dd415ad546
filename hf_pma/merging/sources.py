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

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_pma.core.manifest import SNAPSHOT_RECORD_NAME, find_manifest, manifest_snapshots, read_manifest
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

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

__all__ = [
    "CheckpointSource",
    "CheckpointTensors",
    "resolve_sources",
    "select_newest",
    "open_all",
    "open_weight_files",
    "find_weight_files",
    "WEIGHT_PREFIXES",
]

# "model" for full models, "adapter_model" for PEFT adapters.
WEIGHT_PREFIXES = ("model", "adapter_model")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def find_weight_files(folder: Path) -> tuple[str, list[Path]] | None:
    """The weight files of a model folder and their prefix, or ``None`` if it holds none.

    Prefers safetensors over ``.bin``; follows a shard index when there is one.
    """
    for prefix in WEIGHT_PREFIXES:
        for suffix in ("safetensors", "bin"):
            stem = prefix if prefix == "adapter_model" or suffix == "safetensors" else "pytorch_model"
            index = folder / f"{stem}.{suffix}.index.json"
            single = folder / f"{stem}.{suffix}"
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as err:
                    raise CheckpointFormatError(f"{index} is not a valid shard index: {err}") from err
                files = [folder / name for name in dict.fromkeys(weight_map.values())]
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise CheckpointFormatError(
                        f"{index} lists shard(s) that do not exist: {', '.join(missing)}"
                    )
                return prefix, files
            if single.is_file():
                return prefix, [single]
    return None


class _BinCheckpoint:
    """``.bin`` state dicts loaded with ``torch.load(weights_only=True, mmap=True)``; ``read`` gives torch tensors."""

    def __init__(self, files: Sequence[Path]) -> None:
        import torch

        from hf_pma.io.torch_adapters import safetensors_dtype

        self._state: dict[str, Any] = {}
        self._infos: dict[str, TensorInfo] = {}
        for path in files:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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
        return self._state[name].reshape(-1)[start:stop]

    def close(self) -> None:
        self._state = {}


def open_weight_files(
    files: Sequence[Path], sharded: bool = False
) -> SafetensorsCheckpoint | ShardedCheckpointTensors:
    """Raw (torch-free) read access to safetensors weight files: bytes by element ranges.

    ``sharded``: the files are one per rank (DCP layout). ``.bin`` files need torch
    (:class:`CheckpointTensors`); ``ValueError`` here.
    """
    if sharded:
        return ShardedCheckpointTensors(files)
    if any(Path(f).suffix != ".safetensors" for f in files):
        raise ValueError("reading .bin weights needs torch; open them with CheckpointTensors")
    return SafetensorsCheckpoint(files)


class CheckpointTensors:
    """Read access to every tensor of one checkpoint folder, across its weight files, as torch tensors.

    Safetensors files (plain, sharded by an index, or one per rank with ``sharded``) are read by
    byte ranges (:mod:`hf_pma.io`); ``.bin`` files are loaded with
    ``torch.load(weights_only=True, mmap=True)``. torch is imported on first use.
    """

    def __init__(self, files: Sequence[Path], sharded: bool = False) -> None:
        from hf_pma.io.torch_adapters import TorchTensors

        files = [Path(f) for f in files]
        self._bin = not sharded and any(f.suffix != ".safetensors" for f in files)
        self.raw = _BinCheckpoint(files) if self._bin else open_weight_files(files, sharded)
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
        if self._bin:
            return self.raw.read(name, start, stop)
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

    @property
    def name(self) -> str:
        """The folder's name, or the revision's name for a Hub revision."""
        return self.label or self.path.name

    @property
    def is_adapter(self) -> bool:
        """True for a PEFT adapter folder (``adapter_model.*``)."""
        return self.prefix == "adapter_model"

    @property
    def needs_torch(self) -> bool:
        """True when the weights are ``.bin`` pickles (only torch reads them)."""
        return not self.sharded and any(f.suffix != ".safetensors" for f in self.files)

    def open(self) -> CheckpointTensors:
        """Open the weight files for reading as torch tensors (validates their headers; a sharded
        folder's slices must cover every tensor exactly once)."""
        return CheckpointTensors(self.files, self.sharded)

    def open_raw(self) -> SafetensorsCheckpoint | ShardedCheckpointTensors:
        """Open safetensors weight files for torch-free reading (bytes by element ranges)."""
        return open_weight_files(self.files, self.sharded)

    def num_bytes(self) -> int:
        """Total size of the weight files."""
        return sum(f.stat().st_size for f in self.files)


def _progress_of(folder: Path) -> tuple[int | None, int | None, dict[str, Any]]:
    """Tokens and step of a folder from its snapshot record or Trainer state, if any."""
    record_path = folder / SNAPSHOT_RECORD_NAME
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            return record.get("tokens"), record.get("step"), record
        except ValueError:
            logger.warning(f"Ignoring unreadable snapshot record {record_path}")
    state_path = folder / "trainer_state.json"
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
        except ValueError:
            return None, None, {}
        step = state.get("global_step")
        tokens = state.get("num_input_tokens_seen") or None  # 0 means "not counted"
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
    record_path = folder / SNAPSHOT_RECORD_NAME
    world = None
    if record_path.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            world = (json.loads(record_path.read_text()).get("extra") or {}).get("world_size")
    if isinstance(world, int) and len(files) != world:
        raise CheckpointFormatError(
            f"sharded snapshot {folder} was written by {world} ranks but holds {len(files)} rank files"
        )
    return files


def _source_from_folder(
    folder: Path, tokens: int | None = None, step: int | None = None, record=None
) -> CheckpointSource:
    found = find_weight_files(folder)
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
        tokens, step, record = _progress_of(folder)
    return CheckpointSource(folder, prefix, files, tokens, step, dict(record or {}), sharded=sharded)


def _expand_manifest(manifest: Path) -> list[CheckpointSource]:
    pma_dir = manifest.parent
    interval = read_manifest(pma_dir).get("interval_tokens")
    sources = []
    for record in manifest_snapshots(pma_dir):
        if record.extra.get("excluded"):
            continue
        folder = pma_dir / record.path
        if not folder.is_dir():
            raise FileNotFoundError(f"snapshot {record.path} listed in {manifest} does not exist at {folder}")
        data = record.to_dict()
        data["interval_tokens"] = interval
        sources.append(_source_from_folder(folder, record.tokens, record.step, data))
    if not sources:
        raise ValueError(f"the manifest {manifest} lists no snapshots yet")
    return sources


def _expand_checkpoints(folder: Path) -> list[CheckpointSource]:
    found = [
        (int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))
    ]
    return [_source_from_folder(p) for _, p in sorted(found)]


def _expand(
    item: str | os.PathLike[str], revisions: str | None = None, endpoint: str | None = None
) -> list[Any]:
    """The checkpoints an item names: local sources now, Hub revisions still to download."""
    path = Path(item)
    if not path.exists():
        spec = parse_hub_spec(item) if isinstance(item, str) else None
        if spec is None:
            raise FileNotFoundError(f"source {item} does not exist")
        repo_id, revision = spec
        if revision is None and revisions is not None:
            return list_revisions(repo_id, revisions, endpoint=endpoint)
        return [resolve_revision(repo_id, revision, endpoint=endpoint)]
    if path.is_file():
        raise ValueError(f"source {path} is a file; give the model folder that holds it")
    if find_weight_files(path) is not None or sharded_weight_files(path) is not None:
        return [_source_from_folder(path)]
    manifest = find_manifest(path)
    if manifest is not None:
        return _expand_manifest(manifest)
    checkpoints = _expand_checkpoints(path)
    if checkpoints:
        return checkpoints
    raise FileNotFoundError(
        f"{path} holds no model weights, no PMA manifest (manifest.json or pma/manifest.json) "
        f"and no Trainer checkpoint-* folders"
    )


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
) -> list[CheckpointSource]:
    """Expand and order what the user named, oldest first; keep every ``every``-th counting back
    from the newest, then the newest ``last``.

    ``inputs`` may mix model folders, snapshot folders, Trainer ``checkpoint-*`` folders, run
    folders holding ``manifest.json`` / ``pma/manifest.json`` or ``checkpoint-*`` subfolders,
    and Hub models: ``org/model`` (its default branch, or with ``revisions`` its branches and
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
    if revisions is not None and not any(
        not Path(i).exists() and (spec := parse_hub_spec(i)) is not None and spec[1] is None for i in inputs
    ):
        raise ValueError(
            f"--revisions {revisions!r} applies to a Hub repo given as org/model, and no source is one"
        )
    items = [x for item in inputs for x in _expand(item, revisions, endpoint)]
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
    sources = _download(select_newest(order_by_progress(items), last, every), cache_dir, endpoint)
    prefixes = {s.prefix for s in sources}
    if len(prefixes) > 1:
        raise ValueError(
            "cannot merge full models with PEFT adapters: "
            + ", ".join(f"{s.name} ({s.prefix})" for s in sources)
        )
    return sources
