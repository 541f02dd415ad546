"""The streaming merge engine: ``M = sum_i w_i * M_i`` over N checkpoints, in bounded memory.

Tensors are processed one at a time, in chunks of at most ``chunk_bytes`` of accumulator, read
straight from the source files (see :mod:`hf_pma.merging.safetensors_io`) and accumulated in float32
(or float64); the output is written tensor by tensor into shards planned up front. Peak memory
is a few chunk buffers, independent of N and of the model size; N tensors are never stacked.

Speed: the merge is memory-bound, so chunks are small enough (4 MiB) to stay in the CPU cache
between the read and the accumulation, torch runs them on the calling thread only (a
multi-threaded op on a few MiB costs more in thread hand-offs than it saves, a lot more on
shared cores), and the finite check is one reduction over the merged chunk.

Everything is checked before the first byte is written (names, shapes, dtypes, headers,
output folder), and the output is built in a temporary folder beside ``output_dir`` that is
renamed into place only when complete: a failed merge leaves nothing at ``output_dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from hf_pma import __version__
from hf_pma.core.manifest import MERGE_RECORD_NAME, MODEL_SUPPORT_FILES
from hf_pma.core.strategies import merge_weights
from hf_pma.merging.safetensors_io import SafetensorsWriter, TensorInfo
from hf_pma.merging.sources import CheckpointSource, CheckpointTensors, open_all, resolve_sources
from hf_pma.utils.fs import atomic_write_json, check_output_folder, write_folder_atomically
from hf_pma.utils.parsing import parse_dtype, parse_size

logger = logging.get_logger(__name__)

__all__ = [
    "MergeError",
    "merge_checkpoints",
    "merge_state_dict",
    "parse_dtype",
    "parse_size",
    "SUPPORT_FILES",
]

# Files copied from the newest source so that the merge is a self-contained model folder.
SUPPORT_FILES = MODEL_SUPPORT_FILES
# Accumulator chunk: a chunk read from a source is still in the CPU cache when it is added.
_DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class MergeError(ValueError):
    """The sources cannot be merged (mismatched tensors, non-finite values, ...)."""


@dataclasses.dataclass(frozen=True)
class _TensorPlan:
    """One output tensor: how to read it and what to write."""

    name: str
    shape: tuple[int, ...]
    in_dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def averaged(self) -> bool:
        return self.in_dtype.is_floating_point

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def out_bytes(self) -> int:
        return self.numel * self.out_dtype.itemsize


def _validate(sources: Sequence[CheckpointSource], opened: Sequence[CheckpointTensors]) -> dict[str, TensorInfo]:
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
                parts.append(f"has {len(extra)} tensor(s) that {reference.path} lacks: {', '.join(extra[:5])}")
            raise MergeError(f"different tensor names: {source.path} " + "; ".join(parts))
        for name, ref in ref_infos.items():
            info = infos[name]
            if info.shape != ref.shape:
                raise MergeError(
                    f"tensor {name!r} has shape {list(info.shape)} in {source.path} but {list(ref.shape)} in {reference.path}"
                )
            if info.dtype != ref.dtype:
                raise MergeError(f"tensor {name!r} is {info.dtype} in {source.path} but {ref.dtype} in {reference.path}")
    return ref_infos


def _plan(infos: dict[str, TensorInfo], dtype: torch.dtype | None) -> list[_TensorPlan]:
    plans = []
    for name in sorted(infos):
        info = infos[name]
        out = dtype if (dtype is not None and info.dtype.is_floating_point) else info.dtype
        plans.append(_TensorPlan(name, info.shape, info.dtype, out))
    return plans


def _shard(plans: list[_TensorPlan], max_bytes: int) -> list[list[_TensorPlan]]:
    """Greedy shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[_TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if shards[-1] and size + plan.out_bytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.out_bytes
    return shards


class _ChunkMerger:
    """Computes the merged elements of a tensor chunk by chunk, with reusable buffers."""

    def __init__(
        self,
        sources: Sequence[CheckpointSource],
        opened: Sequence[CheckpointTensors],
        weights: Sequence[float],
        accumulate_dtype: torch.dtype,
        chunk_bytes: int,
    ) -> None:
        self.sources, self.opened, self.weights = sources, opened, list(weights)
        self.acc_dtype = accumulate_dtype
        self.chunk_elems = max(1, chunk_bytes // accumulate_dtype.itemsize)
        self._read_buf = torch.empty(self.chunk_elems * 8, dtype=torch.uint8)
        self._cmp_buf = torch.empty(0, dtype=torch.uint8)
        self._acc = torch.empty(self.chunk_elems, dtype=accumulate_dtype)
        self._out: dict[torch.dtype, torch.Tensor] = {}

    def chunks(self, plan: _TensorPlan) -> Iterator[torch.Tensor]:
        """Yield the merged tensor's elements in order, as 1-D chunks of ``plan.out_dtype``."""
        for start in range(0, plan.numel, self.chunk_elems):
            stop = min(plan.numel, start + self.chunk_elems)
            if plan.averaged:
                yield self._average(plan, start, stop)
            else:
                yield self._check_equal(plan, start, stop)

    def _average(self, plan: _TensorPlan, start: int, stop: int) -> torch.Tensor:
        acc = self._acc[: stop - start]
        for i, (tensors, w) in enumerate(zip(self.opened, self.weights)):
            x = tensors.read(plan.name, start, stop, self._read_buf)
            if i == 0:
                acc.copy_(x)
                acc.mul_(w)
            else:
                acc.add_(x, alpha=w)  # promoted to the accumulator's dtype, no temporary
        # NaN and Inf propagate into the sum: one cheap reduction instead of an isfinite mask;
        # only a non-finite sum (or an overflowing one) pays for the exact check.
        if not bool(torch.isfinite(acc.sum())) and not bool(torch.isfinite(acc).all()):
            self._raise_non_finite(plan, start, stop)
        if plan.out_dtype == acc.dtype:
            return acc
        out = self._out_buffer(plan.out_dtype)[: stop - start]
        return out.copy_(acc)  # the same rounding as acc.to(dtype), into a reused buffer

    def _out_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._out:
            self._out[dtype] = torch.empty(self.chunk_elems, dtype=dtype)
        return self._out[dtype]

    def _check_equal(self, plan: _TensorPlan, start: int, stop: int) -> torch.Tensor:
        nbytes = (stop - start) * plan.in_dtype.itemsize
        if self._cmp_buf.numel() < nbytes:
            self._cmp_buf = torch.empty(nbytes, dtype=torch.uint8)
        first = self.opened[0].read(plan.name, start, stop, self._cmp_buf)
        for source, tensors in zip(self.sources[1:], self.opened[1:]):
            other = tensors.read(plan.name, start, stop, self._read_buf)
            if not torch.equal(first, other):
                raise MergeError(
                    f"integer/bool tensor {plan.name!r} differs between {self.sources[0].path} and {source.path}; "
                    f"such tensors (buffers, counters) cannot be averaged and must be equal in every source"
                )
        return first

    def _raise_non_finite(self, plan: _TensorPlan, start: int, stop: int) -> None:
        for source, tensors in zip(self.sources, self.opened):
            x = tensors.read(plan.name, start, stop, self._read_buf)
            if not bool(torch.isfinite(x).all()):
                raise MergeError(f"tensor {plan.name!r} in {source.path} holds non-finite values (NaN or Inf)")
        raise MergeError(f"the merge of tensor {plan.name!r} overflowed {self.acc_dtype}")


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """Run torch ops on the calling thread only, then restore the thread count.

    A chunk is a few MiB of memory-bound work: splitting it across OpenMP threads costs more in
    hand-offs than it gains, and on busy shared cores each op can wait a scheduler slice for a
    descheduled worker (measured: a 160M-parameter merge of 8 checkpoints took 10.6 s instead of
    2.3 s on 2 busy cores). With the OpenMP backend, threads already running keep their own
    setting, so a merge in a background thread leaves the training thread alone.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_sources(sources: Any, last: int | None) -> list[CheckpointSource]:
    if isinstance(sources, (list, tuple)) and sources and all(isinstance(s, CheckpointSource) for s in sources):
        sources = list(sources)
        if last is not None:
            if len(sources) < last:
                raise ValueError(f"asked for the last {last} sources but got only {len(sources)}")
            sources = sources[-last:]
        return sources
    return resolve_sources(sources, last=last)


def _check_accumulate_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"accumulate_dtype must be torch.float32 or torch.float64, got {dtype}")


def merge_state_dict(
    sources: Sequence[str | os.PathLike[str] | CheckpointSource],
    strategy: str = "sma",
    alpha: float = 0.2,
    weights: Sequence[float] | None = None,
    dtype: str | torch.dtype | None = None,
    last: int | None = None,
    accumulate_dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Merge checkpoints into an in-memory state dict (one model's worth of memory).

    Same inputs, checks and arithmetic as :func:`merge_checkpoints`, for callers that load the
    result straight into a model (merged evaluation, PMA-init, loss-spike recovery).
    """
    _check_accumulate_dtype(accumulate_dtype)
    out_dtype = parse_dtype(dtype)
    srcs = _as_sources(sources, last)
    coefs = merge_weights(len(srcs), strategy, alpha, weights)
    opened = open_all(srcs)
    try:
        plans = _plan(_validate(srcs, opened), out_dtype)
        merger = _ChunkMerger(srcs, opened, coefs, accumulate_dtype, _DEFAULT_CHUNK_BYTES)
        state: dict[str, torch.Tensor] = {}
        with _single_threaded():
            for plan in tqdm(plans, desc="Merging", unit="tensor", disable=not progress):
                out = torch.empty(plan.numel, dtype=plan.out_dtype)
                offset = 0
                for chunk in merger.chunks(plan):
                    out[offset : offset + chunk.numel()].copy_(chunk)
                    offset += chunk.numel()
                state[plan.name] = out.reshape(plan.shape)
        return state
    finally:
        for tensors in opened:
            tensors.close()


def _check_output(output_dir: Path, sources: Sequence[CheckpointSource], overwrite: bool) -> None:
    out = output_dir.resolve()
    for source in sources:
        src = source.path.resolve()
        if out == src or out in src.parents or src in out.parents:
            raise ValueError(f"output folder {output_dir} overlaps source {source.path}; choose another output folder")
    check_output_folder(output_dir, overwrite)


def _copy_support_files(newest: CheckpointSource, dest: Path, out_dtype: torch.dtype | None) -> None:
    names = [n for n in SUPPORT_FILES if (newest.path / n).is_file()]
    names += sorted(p.name for p in newest.path.glob("*.py"))
    config_name = "adapter_config.json" if newest.is_adapter else "config.json"
    if config_name not in names:
        raise FileNotFoundError(f"{newest.path} has no {config_name}; the merged folder would not load without it")
    for name in names:
        shutil.copy2(newest.path / name, dest / name)
    if out_dtype is not None and (dest / "config.json").is_file():
        config = json.loads((dest / "config.json").read_text())
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = str(out_dtype).removeprefix("torch.")
        (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _portable_path(path: Path, output_dir: Path) -> str:
    """A relative path for the record (never an absolute one: the folder may be published)."""
    rel = os.path.relpath(path.resolve(), output_dir.resolve())
    return rel if rel.count("..") <= 2 else path.name


def _merge_record(
    sources: Sequence[CheckpointSource],
    coefs: Sequence[float],
    strategy: str,
    alpha: float,
    explicit: bool,
    out_dtype: str,
    accumulate_dtype: torch.dtype,
    output_dir: Path,
) -> dict[str, Any]:
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
            entries[-1].update(path=f"{rec['repo_id']}@{rec['revision']}", **{k: rec.get(k) for k in ("repo_id", "revision", "commit")})
    interval = next((s.record.get("interval_tokens") for s in sources if s.record.get("interval_tokens")), None)
    repos = {e.get("repo_id") for e in entries}
    return {
        "hf_pma_version": __version__,
        "strategy": "custom" if explicit else strategy,
        "alpha": alpha if strategy == "ema" and not explicit else None,
        "weights": list(coefs),
        "dtype": out_dtype,
        "accumulate_dtype": str(accumulate_dtype).removeprefix("torch."),
        "created": time.time(),
        "interval_tokens": interval,
        "num_sources": len(sources),
        "base_model": repos.pop() if len(repos) == 1 and None not in repos else None,
        "sources": entries,
    }


def _write_shards(
    tmp: Path,
    prefix: str,
    shards: list[list[_TensorPlan]],
    merger: _ChunkMerger,
    progress: bool,
) -> None:
    names = (
        [f"{prefix}.safetensors"]
        if len(shards) == 1
        else [f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    bar = tqdm(total=sum(len(s) for s in shards), desc="Merging", unit="tensor", disable=not progress)
    weight_map = {}
    for filename, shard in zip(names, shards):
        writer = SafetensorsWriter(tmp / filename, [(p.name, p.out_dtype, p.shape) for p in shard])
        for plan in shard:
            for chunk in merger.chunks(plan):
                writer.write(plan.name, chunk)
            weight_map[plan.name] = filename
            bar.update(1)
        writer.close()
    bar.close()
    if len(shards) > 1:
        total = sum(p.out_bytes for shard in shards for p in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def merge_checkpoints(
    sources: Sequence[str | os.PathLike[str] | CheckpointSource] | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    strategy: str = "sma",
    alpha: float = 0.2,
    weights: Sequence[float] | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    last: int | None = None,
    overwrite: bool = False,
    accumulate_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
) -> Path:
    """Merge checkpoints into a new Hugging Face model folder and return its path.

    Args:
        sources: model folders, snapshot folders, Trainer ``checkpoint-*`` folders, run folders
            (a PMA manifest or ``checkpoint-*`` subfolders) or Hub ids; ordered oldest first by
            tokens or step when known, else kept in the given order.
        output_dir: the merged folder; created atomically.
        strategy: ``sma``, ``wma``, ``ema``, ``linear-decay``, ``cosine-decay`` or ``1-sqrt-decay``.
        alpha: EMA smoothing factor.
        weights: explicit weights, oldest first (normalized; overrides ``strategy``).
        dtype: output floating-point dtype; default: each tensor's input dtype.
        max_shard_size: largest output shard, in bytes or like ``"5GB"``.
        last: merge only the newest ``last`` sources.
        overwrite: replace a non-empty ``output_dir``.
        accumulate_dtype: ``torch.float32`` (default) or ``torch.float64``.
        progress: show a progress bar over tensors.
        chunk_bytes: accumulator size; bounds memory for huge tensors.
    """
    _check_accumulate_dtype(accumulate_dtype)
    out_dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    output_dir = Path(output_dir)
    srcs = _as_sources(sources, last)
    coefs = merge_weights(len(srcs), strategy, alpha, weights)
    _check_output(output_dir, srcs, overwrite)

    opened = open_all(srcs)
    try:
        plans = _plan(_validate(srcs, opened), out_dtype)
        logger.info(
            f"Merging {len(srcs)} checkpoints ({srcs[0].name} ... {srcs[-1].name}) with "
            f"{'explicit weights' if weights is not None else strategy} into {output_dir}"
        )

        def write(tmp: Path) -> None:
            merger = _ChunkMerger(srcs, opened, coefs, accumulate_dtype, chunk_bytes)
            with _single_threaded():
                _write_shards(tmp, srcs[-1].prefix, _shard(plans, max_bytes), merger, progress)
            _copy_support_files(srcs[-1], tmp, out_dtype)
            out_dtypes = sorted({str(p.out_dtype).removeprefix("torch.") for p in plans if p.averaged})
            record = _merge_record(
                srcs, coefs, strategy, alpha, weights is not None, ",".join(out_dtypes), accumulate_dtype, output_dir
            )
            atomic_write_json(tmp / MERGE_RECORD_NAME, record)

        write_folder_atomically(output_dir, write, needed=sum(p.out_bytes for p in plans))
    finally:
        for tensors in opened:
            tensors.close()
    logger.info(f"Merged model written to {output_dir}")
    return output_dir
