"""``PMASnapshots``: PMA snapshots in a training loop of your own (no ``Trainer``), e.g. on ``accelerate``.

Three lines in a loop such as transformers' ``run_clm_no_trainer.py``::

    pma = PMASnapshots(model, accelerator, optimizer=optimizer, lr_scheduler=lr_scheduler,
                       max_steps=args.max_train_steps, output_dir=args.output_dir)
    accelerator.register_for_checkpointing(pma)   # resume through save_state / load_state
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        pma.step(batch=batch)                     # after every micro-batch: counts its tokens
    pma.end()

The snapshots, the manifest, the folder claim, the off-thread writes, the sharded and online
sinks and the disk and cost budgets are those of :class:`hf_pma.snapshots.callback.PMACallback`:
both front doors drive the same engine, :class:`hf_pma.snapshots.taker.SnapshotTaker` (no
``Trainer`` object is involved here), so every ``hf-pma`` command reads the folder it writes.
A loss spike is caught and undone with :meth:`PMASnapshots.check_for_spike` and a
:class:`hf_pma.training.recovery.SpikeRecovery`; a run starts from merged weights with
:func:`hf_pma.training.recovery.pma_init`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.manifest import MAX_RECORD_INT, SnapshotRecord
from hf_pma.core.schedule import check_schedule_state, positive_int_or_none
from hf_pma.core.window_choice import check_window_count, is_auto
from hf_pma.snapshots.lr_probe import first_group_value, step_lr
from hf_pma.snapshots.taker import TOKEN_COUNTS, SnapshotTaker, TakenSnapshot
from hf_pma.training.recovery import SpikeRecovery
from hf_pma.utils.distributed import unwrap_model
from hf_pma.utils.logs import notice
from hf_pma.utils.parsing import check_int, is_int, is_number, parameter_error
from hf_pma.utils.text import escape, shown

logger = logging.get_logger(__name__)

__all__ = ["PMASnapshots"]

STATE_VERSION = 1

# Options a resumed run must share with the run it resumes (and token_count): with another one
# the folder would mix two kinds of snapshots, or the online average two rules.
_RESUMED_OPTIONS = (
    "online",
    "online_alpha",
    "online_half_life_tokens",
    "online_half_life_fraction",
    "online_window_tokens",
)


def _check_module(model: Any, name: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise parameter_error(name, f"must be a torch.nn.Module, got {shown(model, 60)}")


class PMASnapshots:
    """Snapshots every V tokens (or an online average) from a training loop without a ``Trainer``.

    Args:
        model: the model the loop trains (as returned by ``accelerator.prepare``); its training
            forwards' losses are recorded in the snapshots' records.
        accelerator: the ``accelerate.Accelerator`` of the loop, if any: tokens are summed over
            its processes, gradient accumulation is followed (``sync_gradients``), the main
            process writes the manifest, and ``save_state`` / ``load_state`` carry this object's
            state once it is registered with ``register_for_checkpointing``.
        optimizer: the optimizer; the LR of each optimizer step is read from it (a hook after its
            ``step``), and the peak LR from its first param group.
        lr_scheduler: the LR scheduler, probed for the phase of every planned step (with
            ``max_steps``).
        max_steps: the planned number of optimizer steps. Needed for the automatic interval
            (``interval_tokens=None``) and for the disk budget's projection; without it give
            ``interval_tokens``.
        output_dir: the training's output folder; snapshots go to ``<output_dir>/pma`` unless
            ``pma_dir`` is given. One of the two is required.
        pma_dir: the snapshot folder itself (as ``PMACallback``'s ``output_dir``).
        token_count: ``"all"`` (every ``input_ids`` position, as the Trainer's default count) or
            ``"non_padding"`` (the ``attention_mask``'s ones) when :meth:`step` counts a batch.
        **options: the options of :class:`hf_pma.snapshots.callback.PMACallback`
            (``interval_tokens``, ``phases``, ``keep_last``, ``save_dtype``, ``max_shard_size``,
            ``async_write``, ``online``, ``online_alpha``, ``online_half_life_tokens``,
            ``online_half_life_fraction``,
            ``online_window_tokens``, ``max_disk_bytes``, ``sharded``, ``online_device``,
            ``max_overhead``).

    Nothing is written before the first :meth:`step`; :meth:`load_state_dict` (called by
    ``accelerator.load_state``) must come before it. :attr:`taker` is the snapshot engine
    (:class:`hf_pma.snapshots.taker.SnapshotTaker`) this object drives.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        accelerator: Any | None = None,
        *,
        optimizer: Any | None = None,
        lr_scheduler: Any | None = None,
        max_steps: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        pma_dir: str | os.PathLike[str] | None = None,
        token_count: str = "all",
        **options: Any,
    ) -> None:
        if output_dir is None and pma_dir is None:
            raise ValueError("PMASnapshots needs output_dir (snapshots go to <output_dir>/pma) or pma_dir")
        _check_module(model, "model")
        for name, folder in (("output_dir", output_dir), ("pma_dir", pma_dir)):
            if folder is not None and not isinstance(folder, (str, os.PathLike)):
                raise parameter_error(
                    name, f"must be a folder path (str or os.PathLike), got {shown(folder, 60)}"
                )
        if accelerator is not None and not all(
            hasattr(accelerator, name)
            for name in ("sync_gradients", "num_processes", "register_save_state_pre_hook", "reduce")
        ):
            raise parameter_error(
                "accelerator", f"must be an accelerate.Accelerator or None, got {shown(accelerator, 60)}"
            )
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise parameter_error(
                "optimizer", f"must be a torch optimizer or None, got {shown(optimizer, 60)}"
            )
        if token_count not in TOKEN_COUNTS:
            raise ValueError(f"token_count must be one of {TOKEN_COUNTS}, got {token_count!r}")
        self.max_steps = positive_int_or_none(max_steps, "max_steps")
        if self.max_steps is None and options.get("interval_tokens") is None:
            raise ValueError("PMASnapshots needs interval_tokens, or max_steps to choose it automatically")
        self.taker = SnapshotTaker(pma_dir=pma_dir, **options)
        self.taker.accelerator = accelerator
        self.model = model
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.token_count = token_count
        # The peak LR when neither the optimizer's initial_lr nor the scheduler's base_lrs say it.
        self._peak_lr = first_group_value(getattr(optimizer, "param_groups", None), "lr")
        self.output_dir = Path(output_dir) if output_dir is not None else Path(pma_dir).parent
        self._tokens = 0  # global tokens counted so far, resumed ones included
        self._global_step = 0  # optimizer steps counted so far, resumed ones included
        self._saved_schedule: dict[str, Any] | None = None  # of the run being resumed
        self._pending_tokens = 0  # this process's tokens of the micro-batches since the last optimizer step
        self._pending_global = 0  # tokens= given since the last optimizer step (global already)
        self._step_lr: float | None = None
        self._begun = False
        self._ended = False
        self._resume_dir: Path | None = None
        self._warned_no_mask = False
        self.taker.watch_losses(model)  # the first step's forwards come before the first step()
        self._hooks = []
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            self._hooks.append(inner.register_step_post_hook(self._after_optimizer_step))
        if accelerator is not None:
            self._hooks.append(accelerator.register_save_state_pre_hook(self._before_save_state))
            self._hooks.append(accelerator.register_load_state_pre_hook(self._before_load_state))

    # ------------------------------------------------------------------ the loop's calls

    @property
    def tokens(self) -> int:
        """Global input tokens (over all processes) counted so far, resumed ones included."""
        return self._tokens

    @property
    def global_step(self) -> int:
        """Optimizer steps counted so far, resumed ones included."""
        return self._global_step

    @property
    def finished(self) -> bool:
        """Whether the run has reached ``max_steps`` (a resumed run may have reached it before this
        process started: then :meth:`swapped` and :meth:`end` work on its snapshots, with no step)."""
        return self.max_steps is not None and self._global_step >= self.max_steps

    @property
    def pma_dir(self) -> Path | None:
        """The snapshot folder (known from the first :meth:`step`)."""
        return self.taker.pma_dir

    @property
    def callback(self) -> SnapshotTaker:
        """The old name of :attr:`taker` (the engine was a ``PMACallback`` driven through fake events)."""
        return self.taker

    @property
    def interval_tokens(self) -> int | None:
        """V in use: the one given, or the automatic choice once made (``None`` before)."""
        return self.taker.interval_tokens

    @property
    def online_count(self) -> int:
        """How many snapshots the online average holds."""
        return self.taker.online_count

    @property
    def snapshot_costs(self) -> list[TakenSnapshot]:
        """What each snapshot of this run cost on this process, oldest first (as
        :attr:`hf_pma.snapshots.callback.PMACallback.snapshot_costs`)."""
        return self.taker.snapshot_costs

    def online_state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor] | None:
        """The online running average on the main process (``None`` without ``online=``, elsewhere,
        or for a sharded average)."""
        return self.taker.online_state_dict(dtype)

    def step(
        self,
        model: torch.nn.Module | None = None,
        *,
        batch: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
        tokens: int | None = None,
        lr: float | None = None,
        loss: float | None = None,
    ) -> None:
        """Call after every optimizer step, or with an ``accelerator`` after every micro-batch
        (those that do not end an optimizer step, ``sync_gradients`` false, only add their tokens).

        Args:
            model: the model (default: the one given at construction).
            batch: the micro-batch (or a list of them) whose tokens to count on this process; the
                count is summed over processes at each optimizer step.
            tokens: instead of ``batch``: the tokens of this call, global over all processes.
            lr: the LR the optimizer step used (default: read from the optimizer at its step).
            loss: the step's training loss, recorded when the model's forwards gave none.
        """
        if self._ended:
            raise ValueError("PMASnapshots.step() after end()")
        if (batch is None) == (tokens is None):
            raise ValueError("PMASnapshots.step() needs exactly one of batch= (counted) or tokens= (global)")
        if tokens is not None:
            check_int(tokens, "tokens", 0, MAX_RECORD_INT)
        if lr is not None and not (is_number(lr, finite=True) and lr >= 0):
            raise parameter_error("lr", f"must be a finite number >= 0 or None, got {shown(lr, 60)}")
        if loss is not None:
            if torch.is_tensor(loss) and loss.numel() == 1 and loss.is_floating_point():
                loss = float(loss.detach())
            if not is_number(loss):
                raise parameter_error("loss", f"must be a number or None, got {shown(loss, 60)}")
        if model is not None:
            _check_module(model, "model")
        model = model if model is not None else self.model
        if batch is not None:
            self._pending_tokens += self._count(batch)
        else:
            self._pending_global += tokens
        if self.accelerator is not None and not self.accelerator.sync_gradients:
            return
        step_tokens = self._pending_global + (self._global(self._pending_tokens) if batch is not None else 0)
        self._pending_tokens = self._pending_global = 0
        if step_tokens <= 0 and (not self._begun or self._tokens == self.taker.schedule.tokens_at_begin):
            raise ValueError(
                f"PMASnapshots.step(): no input tokens in optimizer step {self._global_step + 1} (a batch without "
                "'input_ids', or tokens=0)"
            )
        if self._tokens + step_tokens > MAX_RECORD_INT:
            raise parameter_error(
                "tokens",
                f"would bring the run's count past {MAX_RECORD_INT:,} (the largest count a manifest holds)",
            )
        used_lr = lr if lr is not None else self._step_lr
        if not self._begun and used_lr is None and self.lr_scheduler is None:
            raise ValueError(
                "PMASnapshots.step(): no learning rate is known for the first optimizer step (pass lr=, or give "
                "the optimizer or lr_scheduler at construction)"
            )
        if not self._begun:
            self._begin(model)
        taker = self.taker
        taker.commit()
        taker.optimizer_step(used_lr)
        self._step_lr = None
        self._global_step += 1
        self._tokens += step_tokens
        taker.step_end(model, step=self._global_step, tokens=self._tokens, log_follows=loss is not None)
        if loss is not None:
            taker.logged(self._global_step, float(loss))

    def end(self, model: torch.nn.Module | None = None) -> None:
        """Call once after training: the last write lands, the online average is saved, the
        folder is released. Every process calls it."""
        if self._ended:
            return
        self._ended = True
        for hook in self._hooks:
            hook.remove()
        self.taker.end(model or self.model)

    def wait(self) -> None:
        """Block until the snapshot (or online update) in flight is done; raise if it failed."""
        if self._begun:
            self.taker.wait()

    def snapshots(self, include_excluded: bool = False) -> list[tuple[SnapshotRecord, Path]]:
        """Completed snapshots listed in the manifest, oldest first (see ``PMACallback.snapshots``)."""
        return self.taker.snapshots(include_excluded)

    def exclude_snapshots(self, tokens: Iterable[int], reason: str = "excluded") -> list[SnapshotRecord]:
        """Mark the snapshots taken at ``tokens`` as excluded from merges (see ``PMACallback.exclude_snapshots``)."""
        return self.taker.exclude_snapshots(tokens, reason)

    def check_for_spike(
        self,
        recovery: SpikeRecovery,
        loss: float,
        grad_norm: float | None = None,
        model: torch.nn.Module | None = None,
    ) -> dict[str, Any] | None:
        """Every process, after :meth:`step`: hand the step's training ``loss`` (and gradient norm)
        to ``recovery``'s spike detector; on a spike, the model (default: the one given at
        construction) gets the merge of the last snapshots taken before it, the optimizer's moments
        are reset (``recovery.reset_optimizer``), and the snapshots taken during the spike are
        excluded from merges. Returns the recovery's record, ``None`` when the loss is no spike.
        Raises :class:`hf_pma.training.recovery.LossSpikeError` when it keeps spiking
        (``recovery.max_recoveries``) or no snapshot precedes the spike.
        """
        if self._ended:  # the folder is released: a recovery would write its manifest unclaimed
            raise ValueError("PMASnapshots.check_for_spike() after end()")
        if not isinstance(recovery, SpikeRecovery):
            raise parameter_error("recovery", f"must be a SpikeRecovery, got {shown(recovery, 60)}")
        return recovery.check(
            loss,
            grad_norm,
            model=unwrap_model(model if model is not None else self.model),
            taker=self.taker,
            step=self._global_step,
            tokens=self._tokens,
            optimizer=self.optimizer,
        )

    @contextlib.contextmanager
    def swapped(
        self, model: torch.nn.Module | None = None, last: int | str | None = "auto"
    ) -> Iterator[torch.nn.Module]:
        """Every process: the merge of the last ``last`` snapshots (``"auto"``, the default: the
        window chosen from their records, see :mod:`hf_pma.core.window_choice`; all when
        ``None``), or the online average (then ``last`` must be left at its default), in the live
        model for the ``with`` block; the live weights are put back bit for bit after it (also
        on an exception).

        Raises ``ValueError`` when there is nothing to swap in yet.
        """
        from hf_pma.core.strategies import AUTO_STRATEGY
        from hf_pma.core.window_choice import merge_strategy
        from hf_pma.merging.engine import merge_state_dict
        from hf_pma.merging.swap import backup_weights, load_weights, restore_weights
        from hf_pma.merging.windows import apply_window

        if model is not None:
            _check_module(model, "model")
        last = check_window_count(last, "last", allow_none=True)
        model = model if model is not None else self.model
        if not self._begun:
            if self._global_step == 0:
                raise ValueError("PMASnapshots.swapped(): no snapshot yet (before the first step)")
            self._begin(model)  # a resumed run with no step left (it had finished): its snapshots on disk
        taker = self.taker
        taker.wait()
        if taker.online is not None:
            if last is not None and not is_auto(last):
                raise ValueError(
                    f"PMASnapshots.swapped(): last={last} has no effect with online={taker.online!r} (the online "
                    "average is swapped in); leave it out"
                )
            restore = taker.swap_in_online(model)
            if restore is None:
                raise ValueError("PMASnapshots.swapped(): the online average holds no snapshot yet")
            try:
                yield model
            finally:
                restore()
            return
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()  # every process sees the main process's manifest
        snapshots = taker.snapshots()  # every process reads the manifest
        chosen, choice = apply_window(snapshots, last=last, fewer=True)
        strategy, choice = merge_strategy(AUTO_STRATEGY, choice, len(chosen))
        if choice is not None:
            logger.info(f"PMASnapshots.swapped(): {choice.describe()}")
        listed = [folder for _, folder in chosen]
        if not listed:
            raise ValueError(f"PMASnapshots.swapped(): no snapshot in {escape(taker.pma_dir)} yet")
        merged = merge_state_dict(listed, strategy=strategy)
        target = unwrap_model(model)
        backup = backup_weights(target)
        try:
            load_weights(target, merged, origin=f"the merge of {len(listed)} snapshots")
            yield model
        finally:
            restore_weights(target, backup)

    # ------------------------------------------------------------------ accelerate checkpointing

    def state_dict(self) -> dict[str, Any]:
        """What a resumed loop needs: tokens, optimizer steps and the schedule (plain values)."""
        return {
            "version": STATE_VERSION,
            "tokens": self.tokens,
            "global_step": self.global_step,
            "schedule": self.taker.schedule_state(),
            "options": {**self.taker.options(), "token_count": self.token_count},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (``accelerator.load_state`` calls it); before the first step."""
        if self._begun:
            raise ValueError("PMASnapshots.load_state_dict() must come before the first step()")
        if self._ended:
            raise ValueError("PMASnapshots.load_state_dict() after end()")
        if (
            not isinstance(state, Mapping)
            or not is_int(state.get("version"))
            or state["version"] != STATE_VERSION
        ):
            raise ValueError("PMASnapshots.load_state_dict(): not a state saved by PMASnapshots.state_dict()")
        for key in ("tokens", "global_step"):
            if not is_int(state.get(key), 0, MAX_RECORD_INT):
                raise ValueError(
                    f"PMASnapshots.load_state_dict(): {key} must be a non-negative integer, got {shown(state.get(key), 60)}"
                )
        if (state["tokens"] == 0) != (state["global_step"] == 0):
            raise ValueError(
                f"PMASnapshots.load_state_dict(): tokens={state['tokens']} after global_step={state['global_step']} "
                "optimizer steps"
            )
        schedule = state.get("schedule")
        if not isinstance(schedule, Mapping):
            raise ValueError(
                f"PMASnapshots.load_state_dict(): schedule must be a dict, got {shown(schedule, 60)}"
            )
        check_schedule_state(dict(schedule), "PMASnapshots.load_state_dict(): schedule")
        saved = state.get("options")
        if isinstance(saved, Mapping):
            ours = self.taker.options()
            for key in _RESUMED_OPTIONS:
                if key in saved and saved[key] != ours[key]:
                    raise ValueError(
                        f"PMASnapshots.load_state_dict(): {key}={shown(ours[key], 60)} differs from the "
                        f"{shown(saved[key], 60)} of the run being resumed (give the same {key}, or start a new "
                        "output_dir)"
                    )
            if "token_count" in saved and saved["token_count"] != self.token_count:
                raise ValueError(
                    f"PMASnapshots.load_state_dict(): token_count={self.token_count!r} differs from the "
                    f"{shown(saved['token_count'], 60)} of the run being resumed"
                )
        self._tokens = state["tokens"]
        self._global_step = state["global_step"]
        self._saved_schedule = dict(schedule) if self._global_step > 0 else None
        if self.finished and (self.accelerator is None or self.accelerator.is_main_process):
            done = f"step {self._global_step} of max_steps {self.max_steps}"
            notice(logger, f"hf-pma: the resumed run had finished ({done}): nothing left to train")

    def _before_save_state(self, models: Any, weights: Any, output_dir: str) -> None:
        """``accelerator.save_state``: the snapshot in flight lands first; online averages are saved beside."""
        if self._begun and not self._ended:
            self.taker.before_checkpoint(output_dir)

    def _before_load_state(self, models: Any, input_dir: str) -> None:
        self._resume_dir = Path(input_dir)

    # ------------------------------------------------------------------ internals

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_lr = step_lr(optimizer.param_groups)  # a tensor LR is not read here (no sync)

    def _count(self, batch: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> int:
        if isinstance(batch, Mapping):
            batch = [batch]
        total = 0
        for micro in batch:
            ids = micro.get("input_ids") if isinstance(micro, Mapping) else None
            if not torch.is_tensor(ids):
                raise ValueError(
                    "PMASnapshots.step(batch=...): the batch has no 'input_ids' tensor; pass tokens="
                )
            mask = micro.get("attention_mask")
            if self.token_count == "non_padding" and torch.is_tensor(mask):
                total += int(mask.sum())
            else:
                if self.token_count == "non_padding" and not self._warned_no_mask:
                    self._warned_no_mask = True  # as the Trainer says it, once
                    logger.warning(
                        "hf-pma: token_count='non_padding' but the batch has no 'attention_mask' tensor: counting "
                        "every 'input_ids' position (pass tokens= to count them yourself)"
                    )
                total += ids.numel()
        return total

    def _global(self, local: int) -> int:
        if self.accelerator is None or self.accelerator.num_processes <= 1:
            return local
        count = torch.tensor(local, device=self.accelerator.device, dtype=torch.int64)
        return int(self.accelerator.reduce(count, reduction="sum").item())

    def _begin(self, model: torch.nn.Module) -> None:
        self._begun = True
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        self.taker.begin(
            model,
            output_dir=self.output_dir,
            world_size=self.accelerator.num_processes if self.accelerator is not None else 1,
            is_main=self.accelerator.is_main_process if self.accelerator is not None else True,
            token_count=self.token_count,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            planned_steps=self.max_steps,
            step=self._global_step,
            tokens=self._tokens,
            resume_dir=self._resume_dir,
            saved_state=self._saved_schedule,
            peak_lr=self._peak_lr,
            scheduler_name=type(scheduler).__name__ if scheduler is not None else None,
        )
