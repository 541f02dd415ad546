"""Gather the full weights of a (possibly sharded) model onto the main process's CPU.

:func:`gather_full_state_dict` returns a full CPU copy of the weights on the main process, from a
plain, DDP, FSDP1/FSDP2 or DeepSpeed ZeRO-3 model. Every rank must call it (sharded models
gather collectively); other ranks get ``None``. :func:`sharding_kind` says which case a model
is, :func:`unwrap_model` finds the model inside its wrappers (both from
:mod:`hf_pma.utils.distributed`). Nothing here writes files: that
is :mod:`hf_pma.snapshots.writer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from hf_pma.io.torch_adapters import SAFETENSORS_FROM_DTYPE, is_dtensor, local_tensor
from hf_pma.utils.distributed import sharding_kind, unwrap_model
from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import parse_dtype

logger = get_logger(__name__)

__all__ = [
    "unwrap_model",
    "sharding_kind",
    "gather_full_state_dict",
    "full_state_dict_bytes",
    "LocalSlice",
    "StagedShard",
    "StagingBuffers",
    "local_slices",
    "zero3_partition",
]


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    """Address of a tensor's memory (a DTensor's local shard), ``None`` when it has none."""
    try:
        return local_tensor(tensor).untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _is_main_process() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def _copy_to_cpu(
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Copy tensors to CPU memory (casting floats to ``dtype``), keeping aliases shared.

    Tied weights stay one tensor under two names so that ``remove_tied_weights_from_state_dict``
    recognises them. ``buffers`` (an earlier result nobody uses any more) are reused where
    name, shape and dtype match: no page faults, no new pinned memory. Device tensors go
    through pinned memory without blocking, then one sync.
    """
    buffers = buffers or {}
    used: set[int] = set()
    copies: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    on_device = False
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach()
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
        )
        if key not in copies:
            target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
            pinned = tensor.device.type == "cuda"
            on_device = on_device or tensor.device.type != "cpu"
            buffer = buffers.get(name)
            if (
                buffer is None
                or id(buffer) in used
                or buffer.shape != tensor.shape
                or buffer.dtype != target
                or (pinned and not buffer.is_pinned())
            ):
                buffer = torch.empty(tensor.shape, dtype=target, device="cpu", pin_memory=pinned)
            used.add(id(buffer))
            copies[key] = buffer.copy_(tensor, non_blocking=pinned)
        out[name] = copies[key]
    if on_device and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def host_buffer_plan(
    state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    """What :func:`_copy_to_cpu` will allocate for ``state_dict``: ``(name, shape, dtype, pinned)``
    per tensor, aliases (tied weights) once, under their first name. Reads shapes only."""
    plan, seen = [], set()
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        key = (_storage_ptr(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        plan.append((name, tuple(tensor.shape), target, tensor.device.type == "cuda"))
    return plan


class HostBufferReservation:
    """Host buffers allocated on a background thread from train begin, so that the first snapshot
    only copies into them (allocating, and pinning from CUDA, would otherwise block the training
    thread at the first snapshot). :meth:`buffers` waits for the thread and hands the buffers over
    once; the caller reuses them as if an earlier snapshot had left them."""

    def __init__(self, plan: Sequence[tuple[str, tuple[int, ...], torch.dtype, bool]]) -> None:
        self._result: dict[str, torch.Tensor] = {}
        self._thread = threading.Thread(target=self._allocate, args=(list(plan),), name="hf-pma-buffers", daemon=True)
        self._thread.start()

    def _allocate(self, plan: list[tuple[str, tuple[int, ...], torch.dtype, bool]]) -> None:
        try:
            for name, shape, dtype, pinned in plan:
                self._result[name] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
        except Exception as err:  # no memory now: the first snapshot allocates what is missing
            logger.debug(f"hf-pma: host buffers not reserved at train begin ({err})")

    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers allocated (waiting for the thread); ``{}`` once handed over."""
        self._thread.join()
        result, self._result = self._result, {}
        return result


# ---------------------------------------------------------------------------------------------
# Which slices does this rank hold?
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LocalSlice:
    """The part of one full tensor that this rank holds: where it sits and the live local data.

    ``offsets``/``sizes`` are a box in the full tensor (as DCP records them), or, with
    ``flat=True``, a range ``[offsets[0], offsets[0] + sizes[0])`` of the flattened full tensor.
    """

    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    flat: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


# ---------------------------------------------------------------------------------------------
# Staging: this rank's slices copied into reused host buffers, off the training stream
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StagedShard:
    """This rank's slices of one snapshot, on the host, ready to be read off the training thread."""

    slices: list[LocalSlice]  # metadata only (their ``tensor`` is not used after staging)
    buffers: list[torch.Tensor]  # flat host copies, in the saved dtype
    event: Any | None = None  # CUDA event to wait for before reading ``buffers``

    def synchronize(self) -> None:
        """Wait until the device-to-host copies have landed (nothing on the CPU)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class StagingBuffers:
    """Host buffers for this rank's slices, allocated once and reused by every snapshot (the
    sharded snapshots' and the online average's one way to copy weights to the host).

    ``stage`` casts each slice to ``dtype`` on its device (so a bf16 snapshot of fp32 CUDA weights
    never costs an fp32 host copy), then copies it into its buffer. On CUDA the buffers are
    pinned and the casts and copies are enqueued on a side stream, without blocking the CPU
    thread: the side stream first waits for the training stream (the weights of this step are
    final), one event is recorded on it after the copies, and the training stream waits for that
    event (``wait_event``: the next optimizer step cannot overwrite a weight before it is copied,
    and the CPU thread goes on at once). Whoever reads the buffers calls
    :meth:`StagedShard.synchronize` first. On CPU a cast-while-copying ``copy_``, no CUDA call.
    The caller must not stage again before the previous staged shard has been read.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: Any | None = None  # the side stream (CUDA), made at the first stage
        self._reservation: HostBufferReservation | None = None

    def reserve(self, slices: Sequence[LocalSlice], dtype: torch.dtype | None = None) -> None:
        """Allocate the buffers of ``slices`` on a background thread now (train begin), so that the
        first :meth:`stage` only copies."""
        plan = []
        for s in slices:
            source = s.tensor
            target = dtype if (dtype is not None and source.is_floating_point()) else source.dtype
            plan.append((s.name, (s.numel,), target, source.device.type == "cuda"))
        self._reservation = HostBufferReservation(plan)

    def _take_reservation(self) -> None:
        if self._reservation is not None:
            self._buffers.update(self._reservation.buffers())
            self._reservation = None

    @property
    def num_bytes(self) -> int:
        """Host bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        """Free the buffers (the next ``stage`` allocates again)."""
        self._take_reservation()
        self._buffers = {}

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def stage(self, slices: Sequence[LocalSlice], dtype: torch.dtype | None = None) -> StagedShard:
        """Copy ``slices`` (cast to ``dtype`` when floating) into the host buffers."""
        self._take_reservation()
        device = next((s.tensor.device for s in slices if s.tensor.device.type == "cuda"), None)
        current = side = None
        if device is not None:
            current = torch.cuda.current_stream(device)
            side = self._side_stream(device)
            side.wait_stream(current)  # this step's weights are final on the side stream too
        buffers: list[torch.Tensor] = []
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for s in slices:
                source = s.tensor.detach()
                target = dtype if (dtype is not None and source.is_floating_point()) else source.dtype
                if target not in SAFETENSORS_FROM_DTYPE:
                    raise ValueError(f"tensor {s.name!r} has dtype {target}, which safetensors cannot store")
                pinned = source.device.type == "cuda"
                buffer = self._buffers.get(s.name)
                if (
                    buffer is None
                    or buffer.numel() != s.numel
                    or buffer.dtype != target
                    or (pinned and not buffer.is_pinned())
                ):
                    buffer = torch.empty(s.numel, dtype=target, device="cpu", pin_memory=pinned)
                    self._buffers[s.name] = buffer
                flat = source.reshape(-1) if source.is_contiguous() else source.contiguous().reshape(-1)
                if source.device.type != "cpu" and flat.dtype != target:
                    flat = flat.to(target)  # cast on the device: only the saved dtype crosses to the host
                buffer.copy_(flat, non_blocking=pinned)
                buffers.append(buffer)
            event = None
            if side is not None:
                event = torch.cuda.Event()
                event.record(side)
        if event is not None:
            current.wait_event(event)  # the training stream, not the CPU thread, waits for the copies
        meta = [dataclasses.replace(s, tensor=torch.empty(0)) for s in slices]
        return StagedShard(meta, buffers, event)


# ---------------------------------------------------------------------------------------------
# Which slices does this rank hold?
# ---------------------------------------------------------------------------------------------


def zero3_partition(param: Any, rank: int) -> tuple[int, int]:
    """``(start, length)``: the flat elements of a ZeRO-3 parameter that ``rank``'s ``ds_tensor`` holds.

    DeepSpeed pads a parameter's ``ds_numel`` elements to ``world * partition`` and gives rank r
    ``[r * partition, (r + 1) * partition)``, where ``partition = ds_tensor.ds_numel``; the padding
    at the end (and whole partitions past the end) hold no weights.
    """
    partition = int(getattr(param.ds_tensor, "ds_numel", param.ds_tensor.numel()))
    numel = int(param.ds_numel)
    start = min(numel, rank * partition)
    return start, max(0, min(partition, numel - start))


def _replica_owner(tensor: Any) -> bool:
    """For a DTensor: whether this rank is the first replica of its slice (coordinate 0 on every
    mesh dimension where the tensor is replicated), so that each slice is written once."""
    from torch.distributed.tensor import Replicate

    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if isinstance(p, Replicate))


def _slices_of(name: str, value: Any, rank: int) -> list[LocalSlice]:
    shape = tuple(value.shape)
    if is_dtensor(value) and hasattr(value, "__create_chunk_list__"):
        if not _replica_owner(value):
            return []
        chunks = value.__create_chunk_list__()
        local = local_tensor(value)
        if len(chunks) != 1:
            raise ValueError(f"tensor {name!r}: a DTensor with {len(chunks)} local chunks is not supported")
        chunk = chunks[0]
        return [LocalSlice(name, local, tuple(chunk.offsets), tuple(chunk.sizes), shape)]
    if hasattr(value, "local_shards"):  # FSDP1's ShardedTensor
        return [
            LocalSlice(name, shard.tensor, tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes), shape)
            for shard in value.local_shards()
        ]
    if not isinstance(value, torch.Tensor):
        return []
    # An unsharded tensor (a buffer, a replicated parameter): rank 0 writes it.
    return [LocalSlice(name, value, (0,) * len(shape), shape, shape)] if rank == 0 else []


def _kept_names(module: torch.nn.Module, names: Sequence[str], identity: dict[str, int]) -> list[str]:
    """The names ``save_pretrained`` would store: tied duplicates dropped (the same choice as the
    full-gather path), decided from the parameters' identity so every rank agrees."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # other transformers versions: keep every key
        return list(names)
    if not isinstance(module, PreTrainedModel):
        return list(names)
    stand_ins: dict[int, torch.Tensor] = {}
    state = {n: stand_ins.setdefault(identity[n], torch.empty(1)) for n in names}
    kept = remove_tied_weights_from_state_dict(dict(state), module)
    reverted = revert_weight_conversion(module, dict(kept))
    if set(reverted) != set(kept):
        raise ValueError(
            f"{type(module).__name__} converts its weights at load time (e.g. fused experts); sharded snapshots store "
            "the live tensors and cannot revert that conversion: use PMACallback(sharded=False)"
        )
    return [n for n in names if n in kept]


def local_slices(model: torch.nn.Module, rank: int | None = None, drop_tied: bool = True) -> list[LocalSlice]:
    """This rank's slices of every tensor of the state dict, for FSDP1/FSDP2, DeepSpeed ZeRO-3,
    or an unsharded model (then rank 0 holds everything).

    With ``drop_tied`` only the tensors ``save_pretrained`` would store (tied duplicates dropped,
    decided from the parameters' identity so every rank agrees).
    """
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    kind = sharding_kind(model)
    module = unwrap_model(model)
    slices: list[LocalSlice] = []
    if kind == "zero3":
        import torch.distributed as dist

        params = dict(module.named_parameters(remove_duplicate=False))
        names = list(module.state_dict(keep_vars=True))  # persistent buffers only
        for name in names:
            param = params.get(name)
            if param is None or not hasattr(param, "ds_tensor"):
                value = module.get_parameter(name) if param is not None else module.get_buffer(name)
                slices += _slices_of(name, value.detach(), rank)
                continue
            group = getattr(param, "ds_process_group", None)
            start, length = zero3_partition(param, dist.get_rank(group=group) if group is not None else rank)
            shape = tuple(int(d) for d in param.ds_shape)
            local = param.ds_tensor.detach().reshape(-1)[:length]
            slices.append(LocalSlice(name, local, (start,), (length,), shape, flat=len(shape) != 1))
    else:
        if kind == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
        else:
            state = module.state_dict()
        names = list(state)
        for name, value in state.items():
            slices += _slices_of(name, value.detach() if isinstance(value, torch.Tensor) else value, rank)
    if not drop_tied:
        return slices
    identity = _identities(module)
    identity = {name: identity.get(name, -1 - i) for i, name in enumerate(names)}
    kept = set(_kept_names(module, names, identity))
    return [s for s in slices if s.name in kept]


def _identities(module: torch.nn.Module) -> dict[str, int]:
    """Name -> identity of the live parameter or buffer (tied weights: one identity, two names)."""
    named = itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
    return {name: id(tensor) for name, tensor in named}


def _into_buffer(tensor: torch.Tensor, name: str, dtype: torch.dtype | None, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cast ``tensor`` to ``dtype`` on its device, then copy it into a reused CPU buffer (pinned
    and without blocking from CUDA; the caller synchronizes once)."""
    target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
    if tensor.device.type != "cpu" and tensor.dtype != target:
        tensor = tensor.to(target)  # only the saved dtype crosses to the host
    pinned = tensor.device.type == "cuda"
    buffer = buffers.get(name)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != target or (pinned and not buffer.is_pinned()):
        buffer = torch.empty(tensor.shape, dtype=target, device="cpu", pin_memory=pinned)
    return buffer.copy_(tensor, non_blocking=pinned)


def _gather_fsdp(
    model: torch.nn.Module, dtype: torch.dtype | None, is_main: bool, buffers: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    """Full FSDP1/FSDP2 weights on the main process, one tensor at a time, slice by slice.

    Every rank casts its slice of a tensor to ``dtype`` on its device and sends it to rank 0,
    which receives it straight into that tensor's host buffer (reused from one snapshot to the
    next; through a device buffer of one slice under NCCL). No rank ever builds a full tensor
    it does not keep, and only the saved dtype travels: rank 0 holds one snapshot in the saved
    dtype, the others one slice at a time. Tied weights travel once and share one copy.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    module = unwrap_model(model)
    mine: dict[str, list[LocalSlice]] = {}
    for s in local_slices(model, rank, drop_tied=False):
        if s.numel:
            mine.setdefault(s.name, []).append(s)
    # Where every slice lives (small metadata, once per snapshot): [(name, offsets, sizes, shape, flat, dtype)].
    meta = [(s.name, s.offsets, s.sizes, s.global_shape, s.flat, str(s.tensor.dtype)) for ss in mine.values() for s in ss]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, meta)
    names = list(dict.fromkeys(entry[0] for per_rank in everyone for entry in per_rank))
    identity = _identities(module)
    buffers = buffers or {}
    out: dict[str, torch.Tensor] = {}
    first: dict[Any, str] = {}
    device = next((s.tensor.device for ss in mine.values() for s in ss), torch.device("cpu"))
    for name in names:
        key = identity.get(name, name)
        if key in first:  # a tied weight: already gathered under another name
            if is_main:
                out[name] = out[first[key]]
            continue
        first[key] = name
        entries = [(r, e) for r, per_rank in enumerate(everyone) for e in per_rank if e[0] == name]
        shape, src_dtype = tuple(entries[0][1][3]), getattr(torch, entries[0][1][5].removeprefix("torch."))
        target = dtype if (dtype is not None and src_dtype.is_floating_point) else src_dtype
        buffer = _host_buffer(buffers.get(name), shape, target, device) if is_main else None
        local = iter(mine.get(name, []))
        for src, (_, offsets, sizes, _, flat, _) in entries:
            if src == rank:
                data = next(local).tensor.detach().reshape(-1)
                if data.dtype != target and (data.device.type != "cpu" or not is_main):
                    data = data.to(target)  # cast on the device; on CPU rank 0 casts while copying
                if is_main:
                    region = _region(buffer, offsets, sizes, flat)
                    region.copy_(data.view(region.shape), non_blocking=True)
                else:
                    dist.send(data.contiguous(), dst=0)
            elif is_main:
                region = _region(buffer, offsets, sizes, flat)
                if device.type == "cpu" and region.is_contiguous():
                    dist.recv(region, src=src)
                else:
                    received = torch.empty(region.shape, dtype=target, device=device)
                    dist.recv(received, src=src)
                    region.copy_(received, non_blocking=True)
        if is_main:
            out[name] = buffer
    if is_main and device.type == "cuda":
        torch.cuda.synchronize()
    return out if is_main else None


def _host_buffer(buffer: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``buffer`` when it fits, else a new host tensor (pinned when the weights are on CUDA)."""
    pinned = device.type == "cuda"
    if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype or (pinned and not buffer.is_pinned()):
        buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
    return buffer


def _region(buffer: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], flat: bool) -> torch.Tensor:
    """The part of a full tensor a slice covers: a box, or a flat range."""
    if flat:
        return buffer.view(-1)[offsets[0] : offsets[0] + sizes[0]]
    return buffer[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]


def _gather_zero3(
    model: torch.nn.Module, is_main: bool, dtype: torch.dtype | None, buffers: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """Full weights of a ZeRO-3 model on CPU, gathering one module's own parameters at a time
    (cast on the device, copied into reused buffers; tied weights gathered once, one copy)."""
    import deepspeed  # only reached when parameters carry DeepSpeed's ``ds_id``

    buffers = buffers or {}
    out: dict[str, torch.Tensor] = {}
    by_identity: dict[int, torch.Tensor] = {}
    seen: set[int] = set()  # on every rank: the same collectives everywhere
    on_cuda = False
    for prefix, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if is_main:
                persistent = (
                    (n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set
                )  # what a state dict holds
                for name, tensor in itertools.chain(module.named_parameters(recurse=False), persistent):
                    full = f"{prefix}.{name}" if prefix else name
                    if id(tensor) not in by_identity:
                        on_cuda = on_cuda or tensor.device.type == "cuda"
                        by_identity[id(tensor)] = _into_buffer(tensor.detach(), full, dtype, buffers)
                    out[full] = by_identity[id(tensor)]
    if on_cuda:
        torch.cuda.synchronize()
    return out if is_main else None


def gather_full_state_dict(
    model: torch.nn.Module,
    accelerator: Any | None = None,
    dtype: torch.dtype | str | None = None,
    is_main_process: bool | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor] | None:
    """A full copy of the model's weights on CPU in the main process; ``None`` elsewhere.

    Every process must call it: under FSDP1/FSDP2 every rank sends its slices of one tensor at a
    time to rank 0, which receives them into that tensor's host buffer; DeepSpeed ZeRO-3
    gathers with ``GatheredParameters``, one module at a time; floating tensors are cast to ``dtype`` on their device before the copy to the
    host, and tied weights share one copy. Unsharded models (single process, DDP) are copied
    by the main process alone, the others return at once. The tensors are fresh copies: later
    optimizer steps do not change them. ``dtype`` casts floating tensors (``save_dtype``).
    With ``accelerator`` given and a DeepSpeed engine as ``model``, ``accelerator.get_state_dict``
    gathers instead. ``buffers``: an earlier result that is no longer in use, whose tensors are
    overwritten instead of allocating new memory.
    """
    dtype = parse_dtype(dtype, "dtype")
    if is_main_process is None:
        is_main_process = accelerator.is_main_process if accelerator is not None else _is_main_process()
    if accelerator is not None and type(model).__name__ == "DeepSpeedEngine":
        state_dict = accelerator.get_state_dict(model)
        return _copy_to_cpu(state_dict, dtype) if is_main_process else None
    kind = sharding_kind(model)
    if kind == "fsdp":
        return _gather_fsdp(model, dtype, is_main_process, buffers)
    if kind == "zero3":
        return _gather_zero3(unwrap_model(model), is_main_process, dtype, buffers)
    if not is_main_process:
        return None
    return _copy_to_cpu(unwrap_model(model).state_dict(), dtype, buffers)


def full_state_dict_bytes(model: torch.nn.Module, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of the model's full weights as a snapshot stores them, without gathering anything.

    Counts each parameter once (tied weights once) and the persistent buffers, floating tensors
    in ``dtype`` (``None``: their own), at their full (unsharded) size: DTensors report their
    global shape, ZeRO-3 parameters their ``ds_numel``, FSDP1 flat parameters are scaled by the
    world size. For a PEFT model only the trainable (adapter) parameters count, as a snapshot
    stores only those.
    """
    from hf_pma.utils.distributed import is_peft_model

    dtype = parse_dtype(dtype, "dtype")
    module = unwrap_model(model)
    adapter_only = is_peft_model(module)
    fsdp1 = sharding_kind(model) == "fsdp"
    world = torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1

    def size(tensor: torch.Tensor) -> int:
        numel = getattr(tensor, "ds_numel", None)
        if numel is None:
            numel = tensor.numel()
            if fsdp1 and type(tensor).__name__ == "FlatParameter":
                numel *= world
        target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        return int(numel) * target.itemsize

    total = sum(size(p) for p in module.parameters() if p.requires_grad or not adapter_only)
    if not adapter_only:
        persistent = {name for name, _ in module.named_buffers() if _is_persistent(module, name)}
        total += sum(size(b) for name, b in module.named_buffers() if name in persistent)
    return total


def _is_persistent(module: torch.nn.Module, name: str) -> bool:
    """Whether buffer ``name`` (dotted) is in the module's state dict."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return leaf not in getattr(owner, "_non_persistent_buffers_set", set())
