"""What happens to a snapshot once it is due: the sinks behind :class:`hf_pma.PMACallback`.

The callback decides *when* (:class:`hf_pma.core.schedule.SnapshotSchedule`); a sink decides
*what happens*: :class:`DiskSnapshotSink` writes full HF model folders listed in a manifest,
:class:`OnlineAverageSink` folds the weights into a running average in memory (and, in
:mod:`hf_pma.snapshots.sharded`, :class:`~hf_pma.snapshots.sharded.ShardedSnapshotSink` writes
per-rank files and :class:`~hf_pma.snapshots.sharded.ShardedOnlineAverageSink` keeps each rank's
own slices of the average). A new kind of snapshot is a new subclass of :class:`SnapshotSink`,
not a branch in the callback.

Every method is called on every process, in the same order, so a sink may use collectives
(gathering a sharded model is one). Life cycle, as the callback drives it::

    sink = DiskSnapshotSink(pma_dir, is_main=..., ...)   # at train begin
    saved = sink.open(resume)          # folder checked; a resumed run repaired; returns its run fields
    sink.update_manifest(**fields)     # run-level fields (interval, phases, ...) when they change
    # at the end of an optimizer step where a snapshot is due:
    sink.take(model, record)           # copy the weights now (the next step changes them)
    sink.commit()                      # the record is final (its loss is known): hand it to the writer
    sink.before_checkpoint()           # a Trainer checkpoint follows: the write in flight lands first
    sink.stage_checkpoint(step, tokens)  # ... of that step: what the sink resumes from, staged before it
    sink.save_checkpoint(dir)          # on_save: what the sink needs to resume, in the checkpoint
    sink.close(model)                  # train end: wait for the writes, write final outputs
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers.utils import logging

from hf_pma.core.manifest import (
    MERGE_RECORD_NAME,
    SnapshotRecord,
    is_excluded,
    manifest_snapshots,
    snapshot_path,
)
from hf_pma.core.outputs import not_all_own, record_own_files
from hf_pma.snapshots.gather import (
    HostBufferReservation,
    LocalSlice,
    StagedShard,
    StagingBuffers,
    full_state_dict_bytes,
    gather_full_state_dict,
    host_buffer_plan,
    sharding_kind,
    unwrap_model,
)
from hf_pma.snapshots.online import OnlineAverage
from hf_pma.snapshots.writer import (
    BackgroundWorker,
    SnapshotJob,
    SnapshotWriter,
    model_metadata,
    prepare_snapshot,
    strip_for_save,
    write_folder_atomically,
    write_model_folder,
)
from hf_pma.utils.fs import (
    atomic_write_json,
    fsync_dir,
    is_library_folder,
    remove_stale_temporaries,
    temporary_path,
)
from hf_pma.utils.text import escape

logger = logging.get_logger(__name__)

__all__ = [
    "ONLINE_STATE_NAME",
    "STAGED_STATE_DIR",
    "online_state_name",
    "ResumePoint",
    "SnapshotSink",
    "DiskSnapshotSink",
    "OnlineAverageSink",
    "check_saved_for",
    "check_nothing_lost",
    "restore_staged_states",
]

# File in a Trainer checkpoint folder holding the online average (online mode only).
ONLINE_STATE_NAME = "pma_online.safetensors"


def online_state_name(rank: int) -> str:
    """The file in a Trainer checkpoint folder holding rank ``rank``'s part of a sharded online average."""
    return f"pma_online-rank{rank}.safetensors"


# Under the snapshot folder: the online average's state for a checkpoint about to be written,
# ``step-<step>-<file>``, written before the checkpoint and moved into it once it is written (a
# checkpoint and its average are never one atomic write: this is what survives a kill between).
STAGED_STATE_DIR = "staged-online-state"
_STAGED_RE = re.compile(r"step-(\d{1,19})-(pma_online(?:-rank\d{1,7})?\.safetensors)")


def staged_state_path(pma_dir: Path, step: int, name: str) -> Path:
    """Where the state file ``name`` of the checkpoint of optimizer step ``step`` is staged."""
    return pma_dir / STAGED_STATE_DIR / f"step-{step}-{name}"


def _staged_entries(pma_dir: Path) -> list[tuple[int, str, Path]]:
    """The staged state files (``(step, file name in the checkpoint, path)``); hf-pma's names only."""
    folder = pma_dir / STAGED_STATE_DIR
    if not folder.is_dir() or folder.is_symlink():
        return []
    entries = []
    for entry in os.scandir(folder):
        match = _STAGED_RE.fullmatch(entry.name)
        if match and entry.is_file(follow_symlinks=False):
            entries.append((int(match[1]), match[2], Path(entry.path)))
    return entries


def _stamp(path: Path, folder: Path) -> tuple[int, int] | None:
    """The ``saved_at`` (step, tokens) in the header of a saved average; ``None`` when unreadable
    or absent (never taken for the state of a checkpoint)."""
    from hf_pma.io.safetensors import SafetensorsReader
    from hf_pma.snapshots.online import _saved_at

    try:
        with SafetensorsReader(path, folder) as reader:
            return _saved_at(reader.metadata, path)
    except (OSError, ValueError):
        return None


def restore_staged_states(pma_dir: Path, resume: ResumePoint) -> list[str]:
    """Main process, on resume: finish the move of the average's state into the resumed checkpoint
    that a kill interrupted. Every file staged for ``resume``'s step and tokens goes into the
    checkpoint in place of a missing or stale (other step's) one; one the checkpoint already holds
    is dropped. Returns the names moved in."""
    staging = pma_dir / STAGED_STATE_DIR
    if staging.is_dir() and not staging.is_symlink():  # a kill mid-write leaves a temporary
        remove_stale_temporaries(staging)
    moved = []
    at = (resume.step, resume.tokens)
    for step, name, staged in _staged_entries(pma_dir):
        if step != resume.step or _stamp(staged, staged.parent) != at:
            continue  # another checkpoint's (a later save of this step overwrites it)
        target = resume.checkpoint_dir / name
        if os.path.lexists(target) and _stamp(target, resume.checkpoint_dir) == at:
            staged.unlink()  # moved in already; the kill came before the staged name was gone
            continue
        os.replace(staged, target)  # the one way a missing or stale file is replaced: ours, by stamp
        moved.append(name)
    if moved:
        fsync_dir(resume.checkpoint_dir)
        logger.warning(
            f"hf-pma: {escape(resume.checkpoint_dir)} lacked its online average (a run stopped before saving it "
            f"there); restored it from {escape(pma_dir / STAGED_STATE_DIR)}"
        )
    return moved


def _move_staged(staged: Path, target: Path, rewrite: Any) -> None:
    """``staged`` becomes ``target`` by one rename; across filesystems (or when it is gone),
    ``rewrite()`` writes ``target`` afresh and the staged file is removed."""
    try:
        os.replace(staged, target)
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.ENOENT):
            raise
        rewrite()
        staged.unlink(missing_ok=True)
    fsync_dir(target.parent)


def _earlier_with_average(resume: ResumePoint) -> str:
    """How to resume instead: the latest earlier ``checkpoint-<k>`` beside the resumed one that
    holds an online average, named; or what to look for."""
    best = None
    parent = resume.checkpoint_dir.parent
    for entry in os.scandir(parent) if parent.is_dir() else []:
        match = re.fullmatch(r"checkpoint-(\d{1,19})", entry.name)
        if match and int(match[1]) < resume.step and (best is None or int(match[1]) > best[0]):
            names = (ONLINE_STATE_NAME, online_state_name(0))
            if any(os.path.lexists(os.path.join(entry.path, n)) for n in names):
                best = (int(match[1]), entry.name)
    if best is not None:
        return f"resume from {escape(best[1])} beside it, which holds one"
    return "resume from an earlier checkpoint holding pma_online*.safetensors, or start over in a new output_dir"


def check_saved_for(saved_at: tuple[int, int] | None, resume: ResumePoint, path: Path) -> None:
    """``ValueError`` (one line) when the average read from ``path`` was saved for another
    checkpoint than ``resume``'s (another step or token count): resumed, it would hold other
    snapshots than the run had at that step. ``None`` (an older hf-pma's file) is taken as is."""
    if saved_at is not None and saved_at != (resume.step, resume.tokens):
        raise ValueError(
            f"hf-pma: {escape(path)} holds the online average of step {saved_at[0]} ({saved_at[1]:,} tokens), not of "
            f"this checkpoint's step {resume.step} ({resume.tokens:,} tokens): {_earlier_with_average(resume)}"
        )


def check_nothing_lost(resume: ResumePoint, count: int | None, options: dict[str, Any]) -> None:
    """On resume, what was restored (``count`` snapshots; ``None``: no average in the checkpoint)
    against what the checkpoint's own state says the run held, when it says it of this step and an
    average of these ``options`` (not another callback's): ``ValueError`` (one line, how to resume
    instead) rather than an average of fewer snapshots than the uninterrupted run's."""
    said = resume.online if isinstance(resume.online, dict) else None
    if said is not None and (said.get("step") != resume.step or said.get("options") != options):
        said = None
    held = said.get("count") if said is not None else None
    if held is not None and (type(held) is not int or held < 0):
        raise ValueError(f"hf-pma: {escape(resume.checkpoint_dir)}: its state's online 'count' is not a count")
    if count is None and held:
        raise ValueError(
            f"hf-pma: {escape(resume.checkpoint_dir)} lacks the online average of {held} snapshots the run held (stopped "
            f"before saving it?): {_earlier_with_average(resume)}"
        )
    if count is not None and held is not None and count != held:
        raise ValueError(
            f"hf-pma: the online average in {escape(resume.checkpoint_dir)} holds {count} snapshots, but the run held "
            f"{held} when it wrote the checkpoint: {_earlier_with_average(resume)}"
        )
    if count is None and held is None:
        logger.warning(f"hf-pma: no online average in {escape(resume.checkpoint_dir)}; the online average restarts empty")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: its token count, optimizer step and Trainer checkpoint folder."""

    tokens: int
    step: int
    checkpoint_dir: Path
    #: What the checkpoint's own state says of its online average (``{"step", "count", "options"}``:
    #: the snapshots it held when the checkpoint was written); ``None`` when it says nothing.
    online: dict[str, Any] | None = None


class SnapshotSink:
    """Base class of what happens to a snapshot (written to disk, averaged in memory, ...).

    Subclasses implement :meth:`open` and :meth:`_write` (and :meth:`close` for final outputs);
    the base class gathers the full weights onto the main process at :meth:`take`, keeps at
    most one snapshot in flight on a :class:`BackgroundWorker`, and re-raises its failures in
    the training thread. A sink that gathers differently (per-rank shards) overrides
    :meth:`take`.

    Args:
        pma_dir: the run's snapshot folder (manifest, snapshots, final outputs).
        is_main: whether this is the main process (the one that writes shared files).
        save_dtype: cast floating weights to this dtype (``None``: the training dtype).
        max_shard_size: largest safetensors file of a model folder.
        async_write: write in a background thread (``False``: in the training thread).
        accelerator: the Trainer's accelerator, to gather a DeepSpeed engine (may be ``None``).
        processing_class: tokenizer/processor saved beside the weights (may be ``None``).
    """

    #: Short name recorded in the manifest (``"layout"``).
    kind: ClassVar[str] = "base"

    def __init__(
        self,
        pma_dir: str | os.PathLike[str],
        *,
        is_main: bool = True,
        save_dtype: torch.dtype | None = None,
        max_shard_size: int | str = "5GB",
        async_write: bool = True,
        accelerator: Any | None = None,
        processing_class: Any | None = None,
    ) -> None:
        self.pma_dir = Path(pma_dir)
        self.is_main = is_main
        self.save_dtype = save_dtype
        self.max_shard_size = max_shard_size
        self.accelerator = accelerator
        self.processing_class = processing_class
        self.worker = BackgroundWorker(enabled=async_write, name=f"hf-pma-{self.kind}")
        self._taken: Any | None = None
        self._buffers: dict[str, torch.Tensor] | None = None
        self._reservation: HostBufferReservation | None = None  # the buffers allocated from train begin

    # -- life cycle ---------------------------------------------------------------------------

    def open(self, resume: ResumePoint | None) -> dict[str, Any]:
        """Check the output can be written; on resume make it match ``resume``.

        Returns the run-level fields the resumed run had recorded (for example
        ``interval_tokens`` and ``interval_choice``), ``{}`` when none or not the main process.
        """
        raise NotImplementedError

    def update_manifest(self, **fields: Any) -> None:
        """Record run-level fields (the chosen interval...); nothing by default."""

    def reached(self, tokens: int) -> None:
        """Train end: the run reached ``tokens`` (after :meth:`close`); nothing by default."""

    def warm_up(self, model: torch.nn.Module) -> None:
        """Pay one-time costs before the first snapshot (main process), so that its measured cost
        is what every snapshot costs: ``transformers`` builds its weight-conversion tables on
        first use (about a second), and the host buffers the weights are copied into are
        allocated (pinned from CUDA) on a background thread
        (:class:`hf_pma.snapshots.gather.HostBufferReservation`), not at the first snapshot."""
        if not self.is_main:
            return
        strip_for_save(model, {})
        if self._copies_full_weights(model):
            plan = host_buffer_plan(unwrap_model(model).state_dict(), self.save_dtype)
            self._reservation = HostBufferReservation(plan)

    def _copies_full_weights(self, model: torch.nn.Module) -> bool:
        """Whether :meth:`take` copies the full unsharded weights into host buffers on the main
        process alone (what :meth:`warm_up` reserves); sinks that stage otherwise say ``False``."""
        return sharding_kind(model) is None and type(model).__name__ != "DeepSpeedEngine"

    def take(self, model: torch.nn.Module, record: SnapshotRecord) -> None:
        """Copy the weights of ``model`` for ``record`` now (every process: gathering is collective).

        The copy waits in the sink until :meth:`commit`; ``record`` may still be completed
        (its loss) until then. At most one snapshot is in flight: the previous one is written
        first, and its CPU buffers are reused.
        """
        if self._taken is not None:
            raise RuntimeError("SnapshotSink.take() called twice without commit()")
        if self.is_main:
            self.worker.wait(reason=f"snapshot at {record.tokens:,} tokens")
            if self._buffers is None and self._reservation is not None:
                self._buffers, self._reservation = self._reservation.buffers(), None
        state_dict = gather_full_state_dict(
            model,
            accelerator=self.accelerator,
            dtype=self.save_dtype,
            is_main_process=self.is_main,
            buffers=self._buffers,
        )
        if not self.is_main:
            return
        # The previous write is done: its CPU copy is reused by the next snapshot.
        self._buffers = state_dict
        self._taken = self._prepare(model, state_dict, record)

    @property
    def has_taken(self) -> bool:
        """Whether a snapshot was taken and not committed yet (main process)."""
        return self._taken is not None

    def commit(self) -> None:
        """Hand the snapshot taken to the writer (in the background with ``async_write``)."""
        if self._taken is None:
            return
        taken, self._taken = self._taken, None
        self.worker.submit(lambda: self._write(taken), label=self._label(taken))

    def before_checkpoint(self) -> None:
        """A checkpoint (the Trainer's, or a loop's ``save_state``) is about to be written: the
        snapshot in flight lands first.

        A checkpoint must not get ahead of the snapshots before it: a crash after it would
        resume without them.
        """
        if self.worker.busy:
            self.worker.wait(reason="the checkpoint", warn=False)
        self.worker.raise_if_failed()

    def stage_checkpoint(self, step: int, tokens: int) -> None:
        """A checkpoint of optimizer step ``step`` (``tokens`` seen) follows, and nothing changes
        before it: stage what :meth:`save_checkpoint` puts into it; nothing by default."""

    def save_checkpoint(self, checkpoint_dir: Path) -> None:
        """Store in a Trainer checkpoint folder what this sink needs to resume; nothing by default."""

    def wait(self) -> None:
        """Block until the snapshot in flight is done; raise if it failed."""
        self.worker.wait()

    def raise_if_failed(self) -> None:
        """Raise the failure of a background write, if one failed since the last call."""
        self.worker.raise_if_failed()

    def close(self, model: torch.nn.Module | None) -> None:
        """Train end: commit and wait for everything in flight (and write final outputs)."""
        self.commit()
        self.worker.wait()
        self._buffers = None
        if self._reservation is not None:
            self._reservation.buffers()  # the thread ends before the buffers are dropped
            self._reservation = None

    # -- budgets --------------------------------------------------------------------------------

    def snapshot_bytes(self, model: torch.nn.Module) -> int:
        """Bytes one snapshot of ``model`` takes on disk (estimated from shapes; no gathering)."""
        return full_state_dict_bytes(model, self.save_dtype)

    def kept_on_disk(self, snapshots: int | None) -> int | None:
        """Snapshot-sized folders on disk at the peak after ``snapshots`` were taken (``None``: unknown)."""
        return snapshots

    def last_written_bytes(self) -> int | None:
        """Bytes the last completed snapshot took on disk (``None``: none yet, or nothing on disk)."""
        return None

    # -- listing --------------------------------------------------------------------------------

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots listed in the manifest, oldest first, with absolute folders."""
        if not (self.pma_dir / "manifest.json").exists():
            return []
        records = manifest_snapshots(self.pma_dir)
        return [(r, snapshot_path(self.pma_dir, r)) for r in records if include_excluded or not is_excluded(r)]

    def exclude(self, tokens: Iterable[int], reason: str) -> list[SnapshotRecord]:
        """Mark listed snapshots as excluded from merges; ``[]`` when this sink lists none."""
        return []

    # -- for subclasses -------------------------------------------------------------------------

    def _prepare(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor], record: SnapshotRecord) -> Any:
        """Main process, training thread: detach what the write needs from the live model."""
        raise NotImplementedError

    def _write(self, taken: Any) -> None:
        """Main process, writer thread: write what :meth:`_prepare` returned."""
        raise NotImplementedError

    def _label(self, taken: Any) -> str:
        """What a log line or error calls the snapshot in flight."""
        return str(self.pma_dir)


class DiskSnapshotSink(SnapshotSink):
    """Full HF model folders ``<pma_dir>/snapshot-<tokens>/`` listed in ``<pma_dir>/manifest.json``.

    Each folder holds config, safetensors weights, tokenizer and ``pma.json`` (the record); it is
    written to a temporary name, fsynced and renamed, and only then listed in the manifest
    (:class:`hf_pma.snapshots.writer.SnapshotWriter`). ``keep_last`` deletes the oldest after that.
    """

    kind = "full"

    def __init__(self, pma_dir: str | os.PathLike[str], *, keep_last: int | None = None, **kwargs: Any) -> None:
        super().__init__(pma_dir, **kwargs)
        self.keep_last = keep_last
        self.writer: SnapshotWriter | None = None
        if self.is_main:
            self.writer = SnapshotWriter(
                self.pma_dir, async_write=self.worker.enabled, keep_last=keep_last, max_shard_size=self.max_shard_size
            )
            self.worker = self.writer.worker

    def open(self, resume: ResumePoint | None) -> dict[str, Any]:
        """Create the folder (refusing one that lists another run's snapshots, or holds something
        named like a snapshot that hf-pma did not write); on resume, set aside the snapshots past
        the resume point (deleted only once this run passes them) and list complete unlisted ones."""
        if not self.is_main:
            return {}
        manifest = self.writer.open()
        if resume is None:
            if manifest["snapshots"]:
                raise FileExistsError(
                    f"hf-pma: {self.writer.manifest_path} already lists {len(manifest['snapshots'])} snapshots from "
                    "an earlier run. Resume that run (with a Trainer: "
                    "trainer.train(resume_from_checkpoint=...); in a loop: accelerator.load_state(...) "
                    "with PMASnapshots registered by register_for_checkpointing), or use another "
                    "output_dir, or delete that folder."
                )
            return {}
        set_aside, adopted = self.writer.truncate(resume.tokens)
        if set_aside:
            logger.warning(
                f"hf-pma: resuming at {resume.tokens:,} tokens: set aside {len(set_aside)} later snapshots "
                f"({', '.join(escape(r.path) for r in set_aside)}): kept, excluded from merges, until this run passes "
                "them and takes them again"
            )
        if adopted:
            logger.info(f"hf-pma: listed complete snapshots missing from the manifest: {[r.path for r in adopted]}")
        return {key: manifest.get(key) for key in ("interval_tokens", "interval_choice")}

    def update_manifest(self, **fields: Any) -> None:
        """Set top-level manifest fields (main process)."""
        if self.writer is not None:
            self.writer.update_manifest(layout=self.kind, **fields)

    def reached(self, tokens: int) -> None:
        """Train end at ``tokens``: snapshots set aside by a resume that the run passed are dropped."""
        if self.writer is not None:
            for record in self.writer.settle(tokens):
                logger.info(f"hf-pma: dropped {escape(record.path)}, set aside at the resume and passed since")

    def kept_on_disk(self, snapshots: int | None) -> int | None:
        """All snapshots, or ``keep_last`` plus the one written before the oldest is deleted."""
        if self.keep_last is None:
            return snapshots
        return min(snapshots, self.keep_last) if snapshots is not None and snapshots <= self.keep_last else self.keep_last + 1

    def last_written_bytes(self) -> int | None:
        """Bytes of the last snapshot this run wrote (weights)."""
        if self.writer is None or not self.writer.written:
            return None
        return self.writer.written[-1].num_bytes

    def _prepare(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor], record: SnapshotRecord) -> SnapshotJob:
        return prepare_snapshot(model, state_dict, record, self.processing_class)

    def _write(self, taken: SnapshotJob) -> None:
        self.writer.write(taken)

    def _label(self, taken: SnapshotJob) -> str:
        return str(self.pma_dir / taken.name)

    def close(self, model: torch.nn.Module | None) -> None:
        """Wait for the last write and log how many snapshots this run wrote."""
        super().close(model)
        if self.writer is not None:
            logger.info(
                f"hf-pma: {len(self.writer.written)} snapshots written this run; training waited "
                f"{self.worker.total_wait_s:.2f}s in total for snapshot writes"
            )

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots (through the writer's lock on the main process)."""
        if self.writer is not None:
            return self.writer.snapshots(include_excluded)
        return super().snapshots(include_excluded)

    def exclude(self, tokens: Iterable[int], reason: str) -> list[SnapshotRecord]:
        """Mark listed snapshots as excluded (main process; ``[]`` on the others)."""
        if self.writer is None:
            return []
        return self.writer.exclude(tokens, reason)


# What every rank's file of one sharded online average holds alike (the bookkeeping of the same
# snapshots; the tensors, rank and slices differ).
RANK_SHARED_METADATA = ("kind", "alpha", "count", "online_state", "saved_at")


def check_rank_files_agree(files: list[Path], folder: Path, first: dict[str, str] | None = None) -> None:
    """``ValueError`` (one line naming the file) unless every rank file in ``files`` holds the
    bookkeeping of ``first`` (rank 0's metadata; default: that of ``files[0]``): a rank file of
    another kind, alpha, step or window put beside the others would otherwise be read into one
    silently mixed average. Reads only the files' headers."""
    from hf_pma.io.safetensors import SafetensorsReader

    if first is None:
        with SafetensorsReader(files[0], folder) as reader:
            first = reader.metadata
    for path in files:
        with SafetensorsReader(path, folder) as reader:
            metadata = reader.metadata
        differs = [key for key in RANK_SHARED_METADATA if metadata.get(key) != first.get(key)]
        if differs:
            raise ValueError(
                f"hf-pma: {escape(path)} holds another online average than {escape(files[0].name)} "
                f"({', '.join(differs)} differ): the checkpoint's rank files were not saved together"
            )


def _read_sharded_average(folder: Path, expected: OnlineAverage) -> OnlineAverage:
    """The full average saved by a sharded run as ``pma_online-rank<r>.safetensors`` files (any
    world size): the bookkeeping from rank 0's file, the tensors assembled by global offsets."""
    from hf_pma.io.sharded import ShardedCheckpointTensors
    from hf_pma.io.torch_adapters import DTYPE_FROM_SAFETENSORS

    first = folder / online_state_name(0)
    average = OnlineAverage.load_state(first)
    expected.check_same_options(average, escape(first))
    world = average.metadata.get("world_size", "")
    if not (world.isdigit() and 0 < int(world) <= 2**20):
        raise ValueError(f"hf-pma: {escape(first)} is not an hf-pma sharded online average: bad 'world_size'")
    files = [folder / online_state_name(r) for r in range(int(world))]
    missing = [f.name for f in files if not os.path.lexists(f)]
    if missing:
        raise ValueError(f"hf-pma: {escape(folder)} lacks {', '.join(missing[:3])} of the saved online average")
    check_rank_files_agree(files, folder, average.metadata)
    average._average = {}
    with ShardedCheckpointTensors(files, folder) as tensors:
        for name, info in tensors.infos.items():
            dtype = DTYPE_FROM_SAFETENSORS[info.dtype]
            average._average[name] = torch.from_numpy(tensors.read(name)).view(dtype).reshape(info.shape)
    average.check_tensors(escape(folder))
    return average


class OnlineAverageSink(SnapshotSink):
    """A running float32 average of the snapshots (the kinds of :mod:`hf_pma.snapshots.online`), no folders.

    Where the average lives (``online_device``):

    * ``"cpu"`` (default): in the main process's host memory. At :meth:`take` the live weights
      are copied into reused host buffers (:class:`hf_pma.snapshots.gather.StagingBuffers`:
      from CUDA, pinned and on a side stream, the CPU thread not blocked); :meth:`commit` folds
      them into the average in the background thread (after the copies have landed). The next
      take, commit, checkpoint, swap or write waits for the fold in flight. Host memory: the
      float32 average plus one copy of the weights in the training dtype.
    * ``"device"``: beside the weights, on their device (a float32 copy of the model there),
      folded in the training thread on the training stream: no host copy at all. Checkpoint
      files and the final folder are written from host copies made one tensor at a time.

    A sharded model (FSDP / ZeRO-3 with ``sharded=False``) is gathered to the main process at
    every snapshot instead, and averaged there in host memory whatever ``online_device``.

    Saved in every Trainer checkpoint (``pma_online.safetensors``) and restored on resume; at
    train end written as a model folder ``<pma_dir>/online-<kind>`` with its merge record.
    """

    kind = "online"

    def __init__(
        self,
        pma_dir: str | os.PathLike[str],
        *,
        online: str = "sma",
        alpha: float = 0.2,
        half_life_tokens: int | None = None,
        window_tokens: int | None = None,
        online_device: str = "cpu",
        half_life_fraction: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(pma_dir, **kwargs)
        self.average = OnlineAverage(
            online,
            alpha,
            half_life_tokens=half_life_tokens,
            window_tokens=window_tokens,
            device=online_device,
            half_life_fraction=half_life_fraction,
        )
        self.online_device = online_device
        self.staging = StagingBuffers()
        self._model_dtype: torch.dtype | None = None
        self._interval_tokens: int | None = None
        # The state staged for the next checkpoint, and what it was staged as (step, tokens, count, last tokens).
        self._staged: tuple[Path, tuple[Any, ...]] | None = None

    def open(self, resume: ResumePoint | None) -> dict[str, Any]:
        """Check the folder is writable; on resume, restore the average saved in the checkpoint."""
        if not self.is_main:
            return {}
        if resume is not None:
            restore_staged_states(self.pma_dir, resume)
            path = resume.checkpoint_dir / ONLINE_STATE_NAME
            ranks = resume.checkpoint_dir / online_state_name(0)
            restored = None
            # Present: anything there (a FIFO, a link), which the one way in then refuses. Only rank
            # files: saved by a sharded run, read by global offsets.
            if not os.path.lexists(path) and os.path.lexists(ranks):
                restored = _read_sharded_average(resume.checkpoint_dir, self.average)
                check_saved_for(restored.saved_at, resume, ranks)
            elif os.path.lexists(path):
                restored = OnlineAverage.load_state(path)
                self.average.check_same_options(restored, escape(path))
                check_saved_for(restored.saved_at, resume, path)
            count = restored.count if restored is not None else None
            check_nothing_lost(resume, count, self.average.options)
            if restored is not None:
                self.average = restored
                logger.info(f"hf-pma: restored the online {self.average.kind} average of {self.average.count} snapshots")
            self.average.device = self.online_device  # a restored average goes where this run keeps it
        self._check_target()
        return {}

    @property
    def target(self) -> Path:
        """The folder the average is written to at train end: ``<pma_dir>/online-<kind>``."""
        return self.pma_dir / f"online-{self.average.kind}"

    def _check_target(self) -> None:
        """Main process: the final folder is absent or hf-pma's, the staging folder absent or a real
        folder, and the snapshot folder writable."""
        staging = self.pma_dir / STAGED_STATE_DIR
        if staging.is_symlink() or (os.path.lexists(staging) and not staging.is_dir()):
            raise FileExistsError(
                f"hf-pma: {escape(staging)} is a link or a file, not the folder hf-pma stages the online average "
                "in before each checkpoint: move it away"
            )
        target = self.target
        if os.path.lexists(target) and not is_library_folder(target, MERGE_RECORD_NAME):
            raise FileExistsError(
                f"hf-pma: {escape(target)} exists and hf-pma did not write it (no {MERGE_RECORD_NAME} inside, or a "
                "link); the online average saved at the end would replace it: move it or choose another output_dir"
            )
        problem = not_all_own(target, (MERGE_RECORD_NAME,)) if os.path.lexists(target) else None
        if problem is not None:  # a LoRA folder or notes of the user's beside an earlier average
            raise FileExistsError(
                f"hf-pma: the online average saved at the end would replace {escape(target)}, but {problem}; or "
                "choose another output_dir"
            )
        try:
            self.pma_dir.mkdir(parents=True, exist_ok=True)
            probe = temporary_path(self.pma_dir / "write-check")  # a leftover is a stale temporary, removed as one
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))  # never through a link
            probe.unlink()
        except OSError as err:
            raise PermissionError(f"hf-pma: cannot write to {self.pma_dir}: {err}") from err

    def kept_on_disk(self, snapshots: int | None) -> int | None:
        """One folder: the average, written at train end."""
        return 1 if snapshots is None or snapshots > 0 else 0

    def update_manifest(self, **fields: Any) -> None:
        """No manifest is written; the interval goes into the final merge record."""
        self._interval_tokens = fields.get("interval_tokens", self._interval_tokens)

    def _copies_full_weights(self, model: torch.nn.Module) -> bool:
        return False  # staged (StagingBuffers), or gathered from a sharded model

    def warm_up(self, model: torch.nn.Module) -> None:
        """The one-time costs, and (``"cpu"``, an unsharded model) the staging buffers reserved."""
        super().warm_up(model)
        if self.is_main and self.online_device == "cpu" and sharding_kind(model) is None:
            state_dict = strip_for_save(model, unwrap_model(model).state_dict())
            self.staging.reserve(
                [LocalSlice(n, t, (0,) * t.dim(), tuple(t.shape), tuple(t.shape)) for n, t in state_dict.items()]
            )

    def take(self, model: torch.nn.Module, record: SnapshotRecord) -> None:
        """Every process: the weights of ``record`` go into the average (main process): staged to
        the host now and folded in at :meth:`commit` (``"cpu"``), or folded in now on the device
        (``"device"``). A sharded model is gathered first (every process takes part)."""
        if self._taken is not None:
            raise RuntimeError("SnapshotSink.take() called twice without commit()")
        if sharding_kind(model) is not None:  # sharded=False under FSDP / ZeRO-3: gathered to the main process
            super().take(model, record)
            return
        if not self.is_main:
            return
        self.worker.wait(reason=f"snapshot at {record.tokens:,} tokens")  # the staging buffers are free again
        state_dict = strip_for_save(model, unwrap_model(model).state_dict())
        self._model_dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), None)
        slices = [LocalSlice(n, t, (0,) * t.dim(), tuple(t.shape), tuple(t.shape)) for n, t in state_dict.items()]
        self._take_slices(slices, record)

    def _take_slices(self, slices: list[LocalSlice], record: SnapshotRecord) -> None:
        """Fold ``slices`` into the average now (``"device"``), or stage them for :meth:`commit`."""
        if self.average.device == "device":
            with torch.no_grad():
                self.average.update({s.name: s.tensor for s in slices}, tokens=record.tokens)
            self._taken = (None, record)
        else:
            self._taken = (self.staging.stage(slices), record)

    def commit(self) -> None:
        """The record is final: it joins the average's list; a staged snapshot is handed to the
        background thread, which folds it in (in the calling thread without ``async_write``)."""
        if self._taken is not None and self._taken[0] is None:  # folded in at take
            (_, record), self._taken = self._taken, None
            self.average.records.append(record)
            return
        super().commit()

    def settle(self) -> None:
        """Every process: each snapshot taken is in the average (committed, the fold in flight done)."""
        self.commit()
        self.worker.wait()

    def _prepare(
        self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor], record: SnapshotRecord
    ) -> tuple[dict[str, torch.Tensor], SnapshotRecord]:
        state_dict = strip_for_save(model, state_dict)
        self._model_dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), None)
        return state_dict, record

    def _write(self, taken: tuple[StagedShard | dict[str, torch.Tensor], SnapshotRecord]) -> None:
        """Background thread: fold a staged (once its copies have landed) or gathered snapshot in."""
        weights, record = taken
        if isinstance(weights, StagedShard):
            weights.synchronize()
            weights = {s.name: b.view(s.sizes) for s, b in zip(weights.slices, weights.buffers)}
        with torch.no_grad():
            self.average.update(weights, record)

    def _label(self, taken: tuple[Any, SnapshotRecord]) -> str:
        return f"online {taken[1].path}"

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """The running average (float32 unless ``dtype``); ``None`` off the main process."""
        if not self.is_main:
            return None
        self.settle()
        return self.average.state_dict(dtype)

    @property
    def count(self) -> int:
        """How many snapshots the average holds."""
        return self.average.count

    @torch.no_grad()
    def swap_in(self, model: torch.nn.Module) -> Any | None:
        """Every process: put the average into the live ``model`` (cast to its dtypes); returns
        the function that puts the live weights back (every process calls it), or ``None``
        when the average is still empty. The main process holds the average: under DDP each
        tensor is broadcast from it; every process backs up its live tensors on the CPU."""
        from hf_pma.utils.distributed import distributed_rank_and_size

        _, world_size = distributed_rank_and_size()
        self.settle()
        live = {n: t for n, t in unwrap_model(model).state_dict(keep_vars=True).items() if t.is_floating_point()}
        names = [[n for n in live if n in self.average._average] if self.average.count else None]
        if world_size > 1:
            torch.distributed.broadcast_object_list(names, src=0)
        if names[0] is None:
            return None
        storages = {live[n].data_ptr() for n in names[0]}
        missing = [n for n, t in live.items() if n not in names[0] and t.data_ptr() not in storages]
        if missing:  # the same on every process: they all raise
            raise ValueError(f"the online average lacks tensor(s) the model has: {', '.join(missing[:5])}")
        backup = {n: live[n].detach().to("cpu", copy=True) for n in names[0]}
        for name in names[0]:
            target = live[name].data
            if self.is_main:
                target.copy_(self.average._average[name].reshape(target.shape))
            if world_size > 1:
                torch.distributed.broadcast(target, src=0)

        @torch.no_grad()
        def restore() -> None:
            for name, saved in backup.items():
                live[name].data.copy_(saved)

        return restore

    # -- checkpoints: the state is staged before the checkpoint, moved in after it ----------------

    def _state_name(self) -> str:
        """This process's file of the average in a checkpoint folder."""
        return ONLINE_STATE_NAME

    def _state_metadata(self) -> dict[str, str] | None:
        """What is stored beside the average in its checkpoint file (a sharded average: its slices)."""
        return None

    def _keeps_state(self) -> bool:
        """Whether this process saves (a part of) the average into checkpoints."""
        return self.is_main

    def stage_checkpoint(self, step: int, tokens: int) -> None:
        """The average as of optimizer step ``step`` is written (atomically, stamped with ``step``
        and ``tokens``) to ``<pma_dir>/staged-online-state/step-<step>-<file>`` before the Trainer writes
        that step's checkpoint: a kill after the checkpoint, before :meth:`save_checkpoint` moved
        the state in, leaves it where the next :meth:`open` finds it and moves it in."""
        self.settle()
        if not self._keeps_state():
            return
        key = (step, tokens, self.average.count, self.average.last_tokens)
        if self._staged is not None and self._staged[1] == key and os.path.lexists(self._staged[0]):
            return  # staged already: the step's log, then the save, each say a checkpoint follows
        path = staged_state_path(self.pma_dir, step, self._state_name())
        path.parent.mkdir(exist_ok=True)
        if path.parent.is_symlink() or not path.parent.is_dir():  # never written through a link
            raise FileExistsError(f"hf-pma: {escape(path.parent)} is not a folder hf-pma made: move it away")
        self.average.save_state(path, self._state_metadata(), at=(step, tokens))
        self._staged = (path, key)

    def save_checkpoint(self, checkpoint_dir: Path) -> None:
        """Move the state staged for this checkpoint into it (one rename); written there directly,
        stamped with no step, when none was staged or the average changed since (direct calls)."""
        self.settle()
        if not self._keeps_state():
            return
        staged, self._staged = self._staged, None
        if not checkpoint_dir.is_dir():
            logger.warning(f"hf-pma: {escape(checkpoint_dir)} is not a folder; the online average was not saved in it")
            return
        target = checkpoint_dir / self._state_name()
        if staged is None or staged[1][2:] != (self.average.count, self.average.last_tokens):
            # Not staged, or changed since (direct calls; the taker stages right before): no step to stamp.
            self.average.save_state(target, self._state_metadata())
            if staged is not None:
                staged[0].unlink(missing_ok=True)
            return
        at = staged[1][:2]
        _move_staged(staged[0], target, lambda: self.average.save_state(target, self._state_metadata(), at=at))
        self._prune_staged(checkpoint_dir)

    def _prune_staged(self, checkpoint_dir: Path) -> None:
        """Drop this process's staged files whose Trainer checkpoint is gone (rotated away, or never
        written): nothing will resume from them. Only beside ``checkpoint-<step>`` folders."""
        if re.fullmatch(r"checkpoint-\d+", checkpoint_dir.name) is None:
            return
        for step, name, staged in _staged_entries(self.pma_dir):
            if name == self._state_name() and not os.path.lexists(checkpoint_dir.parent / f"checkpoint-{step}"):
                staged.unlink(missing_ok=True)

    def close(self, model: torch.nn.Module | None) -> None:
        """Write the average as a model folder ``<pma_dir>/online-<kind>`` (main process)."""
        super().close(model)
        self.staging.release()
        if self.is_main and model is not None and self.average.count > 0:
            self._write_model(model)

    def write_average(self, model: torch.nn.Module) -> Path | None:
        """Every process: write the average now as ``<pma_dir>/online-<kind>`` (replacing an
        earlier one; the main process writes); ``None`` while it is empty or on other processes."""
        if not self.is_main:
            return None
        self.settle()
        return self._write_model(model) if self.average.count > 0 else None

    def _write_model(self, model: torch.nn.Module) -> Path:
        dtype = self.save_dtype or self._model_dtype
        state_dict = self.average.state_dict(dtype)
        config, generation_config = model_metadata(model, dtype)
        merge_record = self.average.merge_record(self._interval_tokens, str(dtype).removeprefix("torch.") if dtype else None)

        def write(folder: Path) -> None:
            write_model_folder(folder, state_dict, config, generation_config, self.processing_class, self.max_shard_size)
            # Last, listing every file written: only those are replaced with it later.
            atomic_write_json(folder / MERGE_RECORD_NAME, record_own_files(folder, merge_record, MERGE_RECORD_NAME))

        self._check_target()  # again: the folder may have gained files since train begin
        target = write_folder_atomically(self.pma_dir / f"online-{self.average.kind}", write)
        logger.info(f"hf-pma: online {self.average.kind} average of {self.average.count} snapshots saved to {target}")
        return target
