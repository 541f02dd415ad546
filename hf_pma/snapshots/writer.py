"""Write gathered weights as snapshot folders and keep the run's manifest.

Usable without the callback (the PMATrainer and scripts reuse them); the weights come from
:mod:`hf_pma.snapshots.gather`:

* :func:`prepare_snapshot` + :func:`write_snapshot`: a plain HF model folder (config,
  generation config, safetensors shards, tokenizer, ``pma.json``) written to a temporary
  folder, fsynced and renamed into place.
* :class:`SnapshotWriter`: writes snapshots off the training thread (at most one in flight),
  lists them in the manifest atomically, applies ``keep_last``, and re-raises a failed write
  in the training thread.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.manifest import (
    MANIFEST_NAME,
    SNAPSHOT_FILES_KEY,
    SNAPSHOT_RECORD_NAME,
    SnapshotRecord,
    add_snapshot,
    clean_incomplete,
    exclude_snapshots,
    is_excluded,
    is_set_aside,
    manifest_snapshots,
    orphan_snapshots,
    read_manifest,
    remove_snapshot_folder,
    set_aside_snapshots_after,
    snapshot_folder_problem,
    snapshot_name_problems,
    snapshot_path,
    write_manifest,
)
from hf_pma.utils.distributed import is_peft_model, unwrap_model
from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.fs import atomic_write_json, check_claimed_folder, write_folder_atomically
from hf_pma.utils.logs import quiet_info
from hf_pma.utils.parsing import check_int, parse_size
from hf_pma.utils.text import escape

logger = logging.get_logger(__name__)

# A wait shorter than this (it prints as 0.00 s) is a write that was finishing: no warning.
MIN_REPORTED_WAIT_S = 0.005

__all__ = [
    "SnapshotWriteError",
    "SnapshotJob",
    "strip_for_save",
    "model_metadata",
    "prepare_snapshot",
    "write_safetensors",
    "write_metadata_files",
    "write_model_folder",
    "write_folder_atomically",
    "write_snapshot",
    "BackgroundWorker",
    "SnapshotWriter",
]


class SnapshotWriteError(RuntimeError):
    """A snapshot (or online average) could not be written; raised in the training thread."""


# ---------------------------------------------------------------------------------------------
# Snapshot folders
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SnapshotJob:
    """Everything the writer needs, detached from the live model (safe to write from a thread)."""

    record: SnapshotRecord
    state_dict: dict[str, torch.Tensor]
    config: Any | None = None
    generation_config: Any | None = None
    processing_class: Any | None = None
    # "model" (model.safetensors, config.json) or "adapter_model" (PEFT adapter weights).
    weights_prefix: str = "model"

    @property
    def name(self) -> str:
        """The snapshot's folder name."""
        return self.record.path


def _float_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def strip_for_save(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` stores of a state dict: tied duplicates removed, load-time weight
    conversions reverted, no two names sharing memory (safetensors forbids it)."""
    module = unwrap_model(model)
    state_dict = dict(state_dict)
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        if isinstance(module, PreTrainedModel):
            state_dict = remove_tied_weights_from_state_dict(state_dict, module)
            state_dict = revert_weight_conversion(module, state_dict)
    except ImportError:  # other transformers versions: keep every key
        pass
    seen: set[int] = set()
    for name, tensor in list(state_dict.items()):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen and tensor.numel() > 0:
            state_dict[name] = tensor.clone()
        seen.add(ptr)
    return state_dict


def model_metadata(model: torch.nn.Module, dtype: torch.dtype | None) -> tuple[Any | None, Any | None]:
    """Private copies of the model's config (``dtype`` and ``architectures`` set as
    ``save_pretrained`` sets them) and generation config (``None`` when it cannot generate)."""
    module = unwrap_model(model)
    config = getattr(module, "config", None)
    if config is not None:
        config = copy.deepcopy(config)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        config.architectures = [type(module).__name__.removeprefix("FSDP")]
    generation_config = None
    can_generate = getattr(module, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(module, "generation_config", None) is not None:
        generation_config = copy.deepcopy(module.generation_config)
    return config, generation_config


def prepare_snapshot(
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    record: SnapshotRecord,
    processing_class: Any | None = None,
) -> SnapshotJob:
    """Turn a gathered state dict into a job the writer can write without the live model.

    Runs in the training thread (it reads the model): :func:`strip_for_save` on the weights,
    :func:`model_metadata` for the configs, ``record.dtype`` filled in.
    """
    module = unwrap_model(model)
    if is_peft_model(module):
        # Adapter weights only, saved as PEFT saves them (loads with PeftModel.from_pretrained).
        from peft import get_peft_model_state_dict

        state_dict = get_peft_model_state_dict(module, state_dict=state_dict)
        config, generation_config, prefix = module.peft_config[module.active_adapter], None, "adapter_model"
    else:
        state_dict = strip_for_save(model, state_dict)
        config, generation_config = model_metadata(model, _float_dtype(state_dict))
        prefix = "model"
    dtype = _float_dtype(state_dict)
    if record.dtype is None and dtype is not None:
        record.dtype = str(dtype).removeprefix("torch.")
    return SnapshotJob(record, state_dict, config, generation_config, processing_class, prefix)


_WRITE_CHUNK = 64 * 2**20


def write_safetensors(
    path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Write (and fsync) a safetensors file; returns its size in bytes.

    The same format as ``safetensors.torch.save_file``, written in chunks through ``write()``
    calls that release the GIL, so a background write does not stall the training thread
    (``save_file`` serializes the whole file while holding it).
    """
    from hf_pma.io.safetensors import SafetensorsWriter
    from hf_pma.io.torch_adapters import safetensors_dtype, tensor_bytes

    plan = [(name, safetensors_dtype(t.dtype, name), tuple(t.shape)) for name, t in tensors.items()]
    writer = SafetensorsWriter(path, plan, metadata=metadata or {"format": "pt"})
    try:
        for name, tensor in tensors.items():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            step = max(1, _WRITE_CHUNK // max(1, flat.element_size()))
            for start in range(0, flat.numel(), step):
                writer.write(name, tensor_bytes(flat[start : start + step]))
    except BaseException:
        with contextlib.suppress(Exception):  # the write error is the one to report
            writer.close()
        raise
    writer.close()
    return os.path.getsize(path)


def write_metadata_files(
    folder: str | os.PathLike[str],
    config: Any | None = None,
    generation_config: Any | None = None,
    processing_class: Any | None = None,
) -> None:
    """``save_pretrained`` of the config, generation config and processing class (those given)
    into ``folder``, without their "... saved in <file>" INFO lines (see
    :func:`hf_pma.utils.logs.quiet_info`): hf-pma reports the folder once instead."""
    with quiet_info(config, generation_config, processing_class):
        for item in (config, generation_config, processing_class):
            if item is not None:
                item.save_pretrained(folder)


def write_model_folder(
    folder: str | os.PathLike[str],
    state_dict: dict[str, torch.Tensor],
    config: Any | None = None,
    generation_config: Any | None = None,
    processing_class: Any | None = None,
    max_shard_size: int | str = "5GB",
    json_files: dict[str, Any] | None = None,
    weights_prefix: str = "model",
) -> int:
    """Write a plain HF model folder (no atomicity; see :func:`write_folder_atomically`).

    Weights are sharded as ``save_pretrained`` does (``model.safetensors`` or
    ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``). ``json_files``
    maps extra file names to JSON content (``pma.json``...). Returns the bytes of weights.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_metadata_files(folder, config, generation_config, processing_class)
    split = split_torch_state_dict_into_shards(
        state_dict,
        filename_pattern=weights_prefix + "{suffix}.safetensors",
        max_shard_size=parse_size(max_shard_size),
    )
    num_bytes = 0
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name] for name in names}
        num_bytes += write_safetensors(folder / filename, shard, metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {
                "total_size": split.metadata.get("total_size"),
                "total_parameters": sum(t.numel() for t in state_dict.values()),
            },
            "weight_map": split.tensor_to_filename,
        }
        (folder / f"{weights_prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name, content in (json_files or {}).items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    return num_bytes


def write_snapshot(job: SnapshotJob, pma_dir: str | os.PathLike[str], max_shard_size: int | str = "5GB") -> SnapshotRecord:
    """Write ``job`` as ``<pma_dir>/<job.name>/`` durably; the manifest is not touched.

    The folder holds config.json, generation_config.json (when the model generates),
    safetensors weights, the tokenizer/processor files, and ``pma.json`` (the record).
    Returns the record with ``num_bytes`` filled in.
    """
    record = job.record
    check_claimed_folder(pma_dir)  # a training's folder moved away: never a new one at its path
    check_replaceable(Path(pma_dir) / job.name, pma_dir)

    def write(tmp: Path) -> None:
        record.num_bytes = write_model_folder(
            tmp,
            job.state_dict,
            job.config,
            job.generation_config,
            job.processing_class,
            max_shard_size,
            weights_prefix=job.weights_prefix,
        )
        write_snapshot_record(tmp, record)

    needed = sum(t.numel() * t.element_size() for t in job.state_dict.values())
    write_folder_atomically(Path(pma_dir) / job.name, write, needed=needed)
    return record


def write_snapshot_record(folder: Path, record: SnapshotRecord) -> None:
    """Write ``pma.json`` into the snapshot being written in ``folder``, last: the record, with the
    names of the files in the folder (and its own) under ``extra.files``, so that only those are
    ever deleted with it (:func:`hf_pma.core.manifest.snapshot_folder_problem`)."""
    files = sorted({*(p.name for p in folder.iterdir()), SNAPSHOT_RECORD_NAME})
    data = record.to_dict()
    data["extra"] = {**data["extra"], SNAPSHOT_FILES_KEY: files}
    atomic_write_json(folder / SNAPSHOT_RECORD_NAME, data)


def check_replaceable(target: Path, pma_dir: str | os.PathLike[str]) -> None:
    """``FileExistsError`` (one line naming it and why) when something is at the snapshot folder
    ``target`` that is not entirely hf-pma's: a snapshot never replaces a user's folder or file."""
    if not target.exists() and not target.is_symlink():
        return
    problem = snapshot_folder_problem(target, pma_dir)
    if problem is not None:
        raise FileExistsError(
            f"hf-pma: will not replace {escape(target)} with a snapshot: {problem}; move it out of {escape(pma_dir)}"
        )


# ---------------------------------------------------------------------------------------------
# Off-thread writing
# ---------------------------------------------------------------------------------------------


class BackgroundWorker:
    """Runs one task at a time off the training thread; a failure is re-raised by the next call.

    ``submit`` first waits for the task in flight (so at most one is), logging how long it
    waited. With ``enabled=False`` tasks run in the calling thread.
    """

    def __init__(self, enabled: bool = True, name: str = "hf-pma-writer") -> None:
        self.enabled = enabled
        self.name = name
        self._thread: threading.Thread | None = None
        self._label: str | None = None
        self._error: tuple[str, BaseException] | None = None
        self.total_wait_s = 0.0
        self.tasks_done = 0
        # Tasks handed over so far: the n-th one's seconds are task_seconds[n] once it completed.
        self.submitted = 0
        # Seconds each completed task took, in order.
        self.task_seconds: list[float] = []
        # (start, end) clock readings (time.perf_counter) of every task, end None while it runs.
        self.spans: list[tuple[float, float | None]] = []
        self._warned_wait = False

    @property
    def busy(self) -> bool:
        """Whether a task is running."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self, task: Callable[[], Any], label: str) -> None:
        try:
            self._timed(task)
        except BaseException as err:  # handed to the training thread
            self._error = (label, err)

    def _timed(self, task: Callable[[], Any]) -> None:
        start = time.perf_counter()
        self.spans.append((start, None))
        try:
            task()
        finally:
            end = time.perf_counter()
            self.spans[-1] = (start, end)
        self.task_seconds.append(end - start)
        self.tasks_done += 1

    def raise_if_failed(self) -> None:
        """Raise :class:`SnapshotWriteError` for a task that failed since the last call."""
        if self._error is not None:
            label, err = self._error
            self._error = None
            raise SnapshotWriteError(f"hf-pma: writing {label} failed: {type(err).__name__}: {err}") from err

    def wait(self, reason: str | None = None, warn: bool = True) -> float:
        """Wait for the task in flight, then raise its failure if it failed; returns seconds waited.

        With a ``reason``, a wait that happened is logged (the first time a warning unless
        ``warn=False``, then at INFO): a snapshot that waits for the previous one means the
        interval is shorter than a write.
        """
        waited = 0.0
        if self._thread is not None:
            if self._thread.is_alive():
                start = time.perf_counter()
                self._thread.join()
                waited = time.perf_counter() - start
                self.total_wait_s += waited
                if reason and waited < MIN_REPORTED_WAIT_S:  # the write was finishing: nothing to change
                    logger.debug(f"hf-pma: {reason} waited {waited:.3f}s for {self._label} to finish writing")
                elif reason:
                    # A warning the first time; after that the cost line has said what to change.
                    log = logger.warning if warn and not self._warned_wait else logger.info
                    self._warned_wait = self._warned_wait or warn
                    log(f"hf-pma: {reason} waited {waited:.2f}s for {self._label} to finish writing")
            self._thread = None
        self.raise_if_failed()
        return waited

    def submit(self, task: Callable[[], Any], label: str) -> None:
        """Run ``task`` in the background (after the previous one finished)."""
        self.wait(reason=label)
        self.submitted += 1
        if not self.enabled:
            try:
                self._timed(task)
            except Exception as err:
                raise SnapshotWriteError(f"hf-pma: writing {label} failed: {type(err).__name__}: {err}") from err
            return
        self._label = label
        # Not a daemon: an interpreter that exits normally still finishes the write in flight.
        self._thread = threading.Thread(target=self._run, args=(task, label), name=self.name)
        self._thread.start()


class SnapshotWriter:
    """Writes snapshots into ``pma_dir`` and keeps its manifest, on the main process only.

    ``submit(job)`` returns at once (``async_write=True``) and writes in a background thread;
    the manifest lists a snapshot only once its folder is durable, and ``keep_last`` deletes
    the oldest only after that. All manifest changes (snapshots, exclusions, resume
    truncation) go through this object's lock.
    """

    def __init__(
        self,
        pma_dir: str | os.PathLike[str],
        *,
        async_write: bool = True,
        keep_last: int | None = None,
        max_shard_size: int | str = "5GB",
    ) -> None:
        check_int(keep_last, "keep_last", allow_none=True)
        parse_size(max_shard_size)
        self.pma_dir = Path(pma_dir)
        self.keep_last = keep_last
        self.max_shard_size = max_shard_size
        self.worker = BackgroundWorker(enabled=async_write)
        self.lock = threading.RLock()
        self.written: list[SnapshotRecord] = []

    # -- the folder and its manifest ----------------------------------------------------------

    def open(self, **manifest_fields: Any) -> dict[str, Any]:
        """Create the folder, remove leftovers of interrupted writes, write the manifest fields.

        Fails at once, naming the folder, when it cannot be written. Returns the manifest.
        """
        problems = snapshot_name_problems(self.pma_dir)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise FileExistsError(
                f"hf-pma: {problems[0]}{more}; a snapshot taken at those tokens would replace it: move it out of "
                f"{escape(self.pma_dir)} or choose another output_dir"
            )
        try:
            self.pma_dir.mkdir(parents=True, exist_ok=True)
            with self.lock:
                clean_incomplete(self.pma_dir)  # logs what it removes
                records = manifest_snapshots(self.pma_dir)
                return write_manifest(self.pma_dir, records, **manifest_fields)
        except OSError as err:
            raise PermissionError(f"hf-pma: cannot write snapshots to {self.pma_dir}: {err}") from err

    def manifest(self) -> dict[str, Any]:
        """The manifest on disk (after the write in flight, if any, was listed)."""
        with self.lock:
            return read_manifest(self.pma_dir)

    def update_manifest(self, **fields: Any) -> None:
        """Set top-level manifest fields (for example the chosen interval)."""
        with self.lock:
            write_manifest(self.pma_dir, manifest_snapshots(self.pma_dir), **fields)

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots listed in the manifest, oldest first, with absolute folders."""
        with self.lock:
            records = manifest_snapshots(self.pma_dir)
        return [(r, snapshot_path(self.pma_dir, r)) for r in records if include_excluded or not is_excluded(r)]

    def exclude(self, tokens: Iterable[int], reason: str = "excluded") -> list[SnapshotRecord]:
        """Mark listed snapshots as excluded from merges (waits for the write in flight first)."""
        self.wait()
        with self.lock:
            return exclude_snapshots(self.pma_dir, tokens, reason)

    def truncate(self, tokens: int) -> tuple[list[SnapshotRecord], list[SnapshotRecord]]:
        """Make the folder match a run resumed at ``tokens``: returns (set aside, adopted).

        Nothing the resumed run has not passed is deleted: complete but unlisted snapshot
        folders (a crash between rename and manifest update) are listed again, and every listed
        snapshot past ``tokens`` is set aside (kept on disk and in the manifest, excluded from
        merges, until the resumed run passes it: :func:`hf_pma.core.manifest.set_aside_snapshots_after`),
        so a run interrupted right after resuming loses nothing.
        """
        self.wait()
        with self.lock:
            adopted: list[SnapshotRecord] = []
            orphans = [record for _, record in orphan_snapshots(self.pma_dir) if record is not None]
            if orphans:
                listed = manifest_snapshots(self.pma_dir)
                records = sorted([*listed, *orphans], key=lambda r: (r.tokens, r.step))
                write_manifest(self.pma_dir, records)
                adopted = [r for r in orphans if r.tokens <= tokens]
            set_aside, deleted = set_aside_snapshots_after(self.pma_dir, tokens)
        for record in deleted:
            logger.info(f"hf-pma: deleted {escape(record.path)}, set aside by an earlier resume and passed since")
        return set_aside, adopted

    def settle(self, tokens: int) -> list[SnapshotRecord]:
        """The run reached ``tokens`` (train end): drop the snapshots set aside by a resume that it
        has passed (deleted when everything in them is hf-pma's). Returns them."""
        self.wait()
        with self.lock:
            records = manifest_snapshots(self.pma_dir)
            passed = [r for r in records if is_set_aside(r) and r.tokens <= tokens]
            if passed:
                write_manifest(self.pma_dir, [r for r in records if r not in passed])
            for record in passed:
                remove_snapshot_folder(self.pma_dir, record)
        return passed

    # -- writing --------------------------------------------------------------------------------

    def write(self, job: SnapshotJob) -> SnapshotRecord:
        """Write one snapshot in the calling thread: durable folder, then the manifest entry."""
        record = write_snapshot(job, self.pma_dir, self.max_shard_size)
        with self.lock:
            deleted = add_snapshot(self.pma_dir, record, keep_last=self.keep_last)
        for old in deleted:
            logger.debug(f"hf-pma: deleted {old.path} (keep_last={self.keep_last})")
        self.written.append(record)
        logger.debug(f"hf-pma: snapshot {record.path} written ({format_bytes(record.num_bytes or 0)})")
        return record

    def submit(self, job: SnapshotJob) -> None:
        """Write ``job`` in the background (or now, with ``async_write=False``)."""
        self.worker.submit(lambda: self.write(job), label=f"{self.pma_dir / job.name}")

    def wait(self) -> None:
        """Wait until the write in flight is listed; raise its failure if it failed."""
        self.worker.wait()

    def raise_if_failed(self) -> None:
        """Raise the failure of a background write, if one failed."""
        self.worker.raise_if_failed()

    @property
    def manifest_path(self) -> Path:
        """Path of the manifest."""
        return self.pma_dir / MANIFEST_NAME
