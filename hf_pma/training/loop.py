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
sinks and the disk and time budgets are those of :class:`hf_pma.snapshots.callback.PMACallback`:
``PMASnapshots`` drives one through the same events the ``Trainer`` sends it (one
implementation, two front doors), so every ``hf-pma`` command reads the folder it writes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import TrainerControl, TrainerState
from transformers.utils import logging

from hf_pma.core.manifest import PMA_SUBDIR
from hf_pma.core.schedule import positive_int_or_none
from hf_pma.snapshots.callback import PMACallback
from hf_pma.snapshots.lr_probe import first_group_value

logger = logging.get_logger(__name__)

__all__ = ["PMASnapshots"]

STATE_VERSION = 1
TOKEN_COUNTS = ("all", "non_padding")


class _LoopCallback(PMACallback):
    """The callback as the loop drives it: checkpoints are ``accelerate`` state folders."""

    checkpoint_dir: Path | None = None
    known_steps = True

    def _checkpoint_dir(self, args: Any, state: Any) -> Path:
        return (
            self.checkpoint_dir if self.checkpoint_dir is not None else super()._checkpoint_dir(args, state)
        )

    def _warn_without_constant_phase(self, args: Any) -> None:
        if self.known_steps:  # without max_steps the planned schedule is unknown: nothing to say
            super()._warn_without_constant_phase(args)


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
            ``online_window_tokens``, ``max_disk_bytes``, ``sharded``).

    Nothing is written before the first :meth:`step`; :meth:`load_state_dict` (called by
    ``accelerator.load_state``) must come before it.
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
        if token_count not in TOKEN_COUNTS:
            raise ValueError(f"token_count must be one of {TOKEN_COUNTS}, got {token_count!r}")
        self.max_steps = positive_int_or_none(max_steps, "max_steps")
        if self.max_steps is None and options.get("interval_tokens") is None:
            raise ValueError("PMASnapshots needs interval_tokens, or max_steps to choose it automatically")
        self.callback = _LoopCallback(output_dir=pma_dir, **options)
        self.callback.accelerator = accelerator
        self.callback.known_steps = self.max_steps is not None
        self.model = model
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.token_count = token_count
        output = Path(output_dir) if output_dir is not None else Path(pma_dir).parent
        self._args = SimpleNamespace(
            output_dir=str(output),
            include_num_input_tokens_seen=token_count,
            world_size=accelerator.num_processes if accelerator is not None else 1,
            learning_rate=first_group_value(getattr(optimizer, "param_groups", None), "lr") or 0.0,
            get_warmup_steps=lambda steps: 0,
            lr_scheduler_type=type(getattr(lr_scheduler, "scheduler", lr_scheduler)).__name__,
            average_tokens_across_devices=True,
        )
        self._state = TrainerState(max_steps=self.max_steps or 0, global_step=0, num_input_tokens_seen=0)
        self._state.is_world_process_zero = accelerator.is_main_process if accelerator is not None else True
        self._control = TrainerControl()
        self._pending_tokens = 0  # this process's tokens of the micro-batches since the last optimizer step
        self._pending_global = 0  # tokens= given since the last optimizer step (global already)
        self._step_lr: float | None = None
        self._begun = False
        self._ended = False
        self._resume_dir: Path | None = None
        self.callback._losses.attach(model)  # the first step's forwards come before the first step()
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
        return int(self._state.num_input_tokens_seen)

    @property
    def global_step(self) -> int:
        """Optimizer steps counted so far, resumed ones included."""
        return int(self._state.global_step)

    @property
    def pma_dir(self) -> Path | None:
        """The snapshot folder (known from the first :meth:`step`)."""
        return self.callback.pma_dir

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
        model = model if model is not None else self.model
        if batch is not None:
            self._pending_tokens += self._count(batch)
        else:
            self._pending_global += int(tokens)
        if self.accelerator is not None and not self.accelerator.sync_gradients:
            return
        step_tokens = self._pending_global + (self._global(self._pending_tokens) if batch is not None else 0)
        self._pending_tokens = self._pending_global = 0
        if not self._begun:
            self._begin(model)
        args, state, control, cb = self._args, self._state, self._control, self.callback
        cb.on_step_begin(args, state, control)
        cb._step_lr = lr if lr is not None else self._step_lr
        self._step_lr = None
        if step_tokens <= 0 and state.num_input_tokens_seen == cb.schedule.tokens_at_begin:
            raise ValueError(
                f"PMASnapshots.step(): no input tokens in optimizer step {state.global_step + 1} (a batch without "
                "'input_ids', or tokens=0)"
            )
        state.global_step += 1
        state.num_input_tokens_seen += step_tokens
        control.should_log = loss is not None
        cb.on_step_end(args, state, control, model=model, lr_scheduler=self.lr_scheduler)
        if loss is not None:
            cb.on_log(args, state, control, logs={"loss": float(loss)})
            control.should_log = False

    def end(self, model: torch.nn.Module | None = None) -> None:
        """Call once after training: the last write lands, the online average is saved, the
        folder is released. Every process calls it."""
        if self._ended:
            return
        self._ended = True
        for hook in self._hooks:
            hook.remove()
        if not self._begun:
            self.callback._losses.detach()
            return
        self.callback.on_train_end(self._args, self._state, self._control, model=model or self.model)

    def wait(self) -> None:
        """Block until the snapshot (or online update) in flight is done; raise if it failed."""
        if self._begun:
            self.callback.wait()

    def snapshots(self, include_excluded: bool = False) -> list[tuple[Any, Path]]:
        """Completed snapshots listed in the manifest, oldest first (see ``PMACallback.snapshots``)."""
        return self.callback.snapshots(include_excluded)

    @contextlib.contextmanager
    def swapped(
        self, model: torch.nn.Module | None = None, last: int | None = None
    ) -> Iterator[torch.nn.Module]:
        """Every process: the merge of the last ``last`` snapshots (all when ``None``), or the
        online average, in the live model for the ``with`` block; the live weights are put back
        bit for bit after it (also on an exception).

        Raises ``ValueError`` when there is nothing to swap in yet.
        """
        from hf_pma.merging.engine import merge_state_dict
        from hf_pma.merging.swap import backup_weights, load_weights, restore_weights
        from hf_pma.snapshots.gather import unwrap_model

        model = model if model is not None else self.model
        if not self._begun:
            raise ValueError("PMASnapshots.swapped(): no snapshot yet (before the first step)")
        cb = self.callback
        cb.wait()
        if cb.online is not None:
            restore = cb.swap_in_online(model)
            if restore is None:
                raise ValueError("PMASnapshots.swapped(): the online average holds no snapshot yet")
            try:
                yield model
            finally:
                restore()
            return
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()  # every process sees the main process's manifest
        listed = [folder for _, folder in cb.snapshots()]  # every process reads the manifest
        if last is not None:
            last = positive_int_or_none(last, "last")
            listed = listed[-last:]
        if not listed:
            raise ValueError(f"PMASnapshots.swapped(): no snapshot in {cb.pma_dir} yet")
        merged = merge_state_dict(listed)
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
            "schedule": self.callback.schedule.state(),
            "options": self.callback.state()["args"],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (``accelerator.load_state`` calls it); before the first step."""
        if self._begun:
            raise ValueError("PMASnapshots.load_state_dict() must come before the first step()")
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError("PMASnapshots.load_state_dict(): not a state saved by PMASnapshots.state_dict()")
        self._state.num_input_tokens_seen = int(state["tokens"])
        self._state.global_step = int(state["global_step"])
        self.callback.resume_state = dict(state["schedule"]) if self.global_step > 0 else None

    def _before_save_state(self, models: Any, weights: Any, output_dir: str) -> None:
        """``accelerator.save_state``: the snapshot in flight lands first; online averages are saved beside."""
        if self._begun and not self._ended:
            self.callback.checkpoint_dir = Path(output_dir)
            self.callback.on_save(self._args, self._state, self._control)

    def _before_load_state(self, models: Any, input_dir: str) -> None:
        self._resume_dir = Path(input_dir)

    # ------------------------------------------------------------------ internals

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_lr = first_group_value(optimizer.param_groups, "lr")

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
                total += ids.numel()
        return total

    def _global(self, local: int) -> int:
        if self.accelerator is None or self.accelerator.num_processes <= 1:
            return local
        count = torch.tensor(local, device=self.accelerator.device, dtype=torch.int64)
        return int(self.accelerator.reduce(count, reduction="sum").item())

    def _begin(self, model: torch.nn.Module) -> None:
        self._begun = True
        cb = self.callback
        if cb.output_dir is None:
            cb.output_dir = str(Path(self._args.output_dir) / PMA_SUBDIR)
        if self.global_step > 0:
            cb.checkpoint_dir = self._resume_dir or Path(self._args.output_dir)
        if self.max_steps is None:
            self._state.max_steps = self.global_step  # no planned steps: the disk projection counts none
        cb.on_train_begin(
            self._args,
            self._state,
            self._control,
            model=model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
        )
