"""``SnapshotTaker``: the snapshot engine, in training-loop terms; no ``Trainer`` object needed.

One implementation, two front doors: :class:`hf_pma.snapshots.callback.PMACallback` translates
the ``Trainer``'s events into these calls, and :class:`hf_pma.training.loop.PMASnapshots` makes
them from a loop of your own. *When* comes from :class:`hf_pma.core.schedule.SnapshotSchedule`,
*what happens* to a snapshot from a sink of :mod:`hf_pma.snapshots.sinks` (full model folders,
per-rank shards, an online average), the plan and its messages from
:mod:`hf_pma.snapshots.planning`, the budgets from :mod:`hf_pma.snapshots.budget`.

The calls, in the order a training loop makes them::

    taker = SnapshotTaker(interval_tokens=2**20)
    taker.begin(model, output_dir=out, optimizer=optimizer, lr_scheduler=scheduler, planned_steps=1000)
    for step in range(1, 1001):
        ...                                      # forwards (their losses are recorded), backward
        optimizer.step()
        taker.optimizer_step(lr)                 # the LR this optimizer step used
        scheduler.step()
        taker.step_end(model, step=step, tokens=tokens_so_far)   # global tokens, over all processes
    taker.end(model)

``step_end`` takes the snapshot when the token count passes a multiple of V in a selected phase;
the snapshot is handed to the background writer at once, or, when ``log_follows``, once the
step's logged loss arrives (:meth:`SnapshotTaker.logged`). Before a checkpoint,
:meth:`SnapshotTaker.before_checkpoint` lets the write in flight land first (a checkpoint never
gets ahead of the snapshots it follows) and stores what an online average needs to resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.manifest import PMA_SUBDIR, SnapshotRecord, snapshot_dirname
from hf_pma.core.schedule import (
    RunPlan,
    SnapshotSchedule,
    StepTick,
    crossed_boundary,
    plan_run,
    positive_int_or_none,
)
from hf_pma.snapshots import planning
from hf_pma.snapshots.budget import DEFAULT_MAX_OVERHEAD, DiskBudget, SnapshotBudgetError, check_max_overhead
from hf_pma.snapshots.gather import sharding_kind, unwrap_model
from hf_pma.snapshots.loss import StepLossTracker
from hf_pma.snapshots.lr_probe import peak_lr, planned_lrs
from hf_pma.snapshots.online import ONLINE_KINDS, OnlineAverage
from hf_pma.snapshots.overhead import BASELINE_STEPS, OverheadMeter
from hf_pma.snapshots.sharded import ShardedOnlineAverageSink, ShardedSnapshotSink
from hf_pma.snapshots.sinks import DiskSnapshotSink, OnlineAverageSink, ResumePoint, SnapshotSink
from hf_pma.snapshots.writer import SnapshotWriter
from hf_pma.utils.distributed import check_folder_shared, is_peft_model, run_on_main_process
from hf_pma.utils.fs import FolderClaim, FolderMovedError
from hf_pma.utils.logs import notice
from hf_pma.utils.parsing import check_int, is_number, parameter_error, parse_dtype, parse_size
from hf_pma.utils.text import escape, shown
from hf_pma.utils.version import __version__

logger = logging.get_logger(__name__)

__all__ = ["SnapshotTaker", "TakenSnapshot", "TOKEN_COUNTS"]

# How the tokens of a step are counted: every input position, or the attention mask's ones.
TOKEN_COUNTS = ("all", "non_padding")
# Snapshots of a run after which their measured cost is said (and the automatic V reviewed):
# the first interval may hold one-time costs, the second is the steady state.
COST_REVIEW_SNAPSHOTS = 3


@dataclasses.dataclass(frozen=True)
class TakenSnapshot:
    """What one snapshot of this run cost (:attr:`SnapshotTaker.snapshot_costs`).

    Attributes:
        tokens: the global token count the snapshot was taken at.
        blocked_s: seconds the training thread was blocked taking it (gathering and copying the
            weights; the first snapshot also allocates the host buffers).
        write_s: seconds its background work took on this process (writing the folder or this
            rank's file, or folding it into an online average); ``0.0`` when nothing was left to
            do off the training thread (this process writes none of it, or a sharded online
            average folded it while taking it); ``None`` while it is still in flight.
        num_bytes: bytes it took on disk (all ranks' files of a sharded snapshot), known on the
            process that completed it once written; ``None`` otherwise (and for an online average,
            which writes nothing per snapshot).
    """

    tokens: int
    blocked_s: float
    write_s: float | None
    num_bytes: int | None


@dataclasses.dataclass
class _Taken:
    record: SnapshotRecord
    blocked_s: float
    committed: bool = False
    task: int | None = None  # the sink worker's task that writes it (the n-th submitted)


class SnapshotTaker:
    """Snapshots every V tokens (or an online average), driven by plain calls from a training loop.

    Args:
        interval_tokens: V, the global number of input tokens (over all processes) between
            snapshots. ``None``: chosen after the first optimizer step from the planned run so
            that the steps in ``phases`` hold 4 windows of 10 snapshots (needs ``planned_steps``).
        pma_dir: the snapshot folder; default ``<output_dir>/pma`` (``output_dir`` of :meth:`begin`).
        phases: the learning-rate phases in which snapshots are taken, among ``"warmup"``,
            ``"stable"``, ``"decay"`` (derived from the LR values, whatever the scheduler).
        keep_last: keep only the newest snapshots on disk (``None``: keep all).
        save_dtype: cast floating weights to this dtype in snapshots; default: the training dtype.
        max_shard_size: largest safetensors shard (as ``save_pretrained``).
        async_write: write in a background thread (the step only copies weights to CPU).
        online: ``"sma"``, ``"ema"`` or a decay kind: a running float32 average instead of
            snapshot folders, saved as ``<pma_dir>/online-<kind>`` at the end.
        online_alpha: EMA factor for ``online="ema"``.
        online_half_life_tokens: for ``online="ema"``: the tokens over which a snapshot's weight halves.
        online_half_life_fraction: for ``online="ema"``: the half-life as a share of the tokens
            seen so far (horizon-free, e.g. 0.05).
        online_window_tokens: for ``online="sma"`` or a decay kind: tumbling windows of this many tokens.
        max_disk_bytes: the disk budget of the snapshots (bytes or ``"200GB"``); ``None``: the
            free space of the snapshot folder.
        sharded: ``"auto"``: per-rank files under FSDP1/FSDP2 or ZeRO-3, full folders otherwise
            (and for PEFT models); ``True``/``False`` force it.
        online_device: where the online average lives: ``"cpu"`` (host memory, folded in off the
            training thread) or ``"device"`` (a float32 copy beside the weights).
        max_overhead: the share of training time snapshots may cost (default ``0.01``, 1 %),
            measured from the step times over the first snapshots. With the automatic interval,
            V is widened (whole steps) when they cost more, keeping at least
            :data:`~hf_pma.core.schedule.SNAPSHOTS_PER_WINDOW` snapshots in the constant phase;
            with a given V, a warning says which V would do. ``None``: no budget (V is kept).

    The options are those of :class:`hf_pma.snapshots.callback.PMACallback`, which documents
    them in full. ``accelerator`` (an attribute) is the ``accelerate.Accelerator`` that gathers
    a DeepSpeed engine, when there is one.
    """

    def __init__(
        self,
        interval_tokens: int | None = None,
        pma_dir: str | os.PathLike[str] | None = None,
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
        if not (isinstance(sharded, bool) or sharded == "auto"):  # 1 and 0 are no answer
            raise ValueError(f"sharded must be True, False or 'auto', got {sharded!r}")
        self.sharded = sharded
        self.schedule = SnapshotSchedule(interval_tokens, phases)
        self.requested_interval_tokens = self.schedule.requested_interval_tokens
        self.phases = self.schedule.phases
        if pma_dir is not None and not isinstance(pma_dir, (str, os.PathLike)):
            raise parameter_error("pma_dir", f"must be a folder path or None, got {shown(pma_dir, 60)}")
        self.requested_pma_dir = os.fspath(pma_dir) if pma_dir is not None else None
        self.keep_last = positive_int_or_none(keep_last, "keep_last")
        self.save_dtype = parse_dtype(save_dtype, "save_dtype")
        parse_size(max_shard_size, "max_shard_size")
        self.max_shard_size = max_shard_size
        if not isinstance(async_write, bool):
            raise ValueError(f"async_write must be True or False, got {async_write!r}")
        self.async_write = async_write
        if online is not None and online not in ONLINE_KINDS:
            raise ValueError(f"online must be one of {ONLINE_KINDS} or None, got {shown(online, 60)}")
        self.online = online
        half_life = online_half_life_tokens is not None or online_half_life_fraction is not None
        if online is None and (half_life or online_window_tokens is not None):
            raise ValueError(
                "online_half_life_tokens, online_half_life_fraction and online_window_tokens need online='sma', "
                "'ema' or a decay kind"
            )
        OnlineAverage(  # validates the online options together
            online or ("ema" if half_life else "sma"),
            online_alpha,
            half_life_tokens=online_half_life_tokens,
            window_tokens=online_window_tokens,
            device=online_device,
            half_life_fraction=online_half_life_fraction,
        )
        if online is None and online_device != "cpu":
            raise ValueError(
                f"online_device={shown(online_device, 60)} needs online='sma', 'ema' or a decay kind"
            )
        self.online_device = online_device
        self.online_alpha = float(online_alpha)
        self.online_half_life_tokens = online_half_life_tokens
        self.online_half_life_fraction = online_half_life_fraction
        self.online_window_tokens = online_window_tokens
        if online is not None and keep_last is not None:
            raise ValueError("keep_last has no effect with online averaging (no snapshots are written)")
        self.max_disk_bytes = (
            parse_size(max_disk_bytes, "max_disk_bytes") if max_disk_bytes is not None else None
        )
        if self.max_disk_bytes is not None and self.max_disk_bytes < 1:
            raise ValueError(f"max_disk_bytes must be a positive size, got {max_disk_bytes!r}")
        self.max_overhead = check_max_overhead(max_overhead, "max_overhead")

        # Set by whoever owns the training (PMATrainer, PMASnapshots) to gather a DeepSpeed engine.
        self.accelerator: Any | None = None

        self._pma_dir: Path | None = None
        self._run_claim: FolderClaim | None = None
        self._is_main = True
        self._world_size = 1
        self._sink: SnapshotSink | None = None
        self._step_lr: float | None = None
        self._pending: SnapshotRecord | None = None
        self._last_loss: tuple[int, float] | None = None
        self._losses = StepLossTracker()
        self._last_snapshot_step = 0
        self._warned_small_interval = False
        self._first_step_tokens: int | None = None  # of this run's first step; None once steps vary
        self._plan: RunPlan | None = None
        self._plan_step0 = 0
        self._disk: DiskBudget | None = None
        self._meter: OverheadMeter | None = None
        self._begin_s = 0.0  # seconds begin() took (set-up the training waits for)
        self._cost_reported = False
        self._cost_reviewed = False  # the automatic V was reviewed against the cost budget
        self._cost_measured: dict[str, Any] | None = None  # what the review measured (main process)
        self._lr_backlog: list[torch.Tensor] = []  # tensor LRs of steps not read yet (no sync per step)
        self._disk_checked = False
        self._taken: list[_Taken] = []  # per snapshot of this run
        self._options: dict[str, Any] = {}  # of begin(): token count, loss averaging, scheduler
        self._lr_scheduler: Any | None = None
        self._resume: ResumePoint | None = None
        self._step = 0
        self._tokens = 0
        self._ended = False

    # ------------------------------------------------------------------ read-outs

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
        """The folder of the manifest and snapshots (known from :meth:`begin`)."""
        return self._pma_dir

    @property
    def is_main(self) -> bool:
        """Whether this process writes the manifest (as told at :meth:`begin`)."""
        return self._is_main

    @property
    def sink(self) -> SnapshotSink | None:
        """What happens to snapshots in this run (built at :meth:`begin`)."""
        return self._sink

    @property
    def writer(self) -> SnapshotWriter | None:
        """The snapshot writer (main process, disk snapshots only)."""
        return getattr(self._sink, "writer", None)

    @property
    def online_count(self) -> int:
        """How many snapshots the online average holds."""
        return self._sink.count if isinstance(self._sink, OnlineAverageSink) else 0

    @property
    def snapshot_costs(self) -> list[TakenSnapshot]:
        """What each snapshot of this run (since the last :meth:`begin`) cost on this process,
        oldest first (see :class:`TakenSnapshot`); ``[]`` before the first one."""
        seconds = list(self._sink.worker.task_seconds) if self._sink is not None else []
        costs = []
        for taken in self._taken:
            if taken.task is not None:
                write_s = seconds[taken.task] if taken.task < len(seconds) else None
            else:
                write_s = 0.0 if taken.committed else None
            num_bytes = taken.record.num_bytes if write_s is not None else None
            costs.append(TakenSnapshot(taken.record.tokens, taken.blocked_s, write_s, num_bytes))
        return costs

    def options(self) -> dict[str, Any]:
        """The constructor's arguments (JSON values), to rebuild an equal taker."""
        return {
            "interval_tokens": self.requested_interval_tokens,
            "pma_dir": self.requested_pma_dir,
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
            "online_half_life_fraction": self.online_half_life_fraction,
            "max_overhead": self.max_overhead,
        }

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots (listed in the manifest), oldest first, with absolute folders.

        A write still in flight is not listed yet: call :meth:`wait` first to include it.
        """
        if self._sink is None:
            return []
        return self._sink.snapshots(include_excluded)

    def wait(self) -> None:
        """Block until the snapshot (or online update) in flight is done; raise if it failed."""
        self._commit(checkpoint_follows=False)
        if self._sink is not None:
            self._sink.wait()

    def exclude_snapshots(self, tokens: Iterable[int], reason: str = "excluded") -> list[SnapshotRecord]:
        """Mark the snapshots taken at ``tokens`` as excluded from merges (e.g. a loss spike).

        They stay on disk; their manifest record gets ``"extra": {"excluded": true,
        "excluded_reason": reason}`` (see :func:`hf_pma.core.manifest.is_excluded`). Main process
        only (other processes get ``[]``). Raises ``ValueError`` for tokens the manifest lacks.
        """
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
            raise parameter_error("tokens", f"must be a list of token counts, got {shown(tokens, 60)}")
        tokens = list(tokens)
        for count in tokens:
            check_int(count, "tokens", 0)
        if not isinstance(reason, str):
            raise parameter_error("reason", f"must be a str, got {shown(reason, 60)}")
        if self._sink is None:
            return []
        self.wait()
        return self._sink.exclude(tokens, reason)

    def online_state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor] | None:
        """The online running average (float32 unless ``dtype``), or ``None`` without online mode,
        on other processes than the main one, or for a sharded average (no process holds it all)."""
        if not isinstance(self._sink, OnlineAverageSink):
            return None
        self._commit(checkpoint_follows=False)
        return self._sink.state_dict(parse_dtype(dtype))

    def save_online_average(self, model: Any) -> Path | None:
        """Every process: write the online average now to ``<pma_dir>/online-<kind>`` (a sharded
        folder under FSDP / ZeRO-3, every rank its file), as :meth:`end` does; returns the folder on
        the main process (``None`` elsewhere, without online mode, or before the first snapshot)."""
        if not isinstance(self._sink, OnlineAverageSink):
            return None
        self._commit(checkpoint_follows=False)
        folder = self._sink.write_average(model)
        return folder if self._is_main else None

    def swap_in_online(self, model: Any) -> Any | None:
        """Every process: put the online average into the live ``model`` (each rank its own
        slices under FSDP / ZeRO-3); returns the function that puts the live weights back (every
        process calls it), or ``None`` without online mode or before the first snapshot."""
        if not isinstance(self._sink, OnlineAverageSink):
            return None
        self._commit(checkpoint_follows=False)
        return self._sink.swap_in(model)

    def watch_losses(self, model: torch.nn.Module) -> None:
        """Record the losses of ``model``'s training forwards from now on (:meth:`begin` starts it
        too: call this first when the first step's forwards come before :meth:`begin`)."""
        self._losses.attach(model)

    # ------------------------------------------------------------------ the loop's calls

    def begin(
        self,
        model: Any,
        *,
        output_dir: str | os.PathLike[str] | None = None,
        world_size: int = 1,
        is_main: bool = True,
        token_count: str | None = "all",
        optimizer: Any | None = None,
        lr_scheduler: Any | None = None,
        planned_steps: int | None = None,
        step: int = 0,
        tokens: int = 0,
        resume_dir: str | os.PathLike[str] | None = None,
        saved_state: dict[str, Any] | None = None,
        peak_lr: float | None = None,
        warmup_steps: int = 0,
        scheduler_name: str | None = None,
        processing_class: Any | None = None,
        average_tokens_across_devices: bool = True,
    ) -> None:
        """Every process, once per run before its first optimizer step: claim the snapshot folder,
        plan the run, check the disk budget, open the sink (resuming its folder when ``step > 0``).

        Args:
            model: the model being trained (as the loop calls it: a wrapper is fine).
            output_dir: the training's output folder; snapshots go to ``<output_dir>/pma`` unless
                ``pma_dir`` was given.
            world_size: the number of processes.
            is_main: whether this is the main process (the one that writes the manifest).
            token_count: how tokens are counted (``"all"`` or ``"non_padding"``), for the manifest.
            optimizer: read for the peak LR (its ``initial_lr``).
            lr_scheduler: probed for the phase of every planned step, and read for the LR of a
                step that :meth:`optimizer_step` did not report.
            planned_steps: the planned optimizer steps of the whole run; ``None``: unknown (an
                interval must be given; the disk projection counts no step ahead, and nothing is
                said about the schedule's phases).
            step: optimizer steps already done (``> 0``: a resumed run).
            tokens: global tokens already seen (a resumed run's count).
            resume_dir: the checkpoint folder a resumed run starts from (an online average is
                restored from it; default ``output_dir``).
            saved_state: ``schedule.state()`` of the run being resumed (its phase and automatic
                interval), when known.
            peak_lr: the peak LR when neither the optimizer's ``initial_lr`` nor the scheduler's
                ``base_lrs`` say it (the Trainer's ``learning_rate``).
            warmup_steps: the planned warmup steps (used when the schedule cannot be probed).
            scheduler_name: the schedule's name, for the warning of a schedule without a constant phase.
            processing_class: the tokenizer or processor saved beside each snapshot's weights.
            average_tokens_across_devices: the Trainer's option of that name (how a loss normalised
                by a global token count adds up over processes).
        """
        _check_begin_arguments(locals())
        started = time.perf_counter()
        output = Path(output_dir) if output_dir is not None else None
        if self.requested_pma_dir is None and output is None:
            raise ValueError(
                "SnapshotTaker.begin() needs output_dir (snapshots go to <output_dir>/pma) or a pma_dir"
            )
        self._ended = False
        self._is_main = is_main
        self._world_size = world_size
        self._pma_dir = Path(self.requested_pma_dir or output / PMA_SUBDIR).absolute()
        self._options = {
            "token_count": token_count,
            "average_tokens_across_devices": bool(average_tokens_across_devices),
            "scheduler_name": scheduler_name,
        }
        run_on_main_process(self._claim_folder)  # before anything is written; refused on every rank
        try:
            self._begin(
                model,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                planned_steps=planned_steps,
                step=int(step),
                tokens=int(tokens),
                resume_dir=Path(resume_dir) if resume_dir is not None else output,
                saved_state=saved_state,
                fallback_lr=peak_lr,
                warmup_steps=int(warmup_steps),
                processing_class=processing_class,
            )
            self._finish_begin(model, planned_steps is not None, resumed=step > 0)
        except BaseException:
            self._release_folder()
            raise
        now = time.perf_counter()
        self._begin_s = now - started
        self._meter = OverheadMeter(now)

    def optimizer_step(self, lr: float | torch.Tensor | None) -> None:
        """An optimizer step ran with learning rate ``lr`` (before the scheduler moves it on).

        A one-element tensor (an optimizer that keeps its LR on the device) is copied, not read:
        its value is read at the next step that may snapshot, with those of the steps before it
        in one transfer, so that steps between snapshots never wait for the device.
        """
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise parameter_error("lr", f"must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
            lr = lr.detach().clone()  # the scheduler overwrites the optimizer's tensor in place
        elif lr is not None and not (is_number(lr, finite=True) and lr >= 0):
            raise parameter_error("lr", f"must be a finite number >= 0 or None, got {shown(lr, 60)}")
        self._step_lr = lr

    def step_end(
        self,
        model: Any,
        *,
        step: int,
        tokens: int,
        epoch: float | None = None,
        log_follows: bool = False,
        checkpoint_follows: bool = False,
    ) -> None:
        """Every process, after every optimizer step: take a snapshot when one is due.

        Args:
            model: the model being trained.
            step: optimizer steps done so far (this one included).
            tokens: global input tokens seen so far, over all processes (this step's included).
            epoch: the epoch (fractional), for the record.
            log_follows: the step's loss is logged next (:meth:`logged`): the snapshot taken now
                is handed to the writer then, with that loss in its record.
            checkpoint_follows: a checkpoint is written next: the snapshot lands first.
        """
        self._require_begun("step_end")
        check_int(step, "step", self._step + 1)  # one optimizer step further at least
        check_int(tokens, "tokens", self._tokens)  # a global count only grows
        if epoch is not None and not is_number(epoch, finite=True):
            raise parameter_error("epoch", f"must be a number or None, got {shown(epoch, 60)}")
        self._meter.step_end(time.perf_counter())
        self._sink.raise_if_failed()
        self._losses.end_step()
        self._step, self._tokens = int(step), int(tokens)
        lr, self._step_lr = self._step_lr, None
        if lr is None and self._lr_scheduler is not None:
            lr = self._lr_scheduler.get_last_lr()[0]
            lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)
        if lr is None:
            raise ValueError(
                f"hf-pma: no learning rate is known for optimizer step {step} (no optimizer reported it, and no "
                "lr_scheduler was given to read it from)"
            )
        tick = self._advance(lr, checkpoint_follows)
        if tick.step_tokens == 0 and tick.previous_tokens == self.schedule.tokens_at_begin:
            raise ValueError(
                f"hf-pma: no input tokens were counted in optimizer step {step}: snapshots need every step's "
                "global token count (with the Trainer: its include_num_input_tokens_seen, and batches that carry "
                "the model's main input, e.g. 'input_ids')"
            )
        if self.interval_tokens is None:
            self._choose_interval(tick.step_tokens)
        # The first step of this run (every process): the snapshot count is known now.
        if not self._disk_checked:
            self._disk_checked = True
            error, plan = self._check_disk_plan(model, tick.step_tokens) if self._is_main else (None, None)
            self._raise_together(error)
            if self._is_main:
                where = planning.destination(self._pma_dir, self.online if self._is_online() else None)
                notice(
                    logger,
                    planning.announce_message(
                        self.interval_tokens,
                        tick.step_tokens,
                        bool(self.interval_choice),
                        self.phases,
                        where,
                        plan,
                    ),
                )
                spacing = planning.uneven_spacing_message(
                    self.interval_tokens, tick.step_tokens, bool(self.interval_choice)
                )
                if spacing is not None:
                    notice(logger, spacing)
            self._first_step_tokens = tick.step_tokens
        elif self._first_step_tokens is not None and tick.step_tokens != self._first_step_tokens:
            self._say_steps_vary(tick.step_tokens)
        self._warn_small_interval(tick.step_tokens)
        boundary = self.schedule.due(tick)
        if boundary is not None and self._waits_for_baseline():
            boundary = None
        if boundary is not None:
            self._take(model, tick, boundary, epoch, log_follows, checkpoint_follows)
            self._review_cost(tick.step_tokens)
        if checkpoint_follows and self._pending is None:
            self._checkpoint_follows()

    def logged(self, step: int, loss: float | None = None, checkpoint_follows: bool = False) -> None:
        """The loop logged at optimizer step ``step`` (its training ``loss``, if any): the record of
        a snapshot taken at that step gets that loss when the model gave none, and goes to the writer."""
        check_int(step, "step", 0)
        if loss is not None and not is_number(loss):
            raise parameter_error("loss", f"must be a number or None, got {shown(loss, 60)}")
        if loss is not None:
            self._last_loss = (int(step), float(loss))
        if self._pending is not None and self._pending.step == step:
            self._commit(checkpoint_follows)

    def commit(self, checkpoint_follows: bool = False) -> None:
        """The snapshot taken last is final: hand it to the writer (a step begins, an epoch ends);
        with ``checkpoint_follows`` wait for it to land. Raises a failed background write."""
        self._require_begun("commit")
        self._commit(checkpoint_follows)
        if checkpoint_follows:
            self._checkpoint_follows()
        else:
            self._sink.raise_if_failed()

    def before_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Every process, before the loop writes a checkpoint into ``folder``: the snapshot in flight
        lands first, and an online average is saved into ``folder`` (it is resumed from there)."""
        self.commit(checkpoint_follows=True)
        self._sink.save_checkpoint(Path(folder))

    def end(self, model: Any | None = None) -> None:
        """Every process, once after training: the last write lands, the online average is saved,
        the cost and the snapshots are reported, the folder is released. Before :meth:`begin`, only
        stops recording losses."""
        if self._sink is None or self._ended:
            self._losses.detach()
            return
        self._ended = True
        try:
            self._losses.detach()
            self._commit(checkpoint_follows=False)
            self._check_folder()  # the online average and the last manifest entry: not into a new folder
            self._sink.close(model)
            # Snapshots set aside by a resume and passed since are dropped.
            self._sink.reached(self._tokens)
            if self.interval_tokens is not None and self.schedule.tokens > self.schedule.tokens_at_begin:
                steps = max(1, self._step - self._plan_step0)
                self._report_cost(max(1, (self.schedule.tokens - self.schedule.tokens_at_begin) // steps), at_end=True)
            if self._is_main and isinstance(self._sink, DiskSnapshotSink):
                listed = self._sink.snapshots()
                if listed:
                    total = sum(r.num_bytes or 0 for r, _ in listed)
                    notice(logger, planning.end_message(len(listed), total, self._pma_dir))
        finally:
            self._release_folder()

    # ------------------------------------------------------------------ internals

    def _require_begun(self, call: str) -> None:
        if self._sink is None:
            raise RuntimeError(f"SnapshotTaker.{call}() before begin()")
        if self._ended:  # the folder is released: another run may hold it now
            raise ValueError(f"SnapshotTaker.{call}() after end() (begin() a new run first)")

    def _begin(
        self,
        model: Any,
        *,
        optimizer: Any,
        lr_scheduler: Any,
        planned_steps: int | None,
        step: int,
        tokens: int,
        resume_dir: Path | None,
        saved_state: dict[str, Any] | None,
        fallback_lr: float | None,
        warmup_steps: int,
        processing_class: Any,
    ) -> None:
        """Begin, once this run holds its snapshot folder: the schedule, the plan, the sink."""
        self._pending = None
        resumed = step > 0
        self._lr_scheduler = lr_scheduler
        self._step, self._tokens = step, tokens
        self.schedule.begin(
            peak_lr(optimizer, lr_scheduler, fallback_lr), tokens, saved_state if resumed else None
        )
        # Without planned steps the plan ends here: the disk projection counts no step ahead.
        max_steps = int(planned_steps) if planned_steps is not None else step
        self._plan_step0 = step
        probe = planned_lrs(lr_scheduler, max_steps, self._world_size)
        self._plan = plan_run(
            max_steps,
            self.phases,
            probe[0] if probe else None,
            self.schedule.tracker.peak_lr,
            stride=probe[1] if probe else 1,
            warmup_steps=warmup_steps,
        )
        self._sink = self._make_sink(processing_class, model)
        self._disk = DiskBudget(self._pma_dir, self.max_disk_bytes)
        self._cost_reported = self._cost_reviewed = False
        self._lr_backlog = []
        self._disk_checked = False
        self._first_step_tokens = None
        self._taken = []
        self._last_snapshot_step = step
        self._last_loss = None
        online = (saved_state or {}).get("online") if resumed else None
        self._resume = ResumePoint(tokens, step, resume_dir or self._pma_dir.parent, online) if resumed else None
        if model is not None:
            self._losses.attach(model)

    def _finish_begin(self, model: Any, known_steps: bool, resumed: bool) -> None:
        error = None
        if self._is_main:
            warning = planning.no_constant_phase_warning(
                self._plan, self.phases, self._options["scheduler_name"]
            )
            # Without planned steps nothing is known of the schedule.
            if known_steps and warning is not None:
                logger.warning(warning)
            if not resumed:  # before anything is written; a resumed run is checked at its first step
                error, _ = self._check_disk_plan(model, None)
        self._raise_together(error)
        recorded = self._sink.open(self._resume)
        if recorded.get("interval_tokens"):
            adopted = self.schedule.adopt_interval(
                int(recorded["interval_tokens"]), recorded.get("interval_choice")
            )
            if not adopted and self.schedule.interval_tokens != recorded["interval_tokens"]:
                logger.warning(
                    f"hf-pma: interval_tokens={self.schedule.interval_tokens:,} differs from the "
                    f"{recorded['interval_tokens']:,} of the resumed run's manifest"
                )
        self._sink.update_manifest(**self._manifest_fields())
        # Multi-node: every rank reads what rank 0 writes.
        check_folder_shared(self._pma_dir, "snapshot folder")
        self._sink.warm_up(model)
        self._sync_from_main()

    def _is_online(self) -> bool:
        return isinstance(self._sink, OnlineAverageSink)

    def _claim_folder(self) -> None:
        """Main process (the one that writes the manifest): hold the snapshot folder's claim from
        :meth:`begin` to :meth:`end` (:class:`hf_pma.utils.fs.FolderClaim`), so that a second training
        in the same folder, on this host or another one sharing the filesystem, stops at its start
        with one line naming this one's host and pid instead of interleaving the manifest. Refused
        at once, not waited for: the holder trains for hours. The kernel releases it when this
        process dies; a run that raised keeps it until this taker is collected or begins again
        (the claim is re-entrant within one process)."""
        if self._run_claim is not None and self._run_claim.folder != self._pma_dir:
            self._release_folder()
        if self._pma_dir.is_symlink():  # snapshots, manifest and deletions would land wherever it points
            raise ValueError(
                f"snapshot folder {escape(self._pma_dir)} is a symbolic link; hf-pma writes snapshots only into a "
                "real folder inside output_dir (remove the link, or set output_dir to where it points)"
            )
        if self._run_claim is None:
            # Pinned: a folder moved away while training is noticed (its identity, not its name).
            self._run_claim = FolderClaim(
                self._pma_dir, what="snapshot folder", busy="is in use by another training", pin=True
            )
        # The claim file lies beside the folder (a file there: the sink says so).
        with contextlib.suppress(OSError):
            self._pma_dir.parent.mkdir(parents=True, exist_ok=True)
        self._run_claim.acquire(wait=0)

    def _release_folder(self) -> None:
        if self._run_claim is not None:
            self._run_claim.release()

    def _check_folder(self) -> None:
        """Every process: stop together when the snapshot folder is no longer the one claimed at
        :meth:`begin` (moved or removed while training), before anything more is written to its
        path: a run that wrote on would start a new manifest there, and the moved one stop short."""
        error = None
        if self._is_main and self._run_claim is not None:
            try:
                self._run_claim.check()
            except FolderMovedError as err:
                error = str(err)
        self._raise_together(error, FolderMovedError)

    def _make_sink(self, processing_class: Any | None, model: Any | None = None) -> SnapshotSink:
        """The sink these options ask for: an online average, per-rank shards, or full folders."""
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
            raise ValueError(
                "sharded=True stores full weights; a PEFT model's snapshots are its adapter: use sharded=False"
            )
        sharded = self.sharded is True or (
            self.sharded == "auto" and not adapter and model is not None and sharding_kind(model)
        )
        if self.online is not None:
            online = ShardedOnlineAverageSink if sharded else OnlineAverageSink
            return online(
                self._pma_dir,
                online=self.online,
                alpha=self.online_alpha,
                half_life_tokens=self.online_half_life_tokens,
                half_life_fraction=self.online_half_life_fraction,
                window_tokens=self.online_window_tokens,
                online_device=self.online_device,
                **common,
            )
        if sharded:
            return ShardedSnapshotSink(self._pma_dir, keep_last=self.keep_last, **common)
        return DiskSnapshotSink(self._pma_dir, keep_last=self.keep_last, **common)

    def _manifest_fields(self) -> dict[str, Any]:
        return {
            "hf_pma_version": __version__,
            "interval_tokens": self.schedule.interval_tokens,
            "interval_choice": self.schedule.interval_choice,
            "phases": list(self.phases),
            "token_count": self._options["token_count"],
            "save_dtype": _dtype_name(self.save_dtype),
            "keep_last": self.keep_last,
            "online": self.online,
        }

    def _distributed(self) -> bool:
        return (
            self._world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        )

    def _sync_from_main(self) -> None:
        """Every process uses the main process's interval and phase state (it read the manifest)."""
        if not self._distributed():
            return
        payload = [self.schedule.state()]
        torch.distributed.broadcast_object_list(payload, src=0)
        self.schedule.load_state(payload[0])

    def _raise_together(self, error: str | None, kind: type[Exception] = SnapshotBudgetError) -> None:
        """Raise the main process's error (a budget's by default) on every process (so none waits in a collective)."""
        if self._distributed():
            payload = [error]
            torch.distributed.broadcast_object_list(payload, src=0)
            error = payload[0]
        if error is not None:
            raise kind(error)

    def _choose_interval(self, tokens_per_step: int) -> None:
        """The automatic V, from the first step's tokens and the planned run (same on every rank)."""
        choice = self.schedule.choose_automatically(tokens_per_step, self._plan)
        if self._is_main:
            logger.info(planning.interval_choice_message(choice, tokens_per_step, self.phases))
        self._sink.update_manifest(**self._manifest_fields())

    def _check_disk_plan(self, model: Any, tokens_per_step: int | None) -> tuple[str | None, str | None]:
        """Main process: the disk budget for the rest of the run: the error message (or ``None``)
        and the plan in words (``None`` when over budget or unknown).

        Checked at :meth:`begin` when the count is known then (automatic interval, ``keep_last``,
        online average), and at the end of the first optimizer step with its real token count,
        in both cases before the first snapshot is written.
        """
        count, what = planning.planned_snapshots(
            self._plan,
            self.interval_tokens,
            tokens_per_step,
            max(0, self._step - 1),
            tokens=self._tokens - tokens_per_step if tokens_per_step is not None else None,
            first_step=self._first_snapshot_step(),
        )
        listed = self._sink.snapshots() if self._step > 0 else []
        folders = self._sink.kept_on_disk(len(listed) + count if count is not None else None)
        if folders is None:
            return None, None
        used = sum(r.num_bytes or 0 for r, _ in listed)
        return planning.check_disk_plan(
            self._disk, self._sink.snapshot_bytes(model), folders, len(listed), used, count, what
        )

    def _recheck_disk(self, model: Any, tick: StepTick) -> None:
        """Main process, before a snapshot is written: does it fit, do the rest still fit?"""
        size = self._sink.last_written_bytes() or self._sink.snapshot_bytes(model)
        listed = self._sink.snapshots()
        count, _ = planning.planned_snapshots(
            self._plan, self.interval_tokens, tick.step_tokens, self._step, tokens=self._tokens
        )
        count = count or 0
        extra = planning.extra_folders(self._sink.kept_on_disk(len(listed) + 1 + count), len(listed))
        self._disk.check_next(size, extra, count, sum(r.num_bytes or 0 for r, _ in listed))

    def schedule_state(self) -> dict[str, Any]:
        """:meth:`SnapshotSchedule.state` with every step's LR read (what a checkpoint stores)."""
        if self._lr_backlog:
            self.schedule.catch_up(self._read_lr_backlog())
        state = self.schedule.state()
        if self._sink is not None and self._is_online() and not self._ended:
            # What a checkpoint's average must hold: a resume that finds fewer refuses.
            self._sink.settle()
            average = self._sink.average
            state["online"] = {"step": self._step, "count": average.count, "options": average.options}
        return state

    def _advance(self, lr: float | torch.Tensor, checkpoint_follows: bool) -> StepTick:
        """The schedule moves on by this step; an LR tensor is read only when this step may
        snapshot (it crosses a multiple of V, or V is not chosen yet) or a checkpoint follows,
        together with those of the steps before it (one transfer)."""
        if isinstance(lr, torch.Tensor):
            self._lr_backlog.append(lr)
            interval = self.interval_tokens
            if not (
                interval is None
                or checkpoint_follows
                or crossed_boundary(self.schedule.tokens, self._tokens, interval) is not None
            ):
                return self.schedule.advance(self._tokens, None)
            lr = None
        earlier = self._read_lr_backlog()
        if lr is None:
            lr = earlier.pop()
        return self.schedule.advance(self._tokens, lr, earlier)

    def _read_lr_backlog(self) -> list[float]:
        """The LR tensors held back, read in one transfer (oldest first), checked, then dropped."""
        if not self._lr_backlog:
            return []
        values = torch.stack([t.reshape(()).float() for t in self._lr_backlog]).tolist()
        self._lr_backlog = []
        for value in values:
            if not (math.isfinite(value) and value >= 0):
                raise parameter_error("lr", f"must be a finite number >= 0, got {value!r} from the optimizer")
        return values

    def _waits_for_baseline(self) -> bool:
        """Under a cost budget with the automatic interval, this run takes no snapshot in its first
        :data:`~hf_pma.snapshots.overhead.BASELINE_STEPS` steps: the start-up step and a few clean
        ones give the step time without snapshots that later steps are compared with. The steps
        are the run's first ones (counted from step 0), not a resumed process's: a run resumed
        from a state takes the snapshots the uninterrupted run takes (counted from the resume,
        a run resumed at step 8 skipped the snapshot of step 11)."""
        return self._budgeted() and not self._taken and self._step < BASELINE_STEPS

    def _first_snapshot_step(self) -> int:
        """The first optimizer step that may snapshot (:meth:`_waits_for_baseline`)."""
        return BASELINE_STEPS if self._budgeted() and not self._taken else 0

    def _budgeted(self) -> bool:
        """Whether the automatic interval is still to be reviewed against ``max_overhead`` (widened
        when needed); once reviewed (recorded in ``interval_choice``), a resumed run keeps it."""
        choice = self.interval_choice
        return (
            self.max_overhead is not None
            and self.requested_interval_tokens is None
            and choice is not None
            and not choice.get("cost_reviewed")
        )

    def _review_cost(self, tokens_per_step: int) -> None:
        """Every process, after each snapshot until done: once :data:`COST_REVIEW_SNAPSHOTS`
        snapshots of this run show what one costs (main process: :class:`OverheadMeter`), say it,
        and with the automatic interval under a budget widen V when they cost more (every process
        takes the main process's decision)."""
        if self._cost_reviewed or len(self._taken) < COST_REVIEW_SNAPSHOTS:
            return
        decision: tuple[int | None, dict[str, Any] | None] | None = None
        if self._is_main:
            decision = self._cost_decision(tokens_per_step)
        if self._distributed():
            payload = [decision]
            torch.distributed.broadcast_object_list(payload, src=0)
            decision = payload[0]
        if decision is None:  # too few clean steps yet: the next snapshot tries again
            return
        self._cost_reviewed = True
        interval, why = decision
        if interval is not None and interval != self.interval_tokens:
            self.schedule.widen(interval, why)
        if self._budgeted():
            self.schedule.interval_choice = {
                **self.schedule.interval_choice, "cost_reviewed": True, "cost": self._cost_measured
            }  # fmt: skip
            if self._is_main:
                self._sink.update_manifest(**self._manifest_fields())

    def _cost_decision(self, tokens_per_step: int) -> tuple[int | None, dict[str, Any] | None] | None:
        """Main process: the measured cost said (once), and the interval to use from now on."""
        estimate = self._meter.estimate(self._sink.worker.spans)
        if estimate is None:
            return None
        steps_now = self.interval_tokens / tokens_per_step
        interval, why = self.interval_tokens, None
        if self._budgeted() and planning.should_widen(estimate, steps_now, self.max_overhead):
            widened = planning.widened_interval(
                estimate, self.max_overhead, self.interval_tokens, tokens_per_step, self._plan
            )
            if widened.interval_tokens > self.interval_tokens:
                interval = widened.interval_tokens
                why = widened.to_record()
                later, _ = planning.planned_snapshots(
                    self._plan, interval, tokens_per_step, self._step, tokens=self._tokens
                )
                total = len(self._taken) + (later or 0)
                # One cost line: the widened one says what they cost and what was done about it.
                self._cost_reported = True
                message = planning.widened_message(widened, estimate, self.max_overhead, total)
                if widened.budget_met:
                    notice(logger, message)
                else:  # still over max_overhead: a warning, as the cost line over it is
                    logger.warning(message)
        if why is None:
            self._say_cost(estimate, interval, tokens_per_step)
        self._cost_measured = planning.cost_record(estimate, steps_now, self.max_overhead, widened=why is not None)
        return interval, why

    def _say_cost(self, estimate: Any, interval_tokens: int, tokens_per_step: int) -> None:
        """Main process: the cost line (:func:`planning.cost_message`), a warning over the budget."""
        self._cost_reported = True
        steps_between = interval_tokens / tokens_per_step
        run_steps = max(1, (self._plan.planned_steps if self._plan else self._step) - self._plan_step0)
        remaining, _ = planning.planned_snapshots(
            self._plan, interval_tokens, tokens_per_step, self._step, tokens=self._tokens
        )
        total = len(self._taken) + (remaining or 0)
        costs = self.snapshot_costs
        writes = [c.write_s for c in costs if c.write_s]
        message, over = planning.cost_message(
            estimate,
            steps_between=steps_between,
            tokens_per_step=tokens_per_step,
            run_steps=run_steps,
            snapshots=total,
            setup_s=self._begin_s,
            blocked_s=[c.blocked_s for c in costs],
            write_s=writes[-1] if writes else 0.0,
            num_bytes=self._sink.last_written_bytes(),
            budget=self.max_overhead,
            automatic=self.interval_choice is not None,
        )
        if over:
            logger.warning(message)
        else:
            notice(logger, message)

    def _report_cost(self, tokens_per_step: int, at_end: bool = False) -> None:
        """At the end of a run whose cost was not said yet (fewer snapshots than a review needs):
        what was measured, or the blocked and write seconds of its snapshots."""
        if self._cost_reported or not self._taken or not self._is_main:
            return
        estimate = self._meter.estimate(self._sink.worker.spans)
        if estimate is not None:
            self._say_cost(estimate, self.interval_tokens, tokens_per_step)
            return
        self._cost_reported = True
        costs = self.snapshot_costs
        notice(logger, planning.unmeasured_cost_message(costs, self._sink.last_written_bytes(), self.async_write))

    def _say_steps_vary(self, step_tokens: int) -> None:
        """Once, when an optimizer step's tokens differ from the first step's: V counts tokens, so
        its snapshots are no longer the same number of steps apart."""
        first = self._first_step_tokens
        if self.interval_tokens <= min(first, step_tokens):
            return  # one snapshot every step either way
        self._first_step_tokens = None
        if self._is_main:
            notice(
                logger,
                planning.varying_steps_message(
                    self.interval_tokens, first, step_tokens, self._step, bool(self.interval_choice)
                ),
            )

    def _warn_small_interval(self, step_tokens: int) -> None:
        if self._warned_small_interval or not self._is_main or step_tokens <= self.interval_tokens:
            return
        warning = planning.small_interval_warning(self.interval_tokens, step_tokens)
        if warning is not None:
            self._warned_small_interval = True
            logger.warning(warning)

    def _take(
        self,
        model: Any,
        tick: StepTick,
        boundary: int,
        epoch: float | None,
        log_follows: bool,
        checkpoint_follows: bool,
    ) -> None:
        """Every rank: the sink copies the weights now; the record is committed once its loss is known."""
        self._commit(checkpoint_follows=False)  # at most one snapshot taken and not committed
        self._check_folder()  # never a snapshot into a folder recreated at a moved one's path
        record = SnapshotRecord(
            path=snapshot_dirname(tick.tokens),
            tokens=tick.tokens,
            step=self._step,
            lr=tick.lr,
            phase=tick.phase,
            extra={"interval_tokens": self.interval_tokens, "boundary": boundary, "epoch": epoch},
        )
        # The mean training loss over the steps since the previous snapshot, and this step's.
        window = self._losses.take_window(self._options["average_tokens_across_devices"])
        record.extra["loss_since_step"] = self._last_snapshot_step
        if window is not None:
            record.loss = window.mean
            record.extra.update(loss_steps=window.steps, step_loss=window.last, loss_source="model")
        self._last_snapshot_step = record.step
        start = time.perf_counter()
        self._sink.take(model, record)
        blocked = time.perf_counter() - start
        self._meter.snapshot_taken()
        self._taken.append(_Taken(record, blocked))
        if self._is_main:
            self._recheck_disk(model, tick)
        self._pending = record
        # The step's loss is logged right after: commit then.
        if not log_follows:
            self._commit(checkpoint_follows)

    def _commit(self, checkpoint_follows: bool) -> None:
        if self._pending is None:
            return
        record, self._pending = self._pending, None
        since = record.extra["loss_since_step"]
        if record.loss is None and self._last_loss is not None and since < self._last_loss[0] <= record.step:
            # The model returned no loss (the loop computed it): the last logged loss, when it was
            # logged since the previous snapshot. It averages the logging window.
            record.loss = self._last_loss[1]
            record.extra.update(loss_source="logs", loss_logged_at_step=self._last_loss[0])
        submitted = self._sink.worker.submitted
        self._sink.commit()
        taken = self._taken[-1]
        taken.committed = True
        if self._sink.worker.submitted > submitted:
            taken.task = submitted
        if checkpoint_follows:
            self._checkpoint_follows()

    def _checkpoint_follows(self) -> None:
        """A checkpoint of this step follows and nothing changes before it: the write in flight
        lands, then what the sink resumes from (an online average) is staged, before the
        checkpoint exists, so that no kill leaves the checkpoint without it."""
        self._sink.before_checkpoint()
        self._sink.stage_checkpoint(self._step, self._tokens)


def _check_begin_arguments(given: dict[str, Any]) -> None:
    """:meth:`SnapshotTaker.begin`'s arguments, each checked before the folder is claimed: one
    ``ValueError`` line naming the first bad one."""
    for name in ("output_dir", "resume_dir"):
        if given[name] is not None and not isinstance(given[name], (str, os.PathLike)):
            raise parameter_error(name, f"must be a folder path or None, got {shown(given[name], 60)}")
    check_int(given["world_size"], "world_size")
    check_int(given["planned_steps"], "planned_steps", allow_none=True)
    for name in ("step", "tokens", "warmup_steps"):
        check_int(given[name], name, 0)
    for name in ("is_main", "average_tokens_across_devices"):
        if not isinstance(given[name], bool):
            raise parameter_error(name, f"must be True or False, got {shown(given[name], 60)}")
    if given["token_count"] is not None and given["token_count"] not in TOKEN_COUNTS:
        raise parameter_error(
            "token_count", f"must be one of {TOKEN_COUNTS} or None, got {shown(given['token_count'], 60)}"
        )
    peak = given["peak_lr"]  # a fallback only: 0 when read from a warmup's first LR
    if peak is not None and not (is_number(peak, finite=True) and peak >= 0):
        raise parameter_error("peak_lr", f"must be a finite number >= 0 or None, got {shown(peak, 60)}")
    if given["saved_state"] is not None and not isinstance(given["saved_state"], dict):
        raise parameter_error("saved_state", f"must be a dict or None, got {shown(given['saved_state'], 60)}")
    if given["scheduler_name"] is not None and not isinstance(given["scheduler_name"], str):
        raise parameter_error(
            "scheduler_name", f"must be a str or None, got {shown(given['scheduler_name'], 60)}"
        )


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None
