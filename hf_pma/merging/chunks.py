"""The merge's inner loop, in parallel: ``sum_i w_i * x_i`` over element ranges of tensors.

Work is cut into *chunks*: element ranges of one tensor, aligned on multiples of the chunk
size counted from the tensor's first element, whoever asks for which range. A chunk's result
therefore never depends on the number of workers, on the range that contained it (a whole
tensor, a rank's shard of it) or on the order chunks run in: the output is bit-identical
for any ``workers``.

Each of ``workers`` threads pulls the next chunk from a shared queue (in the planned order, so
the threads work on neighbouring bytes of the files), reads each source's bytes of it into
its own buffer, accumulates them in float32 / float64 and hands the merged chunk to the
chunk's *sink* (write it into a file at its offset, copy it into a tensor, ...). ``read``
and ``sink`` run concurrently from several threads: readers use ``pread`` (no shared file
position), sinks write disjoint ranges. A worker reads and computes in turn (both release
the GIL, so the workers overlap each other's reads): a read thread per worker that reads
source ``i + 1`` while source ``i`` is added (``prefetch=True``) was measured slower on 2
cores, the hand-over of each chunk between the threads costing more than the overlap gains
(issue 21). Memory: each worker holds two read buffers, an accumulator and an output buffer
of one chunk each; nothing grows with the number of sources or the model size.

The arithmetic is numpy's, on raw bytes (neither torch nor transformers is imported): readers
return the bytes of a chunk (:mod:`hf_pma.io`), decoded exactly to float32
(:mod:`hf_pma.merging.casts`); sinks receive the merged chunk's bytes in the output dtype,
rounded as torch rounds. numpy ops (and ``pread``) release the GIL, so threads scale.

Per source after the first, a worker computes ``w * x`` (one rounding) into the buffer that
holds ``x`` when that is its own read buffer or decode scratch (still in the CPU cache; a
separate buffer otherwise, e.g. for memory-mapped ``.bin`` tensors), then adds it to the
accumulator (a second rounding): the same two numpy operations, in the same order, wherever
the product is stored, so where it goes never changes a bit.

How the result compares with torch's ``acc.add_(x, alpha=w)`` (one fused multiply-add per
element): numpy rounds the product ``w * x``, then the sum (two roundings). Where the products
are exact (weights that are powers of two, such as the SMA of 2, 4, 8, ... sources) the result
is bit-identical to torch's; otherwise each step differs by at most the rounding of one
product, half an ulp of the accumulator. Integer and bool tensors are copied, never averaged.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from hf_pma.io.safetensors import DTYPE_ITEMSIZE, FLOAT_DTYPES, TORCH_NAMES
from hf_pma.merging.casts import FINITE_MAX, decode_float, encode_float
from hf_pma.utils.logs import progress_bar
from hf_pma.utils.text import shown

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MergeError",
    "ChunkTask",
    "TensorPlan",
    "TensorReader",
    "accumulate_name",
    "chunk_elements",
    "chunk_tasks",
    "default_workers",
    "useful_workers",
    "run_chunks",
]

# Accumulator chunk: a chunk read from a source (and its product) is still in the CPU cache when
# it is added (1 MiB measured faster than 4 MiB with numpy on 2 cores; elementwise arithmetic,
# so the size never changes the result).
DEFAULT_CHUNK_BYTES = 1024 * 1024


class MergeError(ValueError):
    """The sources cannot be merged (mismatched tensors, non-finite values, ...)."""


class TensorReader(Protocol):
    """What the merge reads from: one checkpoint's tensors by GLOBAL flat element ranges."""

    @property
    def infos(self) -> dict[str, Any]: ...

    def read(self, name: str, start: int = 0, stop: int | None = None, buffer: Any = None) -> Any: ...


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name, shape, stored dtype and merged dtype (safetensors names, ``"F32"``)."""

    name: str
    shape: tuple[int, ...]
    in_dtype: str
    out_dtype: str

    @property
    def averaged(self) -> bool:
        """Floating-point tensors are averaged; the others must be equal in every source."""
        return self.in_dtype in FLOAT_DTYPES

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def out_bytes(self) -> int:
        """Bytes of the merged tensor."""
        return self.numel * DTYPE_ITEMSIZE[self.out_dtype]


# A sink receives (the chunk's first element in the tensor, the merged chunk: a torch tensor of
# the output dtype, or with the numpy backend a uint8 array of its bytes); the chunk is a view
# of a worker's buffer, valid until the sink returns.
Sink = Callable[[int, Any], None]


@dataclasses.dataclass(frozen=True)
class ChunkTask:
    """Elements ``[start, stop)`` of one tensor (within one chunk-size-aligned block) and their sink."""

    plan: TensorPlan
    start: int
    stop: int
    sink: Sink


# Merge threads per usable core worth running: a merge reads and writes, so a few threads per
# core hide the waits on the disk; more only wait, and each costs a stack and its buffers
# (--workers 20000 took 664 MB and 5 s for a 0.5 MB merge).
WORKERS_PER_CORE = 4


def useful_workers(workers: int) -> int:
    """``workers`` capped to :data:`WORKERS_PER_CORE` per usable core (:func:`default_workers`);
    a cap is logged once. ``ValueError`` when ``workers`` is below 1."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    cap = WORKERS_PER_CORE * default_workers()
    if workers > cap:
        from hf_pma.utils.logs import get_logger

        get_logger(__name__).info(
            f"workers={workers:,} capped to {cap} ({WORKERS_PER_CORE} per usable core: more threads would only wait)"
        )
    return min(workers, cap)


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def accumulate_name(dtype: Any) -> str:
    """``"F32"`` or ``"F64"`` for an accumulator dtype given as ``torch.float32``/``"float32"``/``"F32"``."""
    name = str(dtype).removeprefix("torch.")
    name = {"float32": "F32", "float64": "F64"}.get(name, name)
    if name not in ("F32", "F64"):
        raise ValueError(f"accumulate_dtype must be torch.float32 or torch.float64, got {dtype}")
    return name


def chunk_elements(chunk_bytes: int, accumulate_dtype: Any) -> int:
    """Elements per chunk for an accumulator of ``chunk_bytes``."""
    return max(1, int(chunk_bytes) // DTYPE_ITEMSIZE[accumulate_name(accumulate_dtype)])


def chunk_tasks(plan: TensorPlan, start: int, stop: int, chunk_elems: int, sink: Sink) -> Iterator[ChunkTask]:
    """``[start, stop)`` of ``plan``'s tensor cut at multiples of ``chunk_elems`` (counted from element 0)."""
    pos = start
    while pos < stop:
        end = min(stop, (pos // chunk_elems + 1) * chunk_elems)
        yield ChunkTask(plan, pos, end, sink)
        pos = end


class _Worker:
    """Merges the chunks it pulls, reading the next source while it accumulates the current one.

    Readers return the bytes of a chunk; they are decoded exactly to float32
    (:mod:`hf_pma.merging.casts`), accumulated in float32 (or float64) numpy arrays, and the
    merged chunk is encoded to the output dtype with torch's rounding.
    """

    def __init__(
        self,
        names: Sequence[str],
        readers: Sequence[TensorReader],
        weights: Sequence[float],
        accumulate_dtype: str,
        chunk_elems: int,
        prefetch: bool,
        clip: bool = False,
    ) -> None:
        self.names, self.readers, self.weights = list(names), list(readers), list(weights)
        self.clip = clip
        self.clipped: dict[str, int] = {}  # tensor name -> values clipped to the output dtype's range
        self.acc_dtype = accumulate_dtype
        self._kind: Any = np.float32 if accumulate_dtype == "F32" else np.float64
        self._acc = np.empty(chunk_elems, dtype=self._kind)
        self._tmp = np.empty(chunk_elems, dtype=self._kind)
        self._decoded = np.empty(chunk_elems, dtype=np.float32)
        self._out = np.empty(chunk_elems * 8, dtype=np.uint8)
        self._bufs = [np.empty(chunk_elems * 8, dtype=np.uint8) for _ in range(2)]  # 8: the widest dtype
        self._cmp = np.empty(chunk_elems * 8, dtype=np.uint8)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="hf-pma-read") if prefetch else None

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)

    # one read = (task, source index); None for integer tasks, which are read synchronously
    def _reads(self, pull: Callable[[], ChunkTask | None]) -> Iterator[tuple[ChunkTask, int | None]]:
        while (task := pull()) is not None:
            if not task.plan.averaged:
                yield task, None
                continue
            for i in range(len(self.readers)):
                yield task, i

    def _read(self, item: tuple[ChunkTask, int | None] | None, slot: int) -> np.ndarray | None:
        if item is None or item[1] is None:
            return None
        task, i = item
        return self.readers[i].read(task.plan.name, task.start, task.stop, self._bufs[slot])

    def _submit(self, item: tuple[ChunkTask, int | None] | None, slot: int) -> Future | None:
        if item is None or item[1] is None:
            return None
        if self._io is None:
            done: Future = Future()
            done.set_result(self._read(item, slot))
            return done
        return self._io.submit(self._read, item, slot)

    def run(self, pull: Callable[[], ChunkTask | None]) -> None:
        items = self._reads(pull)
        slot = 0
        current = next(items, None)
        pending = self._submit(current, slot)
        while current is not None:
            task, i = current
            if i is None:
                task.sink(task.start, self._check_equal(task))
                current = next(items, None)
                pending = self._submit(current, slot)
                continue
            x = pending.result()
            own = (self._bufs[slot], self._decoded)  # where x's values may lie, this worker's own
            current = next(items, None)
            slot ^= 1
            pending = self._submit(current, slot)  # the next read fills the other buffer meanwhile
            acc = self._acc[: task.stop - task.start]
            weight = self._kind(self.weights[i])
            values = self._values(task, x)
            if i == 0:
                np.multiply(values, weight, out=acc)
            else:
                # The product overwrites the values where they lie in this worker's own read
                # buffer or decode scratch (still in the CPU cache; never a reader's memory,
                # such as a memory-mapped .bin tensor); the same operations either way.
                mine = values.dtype == acc.dtype and any(np.may_share_memory(values, b) for b in own)
                tmp = values if mine else self._tmp[: acc.size]
                np.multiply(values, weight, out=tmp)
                np.add(acc, tmp, out=acc)
            if i == len(self.readers) - 1:
                task.sink(task.start, self._finish(task, acc))
        if pending is not None:  # only after an error elsewhere stopped the queue
            pending.result()

    def _values(self, task: ChunkTask, x: np.ndarray) -> np.ndarray:
        return decode_float(x, task.plan.in_dtype, self._decoded)

    def _finish(self, task: ChunkTask, acc: np.ndarray) -> np.ndarray:
        # The largest and smallest value, while the chunk is in the cache: NaN and Inf propagate
        # into them (the non-finite check), and they bound the chunk for the cast's range check.
        # Two vectorized reductions, measured faster than the one sum they replace.
        high, low = acc.max(), acc.min()
        if not (np.isfinite(high) and np.isfinite(low)):
            self._raise_non_finite(task)
        out = task.plan.out_dtype
        if out == self.acc_dtype:
            return acc.view(np.uint8)
        limit = FINITE_MAX[out]
        if high > limit or -low > limit:
            self._out_of_range(task, acc, float(max(high, -low)), limit)
        return encode_float(acc, out, self._out)

    def _out_of_range(self, task: ChunkTask, acc: np.ndarray, peak: float, limit: float) -> None:
        """A merged chunk beyond the output dtype's finite range: refused, naming the tensor and
        the largest magnitude, or (``clip``) clipped to the range and counted."""
        out = TORCH_NAMES[task.plan.out_dtype]
        if not self.clip:
            cast = "saturate at" if task.plan.out_dtype == "F8_E4M3" else "overflow to infinity beyond"
            raise MergeError(
                f"tensor {shown(task.plan.name)} reaches {peak:.6g} in magnitude after merging, beyond the range of "
                f"{out} (largest finite value {limit:.6g}; its cast would {cast} it): write a wider dtype "
                "(dtype='float32' or 'bfloat16', --dtype), or pass clip_to_dtype=True (--clip-to-dtype) to clip such values "
                "to the range"
            )
        count = int(np.count_nonzero(np.abs(acc) > limit))
        np.clip(acc, -limit, limit, out=acc)
        self.clipped[task.plan.name] = self.clipped.get(task.plan.name, 0) + count

    def _check_equal(self, task: ChunkTask) -> np.ndarray:
        name = task.plan.name
        first = self.readers[0].read(name, task.start, task.stop, self._cmp)
        for source, reader in zip(self.names[1:], self.readers[1:]):
            other = reader.read(name, task.start, task.stop, self._bufs[0])
            if not np.array_equal(first, other):
                raise MergeError(
                    f"integer/bool tensor {name!r} differs between {self.names[0]} and {source}; "
                    f"such tensors (buffers, counters) cannot be averaged and must be equal in every source"
                )
        return first

    def _raise_non_finite(self, task: ChunkTask) -> None:
        name = task.plan.name
        for source, reader in zip(self.names, self.readers):
            x = reader.read(name, task.start, task.stop, self._cmp)
            if not np.isfinite(self._values(task, x)).all():
                raise MergeError(f"tensor {name!r} in {source} holds non-finite values (NaN or Inf)")
        raise MergeError(f"the merge of tensor {name!r} overflowed {TORCH_NAMES[self.acc_dtype]}")


def run_chunks(
    tasks: Iterable[ChunkTask],
    names: Sequence[str],
    readers: Sequence[TensorReader],
    weights: Sequence[float],
    accumulate_dtype: Any = "F32",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int | None = None,
    prefetch: bool = False,
    progress: bool = False,
    desc: str = "Merging",
    clip: bool = False,
) -> dict[str, int]:
    """Merge every task's chunk (``sum_i weights[i] * readers[i][range]``) and hand it to its sink.

    ``names`` name the sources in errors. ``tasks`` must be cut by :func:`chunk_tasks` with the
    same ``chunk_bytes`` and ``accumulate_dtype`` (``torch.float32``/``"float32"``/``"F32"`` or
    the float64 ones). ``workers`` threads (default: the usable cores); the first error stops
    every worker and is raised here. Readers return raw bytes
    (:mod:`hf_pma.io`); sinks receive the merged chunk's bytes in the output dtype.
    ``prefetch``: give each worker a thread that reads its next source meanwhile (off by
    default: slower where measured, see the module's docstring; the result is the same).

    Every merged chunk must be finite (``MergeError`` naming the tensor and the source with NaN
    or Inf) and, where it is cast, within the output dtype's finite range
    (:data:`hf_pma.merging.casts.FINITE_MAX`: float16's 65504, ...): ``MergeError`` naming the
    tensor and the largest magnitude, or with ``clip`` such values are clipped to the range.
    Returns the number of values clipped per tensor (empty when none).
    """
    accumulate_dtype = accumulate_name(accumulate_dtype)
    workers = useful_workers(default_workers() if workers is None else int(workers))
    chunk_elems = chunk_elements(chunk_bytes, accumulate_dtype)
    task_iter = iter(tasks)
    first = list(itertools.islice(task_iter, workers))  # never more threads than chunks
    workers = max(1, len(first))
    task_iter = itertools.chain(first, task_iter)
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    bar = progress_bar(desc=desc, unit="B", unit_scale=True, disable=not progress)

    def pull() -> ChunkTask | None:
        with lock:
            if stop.is_set():
                return None
            task = next(task_iter, None)
        if task is None:
            return None
        if task.stop - task.start > chunk_elems:
            raise ValueError(
                f"chunk of {task.plan.name!r} is larger than the chunk size: cut tasks with chunk_tasks"
            )
        if progress:
            nbytes = (task.stop - task.start) * DTYPE_ITEMSIZE[task.plan.out_dtype]
            return dataclasses.replace(task, sink=_counted(task.sink, bar, nbytes))
        return task

    def work(worker: _Worker) -> None:
        try:
            worker.run(pull)
        except BaseException as err:  # noqa: BLE001 - re-raised by the calling thread
            stop.set()
            errors.append(err)
        finally:
            worker.close()

    pool = [
        _Worker(names, readers, weights, accumulate_dtype, chunk_elems, prefetch, clip)
        for _ in range(workers)
    ]
    if workers == 1:
        work(pool[0])
    else:
        threads = [
            threading.Thread(target=work, args=(w,), name=f"hf-pma-merge-{k}") for k, w in enumerate(pool)
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:
            stop.set()
            for t in threads:
                t.join()
            raise
    bar.close()
    if errors:
        raise errors[0]
    clipped: dict[str, int] = {}
    for worker in pool:
        for name, count in worker.clipped.items():
            clipped[name] = clipped.get(name, 0) + count
    return dict(sorted(clipped.items()))


def _counted(sink: Sink, bar: Any, nbytes: int) -> Sink:
    def counted(start: int, chunk: Any) -> None:
        sink(start, chunk)
        bar.update(nbytes)

    return counted
