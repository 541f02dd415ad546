"""``PMACallback``: weight snapshots every V tokens for any ``transformers.Trainer``.

A thin adapter: the snapshots themselves are taken by
:class:`hf_pma.snapshots.taker.SnapshotTaker` (the engine that
:class:`hf_pma.training.loop.PMASnapshots` drives from a loop of your own); this module only
translates the ``Trainer``'s events and state into its calls. Usage::

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

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from hf_pma.core.manifest import SnapshotRecord
from hf_pma.core.schedule import check_schedule_state
from hf_pma.snapshots.budget import DEFAULT_MAX_OVERHEAD
from hf_pma.snapshots.lr_probe import step_lr
from hf_pma.snapshots.sinks import ONLINE_STATE_NAME, SnapshotSink
from hf_pma.snapshots.taker import SnapshotTaker, TakenSnapshot
from hf_pma.snapshots.writer import SnapshotWriter
from hf_pma.utils.names import scheduler_name
from hf_pma.utils.parsing import parameter_error
from hf_pma.utils.text import shown

logger = logging.get_logger(__name__)

__all__ = ["PMACallback", "ONLINE_STATE_NAME"]


class _OnTaker:
    """An attribute of :class:`PMACallback` that lives on its :class:`SnapshotTaker` (read and set there)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.taker, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.taker, self.name, value)


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
        online_half_life_fraction: for ``online="ema"``: the half-life as a share of the tokens
            seen so far (e.g. ``0.05``: a snapshot's weight halves over 5% of the run at each
            snapshot): a horizon-free EMA, as torchtitan's ``half_life_fraction``, for runs that
            keep no snapshots and need no ``max_steps``. One of it, ``online_alpha`` and
            ``online_half_life_tokens``.
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
        max_overhead: the share of training time snapshots may cost (default ``0.01``: 1 %),
            measured from the step times over the run's first snapshots (the copy, and the
            background write competing for the CPU). With the automatic interval, V is widened
            (whole steps, said in one line) when they cost more, keeping at least 10 snapshots in
            the constant phase; with a given V, a warning says which V would do. ``None``: no budget.

    The tokens come from the Trainer's ``state.num_input_tokens_seen``; counting is turned on
    (``"all"``) when ``include_num_input_tokens_seen`` is ``"no"``, and ``"non_padding"`` is
    respected when set.

    The snapshot folder is held from train begin to train end (:class:`hf_pma.utils.fs.FolderClaim`):
    a second training into it stops at its start naming this one; on a filesystem without
    ``flock`` (Lustre without ``-o flock``) the claim file itself is the lock, so training goes on
    wherever the Trainer's checkpoints do; a folder moved away while training stops it at the
    next snapshot with :class:`hf_pma.utils.fs.FolderMovedError` rather than start over at its path.

    Guards for the zero-argument default: one warning at train begin when the schedule has no
    constant-LR phase (PMA's premise), the disk budget above, and the cost budget
    (``max_overhead``): after the third snapshot, one line says what snapshots cost this run's
    training time, measured from its step times, with its uncertainty.
    """

    # The options, as attributes (they live on the taker).
    sharded = _OnTaker()
    schedule = _OnTaker()
    requested_interval_tokens = _OnTaker()
    phases = _OnTaker()
    output_dir = _OnTaker("requested_pma_dir")
    keep_last = _OnTaker()
    save_dtype = _OnTaker()
    max_shard_size = _OnTaker()
    async_write = _OnTaker()
    online = _OnTaker()
    online_alpha = _OnTaker()
    online_half_life_tokens = _OnTaker()
    online_window_tokens = _OnTaker()
    max_disk_bytes = _OnTaker()
    online_device = _OnTaker()
    online_half_life_fraction = _OnTaker()
    max_overhead = _OnTaker()
    # Set by whoever owns the Trainer (e.g. PMATrainer) to gather a DeepSpeed engine.
    accelerator = _OnTaker()

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
        online_half_life_fraction: float | None = None,
        max_overhead: float | None = DEFAULT_MAX_OVERHEAD,
    ) -> None:
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):  # the taker's pma_dir
            raise parameter_error("output_dir", f"must be a folder path or None, got {shown(output_dir, 60)}")
        #: The snapshot engine this callback drives.
        self.taker = SnapshotTaker(
            interval_tokens=interval_tokens,
            pma_dir=output_dir,
            phases=phases,
            keep_last=keep_last,
            save_dtype=save_dtype,
            max_shard_size=max_shard_size,
            async_write=async_write,
            online=online,
            online_alpha=online_alpha,
            online_half_life_tokens=online_half_life_tokens,
            online_window_tokens=online_window_tokens,
            max_disk_bytes=max_disk_bytes,
            sharded=sharded,
            online_device=online_device,
            online_half_life_fraction=online_half_life_fraction,
            max_overhead=max_overhead,
        )
        # Restored by Trainer(restore_callback_states_from_checkpoint=True); read on resume anyway.
        self.resume_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public API (the taker's)

    @property
    def interval_tokens(self) -> int | None:
        """V in use: the one given, or the automatic choice once made (``None`` before)."""
        return self.taker.interval_tokens

    @property
    def interval_choice(self) -> dict[str, Any] | None:
        """How the automatic interval was chosen (``None`` when V was given)."""
        return self.taker.interval_choice

    @property
    def pma_dir(self) -> Path | None:
        """The folder of the manifest and snapshots (known from train begin)."""
        return self.taker.pma_dir

    @property
    def sink(self) -> SnapshotSink | None:
        """What happens to snapshots in this run (built at train begin)."""
        return self.taker.sink

    @property
    def writer(self) -> SnapshotWriter | None:
        """The snapshot writer (main process, disk snapshots only)."""
        return self.taker.writer

    @property
    def snapshot_costs(self) -> list[TakenSnapshot]:
        """What each snapshot of the last ``train()`` cost on this process, oldest first: tokens,
        seconds the training thread was blocked, seconds of background writing (``None`` while in
        flight), bytes (see :class:`hf_pma.snapshots.taker.TakenSnapshot`)."""
        return self.taker.snapshot_costs

    @property
    def online_count(self) -> int:
        """How many snapshots the online average holds."""
        return self.taker.online_count

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots (listed in the manifest), oldest first, with absolute folders.

        A write still in flight is not listed yet: call :meth:`wait` first to include it.
        """
        return self.taker.snapshots(include_excluded)

    def wait(self) -> None:
        """Block until the snapshot (or online update) in flight is done; raise if it failed."""
        self.taker.wait()

    def exclude_snapshots(self, tokens: Iterable[int], reason: str = "excluded") -> list[SnapshotRecord]:
        """Mark the snapshots taken at ``tokens`` as excluded from merges (e.g. a loss spike).

        They stay on disk; their manifest record gets ``"extra": {"excluded": true,
        "excluded_reason": reason}`` (see :func:`hf_pma.core.manifest.is_excluded`). Main process
        only (other processes get ``[]``). Raises ``ValueError`` for tokens the manifest lacks.
        """
        return self.taker.exclude_snapshots(tokens, reason)

    def online_state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor] | None:
        """The online running average (float32 unless ``dtype``), or ``None`` without online mode,
        on other processes than the main one, or for a sharded average (no process holds it all)."""
        return self.taker.online_state_dict(dtype)

    def save_online_average(self, model: Any) -> Path | None:
        """Every process: write the online average now to ``<pma_dir>/online-<kind>`` (a sharded
        folder under FSDP / ZeRO-3, every rank its file), as train end does; returns the folder on
        the main process (``None`` elsewhere, without online mode, or before the first snapshot)."""
        return self.taker.save_online_average(model)

    def swap_in_online(self, model: Any) -> Any | None:
        """Every process: put the online average into the live ``model`` (each rank its own
        slices under FSDP / ZeRO-3); returns the function that puts the live weights back (every
        process calls it), or ``None`` without online mode or before the first snapshot."""
        return self.taker.swap_in_online(model)

    # ------------------------------------------------------------------ ExportableState

    def state(self) -> dict[str, Any]:
        """JSON state stored in ``trainer_state.json`` at each checkpoint."""
        options = self.taker.options()
        options["output_dir"] = options.pop("pma_dir")
        return {"args": options, "attributes": {"resume_state": self.taker.schedule_state()}}

    # ------------------------------------------------------------------ Trainer events -> taker calls

    def on_init_end(self, args, state, control, **kwargs):
        self._enable_token_count(args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._enable_token_count(args)
        resumed = state.global_step > 0
        self.taker.begin(
            model,
            output_dir=args.output_dir,
            world_size=args.world_size,
            is_main=bool(state.is_world_process_zero),
            token_count=args.include_num_input_tokens_seen,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            planned_steps=int(state.max_steps),
            step=int(state.global_step),
            tokens=int(state.num_input_tokens_seen),
            resume_dir=self._checkpoint_dir(args, state) if resumed else None,
            saved_state=self._saved_state(state) if resumed else None,
            peak_lr=args.learning_rate,
            warmup_steps=args.get_warmup_steps(int(state.max_steps)),
            scheduler_name=scheduler_name(args),
            processing_class=kwargs.get("processing_class"),
            average_tokens_across_devices=bool(getattr(args, "average_tokens_across_devices", True)),
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self.taker.commit(control.should_save)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # The LR this optimizer step used (the scheduler steps right after this event).
        self.taker.optimizer_step(step_lr(getattr(optimizer, "param_groups", None)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.taker.step_end(
            model,
            step=int(state.global_step),
            tokens=int(state.num_input_tokens_seen),
            epoch=state.epoch,
            log_follows=bool(control.should_log),
            checkpoint_follows=bool(control.should_save),
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = logs.get("loss") if logs else None
        self.taker.logged(int(state.global_step), loss, checkpoint_follows=bool(control.should_save))

    def on_epoch_end(self, args, state, control, **kwargs):
        self.taker.commit(control.should_save)

    def on_save(self, args, state, control, **kwargs):
        self.taker.before_checkpoint(self._checkpoint_dir(args, state))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.taker.end(model)

    # ------------------------------------------------------------------ Trainer specifics

    @staticmethod
    def _checkpoint_dir(args: Any, state: Any) -> Path:
        """The Trainer checkpoint folder of this optimizer step (saved to, or resumed from)."""
        return Path(args.output_dir) / f"checkpoint-{state.global_step}"

    def _saved_state(self, state: Any) -> dict[str, Any]:
        """Our state in the resumed checkpoint's ``trainer_state.json`` (or from the Trainer's restore)."""
        what = "the resumed checkpoint's trainer_state.json: PMACallback's resume_state"
        if self.resume_state:
            return dict(check_schedule_state(self.resume_state, what))
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(stored, list):
            stored = stored[0] if stored else None
        if not isinstance(stored, dict):
            return {}
        attributes = stored.get("attributes") or {}
        return dict(
            check_schedule_state(
                attributes.get("resume_state") or {} if isinstance(attributes, dict) else attributes, what
            )
        )

    @staticmethod
    def _enable_token_count(args: Any) -> None:
        if args.include_num_input_tokens_seen in ("no", False, None):
            args.include_num_input_tokens_seen = "all"
            logger.info("hf-pma: turned on include_num_input_tokens_seen='all' to count tokens for snapshots")
