"""PMA-init and loss-spike recovery, for any training loop (``PMATrainer`` uses these too).

* :func:`pma_init`: start a model from merged weights (a merged folder, a run's snapshots, several
  checkpoints, Hub revisions), as the paper's PMA-init does.
* :class:`SpikeDetector`: a logged loss above ``factor`` x the median of the last ``window``
  healthy losses, or a non-finite loss or gradient norm, is a spike.
* :func:`recover_from_spike`: the snapshots taken during the spike are excluded from merges, the
  model gets the merge of the snapshots before it (the automatic window and its weights, or the
  SMA of the newest ``last``), and the optimizer's
  moments (which hold the spike's gradients) are reset.
* :class:`SpikeRecovery`: the two together, with a limit on recoveries and their records (the
  run's manifest lists them under ``"recoveries"``).

In a loop with :class:`hf_pma.training.loop.PMASnapshots`::

    model = pma_init(model, ["previous-run/pma"], window=10)   # optional, before accelerator.prepare
    recovery = SpikeRecovery(factor=3.0, window=20, last=3)
    for batch in train_dataloader:
        ...
        pma.step(batch=batch)
        pma.check_for_spike(recovery, loss.item())
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.strategies import AUTO_STRATEGY, validate_strategy
from hf_pma.core.window_choice import check_window_count, merge_strategy
from hf_pma.merging.engine import merge_state_dict
from hf_pma.merging.sources import resolve_sources
from hf_pma.merging.swap import load_weights
from hf_pma.merging.windows import apply_window
from hf_pma.snapshots.taker import SnapshotTaker
from hf_pma.utils.distributed import all_ranks_checked
from hf_pma.utils.parsing import check_int, is_number, parameter_error
from hf_pma.utils.text import shown

logger = logging.get_logger(__name__)

__all__ = ["LossSpikeError", "SpikeDetector", "SpikeRecovery", "recover_from_spike", "pma_init"]


class LossSpikeError(RuntimeError):
    """The run kept diverging after the allowed recoveries, or had nothing to recover from."""


def pma_init(
    model: torch.nn.Module,
    sources: Sequence[str | os.PathLike[str]],
    *,
    window: int | str = "auto",
    window_tokens: int | None = None,
    strategy: str = AUTO_STRATEGY,
    alpha: float = 0.2,
    what: str = "pma_init",
) -> dict[str, Any]:
    """Load the merge of ``sources`` into ``model`` (every process, before the model is wrapped or
    sharded); return what was used (JSON: strategy, sources with their tokens and steps, time).

    Args:
        model: the model to start from merged weights (its shapes must match).
        sources: one merged model folder, one run or snapshot folder (its newest ``window``
            snapshots, or those within its last ``window_tokens`` tokens, are merged), several
            folders or checkpoints, or Hub revisions (``org/model@REV``), as ``hf-pma merge`` takes.
        window: snapshots merged from a single run folder; ``"auto"`` (default): chosen from the
            run's records (see :mod:`hf_pma.core.window_choice`), said in one line and recorded.
        window_tokens: instead of ``window``: the snapshots within the last T tokens of a run folder.
        strategy: the merge strategy (``"auto"``: the automatic window's own weights, else SMA;
            ``"sma"``, ``"ema"``, ``"wma"``...) when several sources are merged.
        alpha: the EMA factor for ``strategy="ema"``.
        what: how errors name the sources (``PMATrainer`` says ``pma_init_from``).
    """
    _check_module(model, "model")
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]  # one folder or Hub id, not a sequence of its characters
    if not isinstance(sources, Sequence) or not all(isinstance(s, (str, os.PathLike)) for s in sources):
        raise parameter_error("sources", f"must be a list of folders or Hub ids, got {shown(sources, 60)}")
    sources = list(sources)
    if not sources:
        raise ValueError(f"{what}: no source to merge")
    window = check_window_count(window, "window")
    check_int(window_tokens, "window_tokens", allow_none=True)
    if window_tokens is not None and len(sources) > 1:
        raise parameter_error(
            "window_tokens",
            "selects the snapshots of one run folder; with several sources every one is merged",
        )
    validate_strategy(strategy, alpha)  # before any source is read (one source merges as sma)
    resolved = resolve_sources(sources)
    choice = None
    if len(sources) == 1 and (len(resolved) > 1 or window_tokens is not None):
        # A run folder: its window (sources named one by one are all merged).
        resolved, choice = apply_window(resolved, last=window, window_tokens=window_tokens, fewer=True)
    strategy, choice = merge_strategy(strategy, choice, len(resolved))
    if choice is not None:
        logger.warning(f"{what}: {choice.describe()}")
    state = merge_state_dict(resolved, strategy=strategy, alpha=alpha)
    load_weights(model, state, origin=f"{what} ({', '.join(str(s.path) for s in resolved)})")
    logger.info(
        f"PMA-init: the model starts from the {strategy} merge of {len(resolved)} checkpoint(s): "
        + ", ".join(s.name for s in resolved)
    )
    return {
        "strategy": strategy,
        "sources": [{"name": s.name, "tokens": s.tokens, "step": s.step} for s in resolved],
        "window_choice": choice.to_dict() if choice is not None else None,
        "time": time.time(),
    }


def _check_module(model: Any, name: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise parameter_error(name, f"must be a torch.nn.Module, got {shown(model, 60)}")


def _number(value: Any, name: str, allow_none: bool = False) -> float | None:
    """``value`` as a float when it is a number (NaN and infinities included: they are spikes) or a
    one-element tensor; else a one-line ``ValueError`` naming ``name``."""
    if value is None and allow_none:
        return None
    if torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point():
        return float(value.detach())
    if not is_number(value):
        either = " or None" if allow_none else ""
        raise parameter_error(name, f"must be a number{either}, got {shown(value, 60)}")
    return float(value)


class SpikeDetector:
    """Loss spikes: a loss above ``factor`` x the median of the last ``window`` healthy losses (once
    3 are known, or ``window`` when smaller), or a non-finite loss or gradient norm.

    Args:
        factor: how many times the median a spike is (greater than 1).
        window: how many healthy losses the median is taken over.
    """

    def __init__(self, factor: float = 3.0, window: int = 20) -> None:
        if not (is_number(factor, finite=True) and factor > 1.0):
            raise ValueError(f"factor must be greater than 1, got {factor!r}")
        check_int(window, "window")
        self.factor = float(factor)
        self.window = window
        self.losses: deque[float] = deque(maxlen=window)
        #: The optimizer step of the last healthy loss (0 before any).
        self.last_healthy_step = 0

    def is_spike(self, loss: float, grad_norm: float | None = None) -> bool:
        """Whether ``loss`` (and ``grad_norm``) is a spike against the healthy losses so far."""
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            return True
        if len(self.losses) >= min(3, self.window):
            return loss > self.factor * statistics.median(self.losses)
        return False

    def observe(self, loss: float, grad_norm: float | None = None, step: int = 0) -> bool:
        """``True`` for a spike (not remembered); otherwise the loss joins the healthy ones and
        ``step`` becomes :attr:`last_healthy_step`."""
        loss = _number(loss, "loss")
        grad_norm = _number(grad_norm, "grad_norm", allow_none=True)
        check_int(step, "step", 0)
        if self.is_spike(loss, grad_norm):
            return True
        self.losses.append(loss)
        self.last_healthy_step = int(step)
        return False


def recover_from_spike(
    model: torch.nn.Module,
    taker: SnapshotTaker,
    *,
    step: int,
    after_step: int,
    last: int | str = "auto",
    optimizer: Any | None = None,
    reset_optimizer: bool = True,
    loss: float | None = None,
    hint: str = "take snapshots earlier (smaller interval_tokens, or phases including 'warmup')",
) -> dict[str, Any]:
    """Every process: undo a loss spike noticed at optimizer step ``step``.

    The snapshots taken after optimizer step ``after_step`` (the last healthy one) are marked
    excluded from merges (they stay on disk); ``model`` gets the merge of the snapshots left
    (``last="auto"``: the automatic window with its weights; a number: the SMA of the newest ``last``); with ``reset_optimizer`` the optimizer's state (Adam's moments) is cleared.

    Args:
        model: the model to load the merge into (the module itself, not a DDP wrapper).
        taker: the snapshot engine of the run (``PMASnapshots.taker``, ``PMACallback.taker``).
        step: the optimizer step the spike was noticed at.
        after_step: the last optimizer step known healthy.
        last: the snapshots before the spike to average (the paper used 3); ``"auto"`` (default):
            chosen from their records as every merge's window (:mod:`hf_pma.core.window_choice`).
        optimizer: the optimizer whose state to reset (an ``accelerate`` wrapper is fine).
        reset_optimizer: whether to reset it.
        loss: the spike's loss, for the error message.
        hint: what to do when no snapshot precedes the spike (in the caller's option names).

    Returns the record: ``snapshots`` (folder names merged), ``excluded`` (their tokens),
    ``reset_optimizer``. Raises :class:`LossSpikeError` when no snapshot precedes the spike.
    """
    _check_module(model, "model")
    if not isinstance(taker, SnapshotTaker):
        raise parameter_error(
            "taker", f"must be a SnapshotTaker (PMASnapshots.taker), got {shown(taker, 60)}"
        )
    check_int(step, "step", 0)
    check_int(after_step, "after_step", 0)
    last = check_window_count(last, "last")  # last=0 would merge every snapshot ([-0:])
    # Snapshots taken after the last healthy step belong to the spike: never merge them.
    taker.wait()
    during = [r.tokens for r, _ in taker.snapshots() if r.step > after_step]
    if during and taker.is_main:
        taker.exclude_snapshots(during, reason=f"loss spike at step {step}")
    all_ranks_checked(lambda: None, "waiting for the main process")
    usable, choice = apply_window(taker.snapshots(), last=last, fewer=True)
    strategy, choice = merge_strategy(AUTO_STRATEGY, choice, len(usable))
    if choice is not None:
        logger.warning(f"loss-spike recovery at step {step}: {choice.describe()}")
    if not usable:
        said = f" (loss {loss:.4g})" if loss is not None else ""
        raise LossSpikeError(
            f"loss spike at step {step}{said} but no snapshot was taken before it to recover from; {hint}"
        )
    load_weights(
        model,
        merge_state_dict([path for _, path in usable], strategy=strategy),
        origin="loss-spike recovery merge",
    )
    reset = bool(reset_optimizer and optimizer is not None)
    if reset:
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.state.clear()  # Adam moments hold the spike's gradients
    return {
        "snapshots": [r.path for r, _ in usable],
        "strategy": strategy,
        "window_choice": choice.to_dict() if choice is not None else None,
        "excluded": [int(t) for t in during],
        "reset_optimizer": reset,
    }


class SpikeRecovery:
    """Watch the training loss; on a spike, go back to the merge of the snapshots before it.

    Args:
        factor: a loss above ``factor`` x the median of the last ``window`` healthy ones is a spike.
        window: the healthy losses in that median.
        last: the snapshots before the spike averaged for recovery (the paper used 3); ``"auto"``
            (default): chosen from their records.
        reset_optimizer: reset the optimizer's moments on recovery (they hold the spike's gradients).
        max_recoveries: stop with :class:`LossSpikeError` at the spike after this many recoveries.
        option_prefix: how the caller's options are named in messages (``PMATrainer``: ``"pma_"``).

    :attr:`recoveries` lists a record per recovery (step, tokens, loss, grad norm, the snapshots
    merged, those excluded, whether the optimizer was reset), also written to the run's manifest.
    """

    def __init__(
        self,
        factor: float = 3.0,
        window: int = 20,
        last: int | str = "auto",
        reset_optimizer: bool = True,
        max_recoveries: int = 3,
        option_prefix: str = "",
    ) -> None:
        last = check_window_count(last, "last")
        check_int(max_recoveries, "max_recoveries", 0)
        if not isinstance(reset_optimizer, bool):
            raise parameter_error(
                "reset_optimizer", f"must be True or False, got {shown(reset_optimizer, 60)}"
            )
        if not isinstance(option_prefix, str):
            raise parameter_error("option_prefix", f"must be a str, got {shown(option_prefix, 60)}")
        self.detector = SpikeDetector(factor, window)
        self.last = last
        self.reset_optimizer = bool(reset_optimizer)
        self.max_recoveries = max_recoveries
        self.option_prefix = option_prefix
        self.recoveries: list[dict[str, Any]] = []

    def check(
        self,
        loss: float,
        grad_norm: float | None = None,
        *,
        model: torch.nn.Module,
        taker: SnapshotTaker,
        step: int,
        tokens: int,
        optimizer: Any | None = None,
    ) -> dict[str, Any] | None:
        """Every process, with the loss logged at optimizer step ``step``: ``None`` when it is no
        spike; otherwise recover (:func:`recover_from_spike`), record it, and return its record.

        Raises :class:`LossSpikeError` after ``max_recoveries`` recoveries, or when no snapshot
        precedes the spike.
        """
        loss = _number(loss, "loss")
        grad_norm = _number(grad_norm, "grad_norm", allow_none=True)
        check_int(tokens, "tokens", 0)
        _check_module(model, "model")
        if not self.detector.observe(loss, grad_norm, step):
            return None
        prefix = self.option_prefix
        if len(self.recoveries) >= self.max_recoveries:
            raise LossSpikeError(
                f"loss spike at step {step} (loss {loss:.4g}, grad norm {grad_norm}) after "
                f"{len(self.recoveries)} recoveries ({prefix}max_recoveries={self.max_recoveries}): the run keeps "
                "diverging; lower the learning rate or restart from a checkpoint"
            )
        done = recover_from_spike(
            model,
            taker,
            step=step,
            after_step=self.detector.last_healthy_step,
            last=self.last,
            optimizer=optimizer,
            reset_optimizer=self.reset_optimizer,
            loss=loss,
            hint=f"take snapshots earlier (smaller {prefix}interval_tokens, or {prefix}phases including 'warmup')",
        )
        record = {
            "step": int(step),
            "tokens": int(tokens),
            "loss": loss if math.isfinite(loss) else str(loss),
            "grad_norm": grad_norm if grad_norm is None or math.isfinite(grad_norm) else str(grad_norm),
            **done,
        }
        self.recoveries.append(record)
        if taker.is_main and taker.writer is not None:
            taker.writer.update_manifest(recoveries=self.recoveries)
        logger.warning(
            f"PMA recovery #{len(self.recoveries)} at step {step}: loss {loss:.4g}; weights restored to the "
            f"{str(record.get('strategy', 'sma')).upper()} merge of {', '.join(record['snapshots'])}"
            + (" and optimizer moments reset" if record["reset_optimizer"] else "")
        )
        return record
