"""The sharded layout (one safetensors file per rank), and reading it as if it were one checkpoint.

A sharded folder holds ``shard-<r>-model-00001-of-00001.safetensors`` files, one per rank, in
the layout torch DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` writes (what
torchtitan writes): each file stores the slices that rank owned under the tensor's full name,
and its ``__metadata__["DCP_SHARDING_INFO"]`` gives each slice's ``saved_offsets`` in the full
tensor. hf-pma's own sharded snapshots add ``hf_pma_global_shapes`` (the full shapes) so that
a slice may also be a flat element range of the full tensor (DeepSpeed ZeRO-3 partitions).

:func:`rank_file_name` and the metadata keys describe the layout (the snapshot writer writes it);
:class:`ShardedCheckpointTensors` reads it with the interface of
:class:`~hf_pma.io.safetensors.SafetensorsReader`: ``infos`` with the *full* shapes, and
``read(name, start, stop, buffer)`` returning the bytes of elements ``[start, stop)`` of the
flattened full tensor, assembled from the slices that cover them with ``pread`` (each slice read
once, no full tensor ever built). So every reader (merge, sweep, inspect, eval, PMA-init) works
on sharded folders, and snapshots taken at different world sizes mix. No torch here
(:mod:`hf_pma.io.torch_adapters` gives torch tensors).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hf_pma.io.guarded import parse_json
from hf_pma.io.safetensors import (
    DTYPE_ITEMSIZE,
    MAX_DIMS,
    CheckpointFormatError,
    SafetensorsReader,
    TensorInfo,
)
from hf_pma.utils.parsing import is_int
from hf_pma.utils.text import escape, shown

__all__ = [
    "DCP_SHARDING_INFO_KEY",
    "DCP_VERSION_KEY",
    "GLOBAL_SHAPES_KEY",
    "SAVED_OFFSETS_KEY",
    "ShardedCheckpointTensors",
    "rank_file_name",
    "sharded_weight_files",
]

# Keys of torch.distributed.checkpoint's HF safetensors layout (torch/distributed/checkpoint/_hf_utils.py).
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
DCP_VERSION_KEY = "DCP_VERSION"
SAVED_OFFSETS_KEY = "saved_offsets"
# hf-pma's addition: {name: full shape}; needed when a slice is a flat range (ZeRO-3).
GLOBAL_SHAPES_KEY = "hf_pma_global_shapes"

_SHARD_FILE_RE = re.compile(r"shard-(\d{5,})-model-(\d{5,})-of-(\d{5,})\.safetensors")  # fullmatch, not "$"


def rank_file_name(rank: int, index: int = 1, num_files: int = 1) -> str:
    """The file name DCP gives rank ``rank``'s weights (its shard index is ``rank + 1``)."""
    return f"shard-{rank + 1:05d}-model-{index:05d}-of-{num_files:05d}.safetensors"


def sharded_weight_files(folder: str | os.PathLike[str]) -> list[Path] | None:
    """The per-rank weight files of a sharded folder, in shard order, or ``None`` if it has none."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = []
    for path in folder.iterdir():
        match = _SHARD_FILE_RE.fullmatch(path.name)
        if match and not path.is_dir():  # a FIFO or a link: the reader refuses it, naming it
            found.append(((int(match.group(1)), int(match.group(2))), path))
    return [path for _, path in sorted(found)] or None


@dataclasses.dataclass
class _Slice:
    """One stored slice: a box (``offsets``, ``sizes``) of the full tensor, or a flat range."""

    reader: SafetensorsReader
    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    # Elements of the full flattened tensor are stored as ``runs`` runs of ``run_len`` contiguous
    # elements; run i starts at ``run_start(i)`` in the full tensor and at ``i * run_len`` here.
    run_len: int = 0
    runs: int = 0
    outer_sizes: tuple[int, ...] = ()
    outer_strides: tuple[int, ...] = ()
    base: int = 0  # full-tensor flat index of the slice's first element
    first: int = 0  # flat span covered (bounds only)
    last: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def plan(self, shape: tuple[int, ...]) -> None:
        """Precompute the runs of this slice inside a full tensor of ``shape``."""
        strides = _strides(shape)
        if len(self.sizes) == 1 and len(shape) != 1:  # a flat range of the full tensor
            self.run_len, self.runs, self.outer_sizes, self.outer_strides = self.sizes[0], 1, (), ()
            self.base = self.offsets[0]
        else:
            # The innermost dims this slice covers fully, plus the first one it does not, are
            # contiguous in both the full tensor and the slice: one run.
            k = len(shape) - 1
            while k > 0 and self.sizes[k] == shape[k]:
                k -= 1
            self.run_len = math.prod(self.sizes[k:]) if shape else 1
            self.outer_sizes = tuple(self.sizes[:k])
            self.outer_strides = tuple(strides[:k])
            self.runs = math.prod(self.outer_sizes)
            self.base = sum(o * s for o, s in zip(self.offsets, strides))
        self.first = self.base
        self.last = self.run_start(self.runs - 1) + self.run_len if self.runs and self.run_len else self.base

    def run_start(self, i: int) -> int:
        """Full-tensor flat index of run ``i``."""
        pos = self.base
        for size, stride in zip(reversed(self.outer_sizes), reversed(self.outer_strides)):
            i, j = divmod(i, size)
            pos += j * stride
        return pos

    @property
    def contiguous(self) -> bool:
        return self.runs <= 1


def _strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def _json_metadata(reader: SafetensorsReader, key: str) -> dict | None:
    raw = reader.metadata.get(key)
    if raw is None:
        return None
    try:
        value = parse_json(raw, f"{escape(reader.path)}: metadata {key!r}")
    except ValueError as err:
        raise CheckpointFormatError(str(err)) from None
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{escape(reader.path)}: metadata {key!r} is not a JSON object")
    return value


_MAX_INDEX = 2**63 - 1


def _int_list(value: object, path: Path, name: str, what: str, max_len: int = MAX_DIMS) -> tuple[int, ...]:
    """A list of integers from 0 to 2**63 - 1 read from a file's metadata, or one line naming it."""
    if (
        not isinstance(value, list)
        or len(value) > max_len
        or not all(is_int(v, 0, _MAX_INDEX) for v in value)
    ):
        raise CheckpointFormatError(
            f"{escape(path)}: tensor {shown(name)} has {what} {shown(value)} "
            f"(expected a list of at most {max_len} integers from 0 to 2**63 - 1)"
        )
    return tuple(value)


class ShardedCheckpointTensors:
    """Read access to the full tensors of a sharded folder (one file per rank), by flat ranges.

    Opening validates everything before any merge work starts: every file's header, every
    slice's offsets, one dtype per tensor, and that the slices of each tensor cover it exactly
    once (a missing or truncated rank file fails here, naming the file or the tensor).
    """

    def __init__(self, files: Sequence[Path], folder: str | os.PathLike[str] | None = None) -> None:
        """Open the rank ``files`` (under ``folder``, the folder the user gave: see
        :class:`~hf_pma.io.safetensors.SafetensorsReader`) and check their slices."""
        self.files = [Path(f) for f in files]
        self._folder = folder
        self._readers: list[SafetensorsReader] = []
        self._slices: dict[str, list[_Slice]] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._starts: dict[str, list[int]] = {}
        self._local = threading.local()  # per-thread scratch: merge workers read concurrently
        try:
            shapes = self._collect()
            for name, slices in self._slices.items():
                self._finish_tensor(name, slices, shapes.get(name))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ opening

    def _collect(self) -> dict[str, tuple[int, ...]]:
        """Open every file, gather its slices; returns the full shapes the files declare."""
        shapes: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            reader = SafetensorsReader(path, self._folder)
            self._readers.append(reader)
            info = _json_metadata(reader, DCP_SHARDING_INFO_KEY)
            declared = _json_metadata(reader, GLOBAL_SHAPES_KEY) or {}
            for name, shape in declared.items():
                shape = _int_list(shape, path, name, f"a full shape in {GLOBAL_SHAPES_KEY}")
                if math.prod(shape) > _MAX_INDEX:
                    raise CheckpointFormatError(
                        f"{escape(path)}: tensor {shown(name)} has a full shape {list(shape)} of more than 2**63 - 1 elements"
                    )
                if shapes.setdefault(name, shape) != shape:
                    raise CheckpointFormatError(
                        f"{escape(path)}: tensor {shown(name)} has full shape {list(shape)} here but {list(shapes[name])} in another file"
                    )
            for name, tensor in reader.tensors.items():
                if info is None:
                    offsets: tuple[int, ...] = (0,) * len(tensor.shape)
                else:
                    entry = info.get(name)
                    if not isinstance(entry, dict) or not isinstance(entry.get(SAVED_OFFSETS_KEY), list):
                        raise CheckpointFormatError(
                            f"{escape(path)}: tensor {shown(name)} has no {SAVED_OFFSETS_KEY} in {DCP_SHARDING_INFO_KEY}"
                        )
                    offsets = _int_list(entry[SAVED_OFFSETS_KEY], path, name, SAVED_OFFSETS_KEY)
                if len(offsets) != len(tensor.shape):
                    raise CheckpointFormatError(
                        f"{escape(path)}: tensor {shown(name)} has offsets {list(offsets)} for a slice of shape {list(tensor.shape)}"
                    )
                self._slices.setdefault(name, []).append(_Slice(reader, name, offsets, tuple(tensor.shape)))
        return shapes

    def _finish_tensor(self, name: str, slices: list[_Slice], shape: tuple[int, ...] | None) -> None:
        dtypes = {s.reader.tensors[name].dtype for s in slices}
        if len(dtypes) > 1:
            raise CheckpointFormatError(
                f"tensor {shown(name)} is stored with different dtypes {sorted(dtypes)} in {self._where(slices)}"
            )
        dtype = dtypes.pop()
        if shape is None:
            ndim = {len(s.sizes) for s in slices}
            if len(ndim) > 1:
                raise CheckpointFormatError(
                    f"tensor {shown(name)} has slices of different ranks in {self._where(slices)}"
                )
            shape = (
                tuple(
                    max(dims)
                    for dims in zip(*[tuple(o + z for o, z in zip(s.offsets, s.sizes)) for s in slices])
                )
                if slices[0].sizes
                else ()
            )
        numel = math.prod(shape)
        kept: dict[tuple, _Slice] = {}
        for s in slices:
            flat = len(s.sizes) == 1 and len(shape) != 1
            bounds = [numel] if flat else list(shape)
            if len(s.sizes) != len(bounds) or any(o + z > b for o, z, b in zip(s.offsets, s.sizes, bounds)):
                raise CheckpointFormatError(
                    f"{escape(s.reader.path)}: slice of tensor {shown(name)} at offsets {list(s.offsets)} with shape {list(s.sizes)} "
                    f"lies outside the full shape {list(shape)}"
                )
            if s.numel == 0:
                continue
            key = (s.offsets, s.sizes)
            if key not in kept:  # the same slice written by two ranks (a replicated tensor)
                s.plan(shape)
                kept[key] = s
        ordered = sorted(kept.values(), key=lambda s: s.first)
        self._check_coverage(name, shape, numel, ordered)
        self._slices[name] = ordered
        # Disjoint sorted spans allow a binary search; interleaved (multi-dim) slices are all scanned.
        self._starts[name] = [s.first for s in ordered] if all(s.contiguous for s in ordered) else []
        self._infos[name] = TensorInfo(name, dtype, shape, 0, numel * DTYPE_ITEMSIZE[dtype])

    def _check_coverage(self, name: str, shape: tuple[int, ...], numel: int, slices: list[_Slice]) -> None:
        stored = sum(s.numel for s in slices)
        if all(s.contiguous for s in slices):
            position = 0
            for s in slices:
                if s.first != position:
                    break
                position = s.last
            else:
                if position == numel:
                    return
        elif (
            stored == numel and all(len(s.sizes) == len(shape) for s in slices) and not _boxes_overlap(slices)
        ):
            return
        raise CheckpointFormatError(
            f"the slices of tensor {shown(name)} ({len(slices)} of them, {stored} elements in {self._where(slices)}) do not "
            f"cover its {numel} elements (shape {list(shape)}) exactly once: a rank's file is missing or wrong"
        )

    @staticmethod
    def _where(slices: Sequence[_Slice]) -> str:
        names = sorted({escape(s.reader.path.name) for s in slices})
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    # ------------------------------------------------------------------ the reader interface

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype and *full* shape of every tensor (``begin``/``end``: 0 and its byte size)."""
        return dict(self._infos)

    @property
    def num_ranks(self) -> int:
        """How many rank files the folder holds."""
        return len(self.files)

    def read(
        self, name: str, start: int = 0, stop: int | None = None, buffer: np.ndarray | None = None
    ) -> np.ndarray:
        """The bytes of elements ``[start, stop)`` of the full tensor ``name`` (flattened), as a
        ``uint8`` array assembled from its slices.

        ``buffer`` is an optional ``uint8`` array to read into (reused across calls); the result is a
        view of it. Contiguous slices are read straight into it with one ``pread`` each. Safe to
        call from several threads at once (each with its own buffer).
        """
        info = self._infos[name]
        stop = info.numel if stop is None else stop
        if not 0 <= start <= stop <= info.numel:
            raise IndexError(
                f"elements [{start}, {stop}) are outside tensor {shown(name)} of {info.numel} elements"
            )
        item = info.itemsize
        nbytes = (stop - start) * item
        if buffer is None or buffer.size < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
        out = buffer[:nbytes]
        slices, starts = self._slices[name], self._starts[name]
        i = max(0, bisect.bisect_right(starts, start) - 1) if starts else 0
        while i < len(slices) and slices[i].first < stop:
            s = slices[i]
            i += 1
            if s.last <= start:
                continue
            if s.contiguous:
                lo, hi = max(start, s.first), min(stop, s.last)
                s.reader.read(
                    name, lo - s.first, hi - s.first, out[(lo - start) * item : (hi - start) * item]
                )
            else:
                self._read_runs(s, start, stop, out, item)
        return out

    def _read_runs(self, s: _Slice, start: int, stop: int, out: np.ndarray, item: int) -> None:
        """Copy the runs of a non-contiguous slice that fall in ``[start, stop)`` into ``out`` (bytes)."""
        # Runs are in increasing full-tensor order: find the first and last that intersect.
        lo, hi = 0, s.runs
        while lo < hi:  # first run ending after start
            mid = (lo + hi) // 2
            if s.run_start(mid) + s.run_len <= start:
                lo = mid + 1
            else:
                hi = mid
        first = lo
        lo, hi = first, s.runs
        while lo < hi:  # first run starting at or after stop
            mid = (lo + hi) // 2
            if s.run_start(mid) < stop:
                lo = mid + 1
            else:
                hi = mid
        end = lo
        if first >= end:
            return
        # One pread of the slice's elements from run `first` to run `end` (contiguous in the file).
        local_lo, local_hi = first * s.run_len, end * s.run_len
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.size < (local_hi - local_lo) * item:
            scratch = self._local.scratch = np.empty((local_hi - local_lo) * item, dtype=np.uint8)
        data = s.reader.read(s.name, local_lo, local_hi, scratch)
        for r in range(first, end):
            g = s.run_start(r)
            a, b = max(start, g), min(stop, g + s.run_len)
            src = (r - first) * s.run_len + (a - g)
            out[(a - start) * item : (b - start) * item] = data[src * item : (src + b - a) * item]

    def close(self) -> None:
        """Close every file."""
        for reader in self._readers:
            reader.close()
        self._readers = []

    def __enter__(self) -> ShardedCheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _boxes_overlap(slices: Sequence[_Slice]) -> bool:
    """Whether two boxes intersect (general multi-dim layouts only; sorted sweep on dim 0)."""
    boxes = sorted(slices, key=lambda s: s.offsets[0] if s.offsets else 0)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(
                bo < ao + az and ao < bo + bz
                for ao, az, bo, bz in zip(a.offsets, a.sizes, b.offsets, b.sizes)
            ):
                return True
    return False
