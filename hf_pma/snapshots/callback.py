"""``PMACallback``: weight snapshots every V tokens for any ``transformers.Trainer``.

Glue only: *when* comes from :class:`hf_pma.core.schedule.SnapshotSchedule`, *what happens* to a
snapshot from a sink of :mod:`hf_pma.snapshots.sinks` (full model folders on disk, or an
online average), chosen from the arguments. Usage::

    trainer = Trainer(model, args, train_dataset=..., callbacks=[PMACallback()])
    trainer.train()
    # <output_dir>/pma/manifest.json + <output_dir>/pma/snapshot-<tokens>/ model folders

Order of events inside one optimizer step (Trainer): the forward passes (the model's loss
is added up by :class:`hf_pma.snapshots.loss.StepLossTracker`), ``on_optimizer_step`` (the LR
the step used is read here), ``on_step_end`` (tokens and phase checked; the sink takes the
weights on every rank; the record gets the mean training loss of the steps since the previous
snapshot), then ``on_log`` (the sink commits the snapshot to its background writer), then
checkpointing (which first waits for the write in flight, so a Trainer checkpoint never gets
ahead of the snapshots it follows).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from hf_pma import __version__
from hf_pma.core.manifest import PMA_SUBDIR, SnapshotRecord, snapshot_dirname
from hf_pma.core.schedule import RunPlan, SnapshotSchedule, StepTick, plan_run, positive_int_or_none
from hf_pma.snapshots.budget import DiskBudget, SnapshotBudgetError, SnapshotCost, TimeBudget, human_bytes
from hf_pma.snapshots.gather import sharding_kind, unwrap_model
from hf_pma.snapshots.loss import StepLossTracker
from hf_pma.snapshots.lr_probe import first_group_value, peak_lr, planned_lrs
from hf_pma.snapshots.online import ONLINE_KINDS, OnlineAverage
from hf_pma.snapshots.sharded import ShardedOnlineAverageSink, ShardedSnapshotSink
from hf_pma.snapshots.sinks import (
    ONLINE_STATE_NAME,
    DiskSnapshotSink,
    OnlineAverageSink,
    ResumePoint,
    SnapshotSink,
)
from hf_pma.snapshots.writer import SnapshotWriter
from hf_pma.utils.distributed import check_folder_shared, is_peft_model, run_on_main_process
from hf_pma.utils.fs import FolderClaim
from hf_pma.utils.logs import notice
from hf_pma.utils.parsing import parse_dtype, parse_size
from hf_pma.utils.text import escape

logger = logging.get_logger(__name__)

__all__ = ["PMACallback", "ONLINE_STATE_NAME"]


class PMACallback(TrainerCallback, ExportableState):
    """Save the model's weights every ``interval_tokens`` tokens, for Pre-trained Model Averaging.

    Args:
        interval_tokens: V, the global number of input tokens (over all processes) between
            snapshots. ``None``: chosen after the first optimizer step from the planned run so
            that the steps in ``phases`` hold 4 windows of 10 snapshots, about 40 snapshots
            whatever the schedule (logged, and recorded in the manifest).
        output_dir: where snapshots and ``manifest.json`` go; default
            ``<TrainingArguments.output_dir>/pma``.
        phases: the learning-rate phases in which snapshots are taken, among ``"warmup"``,
            ``"stable"``, ``"decay"`` (derived from the LR values, whatever the scheduler).
        keep_last: keep only the newest snapshots on disk (``None``: keep all).
        save_dtype: cast floating weights to this dtype in snapshots (``"bfloat16"``...);
            default: the training dtype.
        max_shard_size: largest safetensors shard (as ``save_pretrained``).
        async_write: write in a background thread (the step only copies weights to CPU).
        online: ``"sma"``, ``"ema"`` or a decay kind: keep a running float32 average on CPU instead of
            writing snapshots; saved as a model folder ``<output_dir>/online-<kind>`` at the end.
            Under FSDP1/FSDP2 or ZeRO-3 (with ``sharded`` ``"auto"`` or ``True``) every rank
            averages only its own slices and the folder is a sharded one (one file per rank).
        online_alpha: EMA factor for ``online="ema"``.
        online_half_life_tokens: for ``online="ema"``: the tokens over which a snapshot's weight
            halves (replaces ``online_alpha``; the same average whatever ``interval_tokens``).
        online_window_tokens: for ``online="sma"`` or a decay kind (``"linear-decay"``,
            ``"cosine-decay"``, ``"1-sqrt-decay"``: WSM's decay emulation, which needs it):
            average over tumbling windows of this many tokens (the average restarts at each
            multiple); see :mod:`hf_pma.snapshots.online` for what each equals offline.
        max_disk_bytes: the disk budget of the snapshots (bytes or ``"200GB"``). ``None``: the
            free space of the snapshot folder. The projected bytes (one snapshot in the saved
            dtype x the snapshots kept) are checked before the first snapshot is written; over
            budget, training stops with a :class:`hf_pma.snapshots.budget.SnapshotBudgetError`.
        sharded: ``"auto"`` (default): under FSDP1/FSDP2 or DeepSpeed ZeRO-3 every rank writes
            only its own slices of the weights (one file per rank in ``snapshot-<tokens>/``, no
            rank gathers the model; every hf-pma reader takes such folders, and
            ``hf-pma consolidate`` turns one into a plain model folder); otherwise (and for PEFT
            models, whose snapshots are their adapters) full folders. ``True``/``False`` force it.
        online_device: where the online average lives: ``"cpu"`` (host memory; from CUDA the
            weights are copied on a side stream and folded in off the training thread) or
            ``"device"`` (a float32 copy on the weights' device, no host copy); see
            :class:`hf_pma.snapshots.sinks.OnlineAverageSink`.

    The tokens come from the Trainer's ``state.num_input_tokens_seen``; counting is turned on
    (``"all"``) when ``include_num_input_tokens_seen`` is ``"no"``, and ``"non_padding"`` is
    respected when set.

    Guards for the zero-argument default: one warning at train begin when the schedule has no
    constant-LR phase (PMA's premise), the disk budget above, and once the second snapshot is
    written what a snapshot costs (blocked and write seconds, bytes; the second, since the
    first also allocates the host buffers) against the training time between snapshots, with a
    warning and the interval that would do when it exceeds 5%.
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
        online_half_life_tokens: int | None = None,
        online_window_tokens: int | None = None,
        max_disk_bytes: int | str | None = None,
        sharded: bool | str = "auto",
        online_device: str = "cpu",
    ) -> None:
        if sharded not in (True, False, "auto"):
            raise ValueError(f"sharded must be True, False or 'auto', got {sharded!r}")
        self.sharded = sharded
        self.schedule = SnapshotSchedule(interval_tokens, phases)
        self.requested_interval_tokens = self.schedule.requested_interval_tokens
        self.phases = self.schedule.phases
        self.output_dir = os.fspath(output_dir) if output_dir is not None else None
        self.keep_last = positive_int_or_none(keep_last, "keep_last")
        self.save_dtype = parse_dtype(save_dtype, "save_dtype")
        parse_size(max_shard_size, "max_shard_size")
        self.max_shard_size = max_shard_size
        if not isinstance(async_write, bool):
            raise ValueError(f"async_write must be True or False, got {async_write!r}")
        self.async_write = async_write
        if online is not None and online not in ONLINE_KINDS:
            raise ValueError(f"online must be one of {ONLINE_KINDS} or None, got {online!r}")
        self.online = online
        if online is None and (online_half_life_tokens is not None or online_window_tokens is not None):
            raise ValueError("online_half_life_tokens and online_window_tokens need online='sma', 'ema' or a decay kind")
        OnlineAverage(  # validates the online options together
            online or ("ema" if online_half_life_tokens is not None else "sma"),
            online_alpha,
            half_life_tokens=online_half_life_tokens,
            window_tokens=online_window_tokens,
            device=online_device,
        )
        self.online_device = online_device
        self.online_alpha = float(online_alpha)
        self.online_half_life_tokens = online_half_life_tokens
        self.online_window_tokens = online_window_tokens
        if online is not None and keep_last is not None:
            raise ValueError("keep_last has no effect with online averaging (no snapshots are written)")
        self.max_disk_bytes = parse_size(max_disk_bytes, "max_disk_bytes") if max_disk_bytes is not None else None
        if self.max_disk_bytes is not None and self.max_disk_bytes < 1:
            raise ValueError(f"max_disk_bytes must be a positive size, got {max_disk_bytes!r}")

        # Set by whoever owns the Trainer (e.g. PMATrainer) to gather a DeepSpeed engine.
        self.accelerator: Any | None = None
        # Restored by Trainer(restore_callback_states_from_checkpoint=True); read on resume anyway.
        self.resume_state: dict[str, Any] | None = None

        self._pma_dir: Path | None = None
        self._run_claim: FolderClaim | None = None
        self._is_main = True
        self._sink: SnapshotSink | None = None
        self._step_lr: float | None = None
        self._pending: SnapshotRecord | None = None
        self._last_loss: tuple[int, float] | None = None
        self._losses = StepLossTracker()
        self._last_snapshot_step = 0
        self._warned_small_interval = False
        self._plan: RunPlan | None = None
        self._disk: DiskBudget | None = None
        self._time: TimeBudget | None = None
        self._disk_checked = False
        self._taken_blocked_s: list[float] = []  # per snapshot of this train(): the training thread blocked

    # ------------------------------------------------------------------ public API

    @property
    def interval_tokens(self) -> int | None:
        """V in use: the one given, or the automatic choice once made (``None`` before)."""
        return self.schedule.interval_tokens

    @property
    def interval_choice(self) -> dict[str, Any] | None:
        """How the automatic interval was chosen (``None`` when V was given)."""
        return self.schedule.interval_choice

    @property
    def pma_dir(self) -> Path | None:
        """The folder of the manifest and snapshots (known from train begin)."""
        return self._pma_dir

    @property
    def sink(self) -> SnapshotSink | None:
        """What happens to snapshots in this run (built at train begin)."""
        return self._sink

    @property
    def writer(self) -> SnapshotWriter | None:
        """The snapshot writer (main process, disk snapshots only)."""
        return getattr(self._sink, "writer", None)

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots (listed in the manifest), oldest first, with absolute folders.

        A write still in flight is not listed yet: call :meth:`wait` first to include it.
        """
        if self._sink is None:
            return []
        return self._sink.snapshots(include_excluded)

    def wait(self) -> None:
        """Block until the snapshot (or online update) in flight is done; raise if it failed."""
        self._commit(should_save=False)
        if self._sink is not None:
            self._sink.wait()

    def exclude_snapshots(self, tokens: Iterable[int], reason: str = "excluded") -> list[SnapshotRecord]:
        """Mark the snapshots taken at ``tokens`` as excluded from merges (e.g. a loss spike).

        They stay on disk; their manifest record gets ``"extra": {"excluded": true,
        "excluded_reason": reason}`` (see :func:`hf_pma.core.manifest.is_excluded`). Main process
        only (other processes get ``[]``). Raises ``ValueError`` for tokens the manifest lacks.
        """
        if self._sink is None:
            return []
        self.wait()
        return self._sink.exclude(tokens, reason)

    def online_state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor] | None:
        """The online running average (float32 unless ``dtype``), or ``None`` without online mode,
        on other processes than the main one, or for a sharded average (no process holds it all)."""
        if not isinstance(self._sink, OnlineAverageSink):
            return None
        self._commit(should_save=False)
        return self._sink.state_dict(parse_dtype(dtype))

    def save_online_average(self, model: Any) -> Path | None:
        """Every process: write the online average now to ``<pma_dir>/online-<kind>`` (a sharded
        folder under FSDP / ZeRO-3, every rank its file), as train end does; returns the folder on
        the main process (``None`` elsewhere, without online mode, or before the first snapshot)."""
        if not isinstance(self._sink, OnlineAverageSink):
            return None
        self._commit(should_save=False)
        folder = self._sink.write_average(model)
        return folder if self._is_main else None

    def swap_in_online(self, model: Any) -> Any | None:
        """Every process: put the online average into the live ``model`` (each rank its own
        slices under FSDP / ZeRO-3); returns the function that puts the live weights back (every
        process calls it), or ``None`` without online mode or before the first snapshot."""
        if not isinstance(self._sink, OnlineAverageSink):
            return None
        self._commit(should_save=False)
        return self._sink.swap_in(model)

    @property
    def online_count(self) -> int:
        """How many snapshots the online average holds."""
        return self._sink.count if isinstance(self._sink, OnlineAverageSink) else 0

    # ------------------------------------------------------------------ ExportableState

    def state(self) -> dict[str, Any]:
        """JSON state stored in ``trainer_state.json`` at each checkpoint."""
        return {
            "args": {
                "interval_tokens": self.requested_interval_tokens,
                "output_dir": self.output_dir,
                "phases": list(self.phases),
                "keep_last": self.keep_last,
                "save_dtype": _dtype_name(self.save_dtype),
                "max_shard_size": self.max_shard_size,
                "async_write": self.async_write,
                "online": self.online,
                "online_alpha": self.online_alpha,
                "online_half_life_tokens": self.online_half_life_tokens,
                "online_window_tokens": self.online_window_tokens,
                "max_disk_bytes": self.max_disk_bytes,
                "sharded": self.sharded,
                "online_device": self.online_device,
            },
            "attributes": {"resume_state": self.schedule.state()},
        }

    # ------------------------------------------------------------------ Trainer events

    def on_init_end(self, args, state, control, **kwargs):
        self._enable_token_count(args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._enable_token_count(args)
        self._is_main = bool(state.is_world_process_zero)
        self._pma_dir = Path(self.output_dir or Path(args.output_dir) / PMA_SUBDIR).absolute()
        run_on_main_process(self._claim_folder)  # before anything is written; refused on every rank
        try:
            self._begin(args, state, model, optimizer, lr_scheduler, kwargs.get("processing_class"))
        except BaseException:
            self._release_folder()
            raise

    def _begin(
        self, args: Any, state: Any, model: Any, optimizer: Any, lr_scheduler: Any, processing_class: Any
    ) -> None:
        """Train begin, once this run holds its snapshot folder."""
        self._pending = None
        resumed = state.global_step > 0
        self.schedule.begin(
            peak_lr(optimizer, lr_scheduler, args),
            int(state.num_input_tokens_seen),
            self._saved_state(state) if resumed else None,
        )
        self._plan = self._plan_run(args, state, lr_scheduler)
        self._sink = self._make_sink(processing_class, model)
        self._disk = DiskBudget(self._pma_dir, self.max_disk_bytes)
        self._time = TimeBudget()
        self._disk_checked = False
        self._taken_blocked_s = []
        self._last_snapshot_step = int(state.global_step)
        self._last_loss = None
        if model is not None:
            self._losses.attach(model)
        error = None
        if self._is_main:
            self._warn_without_constant_phase(args)
            if not resumed:  # before anything is written; a resumed run is checked at its first step
                error, _ = self._check_disk_plan(model, None, state)
        self._raise_together(args, error)
        resume = None
        if resumed:
            resume = ResumePoint(int(state.num_input_tokens_seen), int(state.global_step), self._checkpoint_dir(args, state))
        recorded = self._sink.open(resume)
        if recorded.get("interval_tokens"):
            adopted = self.schedule.adopt_interval(int(recorded["interval_tokens"]), recorded.get("interval_choice"))
            if not adopted and self.schedule.interval_tokens != recorded["interval_tokens"]:
                logger.warning(
                    f"hf-pma: interval_tokens={self.schedule.interval_tokens:,} differs from the "
                    f"{recorded['interval_tokens']:,} of the resumed run's manifest"
                )
        self._sink.update_manifest(**self._manifest_fields(args))
        check_folder_shared(self._pma_dir, "snapshot folder")  # multi-node: every rank reads what rank 0 writes
        self._sink.warm_up(model)
        self._sync_from_main(args)

    def on_step_begin(self, args, state, control, **kwargs):
        self._commit(control.should_save)
        self._sink.raise_if_failed()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # The LR this optimizer step used (the scheduler steps right after this event).
        self._step_lr = first_group_value(getattr(optimizer, "param_groups", None), "lr")

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        self._sink.raise_if_failed()
        self._time.step_done()
        self._losses.end_step()
        lr, self._step_lr = self._step_lr, None
        if lr is None and lr_scheduler is not None:
            lr = float(lr_scheduler.get_last_lr()[0])
        tick = self.schedule.advance(int(state.num_input_tokens_seen), lr)
        if tick.step_tokens == 0 and tick.previous_tokens == self.schedule.tokens_at_begin:
            raise ValueError(
                f"hf-pma: no input tokens were counted in optimizer step {state.global_step}: PMACallback needs "
                "Trainer's token count (include_num_input_tokens_seen) and batches that carry the model's "
                "main input (e.g. 'input_ids')"
            )
        if self.interval_tokens is None:
            self._choose_interval(args, tick.step_tokens)
        if not self._disk_checked:  # the first step of this train() (every process): the count is known now
            self._disk_checked = True
            error, plan = self._check_disk_plan(model, tick.step_tokens, state) if self._is_main else (None, None)
            self._raise_together(args, error)
            if self._is_main:
                self._announce(tick.step_tokens, plan)
        self._report_cost(tick.step_tokens)
        self._warn_small_interval(tick.step_tokens)
        boundary = self.schedule.due(tick)
        if boundary is not None:
            self._take(args, model, state, control, tick, boundary)
        if control.should_save and self._pending is None:
            self._sink.before_checkpoint()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._last_loss = (state.global_step, float(logs["loss"]))
        if self._pending is not None and self._pending.step == state.global_step:
            self._commit(control.should_save)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._commit(control.should_save)
        if control.should_save:
            self._sink.before_checkpoint()

    def on_save(self, args, state, control, **kwargs):
        self._commit(should_save=True)
        self._sink.save_checkpoint(self._checkpoint_dir(args, state))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        try:
            self._losses.detach()
            self._commit(should_save=False)
            self._sink.close(model)
            self._sink.reached(int(state.num_input_tokens_seen))  # snapshots set aside by a resume and passed since
            if self.interval_tokens is not None and self.schedule.tokens > self.schedule.tokens_at_begin:
                steps = max(1, state.global_step - self._plan_step0)
                self._report_cost(max(1, (self.schedule.tokens - self.schedule.tokens_at_begin) // steps), at_end=True)
            if self._is_main and isinstance(self._sink, DiskSnapshotSink):
                self._announce_end()
        finally:
            self._release_folder()

    # ------------------------------------------------------------------ internals

    def _checkpoint_dir(self, args: Any, state: Any) -> Path:
        """The Trainer checkpoint folder of this optimizer step (saved to, or resumed from)."""
        return Path(args.output_dir) / f"checkpoint-{state.global_step}"

    def _claim_folder(self) -> None:
        """Main process (the one that writes the manifest): hold the snapshot folder's claim from
        train begin to train end (:class:`hf_pma.utils.fs.FolderClaim`), so that a second training
        in the same folder, on this host or another one sharing the filesystem, stops at its start
        with one line naming this one's host and pid instead of interleaving the manifest. Refused
        at once, not waited for: the holder trains for hours. The kernel releases it when this
        process dies; a train() that raised keeps it until this callback is collected or trains
        again (the claim is re-entrant within one process)."""
        if self._run_claim is not None and self._run_claim.folder != self._pma_dir:
            self._release_folder()
        if self._pma_dir.is_symlink():  # snapshots, manifest and deletions would land wherever it points
            raise ValueError(
                f"snapshot folder {escape(self._pma_dir)} is a symbolic link; hf-pma writes snapshots only into a "
                "real folder inside output_dir (remove the link, or set output_dir to where it points)"
            )
        if self._run_claim is None:
            self._run_claim = FolderClaim(self._pma_dir, what="snapshot folder", busy="is in use by another training")
        with contextlib.suppress(OSError):  # the claim file lies beside the folder (a file there: the sink says so)
            self._pma_dir.parent.mkdir(parents=True, exist_ok=True)
        self._run_claim.acquire(wait=0)

    def _release_folder(self) -> None:
        if self._run_claim is not None:
            self._run_claim.release()

    @staticmethod
    def _enable_token_count(args: Any) -> None:
        if args.include_num_input_tokens_seen in ("no", False, None):
            args.include_num_input_tokens_seen = "all"
            logger.info("hf-pma: turned on include_num_input_tokens_seen='all' to count tokens for snapshots")

    def _make_sink(self, processing_class: Any | None, model: Any | None = None) -> SnapshotSink:
        """The sink these arguments ask for: an online average, per-rank shards, or full folders."""
        common = {
            "is_main": self._is_main,
            "save_dtype": self.save_dtype,
            "max_shard_size": self.max_shard_size,
            "async_write": self.async_write,
            "accelerator": self.accelerator,
            "processing_class": processing_class,
        }
        adapter = model is not None and is_peft_model(unwrap_model(model))
        if self.sharded is True and adapter:
            raise ValueError("sharded=True stores full weights; a PEFT model's snapshots are its adapter: use sharded=False")
        sharded = self.sharded is True or (self.sharded == "auto" and not adapter and model is not None and sharding_kind(model))
        if self.online is not None:
            online = ShardedOnlineAverageSink if sharded else OnlineAverageSink
            return online(
                self._pma_dir,
                online=self.online,
                alpha=self.online_alpha,
                half_life_tokens=self.online_half_life_tokens,
                window_tokens=self.online_window_tokens,
                online_device=self.online_device,
                **common,
            )
        if sharded:
            return ShardedSnapshotSink(self._pma_dir, keep_last=self.keep_last, **common)
        return DiskSnapshotSink(self._pma_dir, keep_last=self.keep_last, **common)

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
            "interval_tokens": self.schedule.interval_tokens,
            "interval_choice": self.schedule.interval_choice,
            "phases": list(self.phases),
            "token_count": args.include_num_input_tokens_seen,
            "save_dtype": _dtype_name(self.save_dtype),
            "keep_last": self.keep_last,
            "online": self.online,
        }

    def _sync_from_main(self, args: Any) -> None:
        """Every process uses the main process's interval and phase state (it read the manifest)."""
        if args.world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        payload = [self.schedule.state()]
        torch.distributed.broadcast_object_list(payload, src=0)
        self.schedule.load_state(payload[0])

    def _plan_run(self, args: Any, state: Any, lr_scheduler: Any) -> RunPlan:
        """The planned run: the phase of every planned step, probed from the LR schedule."""
        max_steps = int(state.max_steps)
        self._plan_step0 = int(state.global_step)
        probe = planned_lrs(lr_scheduler, max_steps)
        return plan_run(
            max_steps,
            self.phases,
            probe[0] if probe else None,
            self.schedule.tracker.peak_lr,
            stride=probe[1] if probe else 1,
            warmup_steps=args.get_warmup_steps(max_steps),
        )

    def _warn_without_constant_phase(self, args: Any) -> None:
        """One warning when the planned schedule never holds the LR constant (PMA's premise)."""
        if self._plan.has_constant_phase:
            return
        selected = "/".join(self.phases)
        logger.warning(
            f"hf-pma: lr_scheduler_type={getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)!r} "
            "has no constant-LR phase "
            f"({self._plan.stable_steps} of {self._plan.planned_steps} planned steps at the peak LR). PMA merges "
            "snapshots taken at a constant LR to preview what annealing would give; for that, train with "
            "lr_scheduler_type='warmup_stable_decay' (lr_scheduler_kwargs={'num_decay_steps': ...}) or 'constant'. "
            f"If you keep this schedule, snapshots are taken in the {selected} phases (about "
            f"{self._plan.intended_snapshots()} of them) and a merge of the last ones averages weights along the "
            "decay: close to the final weights, rarely better."
        )

    def _choose_interval(self, args: Any, tokens_per_step: int) -> None:
        """The automatic V, from the first step's tokens and the planned run (same on every rank)."""
        choice = self.schedule.choose_automatically(tokens_per_step, self._plan)
        if self._is_main:
            logger.info(
                f"hf-pma: interval_tokens not given: chose {choice.interval_tokens:,} tokens (every "
                f"{choice.steps_between:.2f} steps of {tokens_per_step:,} tokens; {choice.reason}): about "
                f"{choice.expected_snapshots} snapshots in the {'/'.join(self.phases)} phases "
                f"({choice.snapshot_steps} of {choice.planned_steps} planned steps; {choice.stable_steps} at the peak LR)"
            )
        self._sink.update_manifest(**self._manifest_fields(args))

    def _planned_snapshots(self, tokens_per_step: int | None, after_step: int) -> tuple[int | None, str]:
        """How many snapshots the run takes after optimizer step ``after_step``, and where that figure
        comes from; ``None`` when unknown (a given interval before the first step's tokens are known)."""
        if tokens_per_step is None or self.interval_tokens is None:
            if self.interval_tokens is None:
                count = self._plan.intended_snapshots()
                return count, f"the automatic interval aims at {count}"
            return None, "unknown before the first step"
        remaining = self._plan.selected_steps(after_step)
        if tokens_per_step >= self.interval_tokens:
            return remaining, f"{remaining} steps snapshot, at most one snapshot a step"
        count = remaining * tokens_per_step // self.interval_tokens
        return count, f"{remaining} steps snapshot, {self.interval_tokens:,} tokens apart at {tokens_per_step:,} a step"

    def _check_disk_plan(self, model: Any, tokens_per_step: int | None, state: Any) -> tuple[str | None, str | None]:
        """Main process: the disk budget for the rest of the run: the error message (or ``None``)
        and the plan in words (``None`` when over budget or unknown).

        Checked at train begin when the count is known then (automatic interval, ``keep_last``,
        online average), and at the end of the first optimizer step with its real token count,
        in both cases before the first snapshot is written.
        """
        count, what = self._planned_snapshots(tokens_per_step, max(0, int(state.global_step) - 1))
        listed = self._sink.snapshots() if state.global_step > 0 else []
        folders = self._sink.kept_on_disk(len(listed) + count if count is not None else None)
        if folders is None:
            return None, None
        used = sum(r.num_bytes or 0 for r, _ in listed)
        try:
            plan = self._disk.check_plan(
                self._sink.snapshot_bytes(model), max(0, folders - len(listed)), count or folders, what, used
            )
        except SnapshotBudgetError as err:
            return str(err), None
        return None, plan

    def _announce(self, tokens_per_step: int, disk_plan: str | None) -> None:
        """Main process, once per ``train()``: where the snapshots go, how often, what they take.

        Through :func:`hf_pma.utils.logs.notice`, so that a plain script (warnings only) shows it.
        """
        steps = self.interval_tokens / tokens_per_step
        chosen = "; chosen automatically, see Choosing V in the docs" if self.interval_choice else ""
        if isinstance(self._sink, OnlineAverageSink):
            where = f"into an online {self.online} average, saved at the end to {self._pma_dir / f'online-{self.online}'}"
        else:
            where = f"into {self._pma_dir}"
        disk = f"; disk: {disk_plan}" if disk_plan else ""
        notice(
            logger,
            f"hf-pma: a snapshot every {self.interval_tokens:,} tokens ({steps:.1f} steps{chosen}) in the "
            f"{'/'.join(self.phases)} phases {where}{disk}",
        )

    def _announce_end(self) -> None:
        """Main process, at train end: how many snapshots there are and how to merge them (the
        command shell-quoted, to paste)."""
        from hf_pma.utils.text import command_line

        listed = self._sink.snapshots()
        if not listed:
            return
        size = human_bytes(sum(r.num_bytes or 0 for r, _ in listed))
        notice(
            logger,
            f"hf-pma: {len(listed)} snapshots ({size}) in {self._pma_dir}; "
            f"`{command_line(['hf-pma', 'merge', self._pma_dir])} --last N -o MERGED` averages the last N",
        )

    def _recheck_disk(self, model: Any, state: Any, tick: StepTick) -> None:
        """Main process, before a snapshot is written: does it fit, do the rest still fit?"""
        size = self._sink.last_written_bytes() or self._sink.snapshot_bytes(model)
        listed = self._sink.snapshots()
        count, _ = self._planned_snapshots(tick.step_tokens, int(state.global_step))
        count = count or 0
        extra = max(0, (self._sink.kept_on_disk(len(listed) + 1 + count) or 0) - len(listed) - 1)
        self._disk.check_next(size, extra, count, sum(r.num_bytes or 0 for r, _ in listed))

    def _raise_together(self, args: Any, error: str | None) -> None:
        """Raise the main process's budget error on every process (so none waits in a collective)."""
        if args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            payload = [error]
            torch.distributed.broadcast_object_list(payload, src=0)
            error = payload[0]
        if error is not None:
            raise SnapshotBudgetError(error)

    def _report_cost(self, tokens_per_step: int, at_end: bool = False) -> None:
        """Once the second snapshot of this run is written (or at the end, after a single one):
        what a snapshot costs against the time between snapshots. The first snapshot also pays
        one-time costs (pinned host buffers are allocated then), so the second is the one that
        tells what every later snapshot costs."""
        if self._time.reported or not self._taken_blocked_s or not self._is_main:
            return
        seconds = self._sink.worker.task_seconds
        which = 1 if len(self._taken_blocked_s) > 1 and len(seconds) > 1 else 0
        if not seconds or (which == 0 and not at_end):
            return
        cost = SnapshotCost(
            self._taken_blocked_s[which],
            seconds[which],
            self._sink.last_written_bytes() or 0,
            first_blocked_s=self._taken_blocked_s[0] if which else None,
        )
        self._time.report(cost, self.interval_tokens / tokens_per_step, tokens_per_step, self.async_write)

    def _warn_small_interval(self, step_tokens: int) -> None:
        if step_tokens > self.interval_tokens and not self._warned_small_interval and self._is_main:
            self._warned_small_interval = True
            logger.warning(
                f"hf-pma: interval_tokens={self.interval_tokens:,} is smaller than one step ({step_tokens:,} tokens): "
                "at most one snapshot per step is taken"
            )

    def _take(self, args: Any, model: Any, state: Any, control: Any, tick: StepTick, boundary: int) -> None:
        """Every rank: the sink copies the weights now; the record is committed once its loss is known."""
        self._commit(should_save=False)  # at most one snapshot taken and not committed
        record = SnapshotRecord(
            path=snapshot_dirname(tick.tokens),
            tokens=tick.tokens,
            step=int(state.global_step),
            lr=tick.lr,
            phase=tick.phase,
            extra={"interval_tokens": self.interval_tokens, "boundary": boundary, "epoch": state.epoch},
        )
        # The mean training loss over the steps since the previous snapshot, and this step's.
        window = self._losses.take_window(bool(getattr(args, "average_tokens_across_devices", True)))
        record.extra["loss_since_step"] = self._last_snapshot_step
        if window is not None:
            record.loss = window.mean
            record.extra.update(loss_steps=window.steps, step_loss=window.last, loss_source="model")
        self._last_snapshot_step = record.step
        start = time.perf_counter()
        self._sink.take(model, record)
        blocked = time.perf_counter() - start
        self._time.add_blocked(blocked)
        self._taken_blocked_s.append(blocked)
        if self._is_main:
            self._recheck_disk(model, state, tick)
        self._pending = record
        # The step's loss is logged right after on_step_end: commit then.
        if not control.should_log:
            self._commit(control.should_save)

    def _commit(self, should_save: bool) -> None:
        if self._pending is None:
            return
        record, self._pending = self._pending, None
        since = record.extra["loss_since_step"]
        if record.loss is None and self._last_loss is not None and since < self._last_loss[0] <= record.step:
            # The model returned no loss (the Trainer computed it): the last logged loss, when
            # it was logged since the previous snapshot. It averages the logging window.
            record.loss = self._last_loss[1]
            record.extra.update(loss_source="logs", loss_logged_at_step=self._last_loss[0])
        start = time.perf_counter()
        self._sink.commit()
        if should_save:
            self._sink.before_checkpoint()
        self._time.add_blocked(time.perf_counter() - start)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None
