"""A running average of snapshots kept in memory instead of on disk (``online=...``).

For users without the disk budget for N snapshot folders. Trade-offs against writing
snapshots and merging afterwards:

* memory: one float32 copy of the model on the main process's CPU, whatever the model's dtype
  (under FSDP / ZeRO-3, one float32 copy of each rank's own slices on that rank:
  :class:`hf_pma.snapshots.sharded.ShardedOnlineAverageSink`), or on the device with
  ``device="device"`` (``PMACallback(online_device="device")``: no host copy at all; files
  are written from host copies made one tensor at a time);
* no choice after the fact: the strategy, window and exclusions of a spike cannot be changed
  later;
* it survives a restart only through Trainer checkpoints (the average is saved with each
  checkpoint and restored on resume, bit for bit; staged before the checkpoint is written, so a
  kill between the two loses nothing: :meth:`hf_pma.snapshots.sinks.OnlineAverageSink.stage_checkpoint`).

The kinds, each one float32 copy of the weights, and the offline merge each one equals:

* ``sma``: the mean of every snapshot so far (``hf-pma merge`` of them all, ``--strategy sma``);
  with ``window_tokens=T``, of the snapshots in the current *tumbling* window of T tokens
  (``(kT, (k+1)T]``; the average restarts at each multiple of T): the SMA of those snapshots;
* ``ema``: ``M = a*M_i + (1-a)*M`` from the first snapshot (``--strategy ema --alpha a``); with
  ``half_life_tokens=H``, ``a = 1 - 2^(-dt/H)`` where ``dt`` is the tokens since the previous
  snapshot, so a snapshot's weight halves every H tokens whatever the interval V (the merge
  with the weights in ``pma_merge.json``); with ``half_life_fraction=f``, the same with
  ``H = f * t``, ``t`` the tokens seen at the snapshot folded in: a horizon-free EMA (as
  torchtitan's ``half_life_fraction``) that reaches back a fixed share of the run however long
  it gets, for runs that keep no snapshots and do not know their length
  (:func:`hf_pma.core.strategies.ema_half_life_updates` gives its weights from the token counts);
* ``linear-decay``, ``cosine-decay``, ``1-sqrt-decay`` (WSM's decay emulation; needs
  ``window_tokens=T``): inside each tumbling window, snapshot ``j`` weighs
  ``f((t_{j-1} - kT)/T) - f((t_j - kT)/T)`` (``f`` the decay shape, ``t_0 = kT``); with
  snapshots every V tokens and T = nV that is ``--strategy <shape>-decay`` over the window's n
  snapshots; before the window is full, the same weights normalised over the snapshots so far.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from hf_pma.core.manifest import SnapshotRecord
from hf_pma.core.strategies import DECAY_SHAPES, ema_half_life_update, running_average_weights
from hf_pma.utils.parsing import check_int, is_number
from hf_pma.utils.text import escape, shown
from hf_pma.utils.version import __version__

__all__ = ["ONLINE_DEVICES", "ONLINE_KINDS", "OnlineAverage", "effective_weights"]

ONLINE_KINDS = ("sma", "ema", "linear-decay", "cosine-decay", "1-sqrt-decay")
# Where the float32 average lives: host memory, or the device of the tensors folded in.
ONLINE_DEVICES = ("cpu", "device")
DEFAULT_ALPHA = 0.2  # the EMA factor when none is given


def effective_weights(update_weights: list[float]) -> list[float]:
    """The weight of each snapshot in a running average whose i-th update was
    ``M = a_i * M_i + (1 - a_i) * M`` (:func:`hf_pma.core.strategies.running_average_weights`)."""
    return running_average_weights(update_weights)


class OnlineAverage:
    """Running float32 average of state dicts (see the module docstring for the kinds).

    Every update is ``M = a * M_i + (1 - a) * M`` with ``a`` from the kind (``1/i`` for SMA,
    ``alpha`` or the half-life for EMA, ``c_j / sum(c)`` for the decay kinds); ``update_weights``
    keeps each ``a``, so :meth:`weights` gives every snapshot's weight in the average. The EMA
    follows the paper's recursion ``M^(1) = M_1``, so after n updates it equals
    :func:`hf_pma.core.strategies.ema_weights` applied to the n snapshots. Integer and bool
    tensors (buffers) are not averaged: they must not change between updates.
    """

    def __init__(
        self,
        kind: str = "sma",
        alpha: float = DEFAULT_ALPHA,
        *,
        half_life_tokens: int | None = None,
        window_tokens: int | None = None,
        device: str = "cpu",
        half_life_fraction: float | None = None,
    ) -> None:
        if device not in ONLINE_DEVICES:
            raise ValueError(f"online_device must be one of {ONLINE_DEVICES}, got {shown(device, 60)}")
        if kind not in ONLINE_KINDS:
            raise ValueError(f"online must be one of {ONLINE_KINDS} or None, got {shown(kind, 60)}")
        if not (is_number(alpha) and 0.0 < alpha <= 1.0):
            raise ValueError(f"online_alpha must be in (0, 1], got {shown(alpha, 60)}")
        self.half_life_tokens = check_int(half_life_tokens, "online_half_life_tokens", allow_none=True)
        self.window_tokens = check_int(window_tokens, "online_window_tokens", allow_none=True)
        if half_life_fraction is not None and not (is_number(half_life_fraction) and 0.0 < half_life_fraction <= 1.0):
            raise ValueError(f"online_half_life_fraction must be in (0, 1], got {shown(half_life_fraction, 60)}")
        self.half_life_fraction = float(half_life_fraction) if half_life_fraction is not None else None
        # The horizon-free half-life is one of three ways to set the EMA's decay (alpha: other than its default).
        given = {"online_alpha": alpha != DEFAULT_ALPHA, "online_half_life_tokens": half_life_tokens is not None}
        if half_life_fraction is not None and any(given.values()):
            decays = [name for name, value in given.items() if value]
            raise ValueError(f"online_half_life_fraction and {decays[0]} each set the EMA's decay: give one")
        for name, value in (("tokens", self.half_life_tokens), ("fraction", self.half_life_fraction)):
            if value is not None and kind != "ema":
                raise ValueError(f"online_half_life_{name} is for online='ema', not {kind!r}")
        if self.window_tokens is not None and kind == "ema":
            raise ValueError("online_window_tokens is for online='sma' or a decay kind; an EMA has no window")
        if kind.endswith("-decay") and self.window_tokens is None:
            raise ValueError(f"online={kind!r} emulates a decay over a window: give online_window_tokens")
        self.kind = kind
        self.alpha = float(alpha)
        # "cpu": the float32 average in host memory; "device": beside the tensors folded in.
        self.device = device
        self.count = 0
        self.records: list[SnapshotRecord] = []
        self.update_weights: list[float] = []  # ``a`` of every update of the current window
        self.window_start: int | None = None  # first token of the current window (``window_tokens``)
        self.last_tokens: int | None = None  # tokens of the last snapshot
        self.coef_sum = 0.0  # decay kinds: the sum of the window's coefficients so far
        self._average: dict[str, torch.Tensor] = {}
        # The raw ``__metadata__`` of the file :meth:`load_state` read (empty otherwise), and its path.
        self.metadata: dict[str, str] = {}
        self.source: str | None = None
        # (optimizer step, tokens) of the checkpoint :meth:`save_state` wrote it for (``None``: not
        # said, a file of an older hf-pma): a checkpoint of another step must not resume from it.
        self.saved_at: tuple[int, int] | None = None

    @property
    def options(self) -> dict[str, Any]:
        """What defines the average (compared when a saved one is restored)."""
        return {
            "kind": self.kind,
            "alpha": self.alpha if self._by_alpha else None,
            "half_life_tokens": self.half_life_tokens,
            "half_life_fraction": self.half_life_fraction,
            "window_tokens": self.window_tokens,
        }

    @property
    def _by_alpha(self) -> bool:
        """An EMA whose every update weighs ``alpha`` (no half-life)."""
        return self.kind == "ema" and self.half_life_tokens is None and self.half_life_fraction is None

    def _next_weight(self, tokens: int | None) -> float:
        """``a`` of the next update (and the window bookkeeping: a new window restarts the average)."""
        if tokens is None and (self.window_tokens or self.half_life_tokens or self.half_life_fraction):
            raise ValueError("online average: a windowed or half-life average needs each snapshot's tokens")
        if self.window_tokens is not None:
            start = (max(tokens, 1) - 1) // self.window_tokens * self.window_tokens
            if start != self.window_start:  # a new tumbling window: the average restarts
                self.window_start, self.count, self.records, self.update_weights = start, 0, [], []
                self.coef_sum, self.last_tokens = 0.0, start
        previous, self.last_tokens = self.last_tokens, tokens
        if self.count == 0:
            if self.kind.endswith("-decay"):
                self.coef_sum = self._decay_coefficient(previous, tokens)
            return 1.0
        if self.kind == "sma":
            return 1.0 / (self.count + 1)
        if self.kind == "ema":
            if self._by_alpha:
                return self.alpha
            return ema_half_life_update(
                previous, tokens, half_life_tokens=self.half_life_tokens, half_life_fraction=self.half_life_fraction
            )
        coefficient = self._decay_coefficient(previous, tokens)
        self.coef_sum += coefficient
        return coefficient / self.coef_sum if self.coef_sum > 0 else 0.0

    def _decay_coefficient(self, previous: int | None, tokens: int) -> float:
        f = DECAY_SHAPES[self.kind[: -len("-decay")]]
        start = self.window_start or 0
        position = lambda t: min(1.0, max(0.0, (t - start) / self.window_tokens))  # noqa: E731
        return max(0.0, f(position(previous if previous is not None else start)) - f(position(tokens)))

    def update(
        self, state_dict: dict[str, torch.Tensor], record: SnapshotRecord | None = None, *, tokens: int | None = None
    ) -> None:
        """Fold one snapshot into the average (CPU or device tensors of any floating dtype, one
        tensor at a time); ``tokens`` (default: ``record.tokens``) places it in its window."""
        if self._average:
            self._check_same_tensors(state_dict)
        weight = self._next_weight(tokens if tokens is not None else (record.tokens if record is not None else None))
        on_device = self.device == "device"
        if self.count == 0 and not self._average:
            self._average = {
                k: v.detach().to(v.device if on_device else "cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                for k, v in state_dict.items()
            }
        else:
            for name, tensor in state_dict.items():
                average = self._average[name]
                if on_device and average.device != tensor.device:  # restored from a file: onto the device once
                    average = self._average[name] = average.to(tensor.device)
                if average.is_floating_point():
                    if weight == 1.0:
                        average.copy_(tensor.detach())
                    else:
                        average.mul_(1.0 - weight).add_(tensor.detach().to(average.device), alpha=weight)
                elif not torch.equal(average, tensor.detach().to(average.device)):
                    changed = f"non-float tensor {shown(name)} changed between snapshots"
                    raise ValueError(f"online average: {changed}")
        self.update_weights.append(weight)
        self.count += 1
        if record is not None:
            self.records.append(record)

    def _check_same_tensors(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``ValueError`` (one line, before anything is folded in) when ``state_dict`` has other
        tensor names or shapes than the average (a restored one: from another model)."""
        where = f"online average (restored from {escape(self.source)})" if self.source else "online average"
        if set(state_dict) != set(self._average):
            diff = sorted(set(state_dict) ^ set(self._average))[:5]
            raise ValueError(f"{where}: the snapshot's tensor names differ from the average's: {shown(diff)}")
        for name, tensor in state_dict.items():
            average = self._average[name]
            kinds = (tensor.is_floating_point(), average.is_floating_point())
            if tuple(tensor.shape) != tuple(average.shape) or kinds[0] != kinds[1]:
                dtypes = [str(t.dtype).removeprefix("torch.") for t in (tensor, average)]
                raise ValueError(
                    f"{where}: tensor {shown(name)} is {dtypes[0]} of shape {tuple(tensor.shape)} in the "
                    f"snapshot but {dtypes[1]} of shape {tuple(average.shape)} in the average"
                )

    def check_tensors(self, where: str) -> None:
        """``ValueError`` (one line naming ``where``, the file read) unless every floating tensor
        of the average is float32 and finite: what :meth:`update` keeps, so a file holding
        anything else was not written by it (or the run it averages had diverged)."""
        for name, tensor in self._average.items():
            problem = None
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                problem = f"is {str(tensor.dtype).removeprefix('torch.')}, not float32"
            elif tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                problem = "holds NaN or infinite values"
            if problem is not None:
                raise ValueError(f"{where} is not an hf-pma online average: tensor {shown(name)} {problem}")

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A copy of the average in host memory (float32, or cast to ``dtype``; an average kept on
        the device is cast there, then copied to the host one tensor at a time)."""
        out = {}
        for name, tensor in self._average.items():
            target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
            out[name] = tensor.to(target, copy=True) if tensor.device.type == "cpu" else tensor.to(target).to("cpu")
        return out

    def weights(self) -> list[float]:
        """The weight of each averaged snapshot, oldest first (what a merge of them would use)."""
        return effective_weights(self.update_weights)

    def merge_record(self, interval_tokens: int | None, dtype: str | None) -> dict[str, Any]:
        """The ``pma_merge.json`` of a folder holding this average."""
        weights = self.weights()
        sources = []
        for record, weight in zip(self.records, weights):
            sources.append(
                {
                    "name": record.path,
                    "path": None,  # online snapshots are never written
                    "tokens": record.tokens,
                    "step": record.step,
                    "lr": record.lr,
                    "loss": record.loss,
                    "phase": record.phase,
                    "weight": weight,
                }
            )
        return {
            "hf_pma_version": __version__,
            "strategy": self.kind,
            "alpha": self.alpha if self._by_alpha else None,
            "half_life_tokens": self.half_life_tokens,
            "half_life_fraction": self.half_life_fraction,
            "window_tokens": self.window_tokens,
            "window_start_tokens": self.window_start,
            "weights": weights,
            "dtype": dtype,
            "accumulate_dtype": "float32",
            "created": time.time(),
            "interval_tokens": interval_tokens,
            "online": True,
            "sources": sources,
        }

    @property
    def num_bytes(self) -> int:
        """Bytes of memory the average holds."""
        return sum(t.numel() * t.element_size() for t in self._average.values())

    def save_state(
        self,
        path: str | os.PathLike[str],
        extra_metadata: dict[str, str] | None = None,
        *,
        at: tuple[int, int] | None = None,
    ) -> None:
        """Save the average and its bookkeeping to one safetensors file (for checkpoints), atomically
        (a temporary name, fsync, rename); ``extra_metadata`` is stored beside (a sharded average's
        rank, world size and slices), ``at`` (the checkpoint's optimizer step and tokens) as
        ``saved_at``, what :meth:`load_state` gives back as :attr:`saved_at`."""
        from hf_pma.snapshots.writer import write_safetensors
        from hf_pma.utils.fs import atomic_write_file

        metadata = {
            **(extra_metadata or {}),
            "kind": self.kind,
            "alpha": repr(self.alpha),
            "count": str(self.count),
            "records": json.dumps([r.to_dict() for r in self.records]),
            "online_state": json.dumps(
                {
                    "half_life_tokens": self.half_life_tokens,
                    "half_life_fraction": self.half_life_fraction,
                    "window_tokens": self.window_tokens,
                    "update_weights": self.update_weights,
                    "window_start": self.window_start,
                    "last_tokens": self.last_tokens,
                    "coef_sum": self.coef_sum,
                }
            ),
        }
        if at is not None:
            metadata["saved_at"] = json.dumps({"step": int(at[0]), "tokens": int(at[1])})
        atomic_write_file(path, lambda tmp: write_safetensors(tmp, self._average, metadata=metadata))

    @classmethod
    def load_state(cls, path: str | os.PathLike[str]) -> OnlineAverage:
        """Rebuild an average saved by :meth:`save_state` (read through :mod:`hf_pma.io.guarded`:
        confined to the checkpoint folder holding it, header bounded, metadata checked)."""
        from hf_pma.io.guarded import parse_json
        from hf_pma.io.safetensors import SafetensorsReader
        from hf_pma.io.torch_adapters import TorchTensors

        with TorchTensors(SafetensorsReader(path)) as tensors:
            metadata = tensors.raw.metadata
            try:
                alpha = float(metadata["alpha"])
                count = int(metadata["count"]) if len(metadata["count"]) <= 20 else -1
                records = parse_json(metadata["records"], f"{escape(path)}: metadata 'records'")
                if not math.isfinite(alpha) or not 0 <= count < 2**63 or not isinstance(records, list):
                    raise ValueError("'alpha', 'count' or 'records' out of range")
                state = parse_json(metadata.get("online_state", "{}"), f"{escape(path)}: metadata 'online_state'")
                if not isinstance(state, dict):
                    raise ValueError("'online_state' is not an object")
                average = cls(
                    metadata["kind"],
                    alpha,
                    half_life_tokens=state.get("half_life_tokens"),
                    window_tokens=state.get("window_tokens"),
                    half_life_fraction=state.get("half_life_fraction"),
                )
                average.count = count
                average.records = [SnapshotRecord.from_dict(d, f"{escape(path)}: records") for d in records]
                if average.records and len(average.records) != count:
                    raise ValueError(f"'count' is {count} but 'records' holds {len(average.records)}")
                average._load_bookkeeping(state)
                average.saved_at = _saved_at(metadata, path)
                average.metadata = dict(metadata)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{escape(path)} is not an hf-pma online average: {escape(err)}") from None
            average._average = tensors.state_dict()
        average.check_tensors(escape(path))
        average.source = os.fspath(path)
        return average

    def _load_bookkeeping(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`save_state` stored beside the tensors (checked; an older file
        without it: the SMA / EMA weights its count implies)."""
        weights = state.get("update_weights")
        if weights is None:  # written before the token windows: plain SMA or EMA
            weights = [1.0] + [1.0 / (i + 1) if self.kind == "sma" else self.alpha for i in range(1, self.count)]
        if (
            not isinstance(weights, list)
            or len(weights) != self.count
            or not all(isinstance(w, (int, float)) and 0.0 <= w <= 1.0 for w in weights)
        ):
            raise ValueError("'update_weights' does not match 'count'")
        if weights and weights[0] != 1.0:
            raise ValueError("'update_weights' does not start a window with 1.0")
        self.update_weights = [float(w) for w in weights]
        for key in ("window_start", "last_tokens"):
            value = state.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63):
                raise ValueError(f"{key!r} is not a token count")
            setattr(self, key, value)
        coef_sum = state.get("coef_sum", 0.0)
        if not isinstance(coef_sum, (int, float)) or not math.isfinite(coef_sum) or coef_sum < 0:
            raise ValueError("'coef_sum' is not a finite non-negative number")
        self.coef_sum = float(coef_sum)
        self._check_positions()

    def _check_positions(self) -> None:
        """Where the restored average stands agrees with itself: its last snapshot's tokens are
        the last record's, inside the current window; a decay kind's coefficient sum is what the
        window's snapshots give (``f(0) - f(position of the last)``). Otherwise the next update
        would restart the window, or weigh the next snapshot wrongly, without a word."""
        if self.count == 0:
            return
        last = self.last_tokens
        if (self.window_tokens or self.half_life_tokens or self.half_life_fraction) and last is None:
            raise ValueError("'last_tokens' is missing")
        recorded = self.records[-1].tokens if self.records else None
        if recorded is not None and last is not None and recorded != last:
            raise ValueError(f"'last_tokens' is {last} but the last record was taken at {recorded} tokens")
        if self.window_tokens is None:
            return
        start = self.window_start
        if start is None or start % self.window_tokens or not start <= last <= start + self.window_tokens:
            raise ValueError(f"'window_start' {start} is not the window of 'last_tokens' {last}")
        if self.kind.endswith("-decay"):
            expected = self._decay_coefficient(start, last)
            if not math.isclose(self.coef_sum, expected, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(f"'coef_sum' is {self.coef_sum!r}, not {expected!r} for its window")

    def check_same_options(self, other: OnlineAverage, where: str) -> None:
        """``ValueError`` (one line) when ``other`` (a restored average) was taken with other options."""
        if other.options != self.options:
            raise ValueError(
                f"hf-pma: {where} holds an online average taken with {other.options}; this run asks for "
                f"{self.options}: resume with the same online options"
            )


def _saved_at(metadata: dict[str, str], path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """The ``saved_at`` of a saved average's metadata (``None`` when absent); ``ValueError`` when
    it is not an optimizer step and a token count."""
    from hf_pma.io.guarded import parse_json

    if "saved_at" not in metadata:
        return None
    value = parse_json(metadata["saved_at"], f"{escape(path)}: metadata 'saved_at'")
    counts = [value.get(key) for key in ("step", "tokens")] if isinstance(value, dict) else [None]
    if len(counts) != 2 or not all(type(c) is int and 0 <= c < 2**63 for c in counts):
        raise ValueError("'saved_at' is not an optimizer step and a token count")
    return counts[0], counts[1]
