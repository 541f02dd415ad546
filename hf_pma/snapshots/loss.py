"""The training loss of every optimizer step, for per-snapshot records, whatever ``logging_steps`` is.

A ``TrainerCallback`` only sees the loss the Trainer logs, averaged over ``logging_steps``; a
snapshot every 5 steps with a log every 10 would repeat stale values. :class:`StepLossTracker`
reads the loss the model returns to the Trainer instead: a forward hook on the training model
(train mode, gradients on, so evaluations are ignored) keeps each micro-batch's loss (a view:
no kernel, no sync; a long window is summed on its device every :data:`MAX_HELD_LOSSES`), and
:meth:`StepLossTracker.end_step` closes the step as the Trainer does for its own logs:

* a loss normalised by ``num_items_in_batch`` (the model got it: a share of the step's total)
  is summed over the step's micro-batches; any other loss is averaged over them;
* over processes, the Trainer's logged loss is the mean of the processes' losses, except for a
  loss normalised by a token count gathered over all processes
  (``average_tokens_across_devices``), whose shares add up.

A model that returns no loss (the Trainer computes it: ``compute_loss_func``, label smoothing)
leaves the tracker empty; the callback then falls back to the logged loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["StepLossTracker", "WindowLoss", "MAX_HELD_LOSSES"]

# Micro-batch losses held between snapshots before they are summed on their device (a long
# window would otherwise keep one small tensor per micro-batch alive).
MAX_HELD_LOSSES = 1024


@dataclasses.dataclass(frozen=True)
class WindowLoss:
    """The training loss over the optimizer steps between two snapshots."""

    mean: float  # mean of the steps' losses
    steps: int  # optimizer steps in the window
    last: float  # loss of the window's last step (the snapshot's own step)


class StepLossTracker:
    """Per-step training losses from the model's own outputs, accumulated between snapshots.

    Nothing runs on the device between snapshots: the hook keeps a detached reference to each
    micro-batch's loss (a view: no kernel, no copy, no sync) and :meth:`end_step` only groups
    them by step; the arithmetic (one stack and one read to the host) happens in
    :meth:`take_window`, at the snapshot, where the training thread stops anyway.
    """

    def __init__(self) -> None:
        self._handle: Any | None = None
        self._micro: list[torch.Tensor] = []  # this step's micro-batch losses (detached views)
        self._scaled = False
        self._steps: list[tuple[list[torch.Tensor], bool]] = []  # the window's steps: (losses, scaled)
        self._held = 0  # micro-batch losses referenced in _steps
        self._folded: torch.Tensor | None = None  # [sum, last] of the steps folded in already
        self._window_steps = 0
        self._complete = True

    def attach(self, model: torch.nn.Module) -> None:
        """Start listening to ``model``'s training forwards (the module the Trainer calls, or the one inside its wrapper)."""
        self.detach()
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def detach(self) -> None:
        """Stop listening."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        self._micro.append(loss.detach())  # a view of the loss: no device work until the snapshot
        self._scaled = kwargs.get("num_items_in_batch") is not None

    def end_step(self) -> None:
        """Close one optimizer step (``on_step_end``): its loss joins the current window."""
        if self._micro:
            self._steps.append((self._micro, self._scaled))
            self._held += len(self._micro)
        else:
            self._complete = False
        self._micro = []
        self._window_steps += 1
        if self._held >= MAX_HELD_LOSSES:  # a long window: fold on the device (kernels, no sync)
            self._fold()

    def _fold(self) -> None:
        """Sum the steps held so far into ``[sum, last]`` on their device; nothing is read."""
        values = self._window_values()
        if values is None:
            return
        self._folded = values[0]  # the steps folded before included
        self._steps, self._held = [], 0

    def _window_values(self) -> tuple[torch.Tensor, bool] | None:
        """``[sum of the step losses, last step loss]`` on the losses' device (one stack), and
        whether the losses were normalised by ``num_items_in_batch``; ``None`` without a step."""
        if not self._steps:
            return (self._folded, self._scaled) if self._folded is not None else None
        flat = torch.stack([m.reshape(()).float() for losses, _ in self._steps for m in losses])
        sizes = [len(losses) for losses, _ in self._steps]
        index = torch.repeat_interleave(torch.arange(len(sizes), device=flat.device), torch.tensor(sizes, device=flat.device))
        per_step = torch.zeros(len(sizes), device=flat.device, dtype=flat.dtype).index_add_(0, index, flat)
        scaled = self._steps[-1][1]
        if not scaled:  # a mean over the micro-batches, as the Trainer logs it
            per_step = per_step / torch.tensor(sizes, device=flat.device, dtype=flat.dtype)
        pair = torch.stack([per_step.sum(), per_step[-1]])
        if self._folded is not None:
            pair = torch.stack([self._folded[0].to(pair.dtype) + pair[0], pair[1]])
        return pair, scaled

    def take_window(self, average_tokens_across_devices: bool = True) -> WindowLoss | None:
        """The window's losses, reset for the next one; ``None`` when a step of it had no loss.

        Every process must call it in a distributed run (one ``all_reduce``). Pass the
        Trainer's ``average_tokens_across_devices``: with a loss normalised by
        ``num_items_in_batch`` it makes the processes' shares add up (see the module doc).
        """
        values = self._window_values()
        scaled = values[1] if values is not None else self._scaled
        window = values[0] if values is not None else None
        sum_over_processes = scaled and average_tokens_across_devices
        steps, complete = self._window_steps, self._complete
        self._steps, self._held, self._folded, self._window_steps, self._complete = [], 0, None, 0, True
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            flag = torch.tensor([0.0 if (complete and window is not None) else 1.0], device=self._device(window))
            values = window if window is not None else torch.zeros(2, device=flag.device)
            both = torch.cat([values.to(flag.device), flag])
            torch.distributed.all_reduce(both)
            if both[2].item() > 0:
                return None
            window = both[:2] if sum_over_processes else both[:2] / torch.distributed.get_world_size()
        elif window is None or not complete:
            return None
        total, last = window.tolist()
        return WindowLoss(total / steps, steps, last)

    @staticmethod
    def _device(window: torch.Tensor | None) -> torch.device:
        if window is not None:
            return window.device
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
