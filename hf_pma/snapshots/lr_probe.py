"""Read the learning-rate schedule a Trainer built: its peak LR and the planned LR of every step.

The phases of a run (:mod:`hf_pma.core.schedule`) are read from LR values; these helpers get the
values from the optimizer and scheduler objects the Trainer hands its callbacks.
"""

from __future__ import annotations

from typing import Any

from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "first_group_value",
    "step_lr",
    "peak_lr",
    "planned_lrs",
    "scheduler_steps_per_optimizer_step",
    "MAX_PROBED_STEPS",
]

# Schedules with more steps than this are probed at a stride.
MAX_PROBED_STEPS = 100_000


def first_group_value(param_groups: Any, key: str) -> float | None:
    """``param_groups[0][key]`` as a float, ``None`` when absent."""
    try:
        value = param_groups[0].get(key)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return float(value) if value is not None else None


def step_lr(param_groups: Any) -> Any:
    """``param_groups[0]["lr"]`` as it is: a float, or a one-element tensor left unread (reading a
    device tensor would make the step wait for the device); ``None`` when absent."""
    try:
        value = param_groups[0].get("lr")
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    if value is None or hasattr(value, "numel"):
        return value
    return float(value)


def peak_lr(optimizer: Any, lr_scheduler: Any, learning_rate: float | None = None) -> float:
    """The schedule's reference (peak) LR: ``initial_lr`` of the first param group, else the
    scheduler's ``base_lrs``, else ``learning_rate`` (the Trainer's ``args.learning_rate``), else
    the first param group's ``lr`` now (an optimizer without a scheduler)."""
    peak = first_group_value(getattr(optimizer, "param_groups", None), "initial_lr")
    if peak is None:
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
        base_lrs = getattr(scheduler, "base_lrs", None)
        peak = float(base_lrs[0]) if base_lrs else None
    if peak is None and learning_rate is not None:
        peak = float(learning_rate)
    if peak is None:
        peak = first_group_value(getattr(optimizer, "param_groups", None), "lr")
    if peak is None or not peak > 0:
        raise ValueError(f"hf-pma reads the phase of a run from its learning rate, which needs a positive peak LR; got {peak}")
    return peak


def scheduler_steps_per_optimizer_step(lr_scheduler: Any, num_processes: int = 1) -> int:
    """How many steps the wrapped schedule takes per optimizer step: ``accelerate``'s
    ``AcceleratedScheduler`` steps it once per process (``num_processes`` times) unless it splits
    batches or does not step with the optimizer; so scripts that prepare their scheduler with
    accelerate (``run_clm_no_trainer.py``) scale its warmup and length by the number of processes."""
    if not (hasattr(lr_scheduler, "scheduler") and hasattr(lr_scheduler, "split_batches")):
        return 1
    if getattr(lr_scheduler, "step_with_optimizer", True) and not lr_scheduler.split_batches:
        return max(1, int(num_processes))
    return 1


def planned_lrs(lr_scheduler: Any, max_steps: int, num_processes: int = 1) -> tuple[list[float], int] | None:
    """The LR of every planned optimizer step (every ``stride``-th for long runs) and the stride,
    when the schedule is a ``LambdaLR`` (every ``transformers`` schedule is); ``None`` when it cannot
    be probed. Optimizer step ``s`` (from 0) uses the schedule's step ``s * k``, ``k`` from
    :func:`scheduler_steps_per_optimizer_step`."""
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    base_lrs = getattr(scheduler, "base_lrs", None)
    if not lambdas or not base_lrs or max_steps < 1:
        return None
    stride = max(1, -(-max_steps // MAX_PROBED_STEPS))
    k = scheduler_steps_per_optimizer_step(lr_scheduler, num_processes)
    try:
        return [float(base_lrs[0]) * float(lambdas[0](s * k)) for s in range(0, max_steps, stride)], stride
    except Exception as err:  # a custom lambda that needs more than the step
        logger.warning(f"hf-pma: could not probe the learning-rate schedule ({err}); estimating its phases")
        return None
