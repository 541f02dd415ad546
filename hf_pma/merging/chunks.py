"""The merge's inner loop, in parallel: ``sum_i w_i * x_i`` over element ranges of tensors.

Work is cut into *chunks*: element ranges of one tensor, aligned on multiples of the chunk
size counted from the tensor's first element, whoever asks for which range. A chunk's result
therefore never depends on the number of workers, on the range that contained it (a whole
tensor, a rank's shard of it) or on the order chunks run in: the output is bit-identical
for any ``workers``.

Each of ``workers`` threads pulls the next chunk from a shared queue (in the planned order, so
the threads work on neighbouring bytes of the files), accumulates it in float32 / float64
and hands the merged chunk to the chunk's *sink* (write it into a file at its offset, copy it
into a tensor, ...). While a worker accumulates source ``i`` its own I/O thread reads source
``i + 1`` (and, at a chunk's end, the first source of its next chunk) into a second buffer,
so reading and arithmetic overlap. ``read`` and ``sink`` run concurrently from several
threads: readers use ``pread`` (no shared file position), sinks write disjoint ranges.
Memory: each worker holds two read buffers, an accumulator and an output buffer of one chunk
each; nothing grows with the number of sources or the model size.

torch ops (and ``pread``) release the GIL, so threads scale; each op runs on its worker's
thread alone (``torch.set_num_threads(1)`` there): a few MiB of memory-bound work split across
OpenMP threads costs more in hand-offs than it saves, most of all on shared cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MergeError",
    "ChunkTask",
    "TensorPlan",
    "TensorReader",
    "chunk_tasks",
    "default_workers",
    "run_chunks",
]

# Accumulator chunk: a chunk read from a source is still in the CPU cache when it is added.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class MergeError(ValueError):
    """The sources cannot be merged (mismatched tensors, non-finite values, ...)."""


class TensorReader(Protocol):
    """What the merge reads from: one checkpoint's tensors by GLOBAL flat element ranges."""

    @property
    def infos(self) -> dict[str, Any]: ...

    def read(self, name: str, start: int = 0, stop: int | None = None, buffer: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name, shape, stored dtype and merged dtype."""

    name: str
    shape: tuple[int, ...]
    in_dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def averaged(self) -> bool:
        """Floating-point tensors are averaged; the others must be equal in every source."""
        return self.in_dtype.is_floating_point

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def out_bytes(self) -> int:
        """Bytes of the merged tensor."""
        return self.numel * self.out_dtype.itemsize


# A sink receives (the chunk's first element in the tensor, the merged chunk); the chunk is a
# view of a worker's buffer, valid until the sink returns.
Sink = Callable[[int, torch.Tensor], None]


@dataclasses.dataclass(frozen=True)
class ChunkTask:
    """Elements ``[start, stop)`` of one tensor (within one chunk-size-aligned block) and their sink."""

    plan: TensorPlan
    start: int
    stop: int
    sink: Sink


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def chunk_elements(chunk_bytes: int, accumulate_dtype: torch.dtype) -> int:
    """Elements per chunk for an accumulator of ``chunk_bytes``."""
    return max(1, int(chunk_bytes) // accumulate_dtype.itemsize)


def chunk_tasks(plan: TensorPlan, start: int, stop: int, chunk_elems: int, sink: Sink) -> Iterator[ChunkTask]:
    """``[start, stop)`` of ``plan``'s tensor cut at multiples of ``chunk_elems`` (counted from element 0)."""
    pos = start
    while pos < stop:
        end = min(stop, (pos // chunk_elems + 1) * chunk_elems)
        yield ChunkTask(plan, pos, end, sink)
        pos = end


class _Worker:
    """Merges the chunks it pulls, reading the next source while it accumulates the current one."""

    def __init__(
        self,
        names: Sequence[str],
        readers: Sequence[TensorReader],
        weights: Sequence[float],
        accumulate_dtype: torch.dtype,
        chunk_elems: int,
        prefetch: bool,
    ) -> None:
        self.names, self.readers, self.weights = list(names), list(readers), list(weights)
        self.acc_dtype = accumulate_dtype
        self._acc = torch.empty(chunk_elems, dtype=accumulate_dtype)
        self._bufs = [torch.empty(chunk_elems * 8, dtype=torch.uint8) for _ in range(2)]  # 8: the widest dtype
        self._cmp = torch.empty(chunk_elems * 8, dtype=torch.uint8)
        self._out: dict[torch.dtype, torch.Tensor] = {}
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

    def _read(self, item: tuple[ChunkTask, int | None] | None, slot: int) -> torch.Tensor | None:
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
        torch.set_num_threads(1)
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
            current = next(items, None)
            slot ^= 1
            pending = self._submit(current, slot)  # the next read fills the other buffer meanwhile
            acc = self._acc[: task.stop - task.start]
            if i == 0:
                acc.copy_(x)
                acc.mul_(self.weights[0])
            else:
                acc.add_(x, alpha=self.weights[i])  # promoted to the accumulator's dtype, no temporary
            if i == len(self.readers) - 1:
                task.sink(task.start, self._finish(task, acc))
        if pending is not None:  # only after an error elsewhere stopped the queue
            pending.result()

    def _finish(self, task: ChunkTask, acc: torch.Tensor) -> torch.Tensor:
        # NaN and Inf propagate into the sum: one cheap reduction instead of an isfinite mask;
        # only a non-finite sum (or an overflowing one) pays for the exact check.
        if not bool(torch.isfinite(acc.sum())) and not bool(torch.isfinite(acc).all()):
            self._raise_non_finite(task)
        if task.plan.out_dtype == acc.dtype:
            return acc
        dtype = task.plan.out_dtype
        if dtype not in self._out:
            self._out[dtype] = torch.empty(self._acc.numel(), dtype=dtype)
        return self._out[dtype][: acc.numel()].copy_(acc)  # the same rounding as acc.to(dtype)

    def _check_equal(self, task: ChunkTask) -> torch.Tensor:
        name = task.plan.name
        first = self.readers[0].read(name, task.start, task.stop, self._cmp)
        for source, reader in zip(self.names[1:], self.readers[1:]):
            other = reader.read(name, task.start, task.stop, self._bufs[0])
            if not torch.equal(first, other):
                raise MergeError(
                    f"integer/bool tensor {name!r} differs between {self.names[0]} and {source}; "
                    f"such tensors (buffers, counters) cannot be averaged and must be equal in every source"
                )
        return first

    def _raise_non_finite(self, task: ChunkTask) -> None:
        name = task.plan.name
        for source, reader in zip(self.names, self.readers):
            x = reader.read(name, task.start, task.stop, self._cmp)
            if not bool(torch.isfinite(x).all()):
                raise MergeError(f"tensor {name!r} in {source} holds non-finite values (NaN or Inf)")
        raise MergeError(f"the merge of tensor {name!r} overflowed {self.acc_dtype}")


@contextlib.contextmanager
def _restore_num_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_chunks(
    tasks: Iterable[ChunkTask],
    names: Sequence[str],
    readers: Sequence[TensorReader],
    weights: Sequence[float],
    accumulate_dtype: torch.dtype = torch.float32,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int | None = None,
    prefetch: bool = True,
    progress: bool = False,
    desc: str = "Merging",
) -> None:
    """Merge every task's chunk (``sum_i weights[i] * readers[i][range]``) and hand it to its sink.

    ``names`` name the sources in errors. ``tasks`` must be cut by :func:`chunk_tasks` with the
    same ``chunk_bytes`` and ``accumulate_dtype``. ``workers`` threads (default: the usable
    cores); the first error stops every worker and is raised here.
    """
    if accumulate_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"accumulate_dtype must be torch.float32 or torch.float64, got {accumulate_dtype}")
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    chunk_elems = chunk_elements(chunk_bytes, accumulate_dtype)
    task_iter = iter(tasks)
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    bar = tqdm(desc=desc, unit="B", unit_scale=True, disable=not progress)

    def pull() -> ChunkTask | None:
        with lock:
            if stop.is_set():
                return None
            task = next(task_iter, None)
        if task is None:
            return None
        if task.stop - task.start > chunk_elems:
            raise ValueError(f"chunk of {task.plan.name!r} is larger than the chunk size: cut tasks with chunk_tasks")
        if progress:
            return dataclasses.replace(task, sink=_counted(task.sink, bar, task.plan.out_dtype.itemsize))
        return task

    def work(worker: _Worker) -> None:
        try:
            worker.run(pull)
        except BaseException as err:  # noqa: BLE001 - re-raised by the calling thread
            stop.set()
            errors.append(err)
        finally:
            worker.close()

    pool = [_Worker(names, readers, weights, accumulate_dtype, chunk_elems, prefetch) for _ in range(workers)]
    with _restore_num_threads():
        if workers == 1:
            work(pool[0])
        else:
            threads = [threading.Thread(target=work, args=(w,), name=f"hf-pma-merge-{k}") for k, w in enumerate(pool)]
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


def _counted(sink: Sink, bar: Any, itemsize: int) -> Sink:
    def counted(start: int, chunk: torch.Tensor) -> None:
        sink(start, chunk)
        bar.update(chunk.numel() * itemsize)

    return counted
