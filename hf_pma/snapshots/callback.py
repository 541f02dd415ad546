"""``PMACallback``: weight snapshots every V tokens for any ``transformers.Trainer``.

Glue only: *when* comes from :mod:`hf_pma.core.schedule`, *how* from :mod:`hf_pma.snapshots.writer`
and :mod:`hf_pma.core.manifest`. Usage::

    trainer = Trainer(model, args, train_dataset=..., callbacks=[PMACallback()])
    trainer.train()
    # <output_dir>/pma/manifest.json + <output_dir>/pma/snapshot-<tokens>/ model folders

Order of events inside one optimizer step (Trainer): ``on_optimizer_step`` (the LR the step
used is read here), ``on_step_end`` (tokens and phase checked; the weights are gathered on
every rank, copied to CPU on the main process), then ``on_log`` (the step's training loss
goes into the record and the write is handed to the background thread), then checkpointing
(which first waits for the write in flight, so a Trainer checkpoint never gets ahead of the
snapshots it follows).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from hf_pma import __version__
from hf_pma.core.manifest import (
    MERGE_RECORD_NAME,
    PMA_SUBDIR,
    SnapshotRecord,
    is_excluded,
    manifest_snapshots,
    snapshot_dirname,
    snapshot_path,
)
from hf_pma.core.schedule import PhaseTracker, check_phases, choose_interval, crossed_boundary, planned_phases
from hf_pma.snapshots.online import ONLINE_KINDS, OnlineAverage
from hf_pma.snapshots.writer import (
    BackgroundWorker,
    SnapshotJob,
    SnapshotWriter,
    gather_full_state_dict,
    model_metadata,
    prepare_snapshot,
    strip_for_save,
    write_folder_atomically,
    write_model_folder,
)
from hf_pma.utils.parsing import parse_dtype, parse_size

logger = logging.get_logger(__name__)

__all__ = ["PMACallback", "ONLINE_STATE_NAME"]

# File in a Trainer checkpoint folder holding the online average (online mode only).
ONLINE_STATE_NAME = "pma_online.safetensors"
# Schedules with more steps than this are probed at a stride (for the automatic interval).
_MAX_PROBED_STEPS = 100_000


def _positive_int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return value


def _first(param_groups: Any, key: str) -> float | None:
    try:
        value = param_groups[0].get(key)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return float(value) if value is not None else None


def _peak_lr(optimizer: Any, lr_scheduler: Any, args: Any) -> float:
    """The schedule's reference (peak) LR: ``initial_lr`` of the first param group, else the
    scheduler's ``base_lrs``, else ``args.learning_rate``."""
    peak = _first(getattr(optimizer, "param_groups", None), "initial_lr")
    if peak is None:
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
        base_lrs = getattr(scheduler, "base_lrs", None)
        peak = float(base_lrs[0]) if base_lrs else None
    if peak is None:
        peak = float(args.learning_rate)
    if not peak > 0:
        raise ValueError(f"PMACallback reads the phase from the learning rate, which needs a positive peak LR; got {peak}")
    return peak


def _planned_lrs(lr_scheduler: Any, max_steps: int) -> tuple[list[float], int] | None:
    """The LR of every planned step (at a stride for long runs) when the schedule is a
    ``LambdaLR`` (every ``transformers`` schedule is); ``None`` when it cannot be probed."""
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    base_lrs = getattr(scheduler, "base_lrs", None)
    if not lambdas or not base_lrs or max_steps < 1:
        return None
    stride = max(1, -(-max_steps // _MAX_PROBED_STEPS))
    try:
        return [float(base_lrs[0]) * float(lambdas[0](s)) for s in range(0, max_steps, stride)], stride
    except Exception as err:  # a custom lambda that needs more than the step
        logger.warning(f"hf-pma: could not probe the learning-rate schedule ({err}); estimating its phases")
        return None


@dataclasses.dataclass
class _Step:
    """What the last optimizer step looked like."""

    tokens: int = 0
    lr: float | None = None


class PMACallback(TrainerCallback, ExportableState):
    """Save the model's weights every ``interval_tokens`` tokens, for Pre-trained Model Averaging.

    Args:
        interval_tokens: V, the global number of input tokens (over all processes) between
            snapshots. ``None``: chosen after the first optimizer step from the planned run so
            that the stable phase holds 4 windows of 10 snapshots (logged, and recorded in the
            manifest).
        output_dir: where snapshots and ``manifest.json`` go; default
            ``<TrainingArguments.output_dir>/pma``.
        phases: the learning-rate phases in which snapshots are taken, among ``"warmup"``,
            ``"stable"``, ``"decay"`` (derived from the LR values, whatever the scheduler).
        keep_last: keep only the newest snapshots on disk (``None``: keep all).
        save_dtype: cast floating weights to this dtype in snapshots (``"bfloat16"``...);
            default: the training dtype.
        max_shard_size: largest safetensors shard (as ``save_pretrained``).
        async_write: write in a background thread (the step only copies weights to CPU).
        online: ``"sma"`` or ``"ema"``: keep a running float32 average on CPU instead of
            writing snapshots; saved as a model folder ``<output_dir>/online-<kind>`` at the end.
        online_alpha: EMA factor for ``online="ema"``.

    The tokens come from the Trainer's ``state.num_input_tokens_seen``; counting is turned on
    (``"all"``) when ``include_num_input_tokens_seen`` is ``"no"``, and ``"non_padding"`` is
    respected when set.
    """

    def __init__(
        self,
        interval_tokens: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        phases: str | Iterable[str] = ("stable", "decay"),
        keep_last: int | None = None,
        save_dtype: torch.dtype | str | None = None,
        max_shard_size: int | str = "5GB",
        async_write: bool = True,
        online: str | None = None,
        online_alpha: float = 0.2,
    ) -> None:
        self.requested_interval_tokens = _positive_int_or_none(interval_tokens, "interval_tokens")
        self.output_dir = os.fspath(output_dir) if output_dir is not None else None
        self.phases = check_phases(phases)
        self.keep_last = _positive_int_or_none(keep_last, "keep_last")
        self.save_dtype = parse_dtype(save_dtype, "save_dtype")
        parse_size(max_shard_size, "max_shard_size")
        self.max_shard_size = max_shard_size
        if not isinstance(async_write, bool):
            raise ValueError(f"async_write must be True or False, got {async_write!r}")
        self.async_write = async_write
        if online is not None and online not in ONLINE_KINDS:
            raise ValueError(f"online must be one of {ONLINE_KINDS} or None, got {online!r}")
        self.online = online
        OnlineAverage(online or "sma", online_alpha)  # validates online_alpha
        self.online_alpha = float(online_alpha)
        if online is not None and keep_last is not None:
            raise ValueError("keep_last has no effect with online averaging (no snapshots are written)")

        # Set by whoever owns the Trainer (e.g. PMATrainer) to gather a DeepSpeed engine.
        self.accelerator: Any | None = None
        # Restored by Trainer(restore_callback_states_from_checkpoint=True); read on resume anyway.
        self.resume_state: dict[str, Any] | None = None

        self._interval: int | None = self.requested_interval_tokens
        self._interval_choice: dict[str, Any] | None = None
        self._pma_dir: Path | None = None
        self._is_main = True
        self._writer: SnapshotWriter | None = None
        self._online: OnlineAverage | None = None
        self._online_worker: BackgroundWorker | None = None
        self._tracker: PhaseTracker | None = None
        self._step = _Step()
        self._tokens_at_begin = 0
        self._processing_class: Any | None = None
        self._pending: SnapshotJob | None = None
        self._last_loss: tuple[int, float] | None = None
        self._warned_small_interval = False
        self._model_dtype: torch.dtype | None = None
        self._buffers: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ public API

    @property
    def interval_tokens(self) -> int | None:
        """V in use: the one given, or the automatic choice once made (``None`` before)."""
        return self._interval

    @property
    def interval_choice(self) -> dict[str, Any] | None:
        """How the automatic interval was chosen (``None`` when V was given)."""
        return self._interval_choice

    @property
    def pma_dir(self) -> Path | None:
        """The folder of the manifest and snapshots (known from train begin)."""
        return self._pma_dir

    @property
    def writer(self) -> SnapshotWriter | None:
        """The snapshot writer (main process, snapshot mode only)."""
        return self._writer

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots (listed in the manifest), oldest first, with absolute folders.

        A write still in flight is not listed yet: call :meth:`wait` first to include it.
        """
        if self._writer is not None:
            return self._writer.snapshots(include_excluded)
        if self._pma_dir is None or not (self._pma_dir / "manifest.json").exists():
            return []
        records = manifest_snapshots(self._pma_dir)
        return [(r, snapshot_path(self._pma_dir, r)) for r in records if include_excluded or not is_excluded(r)]

    def wait(self) -> None:
        """Block until the snapshot (or online update) in flight is done; raise if it failed."""
        self._flush_pending(should_save=False)
        if self._writer is not None:
            self._writer.wait()
        if self._online_worker is not None:
            self._online_worker.wait()

    def exclude_snapshots(self, tokens: Iterable[int], reason: str = "excluded") -> list[SnapshotRecord]:
        """Mark the snapshots taken at ``tokens`` as excluded from merges (e.g. a loss spike).

        They stay on disk; their manifest record gets ``"extra": {"excluded": true,
        "excluded_reason": reason}`` (see :func:`hf_pma.core.manifest.is_excluded`). Main process
        only (other processes get ``[]``). Raises ``ValueError`` for tokens the manifest lacks.
        """
        if self._writer is None:
            return []
        self.wait()
        return self._writer.exclude(tokens, reason)

    def online_state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor] | None:
        """The online running average (float32 unless ``dtype``), or ``None`` without online mode
        or on other processes than the main one."""
        if self._online is None:
            return None
        if self._online_worker is not None:
            self._online_worker.wait()
        return self._online.state_dict(parse_dtype(dtype))

    @property
    def online_count(self) -> int:
        """How many snapshots the online average holds."""
        return self._online.count if self._online is not None else 0

    # ------------------------------------------------------------------ ExportableState

    def state(self) -> dict[str, Any]:
        """JSON state stored in ``trainer_state.json`` at each checkpoint."""
        return {
            "args": {
                "interval_tokens": self.requested_interval_tokens,
                "output_dir": self.output_dir,
                "phases": list(self.phases),
                "keep_last": self.keep_last,
                "save_dtype": str(self.save_dtype).removeprefix("torch.") if self.save_dtype else None,
                "max_shard_size": self.max_shard_size,
                "async_write": self.async_write,
                "online": self.online,
                "online_alpha": self.online_alpha,
            },
            "attributes": {
                "resume_state": {
                    "interval_tokens": self._interval,
                    "interval_choice": self._interval_choice,
                    "phase": self._tracker.state() if self._tracker is not None else None,
                }
            },
        }

    # ------------------------------------------------------------------ Trainer events

    def on_init_end(self, args, state, control, **kwargs):
        self._enable_token_count(args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._enable_token_count(args)
        self._is_main = bool(state.is_world_process_zero)
        self._pma_dir = Path(self.output_dir or Path(args.output_dir) / PMA_SUBDIR).absolute()
        self._processing_class = kwargs.get("processing_class")
        self._tracker = PhaseTracker(_peak_lr(optimizer, lr_scheduler, args))
        self._tokens_at_begin = int(state.num_input_tokens_seen)
        self._step = _Step(tokens=self._tokens_at_begin)
        self._pending = None
        self._buffers = None
        resumed = state.global_step > 0

        saved = self._saved_state(state) if resumed else {}
        if saved.get("phase"):
            self._tracker.load_state(saved["phase"])
        if self._interval is None and saved.get("interval_tokens"):
            self._interval = int(saved["interval_tokens"])
            self._interval_choice = saved.get("interval_choice")

        if self._is_main:
            self._open_output(args, state, resumed)
        self._sync_from_main(args)
        if self._interval is not None:
            logger.info(f"hf-pma: a snapshot every {self._interval:,} tokens into {self._pma_dir}")

    def on_step_begin(self, args, state, control, **kwargs):
        self._flush_pending(control.should_save)
        self._raise_if_failed()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # The LR this optimizer step used (the scheduler steps right after this event).
        self._step.lr = _first(getattr(optimizer, "param_groups", None), "lr")

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        self._raise_if_failed()
        lr = self._step.lr
        if lr is None and lr_scheduler is not None:
            lr = float(lr_scheduler.get_last_lr()[0])
        phase = self._tracker.update(lr)
        previous, tokens = self._step.tokens, int(state.num_input_tokens_seen)
        self._step = _Step(tokens=tokens)
        if tokens == previous and previous == self._tokens_at_begin:
            raise ValueError(
                f"hf-pma: no input tokens were counted in optimizer step {state.global_step}: PMACallback needs "
                "Trainer's token count (include_num_input_tokens_seen) and batches that carry the model's "
                "main input (e.g. 'input_ids')"
            )
        if self._interval is None:
            self._choose_interval(args, state, tokens - previous, lr_scheduler)
        if tokens - previous > self._interval and not self._warned_small_interval and self._is_main:
            self._warned_small_interval = True
            logger.warning(
                f"hf-pma: interval_tokens={self._interval:,} is smaller than one step ({tokens - previous:,} tokens): "
                "at most one snapshot per step is taken"
            )
        boundary = crossed_boundary(previous, tokens, self._interval)
        if boundary is not None and phase in self.phases:
            self._snapshot(model, state, control, tokens, boundary, lr, phase)
        if control.should_save and self._pending is None:
            self._wait_before_checkpoint()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._last_loss = (state.global_step, float(logs["loss"]))
        if self._pending is not None and self._pending.record.step == state.global_step:
            self._flush_pending(control.should_save)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._flush_pending(control.should_save)
        if control.should_save:
            self._wait_before_checkpoint()

    def on_save(self, args, state, control, **kwargs):
        self._flush_pending(should_save=True)
        if self._online is not None:
            self._save_online_state(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._flush_pending(should_save=False)
        self._buffers = None
        if self._writer is not None:
            self._writer.wait()
            logger.info(
                f"hf-pma: {len(self._writer.written)} snapshots written this run; training waited "
                f"{self._writer.worker.total_wait_s:.2f}s in total for snapshot writes"
            )
        if self._online is not None:
            self._online_worker.wait()
            self._save_online_model(model)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _enable_token_count(args: Any) -> None:
        if args.include_num_input_tokens_seen in ("no", False, None):
            args.include_num_input_tokens_seen = "all"
            logger.info("hf-pma: turned on include_num_input_tokens_seen='all' to count tokens for snapshots")

    def _saved_state(self, state: Any) -> dict[str, Any]:
        """Our state in the resumed checkpoint's ``trainer_state.json`` (or from the Trainer's restore)."""
        if self.resume_state:
            return dict(self.resume_state)
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(stored, list):
            stored = stored[0] if stored else None
        if not isinstance(stored, dict):
            return {}
        return dict((stored.get("attributes") or {}).get("resume_state") or {})

    def _manifest_fields(self, args: Any) -> dict[str, Any]:
        return {
            "hf_pma_version": __version__,
            "interval_tokens": self._interval,
            "interval_choice": self._interval_choice,
            "phases": list(self.phases),
            "token_count": args.include_num_input_tokens_seen,
            "save_dtype": str(self.save_dtype).removeprefix("torch.") if self.save_dtype else None,
            "keep_last": self.keep_last,
            "online": self.online,
        }

    def _open_output(self, args: Any, state: Any, resumed: bool) -> None:
        """Main process: check the folder is writable, and on resume make it match the resumed state."""
        tokens = self._tokens_at_begin
        if self.online is not None:
            self._online = OnlineAverage(self.online, self.online_alpha)
            self._online_worker = BackgroundWorker(enabled=self.async_write, name="hf-pma-online")
            if resumed:
                self._load_online_state(args, state)
            try:
                self._pma_dir.mkdir(parents=True, exist_ok=True)
                probe = self._pma_dir / f".tmp-write-check-{os.getpid()}"
                probe.write_text("ok")
                probe.unlink()
            except OSError as err:
                raise PermissionError(f"hf-pma: cannot write to {self._pma_dir}: {err}") from err
            return
        writer = SnapshotWriter(
            self._pma_dir, async_write=self.async_write, keep_last=self.keep_last, max_shard_size=self.max_shard_size
        )
        manifest = writer.open()
        if not resumed and manifest["snapshots"]:
            raise FileExistsError(
                f"hf-pma: {writer.manifest_path} already lists {len(manifest['snapshots'])} snapshots from an "
                "earlier run. Resume that run (trainer.train(resume_from_checkpoint=...)), or use another "
                "output_dir, or delete that folder."
            )
        if resumed:
            dropped, adopted = writer.truncate(tokens)
            if dropped:
                logger.warning(
                    f"hf-pma: resuming at {tokens:,} tokens: dropped {len(dropped)} later snapshots "
                    f"({', '.join(r.path for r in dropped)}); this run takes them again"
                )
            if adopted:
                logger.info(f"hf-pma: listed complete snapshots missing from the manifest: {[r.path for r in adopted]}")
            if self._interval is None and manifest.get("interval_tokens"):
                self._interval = int(manifest["interval_tokens"])
                self._interval_choice = manifest.get("interval_choice")
            elif (
                self.requested_interval_tokens is not None
                and manifest.get("interval_tokens") not in (None, self.requested_interval_tokens)
            ):
                logger.warning(
                    f"hf-pma: interval_tokens={self.requested_interval_tokens:,} differs from the "
                    f"{manifest['interval_tokens']:,} of the resumed run's manifest"
                )
        writer.update_manifest(**self._manifest_fields(args))
        self._writer = writer

    def _sync_from_main(self, args: Any) -> None:
        """Every process uses the main process's interval and phase state (it read the manifest)."""
        if args.world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        payload = [(self._interval, self._interval_choice, self._tracker.state())]
        torch.distributed.broadcast_object_list(payload, src=0)
        self._interval, self._interval_choice, phase_state = payload[0]
        self._tracker.load_state(phase_state)

    def _choose_interval(self, args: Any, state: Any, tokens_per_step: int, lr_scheduler: Any) -> None:
        """The automatic V, from the first step's tokens and the planned schedule (same on every rank)."""
        max_steps = int(state.max_steps)
        probe = _planned_lrs(lr_scheduler, max_steps)
        if probe is not None:
            lrs, stride = probe
            phases = planned_phases(lrs, self._tracker.peak_lr)
            stable = phases.count("stable") * stride
            selected = sum(p in self.phases for p in phases) * stride
        else:
            warmup = args.get_warmup_steps(max_steps)
            stable = selected = max(0, max_steps - warmup)
        choice = choose_interval(tokens_per_step, max(1, max_steps), stable if stable > 0 else selected)
        self._interval = choice.interval_tokens
        self._interval_choice = {**choice.to_dict(), "auto": True, "probed_schedule": probe is not None}
        if self._is_main:
            logger.warning(
                f"hf-pma: interval_tokens not given: chose {self._interval:,} tokens "
                f"({self._interval // tokens_per_step} steps of {tokens_per_step:,} tokens; {choice.reason}; "
                f"{max_steps} planned steps, {stable} in the stable phase)"
            )
            if self._writer is not None:
                self._writer.update_manifest(**self._manifest_fields(args))

    def _snapshot(self, model, state, control, tokens: int, boundary: int, lr: float, phase: str) -> None:
        """Gather on every rank; the main process prepares the job (or the online update)."""
        if self._is_main:
            # At most one write in flight, and at most one CPU copy of the weights at a time.
            self._flush_pending(should_save=False)
            worker = self._writer.worker if self._writer is not None else self._online_worker
            worker.wait(reason=f"snapshot at {tokens:,} tokens")
        state_dict = gather_full_state_dict(
            model,
            accelerator=self.accelerator,
            dtype=self.save_dtype,
            is_main_process=self._is_main,
            buffers=self._buffers,
        )
        if not self._is_main:
            return
        # The previous write is done: its CPU copy is reused by the next snapshot.
        self._buffers = state_dict
        record = SnapshotRecord(
            path=snapshot_dirname(tokens),
            tokens=tokens,
            step=int(state.global_step),
            lr=lr,
            phase=phase,
            extra={"interval_tokens": self._interval, "boundary": boundary, "epoch": state.epoch},
        )
        if self._online is not None:
            state_dict = strip_for_save(model, state_dict)
            self._model_dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), None)
            online = self._online
            self._online_worker.submit(lambda: online.update(state_dict, record), label=f"online {record.path}")
            return
        self._pending = prepare_snapshot(model, state_dict, record, self._processing_class)
        # The step's loss is logged right after on_step_end: hand the job over then.
        if not control.should_log:
            self._flush_pending(control.should_save)

    def _flush_pending(self, should_save: bool) -> None:
        if self._pending is None:
            return
        job, self._pending = self._pending, None
        if self._last_loss is not None:
            job.record.loss = self._last_loss[1]
            job.record.extra["loss_step"] = self._last_loss[0]
        self._writer.submit(job)
        if should_save:
            self._wait_before_checkpoint()

    def _wait_before_checkpoint(self) -> None:
        # A Trainer checkpoint must not get ahead of the snapshots before it: a crash after it
        # would resume without them.
        if self._writer is not None and self._writer.worker.busy:
            self._writer.worker.wait(reason="the Trainer checkpoint", warn=False)
        if self._writer is not None:
            self._writer.raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._writer is not None:
            self._writer.raise_if_failed()
        if self._online_worker is not None:
            self._online_worker.raise_if_failed()

    # -- online mode

    def _save_online_state(self, checkpoint_dir: Path) -> None:
        if not self._is_main or self._online is None:
            return
        self._online_worker.wait()
        if checkpoint_dir.is_dir():
            self._online.save_state(checkpoint_dir / ONLINE_STATE_NAME)

    def _load_online_state(self, args: Any, state: Any) -> None:
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / ONLINE_STATE_NAME
        if path.is_file():
            self._online = OnlineAverage.load_state(path)
            logger.info(f"hf-pma: restored the online {self.online} average of {self._online.count} snapshots")
        else:
            logger.warning(f"hf-pma: no online average at {path}; the online average restarts empty")

    def _save_online_model(self, model: Any) -> Path | None:
        """Write the online average as a model folder ``<pma_dir>/online-<kind>`` (main process)."""
        if not self._is_main or self._online is None or self._online.count == 0:
            return None
        dtype = self.save_dtype or self._model_dtype
        state_dict = self._online.state_dict(dtype)
        config, generation_config = model_metadata(model, dtype)
        merge_record = self._online.merge_record(self._interval, str(dtype).removeprefix("torch.") if dtype else None)

        def write(folder: Path) -> None:
            write_model_folder(
                folder,
                state_dict,
                config,
                generation_config,
                self._processing_class,
                self.max_shard_size,
                json_files={MERGE_RECORD_NAME: merge_record},
            )

        target = write_folder_atomically(self._pma_dir / f"online-{self.online}", write)
        logger.info(f"hf-pma: online {self.online} average of {self._online.count} snapshots saved to {target}")
        return target
