"""Merge checkpoints straight into a live model's own shards, for merged evaluation at scale.

Every process reads from each checkpoint only the elements it holds and merges them in place:

- a tensor sharded on its first dimension (an FSDP2 ``DTensor`` with ``Shard(0)``: a
  contiguous range of rows is a contiguous range of flat elements) or held as part of an
  FSDP1 flat parameter: this process's elements only;
- a tensor every process holds in full (DDP, a single process, buffers, ``Replicate``
  DTensors): one process merges it (tensors are dealt out by size) and broadcasts it to the
  others, so the whole job reads every checkpoint once, not once per process.

No process builds a full merged state dict; the live weights are backed up per process (its
shards and the replicated tensors it merges), on the CPU, and put back by :meth:`SliceSwap.restore`.
The readers need only ``infos`` and ``read(name, start, stop, buffer)`` over global flat
element ranges, so full and sharded snapshots work alike. The arithmetic is the one of
:func:`hf_pma.merging.engine.merge_state_dict` (chunks aligned on the same global multiples,
the stored dtype's rounding, then the live dtype's), so a process's slice holds exactly
the values a full merge would have put there.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.core.strategies import merge_coefficients
from hf_pma.io.guarded import check_one_version, pin_folders, reads_one_version
from hf_pma.io.torch_adapters import DTYPE_FROM_SAFETENSORS, is_dtensor, local_tensor
from hf_pma.merging.chunks import DEFAULT_CHUNK_BYTES, TensorPlan, chunk_elements, chunk_tasks, run_chunks
from hf_pma.merging.engine import validate_sources
from hf_pma.merging.sources import (
    CheckpointSource,
    CheckpointTensors,
    check_same_model,
    open_all,
    resolve_sources,
)
from hf_pma.utils.distributed import all_ranks_checked, distributed_rank_and_size

logger = logging.get_logger(__name__)

__all__ = ["SliceSwap", "LocalSlot", "local_slots", "reshard", "swap_in_merge"]

# Name parts that wrappers insert (FSDP1, activation checkpointing, torch.compile).
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


@dataclasses.dataclass
class LocalSlot:
    """Elements ``[start, stop)`` of checkpoint tensor ``name`` that live in ``dest`` on this process.

    ``owner`` is ``None`` for this process's own shard, else the rank that merges this
    replicated tensor and broadcasts it (``dest`` is then the whole local tensor).
    """

    name: str
    start: int
    stop: int
    dest: torch.Tensor  # 1-D, contiguous, this process's storage
    owner: int | None = None

    @property
    def numel(self) -> int:
        """Elements in this slot."""
        return self.stop - self.start


def reshard(model: torch.nn.Module) -> None:
    """Put every FSDP1/FSDP2 module back on its shards and free the gathered copies.

    The root keeps its parameters gathered after a forward pass; the next forward would reuse
    that copy instead of gathering the shards that were just written.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
        elif isinstance(module, FullyShardedDataParallel) and module._handle is not None:
            handle = module._handle
            if handle.uses_sharded_strategy:
                handle.reshard(True)
                handle.post_reshard()


def _persistent_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(clean name, tensor) of every parameter and persistent buffer, aliases included."""
    out = [(_clean(n), p) for n, p in model.named_parameters(remove_duplicate=False)]
    for module_name, module in model.named_modules(remove_duplicate=False):
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module._buffers.items():
            if buf is not None and name not in skip:
                out.append((_clean(f"{module_name}.{name}" if module_name else name), buf))
    return [(n, t) for n, t in out if not n.endswith("_flat_param")]


def _checkpoint_name(names: set[str], infos: dict[str, Any], what: str) -> str:
    present = sorted(names & set(infos))
    if not present:
        raise ValueError(f"the checkpoints lack tensor(s) the model needs: {what}")
    return present[0]


def _fsdp1_slots(
    model: torch.nn.Module, infos: dict[str, Any], aliases: dict[str, set[str]]
) -> tuple[list[LocalSlot], set[str]]:
    """This process's elements of every FSDP1 flat parameter, and the names they cover."""
    slots: list[LocalSlot] = []
    covered: set[str] = set()
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return slots, covered
    for module_name, module in model.named_modules():
        if not isinstance(module, FullyShardedDataParallel) or module._handle is None:
            continue
        handle = module._handle
        flat = handle.flat_param
        storage = flat._local_shard if handle.uses_sharded_strategy else flat.detach()
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            full = _clean(f"{module_name}.{fqn}" if module_name else fqn)
            names = aliases.get(full, {full})
            covered |= names
            name = _checkpoint_name(names, infos, full)
            _check_shape(name, tuple(shape), infos)
            if not info.in_shard or not info.numel_in_shard:
                continue
            dest = storage[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            slots.append(LocalSlot(name, info.intra_param_start_idx, info.intra_param_end_idx + 1, dest))
    return slots, covered


def _check_shape(name: str, shape: tuple[int, ...], infos: dict[str, Any]) -> None:
    if tuple(infos[name].shape) != tuple(shape):
        raise ValueError(
            f"tensor {name!r} has shape {list(infos[name].shape)} in the checkpoints but {list(shape)} in the model"
        )


def _dtensor_slot(name: str, tensor: torch.Tensor) -> LocalSlot | None:
    """The slot of this process's shard of a DTensor; ``None`` when it holds no element of it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(tensor.placements)
    if all(isinstance(p, Replicate) for p in placements):
        raise _Replicated
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements):
        raise ValueError(
            f"tensor {name!r} is sharded as {placements}: merged evaluation by local slice supports first-dimension "
            "sharding (FSDP's Shard(0)) only"
        )
    shape = tuple(tensor.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, placements)
    local = local_tensor(tensor.detach())
    numel = math.prod(local_shape)
    if numel == 0:
        return None
    row = math.prod(shape[1:])
    return LocalSlot(name, offset[0] * row, offset[0] * row + numel, _flat(local, name))


class _Replicated(Exception):
    pass


def _flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"tensor {name!r} is not contiguous in memory: it cannot be merged in place")
    return tensor.view(-1)


def local_slots(
    model: torch.nn.Module, infos: dict[str, Any], rank: int = 0, world_size: int = 1
) -> list[LocalSlot]:
    """Where each checkpoint tensor's elements go on this process (see the module docstring).

    Checks names and shapes against ``infos`` (tensor name -> ``.shape``); replicated tensors
    are dealt out to ranks by size, identically on every rank. Tied tensors are merged once.
    """
    reshard(model)
    named = _persistent_tensors(model)
    by_id: dict[int, set[str]] = {}
    for name, tensor in named:
        by_id.setdefault(id(tensor), set()).add(name)
    aliases = {name: by_id[id(tensor)] for name, tensor in named}
    slots, covered = _fsdp1_slots(model, infos, aliases)
    replicated: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for full, tensor in named:
        if full in covered or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        name = _checkpoint_name(aliases[full], infos, full)
        _check_shape(name, tuple(tensor.shape), infos)
        if is_dtensor(tensor):
            try:
                slot = _dtensor_slot(name, tensor)
            except _Replicated:
                replicated.append((name, local_tensor(tensor.detach())))
                continue
            if slot is not None:
                slots.append(slot)
            continue
        replicated.append((name, tensor.detach()))
    unexpected = sorted(set(infos) - set(aliases) - covered)
    if unexpected:
        raise ValueError(
            f"the checkpoints hold tensor(s) the model does not have: {', '.join(unexpected[:5])}"
        )
    load = [0] * world_size
    for name, tensor in sorted(
        replicated, key=lambda item: (-item[1].numel() * item[1].element_size(), item[0])
    ):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += tensor.numel() * tensor.element_size()
        slots.append(LocalSlot(name, 0, tensor.numel(), _flat(tensor, name), owner=owner))
    return sorted(slots, key=lambda s: (s.name, s.start))


class SliceSwap:
    """Merged weights swapped into a live model, this process's part only; :meth:`restore` undoes it.

    Every process of the job constructs it (a collective when several processes run); the
    attributes ``bytes_read`` (this process's reads of checkpoint data) and ``backup_bytes``
    (its CPU copy of the live weights) describe what it cost.
    """

    @reads_one_version
    def __init__(
        self,
        model: torch.nn.Module,
        sources: Sequence[str | os.PathLike[str] | CheckpointSource],
        strategy: str = "sma",
        alpha: float = 0.2,
        weights: Sequence[float] | None = None,
        accumulate_dtype: torch.dtype = torch.float32,
        workers: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.model = model
        self.rank, self.world_size = distributed_rank_and_size()
        srcs = (
            sources
            if all(isinstance(s, CheckpointSource) for s in sources)
            else resolve_sources(list(sources))
        )
        pin_folders(s.path for s in srcs)  # read as one version, or refused before the swap holds
        coefs = merge_coefficients(len(srcs), strategy, alpha, weights)
        check_same_model(srcs)  # one model: configurations compared before the first tensor
        self._slots: list[LocalSlot] = []
        self._backup: list[torch.Tensor] = []
        self.bytes_read = 0
        opened: list[CheckpointTensors] = []

        def merge_mine() -> None:
            opened.extend(open_all(srcs, raw=True))
            infos = validate_sources(srcs, opened)
            self._slots = local_slots(model, infos, self.rank, self.world_size)
            mine = [s for s in self._slots if s.owner in (None, self.rank)]
            self._backup = [s.dest.to("cpu", copy=True) for s in mine]
            chunk_elems = chunk_elements(chunk_bytes, accumulate_dtype)
            tasks = (
                task
                for slot in mine
                for task in chunk_tasks(
                    _plan(slot.name, infos),
                    slot.start,
                    slot.stop,
                    chunk_elems,
                    _into(slot, infos[slot.name].dtype),
                )
            )
            with torch.no_grad():
                run_chunks(
                    tasks, [str(s.path) for s in srcs], opened, coefs, accumulate_dtype, chunk_bytes, workers
                )
            self.bytes_read = len(srcs) * sum(s.numel * infos[s.name].itemsize for s in mine)
            check_one_version()  # on every process: a change anywhere puts the live weights back

        try:
            all_ranks_checked(merge_mine, "merging the snapshots into this process's shards")
        except BaseException:
            self._put_back_local()
            raise
        finally:
            for tensors in opened:
                tensors.close()
        self._broadcast()

    @property
    def backup_bytes(self) -> int:
        """Bytes of this process's CPU copy of the live weights."""
        return sum(t.numel() * t.element_size() for t in self._backup)

    def _mine(self) -> list[LocalSlot]:
        return [s for s in self._slots if s.owner in (None, self.rank)]

    @torch.no_grad()
    def _put_back_local(self) -> None:
        for slot, saved in zip(self._mine(), self._backup):
            slot.dest.copy_(saved)

    @torch.no_grad()
    def _broadcast(self) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        for slot in self._slots:
            if slot.owner is not None:
                dist.broadcast(slot.dest, src=slot.owner)

    def restore(self) -> None:
        """Put the live weights back (every process calls it: replicated tensors are broadcast again)."""
        reshard(self.model)
        self._put_back_local()
        self._broadcast()
        self._backup = []


def _plan(name: str, infos: dict[str, Any]) -> TensorPlan:
    info = infos[name]
    return TensorPlan(name, tuple(info.shape), info.dtype, info.dtype)


def _into(slot: LocalSlot, dtype: str):
    stored = DTYPE_FROM_SAFETENSORS[dtype]

    def sink(start: int, chunk: Any) -> None:  # the merged chunk's bytes, in the stored dtype
        merged = torch.from_numpy(chunk).view(stored)
        slot.dest[start - slot.start : start - slot.start + merged.numel()].copy_(merged)

    return sink


def swap_in_merge(
    model: torch.nn.Module,
    sources: Sequence[str | os.PathLike[str] | CheckpointSource],
    strategy: str = "sma",
    alpha: float = 0.2,
    weights: Sequence[float] | None = None,
    workers: int | None = None,
) -> SliceSwap:
    """Swap the merge of ``sources`` into ``model`` by local slice; call ``.restore()`` afterwards."""
    return SliceSwap(model, sources, strategy=strategy, alpha=alpha, weights=weights, workers=workers)
