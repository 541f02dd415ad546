"""A running average of snapshots kept in memory instead of on disk (``online="sma"|"ema"``).

For users without the disk budget for N snapshot folders. Trade-offs against writing
snapshots and merging afterwards:

* memory: one float32 copy of the model on the main process's CPU, whatever the model's dtype;
* no choice after the fact: ``sma`` averages *every* snapshot since the run started taking
  them (not a window of the last N), ``ema`` weighs recent ones with ``alpha``; the strategy,
  window and exclusions of a spike cannot be changed later;
* it survives a restart only through Trainer checkpoints (the average is saved with each
  checkpoint and restored on resume).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from hf_pma import __version__
from hf_pma.core.manifest import SnapshotRecord
from hf_pma.core.strategies import ema_weights, sma_weights

__all__ = ["ONLINE_KINDS", "OnlineAverage"]

ONLINE_KINDS = ("sma", "ema")


class OnlineAverage:
    """Running float32 average of state dicts: ``sma`` (cumulative mean) or ``ema`` (alpha).

    The EMA follows the paper's recursion ``M^(1) = M_1``, ``M^(i) = a*M_i + (1-a)*M^(i-1)``, so
    after n updates it equals :func:`hf_pma.core.strategies.ema_weights` applied to the n snapshots.
    Integer and bool tensors (buffers) are not averaged: they must not change between updates.
    """

    def __init__(self, kind: str = "sma", alpha: float = 0.2) -> None:
        if kind not in ONLINE_KINDS:
            raise ValueError(f"online must be one of {ONLINE_KINDS} or None, got {kind!r}")
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"online_alpha must be in (0, 1], got {alpha!r}")
        self.kind = kind
        self.alpha = float(alpha)
        self.count = 0
        self.records: list[SnapshotRecord] = []
        self._average: dict[str, torch.Tensor] = {}
        # The raw ``__metadata__`` of the file :meth:`load_state` read (empty otherwise).
        self.metadata: dict[str, str] = {}

    def update(self, state_dict: dict[str, torch.Tensor], record: SnapshotRecord | None = None) -> None:
        """Fold one snapshot into the average (CPU tensors of any floating dtype)."""
        if self.count == 0:
            self._average = {
                k: (v.detach().to("cpu", torch.float32, copy=True) if v.is_floating_point() else v.detach().cpu().clone())
                for k, v in state_dict.items()
            }
        else:
            if set(state_dict) != set(self._average):
                diff = sorted(set(state_dict) ^ set(self._average))[:5]
                raise ValueError(f"online average: the snapshot's tensor names differ from the average's: {diff}")
            weight = 1.0 / (self.count + 1) if self.kind == "sma" else self.alpha
            for name, tensor in state_dict.items():
                average = self._average[name]
                if average.is_floating_point():
                    average.mul_(1.0 - weight).add_(tensor.detach().to("cpu"), alpha=weight)
                elif not torch.equal(average, tensor.detach().cpu()):
                    raise ValueError(f"online average: non-float tensor {name!r} changed between snapshots")
        self.count += 1
        if record is not None:
            self.records.append(record)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A copy of the average (float32, or cast to ``dtype``)."""
        out = {}
        for name, tensor in self._average.items():
            target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
            out[name] = tensor.to(target, copy=True)
        return out

    def weights(self) -> list[float]:
        """The weight of each averaged snapshot, oldest first (what a merge of them would use)."""
        if self.count == 0:
            return []
        return sma_weights(self.count) if self.kind == "sma" else ema_weights(self.count, self.alpha)

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
            "alpha": self.alpha if self.kind == "ema" else None,
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

    def save_state(self, path: str | os.PathLike[str], extra_metadata: dict[str, str] | None = None) -> None:
        """Save the average and its bookkeeping to one safetensors file (for checkpoints);
        ``extra_metadata`` is stored beside (a sharded average's rank, world size and slices)."""
        from hf_pma.snapshots.writer import write_safetensors

        metadata = {
            **(extra_metadata or {}),
            "kind": self.kind,
            "alpha": repr(self.alpha),
            "count": str(self.count),
            "records": json.dumps([r.to_dict() for r in self.records]),
        }
        tmp = f"{os.fspath(path)}.tmp"
        write_safetensors(tmp, self._average, metadata=metadata)
        os.replace(tmp, path)

    @classmethod
    def load_state(cls, path: str | os.PathLike[str]) -> OnlineAverage:
        """Rebuild an average saved by :meth:`save_state` (read through :mod:`hf_pma.io.guarded`:
        confined to the checkpoint folder holding it, header bounded, metadata checked)."""
        from hf_pma.io.guarded import parse_json
        from hf_pma.io.safetensors import SafetensorsReader
        from hf_pma.io.torch_adapters import TorchTensors
        from hf_pma.utils.text import escape

        with TorchTensors(SafetensorsReader(path)) as tensors:
            metadata = tensors.raw.metadata
            try:
                alpha = float(metadata["alpha"])
                count = int(metadata["count"]) if len(metadata["count"]) <= 20 else -1
                records = parse_json(metadata["records"], f"{escape(path)}: metadata 'records'")
                if not math.isfinite(alpha) or not 0 <= count < 2**63 or not isinstance(records, list):
                    raise ValueError("'alpha', 'count' or 'records' out of range")
                average = cls(metadata["kind"], alpha)
                average.count = count
                average.records = [SnapshotRecord.from_dict(d, f"{escape(path)}: records") for d in records]
                average.metadata = dict(metadata)
            except (KeyError, ValueError) as err:
                raise ValueError(f"{escape(path)} is not an hf-pma online average: {escape(err)}") from None
            average._average = tensors.state_dict()
        return average
