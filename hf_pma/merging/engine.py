"""The streaming merge engine: ``M = sum_i w_i * M_i`` over N checkpoints, in bounded memory.

Tensors are cut into chunks of at most ``chunk_bytes`` of accumulator, read straight from the
source files (see :mod:`hf_pma.io.safetensors`) and accumulated in float32 (or
float64) by several worker threads (see :mod:`hf_pma.merging.chunks`: reads overlap the
arithmetic, and the result is bit-identical for any number of workers); each merged chunk is
written at its place in output shards planned up front. Peak memory is a few chunk buffers
per worker, independent of N and of the model size; N tensors are never stacked.

The arithmetic runs in numpy (:mod:`hf_pma.merging.chunks`): merging safetensors sources in one
process imports neither torch nor transformers (``.bin`` sources need ``torch.load``, the
distributed merge ``torch.distributed``; the in-memory merge returns torch tensors).

Everything is checked before the first byte is written (names, shapes, dtypes, headers,
output folder), and the output is built in a temporary folder beside ``output_dir`` that is
renamed into place only when complete: a failed merge leaves nothing at ``output_dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hf_pma.core.manifest import MERGE_RECORD_NAME, MODEL_SUPPORT_FILES, TOKENIZER_FILES
from hf_pma.core.outputs import check_overwrite_target, record_own_files
from hf_pma.core.selection import check_window, snapshot_intervals
from hf_pma.core.strategies import AUTO_STRATEGY, merge_coefficients, validate_strategy
from hf_pma.core.window_choice import WindowChoice, check_window_count, is_auto, merge_strategy
from hf_pma.io.guarded import (
    check_file,
    check_one_version,
    copy_file,
    pin_folders,
    read_json,
    reads_one_version,
)
from hf_pma.io.safetensors import (
    DTYPE_ITEMSIZE,
    SAFETENSORS_NAMES,
    TORCH_NAMES,
    SafetensorsWriter,
    TensorInfo,
)
from hf_pma.merging.checkpoint_source import (
    CheckpointSource,
    allow_open_sources,
    open_all,
    recorded_interval,
    tokenizer_folder,
)
from hf_pma.merging.chunks import (
    DEFAULT_CHUNK_BYTES,
    MergeError,
    TensorPlan,
    accumulate_name,
    chunk_elements,
    chunk_tasks,
    default_workers,
    run_chunks,
)
from hf_pma.merging.same_model import check_same_model
from hf_pma.merging.sources import resolve_sources_and_window
from hf_pma.merging.weight_files import CheckpointTensors
from hf_pma.merging.windows import apply_window, describe_sources, sources_span
from hf_pma.utils.fs import (
    atomic_write_json,
    check_output_folder,
    claim_output,
    no_space_errors,
    publish_folder,
    raise_if_no_space,
    remove_stale_temporaries,
    temporary_path,
)
from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import parse_dtype, parse_dtype_name, parse_size
from hf_pma.utils.text import escape, shown
from hf_pma.utils.version import __version__

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

T = TypeVar("T")

__all__ = [
    "MergeError",
    "merge_checkpoints",
    "merge_state_dict",
    "parse_dtype",
    "parse_size",
    "SUPPORT_FILES",
    "default_workers",
    "plan_tensors",
    "plan_output_shards",
    "validate_sources",
    "check_config_file",
]

# Files copied from the newest source so that the merge is a self-contained model folder.
SUPPORT_FILES = MODEL_SUPPORT_FILES


def validate_sources(
    sources: Sequence[CheckpointSource], opened: Sequence[CheckpointTensors]
) -> dict[str, TensorInfo]:
    """Every source must have the same tensor names, shapes and dtypes; returns the first's infos."""
    reference, ref_infos = sources[0], opened[0].infos
    if not ref_infos:
        raise MergeError(f"{reference.path} holds no tensors")
    for source, tensors in zip(sources[1:], opened[1:]):
        infos = tensors.infos
        missing, extra = sorted(set(ref_infos) - set(infos)), sorted(set(infos) - set(ref_infos))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"lacks {len(missing)} tensor(s) of {reference.path}: {', '.join(missing[:5])}")
            if extra:
                parts.append(
                    f"has {len(extra)} tensor(s) that {reference.path} lacks: {', '.join(extra[:5])}"
                )
            raise MergeError(f"different tensor names: {source.path} " + "; ".join(parts))
        for name, ref in ref_infos.items():
            info = infos[name]
            if info.shape != ref.shape:
                raise MergeError(
                    f"tensor {name!r} has shape {list(info.shape)} in {source.path} but {list(ref.shape)} in {reference.path}"
                )
            if info.dtype != ref.dtype:
                raise MergeError(
                    f"tensor {name!r} is {info.dtype} in {source.path} but {ref.dtype} in {reference.path}"
                )
    return ref_infos


def plan_tensors(infos: dict[str, TensorInfo], dtype: str | torch.dtype | None) -> list[TensorPlan]:
    """One plan per tensor, sorted by name; floating-point tensors take ``dtype`` (``"bfloat16"``,
    ``torch.bfloat16``, ...) when given."""
    name_of = parse_dtype_name(dtype)
    out_dtype = None if name_of is None else SAFETENSORS_NAMES[name_of]
    plans = []
    for name in sorted(infos):
        info = infos[name]
        out = out_dtype if (out_dtype is not None and info.is_floating_point) else info.dtype
        plans.append(TensorPlan(name, info.shape, info.dtype, out))
    return plans


@dataclasses.dataclass(frozen=True)
class OutputShard:
    """One output safetensors file and the tensors it holds, in order."""

    filename: str
    plans: tuple[TensorPlan, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(p.out_bytes for p in self.plans)


def plan_output_shards(plans: Sequence[TensorPlan], max_bytes: int, prefix: str) -> list[OutputShard]:
    """Greedy shards of at most ``max_bytes`` (a larger tensor gets a shard of its own), named like
    ``save_pretrained`` names them."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if groups[-1] and size + plan.out_bytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(plan)
        size += plan.out_bytes
    if len(groups) == 1:
        return [OutputShard(f"{prefix}.safetensors", tuple(groups[0]))]
    return [
        OutputShard(f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors", tuple(group))
        for i, group in enumerate(groups, 1)
    ]


def _as_sources(
    sources: Any,
    last: int | str | None,
    window_tokens: int | None = None,
    window_steps: int | None = None,
    include_final: bool = False,
) -> tuple[list[CheckpointSource], WindowChoice | None]:
    """The sources a merge takes, and the automatic window's choice (``last="auto"``: from the
    run's records; sources named one by one are all taken)."""
    if (
        isinstance(sources, (list, tuple))
        and sources
        and all(isinstance(s, CheckpointSource) for s in sources)
    ):
        last = check_window_count(last, "last", allow_none=True)
        check_window(window_tokens, window_steps, None if is_auto(last) else last)
        # The one path a window is chosen by, for sources as for names (resolve_sources_and_window).
        return apply_window(list(sources), last=last, window_tokens=window_tokens, window_steps=window_steps)
    return resolve_sources_and_window(
        sources,
        last=last,
        include_final=include_final,
        window_tokens=window_tokens,
        window_steps=window_steps,
    )


def _window_record(
    sources: Sequence[CheckpointSource],
    window_tokens: int | None,
    window_steps: int | None,
    choice: WindowChoice | None = None,
) -> dict[str, Any] | None:
    """The span the merged sources cover (``window`` in the merge record and the card), with the
    automatic window's choice and reason (``auto``) when it chose."""
    unit = "tokens" if window_tokens is not None else "steps" if window_steps is not None else None
    span = sources_span(sources, window_tokens if window_tokens is not None else window_steps, unit)
    record = span.to_dict() if span is not None else None
    if choice is not None:
        record = {**(record or {}), "auto": choice.to_dict()}
    return record


def _merge_strategy(
    strategy: str, choice: WindowChoice | None, count: int, weights: Sequence[float] | None
) -> tuple[str, WindowChoice | None]:
    """:func:`~hf_pma.core.window_choice.merge_strategy`, or ``"custom"`` for explicit weights."""
    return merge_strategy("custom" if weights is not None else strategy, choice, count)


def _say_window(what: str, choice: WindowChoice | None) -> None:
    """Every automatically chosen window is said, with its reason, where a plain script shows it."""
    if choice is not None:
        logger.warning(f"{what}: {choice.describe()}")


def _announce(sources: Sequence[CheckpointSource], what: str, window: dict[str, Any] | None) -> None:
    """Say which sources a merge takes; a merge of one source is a copy, which a user must know."""
    if len(sources) == 1:
        logger.warning(
            f"{what}: only one source, {sources[0].name} ({sources[0].path}): the result is a copy of it"
        )
    else:
        window = window or {}
        logger.info(f"{what}: {describe_sources(sources, window.get('requested'), window.get('unit'))}")


@reads_one_version
def merge_state_dict(
    sources: Sequence[str | os.PathLike[str] | CheckpointSource],
    *,
    strategy: str = AUTO_STRATEGY,
    alpha: float = 0.2,
    weights: Sequence[float] | None = None,
    dtype: str | torch.dtype | None = None,
    last: int | str | None = None,
    accumulate_dtype: torch.dtype | str = "float32",
    progress: bool = False,
    workers: int | None = None,
    window_tokens: int | None = None,
    window_steps: int | None = None,
    include_final: bool = False,
    allow_different_configs: bool = False,
    clip_to_dtype: bool = False,
) -> dict[str, torch.Tensor]:
    """Merge checkpoints into an in-memory state dict (one model's worth of memory).

    Same inputs, checks and arithmetic as :func:`merge_checkpoints` (bit-identical tensors), for
    callers that load the result straight into a model (PMA-init, loss-spike recovery). Every
    option after ``sources`` is given by keyword. Every source is read as one version, or a
    :class:`~hf_pma.io.guarded.SourceChangedError` names the file that changed meanwhile.
    """
    import torch

    from hf_pma.io.torch_adapters import DTYPE_FROM_SAFETENSORS, tensor_bytes

    accumulate_dtype = accumulate_name(accumulate_dtype)
    out_dtype = parse_dtype(dtype)
    validate_strategy(strategy, alpha, weights)  # before a Hub source is downloaded
    srcs, choice = _as_sources(sources, last, window_tokens, window_steps, include_final)
    pin_folders(s.path for s in srcs)
    strategy, choice = _merge_strategy(strategy, choice, len(srcs), weights)  # "auto": the window's own weights
    _say_window("merge", choice)
    coefs = merge_coefficients(len(srcs), strategy, alpha, weights)
    check_same_model(srcs, allow_different_configs)
    check_intervals(srcs)
    opened = open_all(srcs, raw=True)
    try:
        plans = plan_tensors(validate_sources(srcs, opened), out_dtype)
        state = {
            plan.name: torch.empty(plan.shape, dtype=DTYPE_FROM_SAFETENSORS[plan.out_dtype]) for plan in plans
        }
        chunk_elems = chunk_elements(DEFAULT_CHUNK_BYTES, accumulate_dtype)
        tasks = (
            task
            for plan in plans
            for task in chunk_tasks(
                plan, 0, plan.numel, chunk_elems, _copy_into(tensor_bytes(state[plan.name]), plan)
            )
        )
        clipped = run_chunks(
            tasks,
            [str(s.path) for s in srcs],
            opened,
            coefs,
            accumulate_dtype,
            DEFAULT_CHUNK_BYTES,
            workers,
            progress=progress,
            clip=clip_to_dtype,
        )
        _report_clipped(clipped, plans)
        check_one_version()  # what was read is one version of every source
        return state
    finally:
        for tensors in opened:
            tensors.close()


def _copy_into(flat: Any, plan: TensorPlan):
    """A sink copying merged bytes into ``flat``, the bytes of the output tensor."""
    itemsize = DTYPE_ITEMSIZE[plan.out_dtype]

    def sink(start: int, chunk: Any) -> None:
        flat[start * itemsize : start * itemsize + len(chunk)] = chunk

    return sink


def _check_output(
    output_dir: Path,
    sources: Sequence[CheckpointSource],
    overwrite: bool,
    markers: tuple[str, ...] = (MERGE_RECORD_NAME,),
) -> None:
    out = output_dir.resolve()
    for source in sources:
        src = source.path.resolve()
        if out == src or out in src.parents or src in out.parents:
            raise ValueError(
                f"output folder {output_dir} overlaps source {source.path}; choose another output folder"
            )
    check_output_folder(output_dir, overwrite)
    if overwrite:  # only an output hf-pma wrote: never a checkpoint, a listed snapshot or the user's folder
        check_overwrite_target(output_dir, markers)


def _replaceable(markers: tuple[str, ...]) -> Callable[[Path], None]:
    """The check of an output folder that ``--overwrite`` replaces, for :func:`publish_folder`."""
    return lambda folder: check_overwrite_target(folder, markers)


# Support files parsed (bounded, a JSON object) before they are copied: the configurations a
# loader reads first. tokenizer.json and vocab.json (large, read by the tokenizers library) are
# only checked to be regular files inside the source.
_PARSED_SUPPORT_FILES = frozenset(n for n in SUPPORT_FILES if n.endswith(".json")) - {
    "tokenizer.json",
    "vocab.json",
}


# Where check_config_file takes the tokenizer from when not told: the newest source's own folder.
_OWN_FOLDER = Path(".")


def _support_files(newest: CheckpointSource, tokenizer: Path | None = _OWN_FOLDER) -> list[tuple[Path, Path]]:
    """The support files the output copies, each with the folder it must stay inside: the
    configuration and ``*.py`` of the newest source, and the tokenizer files of ``tokenizer``
    (a folder; the newest source's own by default; ``None``: no tokenizer)."""
    files = [
        (newest.path / n, newest.confined_to)
        for n in SUPPORT_FILES
        if n not in TOKENIZER_FILES and os.path.lexists(newest.path / n)
    ]
    files += [(p, newest.confined_to) for p in sorted(newest.path.glob("*.py"))]
    folder = newest.path if tokenizer is _OWN_FOLDER else tokenizer
    if folder is not None:
        inside = newest.confined_to if folder in (newest.path, newest.root) else folder
        files += [(folder / n, inside) for n in TOKENIZER_FILES if os.path.lexists(folder / n)]
    return files


def check_config_file(newest: CheckpointSource, tokenizer: Path | None = _OWN_FOLDER) -> list[str]:
    """Check now, before any tensor, the files that the output copies from the newest source
    (and the tokenizer files from ``tokenizer``, a folder: by default the newest source's own;
    ``None``: none).

    ``FileNotFoundError`` when it has no ``config.json`` (``adapter_config.json`` for an
    adapter). Every support file must be a regular file inside its folder after links
    (:func:`hf_pma.io.guarded.check_file`; a ``tokenizer.model`` or ``*.py`` linking outside is
    refused, naming it), and every configuration (``config.json``, ``generation_config.json``,
    ``tokenizer_config.json``, ...) a bounded JSON object (:func:`hf_pma.io.guarded.read_json`):
    a truncated one is refused, naming it. Returns the names to copy.
    """
    config_name = "adapter_config.json" if newest.is_adapter else "config.json"
    files = _support_files(newest, tokenizer)
    if newest.path / config_name not in {path for path, _ in files}:
        raise FileNotFoundError(
            f"{escape(newest.path)} has no {config_name}; the merged folder would not load without it"
        )
    for path, inside in files:
        if path.name in _PARSED_SUPPORT_FILES:
            _read_config(path, inside)
        else:
            check_file(path, inside)
    return [path.name for path, _ in files]


def _read_config(path: Path, inside: Path) -> dict[str, Any]:
    config = read_json(path, inside, kind="config")
    if not isinstance(config, dict):
        raise ValueError(f"{escape(path)} should hold a JSON object, got {type(config).__name__}")
    return config


def _copy_support_files(
    newest: CheckpointSource,
    dest: Path,
    out_dtype: str | torch.dtype | None,
    tokenizer: Path | None = _OWN_FOLDER,
) -> None:
    """Copy the support files of the newest source (and the tokenizer files of ``tokenizer``, see
    :func:`check_config_file`) into ``dest``, checked again (regular files inside their folder,
    copied as plain files), with ``config.json``'s dtype set to ``out_dtype`` when given."""
    check_config_file(newest, tokenizer)
    for path, inside in _support_files(newest, tokenizer):
        if path.name == "config.json" and out_dtype is not None:
            config = _read_config(path, inside)
            for key in ("dtype", "torch_dtype"):
                if key in config:
                    config[key] = parse_dtype_name(out_dtype)
            (dest / path.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            copy_file(path, dest / path.name, inside)


def check_intervals(sources: Sequence[CheckpointSource]) -> tuple[list[int], str | None]:
    """The snapshot intervals V of the merged sources (see
    :func:`hf_pma.core.selection.snapshot_intervals`); a warning when there is more than one: V
    changed within the merge (a run resumed with another ``interval_tokens``: the sources are
    unevenly spaced in tokens, and the strategy's weights count sources, not tokens), or the
    sources are unevenly spaced."""
    intervals, basis = snapshot_intervals(
        [recorded_interval(s) for s in sources], [s.tokens for s in sources]
    )
    if len(intervals) > 1:
        values = " then ".join(f"{v:,}" for v in intervals)
        what = (
            f"the snapshot interval V changed within the merged sources: {values} tokens (their records)"
            if basis == "recorded"
            else f"the merged sources are unevenly spaced: token gaps of {values}"
        )
        logger.warning(
            f"{what}, from {escape(sources[0].name)} to {escape(sources[-1].name)}; the strategy weighs sources, "
            "not tokens (a window in tokens, window_tokens=, --window-tokens, keeps the span)"
        )
    return intervals, basis


def _report_clipped(clipped: dict[str, int], plans: Sequence[TensorPlan]) -> dict[str, Any] | None:
    """Warn of the values clipped to the output dtype's range (``clip_to_dtype``); their count for the record."""
    if not clipped:
        return None
    dtypes = sorted({TORCH_NAMES[p.out_dtype] for p in plans if p.name in clipped})
    total = sum(clipped.values())
    names = ", ".join(shown(n) for n in list(clipped)[:5]) + (", ..." if len(clipped) > 5 else "")
    logger.warning(
        f"clipped {total:,} merged value(s) in {len(clipped)} tensor(s) ({names}) to the range of "
        f"{'/'.join(dtypes)} (clip_to_dtype)"
    )
    return {"dtype": ",".join(dtypes), "values": total, "tensors": dict(clipped)}


def _tokenizer_record(folder: Path | None, newest: CheckpointSource, output_dir: Path) -> str | None:
    """How the record names the tokenizer's folder: the Hub revision, or a relative path."""
    if folder is None:
        return None
    if folder == newest.path and newest.record.get("repo_id"):
        return f"{newest.record['repo_id']}@{newest.record.get('revision')}"
    return _portable_path(folder, output_dir)


def _portable_path(path: Path, output_dir: Path) -> str:
    """A relative path for the record (never an absolute one: the folder may be published)."""
    rel = os.path.relpath(path.resolve(), output_dir.resolve())
    return rel if rel.count("..") <= 2 else path.name


def _merge_record(
    sources: Sequence[CheckpointSource],
    coefs: Sequence[float],
    *,
    strategy: str,
    alpha: float,
    explicit: bool,
    out_dtype: str,
    accumulate_dtype: str,
    output_dir: Path,
    window: dict[str, Any] | None = None,
    notes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The merge record (``pma_merge.json``); ``notes``: what the merge found on the way
    (``intervals``, ``config_differences``, ``clipped``, ``tokenizer``)."""
    notes = notes or {}
    entries = []
    for source, weight in zip(sources, coefs):
        rec = source.record
        entries.append(
            {
                "name": source.name,
                "path": _portable_path(source.path, output_dir),
                "tokens": source.tokens,
                "step": source.step,
                "lr": rec.get("lr"),
                "loss": rec.get("loss"),
                "phase": rec.get("phase"),
                "weight": weight,
            }
        )
        if rec.get("repo_id"):  # a Hub revision: what names it again, whatever the local cache path
            entries[-1].update(
                path=f"{rec['repo_id']}@{rec['revision']}",
                **{k: rec.get(k) for k in ("repo_id", "revision", "commit")},
            )
    recorded = [v for v in map(recorded_interval, sources) if v is not None]
    intervals, basis = notes.get("intervals") or ([], None)
    repos = {e.get("repo_id") for e in entries}
    return {
        "hf_pma_version": __version__,
        "strategy": "custom" if explicit else strategy,
        "alpha": alpha if strategy == "ema" and not explicit else None,
        "weights": list(coefs),
        "dtype": out_dtype,
        "accumulate_dtype": TORCH_NAMES[accumulate_name(accumulate_dtype)],
        "created": time.time(),
        "interval_tokens": recorded[-1] if recorded else None,  # the newest source's V
        # Every V within the merge, in order (several: V changed on resume, or uneven gaps).
        "intervals_tokens": intervals or None,
        "intervals_from": basis,  # "recorded" (the snapshots' records) or "gaps" (between their tokens)
        "config_differences": notes.get("config_differences") or None,  # allow_different_configs
        "clipped": notes.get("clipped"),  # clip_to_dtype: values clipped to the output dtype's range
        "tokenizer": notes.get("tokenizer"),  # the folder whose tokenizer the merge holds
        "num_sources": len(sources),
        "window": window,
        "base_model": repos.pop() if len(repos) == 1 and None not in repos else None,
        "sources": entries,
    }


def write_output_shards(
    folder: Path,
    shards: Sequence[OutputShard],
    sources: Sequence[CheckpointSource],
    opened: Sequence[Any],
    coefs: Sequence[float],
    accumulate_dtype: torch.dtype | str = "float32",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int | None = None,
    progress: bool = False,
    clip: bool = False,
) -> dict[str, int]:
    """Merge the tensors of ``shards`` and write each shard file into ``folder`` (fsynced).

    ``opened``: the sources opened with :func:`~hf_pma.merging.checkpoint_source.open_all` ``(raw=True)``.
    ``clip``: clip values beyond the output dtype's range (else refused, see
    :func:`~hf_pma.merging.chunks.run_chunks`). Returns the values clipped per tensor."""
    writers = [
        SafetensorsWriter(folder / s.filename, [(p.name, p.out_dtype, p.shape) for p in s.plans])
        for s in shards
    ]
    try:
        chunk_elems = chunk_elements(chunk_bytes, accumulate_dtype)
        tasks = (
            task
            for shard, writer in zip(shards, writers)
            for plan in shard.plans
            for task in chunk_tasks(plan, 0, plan.numel, chunk_elems, _write_into(writer, plan.name))
        )
        clipped = run_chunks(
            tasks,
            [str(s.path) for s in sources],
            opened,
            coefs,
            accumulate_dtype,
            chunk_bytes,
            workers,
            progress=progress,
            clip=clip,
        )
    finally:
        errors = []
        for writer in writers:
            try:
                writer.close()
            except RuntimeError as err:
                errors.append(err)
    if errors:
        raise errors[0]
    return clipped


def _write_into(writer: SafetensorsWriter, name: str):
    def sink(start: int, chunk: Any) -> None:
        writer.write_at(name, start, chunk)

    return sink


def write_shard_index(folder: Path, prefix: str, shards: Sequence[OutputShard]) -> None:
    """The ``<prefix>.safetensors.index.json`` of a sharded output (nothing for a single file)."""
    if len(shards) <= 1:
        return
    weight_map = {plan.name: shard.filename for shard in shards for plan in shard.plans}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    (folder / f"{prefix}.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )


@reads_one_version
def merge_checkpoints(
    sources: Sequence[str | os.PathLike[str] | CheckpointSource] | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    strategy: str = AUTO_STRATEGY,
    alpha: float = 0.2,
    weights: Sequence[float] | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    last: int | None = None,
    overwrite: bool = False,
    accumulate_dtype: torch.dtype | str = "float32",
    progress: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int | None = None,
    distributed: bool = False,
    window_tokens: int | None = None,
    window_steps: int | None = None,
    include_final: bool = False,
    allow_different_configs: bool = False,
    clip_to_dtype: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
    window_choice: WindowChoice | None = None,
) -> Path:
    """Merge checkpoints into a new Hugging Face model folder and return its path.

    Every option after ``output_dir`` is given by keyword.

    Args:
        sources: model folders, snapshot folders, Trainer ``checkpoint-*`` folders, run folders
            (a PMA manifest or ``checkpoint-*`` subfolders) or Hub ids; ordered oldest first by
            tokens or step when known, else kept in the given order.
        output_dir: the merged folder; created atomically and exclusively (a second merge into
            the same folder while this one runs stops at once, naming this process; see
            :func:`hf_pma.utils.fs.claim_output`).
        strategy: ``auto`` (default: the weights the automatic window chose with it, SMA for a
            window that was given), ``sma``, ``wma``, ``ema``, ``linear-decay``, ``cosine-decay`` or
            ``1-sqrt-decay``.
        alpha: EMA smoothing factor.
        weights: explicit weights, oldest first (normalized; overrides ``strategy``).
        dtype: output floating-point dtype; default: each tensor's input dtype.
        max_shard_size: largest output shard, in bytes or like ``"5GB"``.
        last: merge only the newest ``last`` sources; ``"auto"``: the window chosen from the run's
            records (tokens, learning rate, phase, training loss at each snapshot; see
            :mod:`hf_pma.core.window_choice`), said in one line and recorded with its reason
            (``window.auto`` in ``pma_merge.json``, and the card). It applies where a run folder
            or a revision pattern expands into several checkpoints, or to a list of
            ``CheckpointSource``; sources named one by one are all merged.
        overwrite: replace a non-empty ``output_dir`` (never a source, a snapshot listed in a
            manifest, a Trainer checkpoint or a folder hf-pma did not write).
        accumulate_dtype: ``torch.float32`` / ``"float32"`` (default) or the float64 ones.
        progress: show a progress bar.
        chunk_bytes: accumulator size per worker; bounds memory for huge tensors.
        workers: merge threads (default: the usable cores, shared by the processes of this
            machine when ``distributed``); the output is bit-identical for any number.
        distributed: every process of the ``torch.distributed`` job calls this with the same
            arguments; each writes its share of the output shards (planned up front, balanced
            by bytes), rank 0 writes the index, configuration and record and moves the folder
            into place. Waits happen on a gloo group with a long timeout; an error on any rank
            is raised on every rank. The output is identical to a single process's.
        window_tokens: merge the sources within the last ``window_tokens`` tokens of the newest
            (progress in ``(newest - T, newest]``: snapshots every V tokens and ``T = N * V``
            take N); needs every source's token count. Exclusive with ``last``.
        window_steps: the same in optimizer steps (Trainer checkpoints without token counts).
        include_final: with a run folder, also merge the final model at its top (as the
            newest source).
        allow_different_configs: merge sources whose ``config.json`` differ in what changes the
            meaning of the weights (heads, head size, RoPE, vocabulary, ...: see
            :func:`~hf_pma.merging.same_model.check_same_model`), a deliberate soup, with a warning
            and the differences in the record; refused by default, naming both sources.
        clip_to_dtype: clip merged values beyond the output dtype's finite range (float16's
            65504, ...) to the range, with a warning and their count in the record; by default
            such a tensor is refused, naming it and its largest magnitude, before anything is
            published.
        tokenizer: the folder whose tokenizer the output takes; default: the newest source's
            own, else that of the run folder named that holds it (never a folder above);
            recorded as ``tokenizer``.
        window_choice: the automatic window's choice when the caller already chose ``sources``
            with it (:func:`~hf_pma.merging.sources.resolve_sources_and_window`): recorded.

    Sources are one model and one run: their ``config.json`` are compared before the first
    tensor is read, and a run folder given with other sources is refused
    (:func:`~hf_pma.merging.same_model.check_one_run`; explicit snapshot folders of several runs
    are merged). The sources taken (count, first and last, the tokens or steps they span) are
    logged, and recorded with the window's span (``window``) in ``pma_merge.json``, with the
    snapshot intervals they were taken at (``intervals_tokens``: a warning when V changed within
    them); a merge of a single source logs a warning.

    Without ``distributed`` and with safetensors sources, the merge imports neither torch nor
    transformers (see :mod:`hf_pma.merging.chunks` for how numpy's arithmetic compares with
    torch's).
    """
    accumulate_dtype = accumulate_name(accumulate_dtype)
    out_dtype = parse_dtype_name(dtype)
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    output_dir = Path(output_dir)
    validate_strategy(strategy, alpha, weights)  # before a Hub source is downloaded
    said = window_choice is not None  # chosen by the caller (hf-pma merge), which says it
    if window_choice is None:
        srcs, window_choice = _as_sources(sources, last, window_tokens, window_steps, include_final)
    else:
        srcs, _ = _as_sources(sources, None, window_tokens, window_steps, include_final)
    strategy, window_choice = _merge_strategy(strategy, window_choice, len(srcs), weights)
    if not said:
        _say_window(f"merge into {escape(output_dir)}", window_choice)
    coefs = merge_coefficients(len(srcs), strategy, alpha, weights)
    window = _window_record(srcs, window_tokens, window_steps, window_choice)
    tok_folder = tokenizer_folder(srcs, tokenizer)
    pin_folders([*(s.path for s in srcs), tok_folder])  # one version of each, or nothing published
    check_config_file(srcs[-1], tok_folder)
    notes: dict[str, Any] = {
        "config_differences": check_same_model(srcs, allow_different_configs),
        "intervals": check_intervals(srcs),
        "tokenizer": _tokenizer_record(tok_folder, srcs[-1], output_dir),
    }
    if tok_folder is None:
        logger.info(
            f"no tokenizer in {escape(srcs[-1].path)} nor in the run folder that holds it: the merged folder has "
            "none (name one with --tokenizer, tokenizer=)"
        )
    rank, world_size = _process_place(distributed)
    if workers is None:
        workers = max(1, default_workers() // (_local_world_size() if world_size > 1 else 1))
    job = _MergeJob(
        sources=srcs,
        coefs=coefs,
        output_dir=output_dir,
        overwrite=overwrite,
        rank=rank,
        world_size=world_size,
        what=f"Merging with {'explicit weights' if weights is not None else strategy} into {output_dir}",
        record=functools.partial(
            _merge_record,
            strategy=strategy,
            alpha=alpha,
            explicit=weights is not None,
            accumulate_dtype=accumulate_dtype,
            window=window,
            notes=notes,
        ),
        out_dtype=out_dtype,
        accumulate_dtype=accumulate_dtype,
        max_bytes=max_bytes,
        chunk_bytes=chunk_bytes,
        workers=workers,
        progress=progress and rank == 0,
        clip=clip_to_dtype,
        tokenizer=tok_folder,
        window=window,
    )
    try:
        job.tmp = _on_every_rank(job.begin, f"preparing the merge into {output_dir}", world_size)[0]
    except BaseException:
        job.claim.close()
        raise
    try:
        with no_space_errors(output_dir, None):
            clipped: dict[str, int] = {}
            for counts in _on_every_rank(
                job.write_mine, f"writing the merged shards into {job.tmp}", world_size
            ):
                for name, count in (counts or {}).items():
                    clipped[name] = clipped.get(name, 0) + count
            if rank == 0:
                notes["clipped"] = _report_clipped(clipped, job.plans)
            _on_every_rank(job.finish, f"finishing the merge into {output_dir}", world_size)
    except BaseException:
        if rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    finally:
        job.close()
    if rank == 0:
        logger.info(f"Merged model written to {output_dir}")
    return output_dir


def _process_place(distributed: bool) -> tuple[int, int]:
    """``(rank, world size)`` of this process in a distributed merge; ``(0, 1)`` otherwise (without
    importing ``torch.distributed``)."""
    if not distributed:
        return 0, 1
    from hf_pma.utils.distributed import distributed_rank_and_size

    return distributed_rank_and_size()


def _local_world_size() -> int:
    from hf_pma.utils.distributed import local_world_size

    return local_world_size()


def _on_every_rank(fn: Callable[[], T], what: str, world_size: int) -> list[T]:
    """``fn()`` on every rank of the merge, every rank's result (see
    :func:`hf_pma.utils.distributed.all_ranks_checked`: a failure on one rank is raised on all);
    in a single process, ``[fn()]`` without importing ``torch.distributed``."""
    if world_size == 1:
        return [fn()]
    from hf_pma.utils.distributed import all_ranks_checked

    return all_ranks_checked(fn, what)


@dataclasses.dataclass
class _MergeJob:
    """One merge into ``output_dir`` by this process (rank ``rank`` of ``world_size``), in three
    steps that every rank runs together (:func:`_on_every_rank`): :meth:`begin` (rank 0 checks and
    claims the output and makes the temporary folder), :meth:`write_mine` (each rank writes its
    share of the shards), :meth:`finish` (rank 0 writes the index, support files and record, and
    publishes the folder)."""

    sources: list[CheckpointSource]
    coefs: list[float]
    output_dir: Path
    overwrite: bool
    rank: int
    world_size: int
    what: str  # the announcement of the merge, logged by rank 0
    # The merge record from the sources and the output dtype (see _merge_record).
    record: Callable[..., dict[str, Any]]
    out_dtype: str | None
    accumulate_dtype: str
    max_bytes: int
    chunk_bytes: int
    workers: int
    progress: bool
    clip: bool
    tokenizer: Path | None
    window: dict[str, Any] | None
    tmp: Path | None = None
    claim: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)
    opened: list[Any] = dataclasses.field(default_factory=list)
    plans: list[TensorPlan] = dataclasses.field(default_factory=list)
    shards: list[OutputShard] = dataclasses.field(default_factory=list)

    def begin(self) -> Path | None:
        """On rank 0: check the output folder, claim it (a second merge into it stops here, naming
        this one), remove a killed merge's temporaries, make the temporary folder; its path."""
        if self.rank != 0:
            return None
        _check_output(self.output_dir, self.sources, self.overwrite)
        allow_open_sources(self.sources)  # before any work: one line when even the hard limit is too low
        self.claim.enter_context(claim_output(self.output_dir, self.overwrite))
        remove_stale_temporaries(self.output_dir.parent, self.output_dir.name)  # of a killed earlier merge
        tmp = temporary_path(self.output_dir)
        tmp.mkdir()
        return tmp

    def write_mine(self) -> dict[str, int]:
        """Open the sources, plan the tensors and shards, and write this rank's shards into the
        temporary folder; the values clipped per tensor."""
        srcs = self.sources
        self.opened.extend(open_all(srcs, raw=True))
        self.plans = plan_tensors(validate_sources(srcs, self.opened), self.out_dtype)
        self.shards = plan_output_shards(self.plans, self.max_bytes, srcs[-1].prefix)
        if self.rank == 0:
            raise_if_no_space(self.output_dir, sum(p.out_bytes for p in self.plans))
            processes = f" ({self.world_size} processes)" if self.world_size > 1 else ""
            _announce(srcs, self.what + processes, self.window)
        owners = _owners(self.shards, self.world_size)
        mine = [shard for shard, owner in zip(self.shards, owners) if owner == self.rank]
        clipped = write_output_shards(
            self.tmp,
            mine,
            srcs,
            self.opened,
            self.coefs,
            self.accumulate_dtype,
            self.chunk_bytes,
            self.workers,
            self.progress,
            clip=self.clip,
        )
        check_one_version()  # every rank read one version of every source, or all stop
        return clipped

    def finish(self) -> None:
        """On rank 0: the shard index, the support files, the merge record, and the folder moved
        into place."""
        if self.rank != 0:
            return
        newest = self.sources[-1]
        write_shard_index(self.tmp, newest.prefix, self.shards)
        _copy_support_files(newest, self.tmp, self.out_dtype, self.tokenizer)
        out_dtypes = sorted({TORCH_NAMES[p.out_dtype] for p in self.plans if p.averaged})
        record = self.record(
            self.sources, self.coefs, out_dtype=",".join(out_dtypes), output_dir=self.output_dir
        )
        # The record lists every file written, so a later --overwrite replaces only hf-pma's own.
        atomic_write_json(self.tmp / MERGE_RECORD_NAME, record_own_files(self.tmp, record, MERGE_RECORD_NAME))
        check_one_version()  # the support files copied come from the version the weights did
        # What --overwrite replaces is checked again: the user may have added a file meanwhile.
        publish_folder(self.tmp, self.output_dir, replace=self.overwrite, check_replaced=_replaceable((MERGE_RECORD_NAME,)))

    def close(self) -> None:
        """Close the sources and release the output's claim."""
        for tensors in self.opened:
            tensors.close()
        self.claim.close()


def _owners(shards: Sequence[OutputShard], world_size: int) -> list[int]:
    """The rank that writes each shard: largest first to the least loaded rank (deterministic)."""
    load = [0] * world_size
    owners = [0] * len(shards)
    for k in sorted(range(len(shards)), key=lambda k: (-shards[k].nbytes, k)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[k] = rank
        load[rank] += shards[k].nbytes
    return owners
