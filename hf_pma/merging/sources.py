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
    TOKENIZER_FILES,
    find_manifest,
    manifest_snapshots,
    missing_snapshot_error,
    read_manifest,
    read_snapshot_record,
)
from hf_pma.core.selection import WindowSpan, check_window, window_by_progress, window_span
from hf_pma.io.guarded import UnsafeFileError, check_file, check_folder, read_json
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
    "vanished_source_error",
    "open_weight_files",
    "find_weight_files",
    "WEIGHT_PREFIXES",
    "MEANING_FIELDS",
    "TOKENIZER_FILES",
    "config_differences",
    "check_same_model",
    "check_one_run",
    "recorded_interval",
    "tokenizer_folder",
]

# "model" for full models, "adapter_model" for PEFT adapters.
WEIGHT_PREFIXES = ("model", "adapter_model")
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # fullmatch: "$" would pass "checkpoint-5\n"
# The name of a run's final model (the weights at the top of its folder) among merge sources.
FINAL_LABEL = "final"

# The fields of config.json whose difference makes two checkpoints two different models even
# where every tensor shape matches (heads and head size trade against each other, RoPE and the
# activation change what the same weights compute). Compared where both configurations hold
# them; the head size, the key-value heads and RoPE are compared as what they mean (see
# _meaning), whichever way a transformers version writes them. Settings that do not change the
# meaning of the weights (dropout, max_position_embeddings, token ids, dtype) are not compared.
MEANING_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "n_embd",
    "d_model",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "hidden_act",
    "activation_function",
    "partial_rotary_factor",
    "rotary_pct",
    "position_embedding_type",
    "num_experts_per_tok",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
)
# adapter_config.json (PEFT): what scales or places the same adapter weights differently.
_ADAPTER_FIELDS = ("peft_type", "lora_alpha", "use_rslora", "use_dora", "target_modules")
# Sub-configurations of composite models, compared field by field the same way.
_NESTED_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def _is_file_name(name: object) -> bool:
    """A plain file name (what a shard index may list): no folder, no ``..``, nothing absolute."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    return not any(c in name for c in ("/", "\\", "\x00"))


def _present(path: Path) -> bool:
    """Whether something is at ``path`` (a file, a link, a FIFO, ...): what is there is then
    opened through :mod:`hf_pma.io.guarded`, which refuses anything but a regular file."""
    return not path.is_dir() and os.path.lexists(path)


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
            raise missing_snapshot_error(
                manifest, record.path, folder
            )  # or deleted since the manifest was read
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
    check_one_run(inputs, revisions)
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


# ---------------------------------------------------------------- one model, one run


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rope(config: dict[str, Any]) -> tuple[Any, Any]:
    """``(rope_theta, the other RoPE settings)`` whichever way the configuration writes them
    (``rope_theta`` and ``rope_scaling`` at the top, as transformers 4 writes them, or
    ``rope_parameters``, as transformers 5 does; ``type`` or ``rope_type``, ``default`` when none)."""
    theta = config.get("rope_theta")
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            return theta, value  # one set per layer type (Gemma 3): compared whole
        if isinstance(value, dict):
            params.update(value)
    if "rope_theta" in params:
        value = params.pop("rope_theta")
        theta = value if theta is None else theta
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    return theta, params


def _meaning(config: dict[str, Any], adapter: bool = False) -> dict[str, Any]:
    """The fields of one configuration that two sources must share, by name (see :data:`MEANING_FIELDS`)."""
    if adapter:
        out = {k: config[k] for k in _ADAPTER_FIELDS if k in config}
        if isinstance(out.get("target_modules"), list):  # a set, written in any order
            out["target_modules"] = sorted(map(str, out["target_modules"]))
        return out
    out = {k: config[k] for k in MEANING_FIELDS if k in config}
    heads = config.get("num_attention_heads", config.get("n_head"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    head_dim = config.get("head_dim")
    if head_dim is None and _is_int(heads) and _is_int(hidden) and heads > 0:
        head_dim = hidden // heads
    if head_dim is not None:
        out["head size (head_dim or hidden_size/num_attention_heads)"] = head_dim
    kv_heads = config.get("num_key_value_heads", heads)
    if kv_heads is not None:
        out["key-value heads (num_key_value_heads)"] = kv_heads
    if any(k in config for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        theta, params = _rope(config)
        if theta is not None:
            out["rope_theta"] = theta
        out["RoPE (rope_scaling / rope_parameters)"] = params
    for key in _NESTED_CONFIGS:
        if isinstance(config.get(key), dict):
            out.update({f"{key}.{k}": v for k, v in _meaning(config[key]).items()})
    return out


def config_differences(
    first: dict[str, Any], second: dict[str, Any], adapter: bool = False
) -> list[tuple[str, Any, Any]]:
    """``(field, first's value, second's value)`` for every field that changes what the weights
    mean (architecture, heads, head size, key-value heads, RoPE, vocabulary, hidden size, layers,
    tied embeddings, activation, ...; for an adapter its scaling and targets) and that the two
    configurations set differently. A field only one of them sets is not compared."""
    a, b = _meaning(first, adapter), _meaning(second, adapter)
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]]


def _source_config(source: CheckpointSource) -> dict[str, Any] | None:
    """The source's ``config.json`` (``adapter_config.json`` for an adapter) read through the
    bounded reader, confined to the folder the user gave; ``None`` when it has none."""
    path = source.path / ("adapter_config.json" if source.is_adapter else "config.json")
    if not _present(path):
        return None
    config = read_json(path, source.confined_to, kind="config")
    if not isinstance(config, dict):
        raise ValueError(f"{escape(path)} should hold a JSON object, got {type(config).__name__}")
    return config


def check_same_model(sources: Sequence[CheckpointSource], allow_different_configs: bool = False) -> list[str]:
    """Check, before any tensor is read, that the sources are one model: every source's
    ``config.json`` sets the fields that change what the weights mean (:func:`config_differences`)
    as the newest source's does, the configuration the merge copies.

    A difference is a one-line ``ValueError`` naming the two sources, the fields and both values
    (snapshots of two models whose tensor shapes happen to match: 8 heads of 4 against 4 heads
    of 8, another ``rope_theta``). With ``allow_different_configs`` (a deliberate model soup) each
    difference is a warning instead. Returns the differences in words (``[]`` when none), for
    the merge record. A source without a configuration is not compared (logged).
    """
    if len(sources) < 2:
        return []
    reference = sources[-1]
    ref_config = _source_config(reference)
    if ref_config is None:
        return []
    found: list[str] = []
    unknown = []
    for source in sources[:-1]:
        config = _source_config(source)
        if config is None:
            unknown.append(escape(source.name))
            continue
        diffs = config_differences(config, ref_config, reference.is_adapter)
        if not diffs:
            continue
        fields = "; ".join(f"{field} {shown(a, 80)} vs {shown(b, 80)}" for field, a, b in diffs)
        line = f"{escape(source.path)} and {escape(reference.path)} are different models: config.json differs in {fields}"
        if not allow_different_configs:
            raise ValueError(
                f"{line}; merge the checkpoints of one model (pass --allow-different-configs, "
                "allow_different_configs=True, for a deliberate soup of different configurations)"
            )
        logger.warning(
            f"{line}; merged anyway (allow_different_configs), with the configuration of {escape(reference.name)}"
        )
        found.extend(
            f"{escape(source.name)}: {field} {shown(a, 80)} vs {shown(b, 80)}" for field, a, b in diffs
        )
    if unknown:
        logger.info(
            f"no configuration to compare in {', '.join(unknown[:5])}: assumed to be the model of {escape(reference.name)}"
        )
    return found


def _is_whole_run(item: Any, revisions: str | None) -> bool:
    """Whether an input stands for many sources ordered by progress: a run folder, or a Hub repo
    read through ``revisions``."""
    path = Path(item)
    if path.is_dir():
        return run_layout(path).is_run
    if path.exists() or revisions is None:
        return False
    spec = parse_hub_spec(item) if isinstance(item, str) and not looks_local(item) else None
    return spec is not None and spec[1] is None


def _inside(item: Any, folder: Any) -> bool:
    path, root = Path(item), Path(folder)
    if not path.exists() or not root.is_dir():
        return False
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def check_one_run(inputs: Sequence[str | os.PathLike[str]], revisions: str | None = None) -> None:
    """Sources of different runs are merged only when named one by one.

    A run folder (a PMA manifest or ``checkpoint-*`` folders) stands for all its snapshots, and
    a Hub repo read through ``--revisions`` for its revisions, ordered by tokens: given with
    anything outside it (another run, a snapshot of another run), the two would be interleaved
    by tokens, and a window (``--last``, ``--window-tokens``) drawn across both. One-line
    ``ValueError`` naming the two; a run folder with its own weight file (``RUN
    RUN/model.safetensors``) is one run. Explicit lists of snapshot folders, from any runs, pass.
    """
    if len(inputs) < 2:
        return
    for item in inputs:
        if not _is_whole_run(item, revisions):
            continue
        other = next((x for x in inputs if x is not item and not _inside(x, item)), None)
        if other is not None:
            what = (
                "a run folder"
                if Path(item).is_dir()
                else f"a Hub repo read through --revisions {shown(revisions)}"
            )
            raise ValueError(
                f"{escape(item)} is {what}, and it stands for all its snapshots: given with {escape(other)}, "
                "the sources of two runs would be ordered together by tokens (and --last or --window-tokens "
                "drawn across both); merge one run at a time, or name each snapshot folder to merge sources of "
                "several runs"
            )


def recorded_interval(source: Any) -> int | None:
    """The snapshot interval V (tokens) a source was taken at, as its record says: the snapshot's
    own (``extra.interval_tokens``), else its run manifest's; ``None`` when unknown."""
    record = getattr(source, "record", None) or {}
    extra = record.get("extra") if isinstance(record.get("extra"), dict) else {}
    for value in (extra.get("interval_tokens"), record.get("interval_tokens")):
        if _is_int(value) and value > 0:
            return value
    return None


def tokenizer_folder(
    sources: Sequence[CheckpointSource], tokenizer: str | os.PathLike[str] | None = None
) -> Path | None:
    """The folder whose tokenizer files a merge of ``sources`` copies: ``tokenizer`` when the user
    names one (``FileNotFoundError`` when it holds no tokenizer), else the newest source's own
    folder when it holds one, else the run folder the user named that holds that source (a
    snapshot's run, where the Trainer saves the tokenizer); ``None`` when none does. The lookup
    never climbs above the folders the user named."""
    if tokenizer is not None:
        folder = Path(tokenizer)
        if not folder.is_dir() or not any(_present(folder / n) for n in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"tokenizer folder {escape(folder)} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...)"
            )
        return folder
    newest = sources[-1]
    for folder in (newest.path, newest.root):
        if folder is not None and any(_present(folder / n) for n in TOKENIZER_FILES):
            return folder
    return None
