"""Sharded snapshots: every rank writes only its own slices of the weights; no rank gathers the model.

For FSDP1/FSDP2 and DeepSpeed ZeRO-3 runs. One snapshot is one folder::

    <pma_dir>/snapshot-<tokens>/
        shard-00001-model-00001-of-00001.safetensors   # rank 0's slices
        shard-0000r-model-00001-of-00001.safetensors   # rank r-1's slices
        config.json, generation_config.json, tokenizer files, pma.json (the record)

in the layout torch DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` writes (what
torchtitan writes): each file stores its slices under the full tensor names, with
``__metadata__["DCP_SHARDING_INFO"]`` giving each slice's ``saved_offsets``, so DCP and
torchtitan tooling read it too. A ZeRO-3 partition is a flat range of the flattened tensor,
which DCP's layout cannot express: it is stored flat, and ``hf_pma_global_shapes`` (written
for every tensor) gives the full shapes. :mod:`hf_pma.io.sharded` reads both.

How a snapshot is taken (:class:`ShardedSnapshotSink`), on every rank:

1. in the training thread: the rank's slices (FSDP2 ``DTensor`` local shards, FSDP1
   ``ShardedTensor`` local shards, ZeRO-3 ``ds_tensor`` partitions; unsharded tensors on rank 0
   only) are cast to ``save_dtype`` on their device and copied into host staging buffers that
   are reused from one snapshot to the next (pinned, and copied without blocking, on CUDA);
2. in a background thread: the rank's file is written under a temporary name in
   ``<pma_dir>/.tmp-snapshot-<tokens>/``, fsynced, and renamed to its final name (the rename is
   the rank's "done" mark);
3. rank 0's background thread waits until every rank's file has its final name, writes the
   config and the record, renames the folder to ``snapshot-<tokens>`` and only then lists it in
   the manifest (``keep_last`` deletes whole folders). A rank that dies mid-write leaves a
   ``.tmp-`` folder that is never listed and is removed when the run restarts.

Host memory per rank: one copy of the rank's slices in the saved dtype (the staging buffers),
whatever the model size or world size; nothing is gathered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.manifest import SHARDED_TMP_MARKER, SHARDED_TMP_PREFIX, SnapshotRecord, add_snapshot
from hf_pma.core.outputs import record_own_files
from hf_pma.io.guarded import parse_json
from hf_pma.io.safetensors import SafetensorsWriter
from hf_pma.io.sharded import (
    DCP_SHARDING_INFO_KEY,
    DCP_VERSION_KEY,
    GLOBAL_SHAPES_KEY,
    SAVED_OFFSETS_KEY,
    ShardedCheckpointTensors,
    rank_file_name,
)
from hf_pma.io.torch_adapters import (
    DTYPE_FROM_SAFETENSORS,
    safetensors_dtype,
    tensor_bytes,
)
from hf_pma.snapshots.gather import LocalSlice, StagedShard, StagingBuffers, local_slices
from hf_pma.snapshots.online import OnlineAverage
from hf_pma.snapshots.sinks import (
    ONLINE_STATE_NAME,
    DiskSnapshotSink,
    OnlineAverageSink,
    ResumePoint,
    check_nothing_lost,
    check_rank_files_agree,
    check_saved_for,
    online_state_name,
    restore_staged_states,
)
from hf_pma.snapshots.writer import (
    check_replaceable,
    model_metadata,
    write_metadata_files,
    write_snapshot_record,
)
from hf_pma.utils.fs import atomic_write_text, fsync_dir, publish_folder
from hf_pma.utils.text import escape, shown

logger = logging.get_logger(__name__)

__all__ = [
    "LAYOUT_DCP",
    "LAYOUT_FLAT",
    "write_rank_file",
    "wait_for_rank_files",
    "finish_sharded_snapshot",
    "sharded_tmp_dir",
    "mark_sharded_tmp_dir",
    "ShardedSnapshotSink",
    "ShardedOnlineAverageSink",
]

# Layout names recorded in the manifest and in pma.json.
LAYOUT_DCP = "dcp-hf-safetensors"  # slices are boxes with DCP offsets (FSDP)
LAYOUT_FLAT = "dcp-hf-safetensors+flat"  # some slices are flat ranges (ZeRO-3)
_DCP_VERSION = "1.0"
_WRITE_CHUNK = 64 * 2**20
# How long rank 0 waits for the other ranks' files before failing the snapshot.
DEFAULT_RANK_TIMEOUT_S = 3600.0


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def write_rank_file(path: str | os.PathLike[str], staged: StagedShard) -> int:
    """Write one rank's slices as a DCP-layout safetensors file, atomically; returns its size.

    Written under ``<name>.partial``, fsynced, then renamed: a file with the final name is complete.
    The rename hands the file over: from then on rank 0 may move the folder (it completes the
    snapshot as soon as every rank's file has its name), so nothing here touches the path again.
    """
    path = Path(path)
    staged.synchronize()
    info = {s.name: {SAVED_OFFSETS_KEY: list(s.offsets)} for s in staged.slices}
    shapes = {s.name: list(s.global_shape) for s in staged.slices}
    metadata = {
        DCP_SHARDING_INFO_KEY: json.dumps(info),
        DCP_VERSION_KEY: _DCP_VERSION,
        GLOBAL_SHAPES_KEY: json.dumps(shapes),
        "format": "pt",
    }
    plan = [(s.name, safetensors_dtype(b.dtype, s.name), (s.numel,) if s.flat else tuple(s.sizes)) for s, b in zip(staged.slices, staged.buffers)]
    partial = path.with_name(path.name + ".partial")
    writer = SafetensorsWriter(partial, plan, metadata=metadata)
    try:
        for s, buffer in zip(staged.slices, staged.buffers):
            step = max(1, _WRITE_CHUNK // buffer.element_size())
            for start in range(0, buffer.numel(), step):
                writer.write(s.name, tensor_bytes(buffer[start : start + step]))
        writer.close()
    except BaseException:
        with contextlib.suppress(Exception):
            writer.close()
        partial.unlink(missing_ok=True)
        raise
    size = partial.stat().st_size
    os.replace(partial, path)
    # The folder may already be renamed by rank 0 (which fsyncs it first); then this is a no-op.
    fsync_dir(path.parent)
    return size


def sharded_tmp_dir(pma_dir: str | os.PathLike[str], name: str) -> Path:
    """The folder where the ranks write snapshot ``name`` before rank 0 renames it into place.

    Every rank must find it without talking to the others, so the name carries no host or pid:
    it is ``.tmp-<name>``, which ``clean_incomplete`` removes when a run (re)starts only when it
    holds the mark every rank writes there first (:func:`mark_sharded_tmp_dir`)."""
    return Path(pma_dir) / f"{SHARDED_TMP_PREFIX}{name}"


def mark_sharded_tmp_dir(tmp: Path) -> None:
    """Write the mark that says ``tmp`` is hf-pma's sharded temporary folder (atomically, never
    through a link: every rank writes it), before this rank writes its file there."""
    atomic_write_text(tmp / SHARDED_TMP_MARKER, "")


def wait_for_rank_files(folder: Path, world_size: int, timeout_s: float = DEFAULT_RANK_TIMEOUT_S) -> list[Path]:
    """Wait until every rank's file in ``folder`` has its final name; returns them in rank order.

    Raises ``TimeoutError`` naming the ranks still missing after ``timeout_s`` seconds.
    """
    files = [folder / rank_file_name(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        missing = [r for r, f in enumerate(files) if not f.is_file()]
        if not missing:
            return files
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {missing} did not finish writing their part of {folder.name} within {timeout_s:.0f}s"
            )
        time.sleep(delay)
        delay = min(0.5, delay * 2)


def finish_sharded_snapshot(
    pma_dir: str | os.PathLike[str],
    record: SnapshotRecord,
    world_size: int,
    write_extras: Any | None = None,
    keep_last: int | None = None,
    timeout_s: float = DEFAULT_RANK_TIMEOUT_S,
    layout: str = LAYOUT_DCP,
) -> tuple[SnapshotRecord, list[SnapshotRecord]]:
    """Rank 0: once every rank's file is in, complete the folder and list it in the manifest.

    ``write_extras(folder)`` writes the config, generation config and tokenizer. Returns the
    record (``num_bytes``: all ranks' files) and the records ``keep_last`` deleted.
    """
    pma_dir = Path(pma_dir)
    tmp = sharded_tmp_dir(pma_dir, record.path)
    files = wait_for_rank_files(tmp, world_size, timeout_s)
    record.num_bytes = sum(f.stat().st_size for f in files)
    record.extra = {**record.extra, "sharded": True, "world_size": world_size, "layout": layout}
    if write_extras is not None:
        write_extras(tmp)
    (tmp / SHARDED_TMP_MARKER).unlink(missing_ok=True)  # the mark never ends up in the snapshot
    write_snapshot_record(tmp, record)
    final = pma_dir / record.path
    check_replaceable(final, pma_dir)  # never a folder or file that is not entirely hf-pma's
    publish_folder(tmp, final)  # an older one of the same name is replaced whole, even by a crash
    deleted = add_snapshot(pma_dir, record, keep_last=keep_last)
    return record, deleted


# ---------------------------------------------------------------------------------------------
# The per-rank writer
# ---------------------------------------------------------------------------------------------


class ShardedSnapshotSink(DiskSnapshotSink):
    """Sharded snapshots behind :class:`hf_pma.PMACallback` (``sharded=True``, or ``"auto"`` under
    FSDP / ZeRO-3): every rank writes its own slices; no rank gathers the model.

    :meth:`take` (training thread, every rank) waits for this rank's previous write, then copies
    the rank's slices into reused host buffers (cast on the device); :meth:`commit` writes the
    rank's file in the background. Rank 0's background task then waits for every rank's file
    (its final name is the rank's "done" mark: no collective runs off the training thread),
    completes the folder and lists it in the manifest. Everything else (opening, resume
    truncation, ``keep_last``, exclusions, listing) is :class:`DiskSnapshotSink`'s, on whole folders.

    Args:
        rank: this process (default: from ``torch.distributed``).
        world_size: the number of processes (default: from ``torch.distributed``).
        rank_timeout_s: how long rank 0 waits for the other ranks' files before failing the snapshot.
    """

    kind = "sharded"

    def __init__(
        self,
        pma_dir: str | os.PathLike[str],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (torch.distributed.get_world_size() if initialized else 1)
        kwargs.setdefault("is_main", self.rank == 0)
        super().__init__(pma_dir, **kwargs)
        self.rank_timeout_s = rank_timeout_s
        self.staging = StagingBuffers()
        self.layout = LAYOUT_DCP
        self.written: list[SnapshotRecord] = []
        self.bytes_written = 0

    def update_manifest(self, **fields: Any) -> None:
        """Run-level fields, plus ``sharded``, ``world_size`` and ``shard_layout`` (main process)."""
        if self.writer is not None:
            self.writer.update_manifest(
                layout=self.kind, sharded=True, world_size=self.world_size, shard_layout=self.layout, **fields
            )

    def warm_up(self, model: torch.nn.Module) -> None:
        """Every rank: the one-time costs before the first snapshot, and this rank's staging
        buffers allocated on a background thread (:meth:`StagingBuffers.reserve`)."""
        super().warm_up(model)
        self.staging.reserve(local_slices(model, self.rank), self.save_dtype)

    def _copies_full_weights(self, model: torch.nn.Module) -> bool:
        return False  # each rank stages its own slices

    def take(self, model: torch.nn.Module, record: SnapshotRecord) -> None:
        """Every rank: copy this rank's slices to the host buffers (after its previous write)."""
        from hf_pma.snapshots.writer import model_metadata

        if self._taken is not None:
            raise RuntimeError("SnapshotSink.take() called twice without commit()")
        self.worker.wait(reason=f"snapshot at {record.tokens:,} tokens")
        slices = local_slices(model, self.rank)
        staged = self.staging.stage(slices, self.save_dtype)
        layout = LAYOUT_FLAT if any(s.flat for s in slices) else LAYOUT_DCP
        extras = None
        if self.is_main:
            dtype = self.save_dtype or next((b.dtype for b in staged.buffers if b.is_floating_point()), None)
            if record.dtype is None and dtype is not None:
                record.dtype = str(dtype).removeprefix("torch.")
            config, generation_config = model_metadata(model, dtype)
            extras = (config, generation_config, self.processing_class)
        self._taken = (staged, record, extras, layout)

    @property
    def has_taken(self) -> bool:
        """Whether a snapshot was taken and not committed yet."""
        return self._taken is not None

    def _write(self, taken: tuple) -> None:
        staged, record, extras, layout = taken
        tmp = sharded_tmp_dir(self.pma_dir, record.path)
        tmp.mkdir(parents=True, exist_ok=True)
        if tmp.is_symlink():  # planted since train begin removed it: never write through it
            raise FileExistsError(f"hf-pma: {tmp} is a symbolic link; sharded snapshots are written only into a real folder")
        mark_sharded_tmp_dir(tmp)
        self.bytes_written += write_rank_file(tmp / rank_file_name(self.rank), staged)
        if not self.is_main:
            return
        config, generation_config, processing_class = extras

        def write_extras(folder: Path) -> None:
            write_metadata_files(folder, config, generation_config, processing_class)

        with self.writer.lock:
            record, deleted = finish_sharded_snapshot(
                self.pma_dir, record, self.world_size, write_extras, self.keep_last, self.rank_timeout_s, layout
            )
        if layout != self.layout:
            self.layout = layout
            self.writer.update_manifest(shard_layout=layout)
        for old in deleted:
            logger.debug(f"hf-pma: deleted {old.path} (keep_last={self.keep_last})")
        self.writer.written.append(record)
        logger.debug(
            f"hf-pma: sharded snapshot {record.path} written by {self.world_size} ranks "
            f"({(record.num_bytes or 0) / 2**20:.1f} MiB in all)"
        )

    def _label(self, taken: tuple) -> str:
        return f"{self.pma_dir / taken[1].path} (rank {self.rank})"

    def close(self, model: torch.nn.Module | None) -> None:
        """Wait for the last write (on rank 0: until it is listed), then free the staging buffers."""
        super().close(model)
        self.staging.release()


# ---------------------------------------------------------------------------------------------
# The shard-local online average
# ---------------------------------------------------------------------------------------------


def _flat_ranges(s: LocalSlice) -> list[tuple[int, int]]:
    """The runs ``[start, stop)`` of the flattened full tensor that slice ``s`` covers, in order."""
    if s.numel == 0:
        return []
    if s.flat:
        return [(s.offsets[0], s.offsets[0] + s.sizes[0])]
    shape = s.global_shape
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    partial = [i for i in range(len(shape)) if s.offsets[i] != 0 or s.sizes[i] != shape[i]]
    if not partial:
        return [(0, math.prod(shape))]
    k = partial[-1]  # dims after k are whole: one run per index of the dims before it
    length = s.sizes[k] * strides[k]
    runs = []
    for index in itertools.product(*(range(o, o + z) for o, z in zip(s.offsets[:k], s.sizes[:k]))):
        start = sum(i * st for i, st in zip(index, strides)) + s.offsets[k] * strides[k]
        runs.append((start, start + length))
    return runs


def read_slice(tensors: ShardedCheckpointTensors, s: LocalSlice) -> torch.Tensor:
    """The elements slice ``s`` covers, read from rank files of any world size (``tensors``), in
    the stored dtype and the slice's own shape (flat for a flat slice)."""
    info = tensors.infos.get(s.name)
    if info is None or tuple(info.shape) != tuple(s.global_shape):
        found = list(info.shape) if info is not None else "nothing"
        raise ValueError(f"the saved online average holds {found} for tensor {shown(s.name)}, not {list(s.global_shape)}")
    dtype = DTYPE_FROM_SAFETENSORS[info.dtype]
    out = torch.empty(s.numel, dtype=dtype)
    position = 0
    for start, stop in _flat_ranges(s):
        out[position : position + stop - start] = torch.from_numpy(tensors.read(s.name, start, stop)).view(dtype)
        position += stop - start
    return out if s.flat else out.reshape(s.sizes)


def _refresh_zero3_available(model: torch.nn.Module) -> None:
    """ZeRO-3 keeps small parameters (``ds_persist``) and those still gathered in full on every rank,
    and a forward pass uses that copy: after their partitions were written, rebuild it from the
    partitions (DeepSpeed's own partition and all-gather of those parameters, as a forward pass
    does for the others). Nothing without ZeRO-3."""
    from hf_pma.snapshots.gather import unwrap_model

    params = [p for p in unwrap_model(model).parameters() if hasattr(p, "ds_tensor")]
    if not params:
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    available = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
    if available:  # the same parameters on every rank
        available[0].partition(param_list=available, has_been_updated=False)
        available[0].all_gather(param_list=available)


def _check_live(model: torch.nn.Module, slices: Sequence[LocalSlice]) -> None:
    """``ValueError`` unless every slice's tensor is the live storage of a parameter or buffer
    (a copy would take the average and leave the model as it was)."""
    from hf_pma.snapshots.gather import unwrap_model

    storages = set()
    for tensor in itertools.chain(model.parameters(), model.buffers(), unwrap_model(model).parameters()):
        for part in (tensor, getattr(tensor, "ds_tensor", None)):
            if part is None:
                continue
            local = part.to_local() if hasattr(part, "to_local") else part
            with contextlib.suppress(RuntimeError):
                storages.add(local.untyped_storage().data_ptr())
    for s in slices:
        if s.numel and s.tensor.untyped_storage().data_ptr() not in storages:
            raise ValueError(
                f"tensor {shown(s.name)}: this rank's slice is a copy, not the live shard, under this sharding: "
                "the online average can be evaluated in place under FSDP2 and ZeRO-3 (or write snapshots)"
            )


def _slice_layout(s: LocalSlice) -> list[Any]:
    """What identifies where a slice sits (stored with a rank's saved average, compared on resume)."""
    return [list(s.offsets), list(s.sizes), list(s.global_shape), bool(s.flat)]


class ShardedOnlineAverageSink(OnlineAverageSink):
    """The online average of a sharded run (``online=`` under FSDP1/FSDP2 or DeepSpeed ZeRO-3):
    every rank averages its own slices in float32; no rank gathers the model, and no collective
    runs at a snapshot.

    At each snapshot every rank takes the live slices it holds
    (:func:`hf_pma.snapshots.gather.local_slices`: FSDP ``DTensor`` / ``ShardedTensor`` local
    shards, ZeRO-3 ``ds_tensor`` partitions; unsharded tensors on rank 0). Where they go
    (``online_device``, as in :class:`~hf_pma.snapshots.sinks.OnlineAverageSink`):

    * ``"cpu"`` (default): copied into reused host buffers in the training dtype
      (:class:`~hf_pma.snapshots.gather.StagingBuffers`; from CUDA pinned, on a side stream,
      the CPU thread not blocked), then folded into the rank's float32 copy in the background
      thread. Host memory per rank: one float32 copy of the rank's slices plus one copy in the
      training dtype.
    * ``"device"``: folded into a float32 copy on the device, in the training thread; device
      memory per rank: one float32 copy of the rank's slices; no host memory.

    Every Trainer checkpoint gets one file per rank, ``pma_online-rank<r>.safetensors``
    (float32 slices; the count, records, world size and each slice's place in its metadata),
    restored on resume by the same rank: the resumed average is bit-identical to an
    uninterrupted one. A resume at another world size reads every rank's saved file by global
    offsets (this rank's slices of it); other shards at the same world size stop with one line.
    At train end the average is written as a sharded folder ``<pma_dir>/online-<kind>/`` (one
    file per rank in the layout of :class:`ShardedSnapshotSink`, config, tokenizer and
    ``pma_merge.json``), which every hf-pma reader takes (``merge``, ``consolidate``, ``eval``).
    """

    def __init__(
        self,
        pma_dir: str | os.PathLike[str],
        *,
        online: str = "sma",
        alpha: float = 0.2,
        rank: int | None = None,
        world_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (torch.distributed.get_world_size() if initialized else 1)
        kwargs.setdefault("is_main", self.rank == 0)
        super().__init__(pma_dir, online=online, alpha=alpha, **kwargs)
        self._slices: dict[str, LocalSlice] = {}  # where each averaged tensor sits (no data)
        # A resume at another world size: the saved files, read by global offsets at warm_up.
        self._reshard_from: tuple[list[Path], Path] | None = None

    # -- resume ---------------------------------------------------------------------------------

    def open(self, resume: ResumePoint | None) -> dict[str, Any]:
        """Every rank: restore its part of the average from the checkpoint (same world size only);
        the main process checks the final folder can be written. A failure stops every rank."""
        from hf_pma.utils.distributed import all_ranks_checked

        if resume is not None:  # a state staged for the checkpoint, and not moved in before a kill: moved now
            all_ranks_checked(
                lambda: restore_staged_states(self.pma_dir, resume) if self.is_main else None,
                "restoring the online average staged for the checkpoint",
            )
        counts = all_ranks_checked(lambda: self._restore(resume), "restoring the sharded online average")
        if resume is not None:
            missing = [r for r, c in enumerate(counts) if c is None]
            if missing and len(missing) < len(counts):
                raise ValueError(
                    f"hf-pma: {escape(resume.checkpoint_dir)} lacks the online average of rank(s) {missing}: "
                    "resume from a checkpoint that every rank saved"
                )
            # The same on every rank (every rank read the checkpoint's state): all raise, or none.
            check_nothing_lost(resume, None if missing else counts[0], self.average.options)
            if not missing and len(set(counts)) > 1:
                raise ValueError(
                    f"hf-pma: the ranks' online averages in {escape(resume.checkpoint_dir)} hold different numbers of "
                    f"snapshots ({counts}): the checkpoint is inconsistent"
                )
            if not missing and self.is_main:
                logger.info(
                    f"hf-pma: restored the sharded online {self.average.kind} average of {counts[0]} snapshots "
                    f"({self.world_size} ranks)"
                )
        self.average.device = self.online_device  # a restored average goes where this run keeps it
        all_ranks_checked(lambda: self._check_target() if self.is_main else None, "checking the online average's folder")
        return {}

    def _restore(self, resume: ResumePoint | None) -> int | None:
        if resume is None:
            return 0
        folder = resume.checkpoint_dir
        path = folder / online_state_name(self.rank)
        first = folder / online_state_name(0)
        single = folder / ONLINE_STATE_NAME  # saved by an unsharded run
        # Present: anything there, even a FIFO or a link, which the one way in then refuses (never
        # taken for "no average", which would restart it empty).
        if not os.path.lexists(first) and not os.path.lexists(single):
            return None
        read = path if os.path.lexists(path) else first if os.path.lexists(first) else single
        average = OnlineAverage.load_state(read)
        self.average.check_same_options(average, escape(path))
        check_saved_for(average.saved_at, resume, read)
        saved_world = average.metadata.get("world_size", "1" if not os.path.lexists(first) else None)
        if saved_world == str(self.world_size) and os.path.lexists(first):
            if not os.path.lexists(path):
                return None
            self._restore_own(path, average)
            # The same count on every rank is checked together; the rest of the bookkeeping here,
            # against rank 0's file (a windowed average's count repeats from window to window).
            check_rank_files_agree([first, path], folder)
            return average.count
        # Another world size (or an unsharded run's average): every saved file, read by global offsets.
        if not (isinstance(saved_world, str) and saved_world.isdigit() and 0 < int(saved_world) <= 2**20):
            raise ValueError(f"hf-pma: {escape(path)} is not an hf-pma sharded online average: bad 'world_size'")
        files = [folder / online_state_name(r) for r in range(int(saved_world))] if os.path.lexists(first) else [single]
        missing = [f.name for f in files if not os.path.lexists(f)]
        if missing:
            raise ValueError(f"hf-pma: {escape(folder)} lacks {', '.join(missing[:3])} of the saved online average")
        check_rank_files_agree(files, folder, average.metadata)
        average._average = {}  # read by this run's slices at warm_up
        self.average = average
        self._reshard_from = (files, folder)
        logger.info(
            f"hf-pma: the online average was saved by {saved_world} rank(s); rank {self.rank} reads its slices of it "
            "by global offsets"
        )
        return average.count

    def _restore_own(self, path: Path, average: OnlineAverage) -> None:
        """This rank's own file, saved at the same world size: its slices as they were."""
        if average.metadata.get("rank") != str(self.rank):
            raise ValueError(
                f"hf-pma: {escape(path)} holds rank {shown(average.metadata.get('rank'))}'s part of the online average, "
                f"not rank {self.rank}'s: the checkpoint's files were renamed or mixed"
            )
        layout = parse_json(average.metadata.get("slices", "null"), f"{escape(path)}: metadata 'slices'")
        if not isinstance(layout, dict) or set(layout) != set(average.state_dict()):
            raise ValueError(f"hf-pma: {escape(path)} is not an hf-pma sharded online average: bad 'slices' metadata")
        self._slices = {}
        for name, entry in layout.items():
            try:
                offsets, sizes, shape, flat = entry
                s = LocalSlice(name, torch.empty(0), tuple(offsets), tuple(sizes), tuple(shape), bool(flat))
                ok = s.numel == average._average[name].numel()
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"hf-pma: {escape(path)}: the slice of {shown(name)} does not match its tensor")
            self._slices[name] = s
        self.average = average

    def warm_up(self, model: torch.nn.Module) -> None:
        """Every rank: a restored average must sit on this run's shards (checked before training)."""
        from hf_pma.utils.distributed import all_ranks_checked

        if self._reshard_from is not None:
            all_ranks_checked(lambda: self._reshard(model), "reading the online average by global offsets")
        elif self._slices:
            all_ranks_checked(lambda: self._check_layout(local_slices(model, self.rank)), "checking the online average's shards")

    def _reshard(self, model: torch.nn.Module) -> None:
        """This rank's slices of an average saved at another world size (any layout), in float32."""
        files, folder = self._reshard_from
        slices = local_slices(model, self.rank)
        with ShardedCheckpointTensors(files, folder) as tensors:
            names = {s.name for s in slices}
            if not names <= set(tensors.infos):
                raise ValueError(
                    f"hf-pma: the online average in {escape(folder)} lacks tensor(s) this model has: "
                    f"{', '.join(sorted(names - set(tensors.infos))[:5])}"
                )
            self.average._average = {s.name: read_slice(tensors, s) for s in slices}
        self.average.check_tensors(escape(folder))
        self._slices = {s.name: dataclasses.replace(s, tensor=torch.empty(0)) for s in slices}
        self._reshard_from = None

    def _check_layout(self, slices: Sequence[LocalSlice]) -> None:
        live = {s.name: _slice_layout(s) for s in slices}
        saved = {name: _slice_layout(s) for name, s in self._slices.items()}
        if live != saved:
            name = next(iter(sorted(n for n in set(live) | set(saved) if live.get(n) != saved.get(n))))
            raise ValueError(
                f"hf-pma: rank {self.rank}'s online average holds tensor {shown(name)} as {saved.get(name)} but this "
                f"run's shards hold it as {live.get(name)} (offsets, sizes, shape, flat): resume with the sharding "
                "the average was taken with"
            )

    # -- snapshots ------------------------------------------------------------------------------

    def take(self, model: torch.nn.Module, record: SnapshotRecord) -> None:
        """Every rank: this rank's live slices go into its float32 average: staged to the host now
        and folded in at :meth:`commit` (``"cpu"``), or folded in now on the device (``"device"``)."""
        if self._taken is not None:
            raise RuntimeError("SnapshotSink.take() called twice without commit()")
        self.worker.wait(reason=f"snapshot at {record.tokens:,} tokens")  # the staging buffers are free again
        slices = local_slices(model, self.rank)
        if self._slices:
            self._check_layout(slices)
        else:
            self._slices = {s.name: dataclasses.replace(s, tensor=torch.empty(0)) for s in slices}
        self._model_dtype = next((s.tensor.dtype for s in slices if s.tensor.is_floating_point()), self._model_dtype)
        self._take_slices(slices, record)

    def state_dict(self, dtype: torch.dtype | None = None) -> None:
        """``None``: no process holds the full average (see :meth:`local_average`)."""
        return None

    def local_average(self) -> list[tuple[LocalSlice, torch.Tensor]]:
        """This rank's slices of the average: ``(where it sits, float32 data)`` per tensor."""
        self.settle()
        return [(self._slices[name], tensor) for name, tensor in self.average._average.items()]

    @torch.no_grad()
    def swap_in(self, model: torch.nn.Module) -> Any | None:
        """Every rank: put its slices of the average into its own live shards (no gather; the
        unsharded tensors, which rank 0 averages, are broadcast from it); returns the function
        that puts the live weights back (every rank calls it), or ``None`` while the average is
        empty. Call it with the model resharded (:func:`hf_pma.merging.slices.reshard`)."""
        from hf_pma.utils.distributed import all_ranks_checked

        self.settle()
        if self.average.count == 0:
            return None
        mine: list[LocalSlice] = []
        unsharded: list[LocalSlice] = []

        def find() -> None:
            mine[:] = local_slices(model, self.rank)
            self._check_layout(mine)
            if self.world_size > 1:
                sharded_names = {s.name for s in local_slices(model, 1)}
                unsharded[:] = [s for s in local_slices(model, 0) if s.name not in sharded_names]
            _check_live(model, [*mine, *unsharded])

        all_ranks_checked(find, "finding this rank's live shards for the online average")
        backup: list[tuple[torch.Tensor, torch.Tensor]] = []
        for s in mine:
            backup.append((s.tensor, s.tensor.to("cpu", copy=True)))
            s.tensor.copy_(self.average._average[s.name].reshape(s.tensor.shape))
        for s in unsharded:  # the same list, in the same order, on every rank
            if self.rank != 0:
                backup.append((s.tensor, s.tensor.to("cpu", copy=True)))
            torch.distributed.broadcast(s.tensor, src=0)
        _refresh_zero3_available(model)

        @torch.no_grad()
        def restore() -> None:
            for live, saved in backup:
                live.copy_(saved)
            _refresh_zero3_available(model)

        return restore

    # Every rank stages and saves its own part, ``pma_online-rank<r>.safetensors`` (the mechanism
    # of OnlineAverageSink.stage_checkpoint / save_checkpoint), once the average holds a snapshot.

    def _state_name(self) -> str:
        return online_state_name(self.rank)

    def _keeps_state(self) -> bool:
        return self.average.count > 0

    def _state_metadata(self) -> dict[str, str]:
        """This rank's file's metadata: world size, rank and where each slice sits."""
        layout = {name: _slice_layout(self._slices[name]) for name in self.average._average}
        return {
            "world_size": str(self.world_size),
            "rank": str(self.rank),
            "slices": json.dumps(layout),
            # The layout of a sharded snapshot's rank file: readable by global offsets at any world size.
            DCP_SHARDING_INFO_KEY: json.dumps({n: {SAVED_OFFSETS_KEY: entry[0]} for n, entry in layout.items()}),
            GLOBAL_SHAPES_KEY: json.dumps({n: entry[2] for n, entry in layout.items()}),
            DCP_VERSION_KEY: _DCP_VERSION,
        }

    # -- the end --------------------------------------------------------------------------------

    def close(self, model: torch.nn.Module | None) -> None:
        """Every rank: write the average as the sharded folder ``<pma_dir>/online-<kind>``."""
        self.settle()
        self.staging.release()
        if model is not None and self.average.count > 0:
            self.write_sharded(model)

    def write_average(self, model: torch.nn.Module) -> Path | None:
        """Every rank: write the average now as the sharded folder ``<pma_dir>/online-<kind>``
        (replacing an earlier one); ``None`` while it is empty."""
        self.settle()
        return self.write_sharded(model) if self.average.count > 0 else None

    def write_sharded(self, model: torch.nn.Module) -> Path:
        """Every rank writes its file of the average into a temporary folder beside the target;
        the main process adds the config, tokenizer and merge record and renames it into place."""
        from hf_pma.core.manifest import MERGE_RECORD_NAME
        from hf_pma.utils.distributed import all_ranks_checked
        from hf_pma.utils.fs import publish_folder, remove_stale_temporaries, temporary_path

        dtype = self.save_dtype or self._model_dtype
        payload = [str(temporary_path(self.target)) if self.is_main else None]
        if self.world_size > 1:
            torch.distributed.broadcast_object_list(payload, src=0)
        tmp = Path(payload[0])

        def prepare() -> None:
            if self.is_main:
                remove_stale_temporaries(self.pma_dir, self.target.name)
                tmp.mkdir()

        def write_mine() -> None:
            names = list(self.average._average)
            buffers = []
            for name in names:
                tensor = self.average._average[name]
                target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
                buffers.append(tensor.to(target).reshape(-1))  # on the device: copied to the host chunk by chunk
            write_rank_file(tmp / rank_file_name(self.rank), StagedShard([self._slices[n] for n in names], buffers))

        def publish() -> None:
            if not self.is_main:
                return
            layout = LAYOUT_FLAT if any(s.flat for s in self._slices.values()) else LAYOUT_DCP
            config, generation_config = model_metadata(model, dtype)
            write_metadata_files(tmp, config, generation_config, self.processing_class)
            record = self.average.merge_record(self._interval_tokens, str(dtype).removeprefix("torch.") if dtype else None)
            record.update(sharded=True, world_size=self.world_size, layout=layout)
            (tmp / MERGE_RECORD_NAME).write_text(json.dumps(record_own_files(tmp, record, MERGE_RECORD_NAME), indent=2) + "\n")
            self._check_target()
            publish_folder(tmp, self.target)

        try:
            all_ranks_checked(prepare, f"creating {self.target}")
            all_ranks_checked(write_mine, f"writing this rank's part of {self.target}")
            all_ranks_checked(publish, f"completing {self.target}")
        except BaseException:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.is_main:
            logger.info(
                f"hf-pma: sharded online {self.average.kind} average of {self.average.count} snapshots saved to "
                f"{self.target} ({self.world_size} rank files)"
            )
        return self.target
