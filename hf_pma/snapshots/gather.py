"""Gather the full weights of a (possibly sharded) model onto the main process's CPU.

:func:`gather_full_state_dict` returns a full CPU copy of the weights on the main process, from a
plain, DDP, FSDP1/FSDP2 or DeepSpeed ZeRO-3 model. Every rank must call it (sharded models
gather collectively); other ranks get ``None``. :func:`sharding_kind` says which case a model
is, :func:`unwrap_model` finds the model inside its wrappers. Nothing here writes files: that
is :mod:`hf_pma.snapshots.writer`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from hf_pma.utils.parsing import parse_dtype

__all__ = ["unwrap_model", "sharding_kind", "gather_full_state_dict", "full_state_dict_bytes"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / DataParallel / DeepSpeed / ``torch.compile`` wrappers.

    FSDP2 modules are the model itself (``fully_shard`` works in place); for FSDP1 this is the
    wrapped module, which carries the config (its parameters stay sharded: gather with
    :func:`gather_full_state_dict`, never ``state_dict()`` of the result).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel, FullyShardedDataParallel)
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        elif type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine") and hasattr(model, "module"):
            model = model.module
    return model


def sharding_kind(model: torch.nn.Module) -> str | None:
    """``"fsdp"`` (FSDP1 or FSDP2), ``"zero3"`` (DeepSpeed ZeRO-3) or ``None`` (full weights here)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    # Wrappers (DDP, DeepSpeed engine) are modules too: their modules() include the model's.
    for module in model.modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            return "fsdp"
    for param in itertools.islice(model.parameters(), 64):
        if hasattr(param, "ds_id"):
            return "zero3"
        if type(param.data).__name__ == "DTensor":
            return "fsdp"
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    """Address of a tensor's memory (a DTensor's local shard), ``None`` when it has none."""
    try:
        return _local(tensor).untyped_storage().data_ptr()
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
    """Full FSDP weights on the main process, one tensor at a time.

    FSDP2 (DTensor parameters): each tensor is all-gathered on its device, cast there, copied
    into a reused CPU buffer on the main process and dropped, so the host holds one snapshot in
    the saved dtype plus nothing; tied weights are gathered once and share one copy. FSDP1
    (``ShardedTensor``): torch's full state dict, cast as it arrives.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = unwrap_model(model)
    identity = _identities(module)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    if any(hasattr(v, "local_shards") for v in state.values()):
        return _gather_fsdp1(model, dtype, is_main, identity)
    buffers = buffers or {}
    out: dict[str, torch.Tensor] = {}
    by_identity: dict[int, torch.Tensor | None] = {}  # on every rank: the same collectives everywhere
    on_cuda = False
    for name, value in state.items():
        key = identity.get(name, id(value))
        if key in by_identity:
            if is_main:
                out[name] = by_identity[key]
            continue
        full = value.full_tensor() if hasattr(value, "full_tensor") else value  # a collective for DTensors
        by_identity[key] = None
        if is_main:
            on_cuda = on_cuda or full.device.type == "cuda"
            out[name] = by_identity[key] = _into_buffer(full.detach(), name, dtype, buffers)
        del full
    if on_cuda:
        torch.cuda.synchronize()
    return out if is_main else None


def _gather_fsdp1(
    model: torch.nn.Module, dtype: torch.dtype | None, is_main: bool, identity: dict[str, int]
) -> dict[str, torch.Tensor] | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Offload to CPU gathers on rank 0 only; with parameters already on CPU it is skipped
    # (FSDP1's offload breaks on CPU tensors) and every rank briefly holds the full copy.
    on_device = any(_local(p).device.type != "cpu" for p in model.parameters())
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_device))
    if not is_main:
        return None
    # cpu_offload gives fresh CPU tensors, except for anything already unsharded on CPU: copy
    # those so the snapshot cannot alias live parameters. Tied weights share one copy.
    live = {_storage_ptr(t) for t in itertools.chain(model.parameters(), model.buffers())}
    out: dict[str, torch.Tensor] = {}
    by_identity: dict[int, torch.Tensor] = {}
    for name in list(state_dict):
        tensor = state_dict.pop(name)
        key = identity.get(name, id(tensor))
        if key not in by_identity:
            if _storage_ptr(tensor) in live:
                tensor = tensor.clone()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            by_identity[key] = tensor
        out[name] = by_identity[key]
    return out


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

    Every process must call it: FSDP2 gathers one tensor at a time (``DTensor.full_tensor``),
    FSDP1 with ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (no offload when
    the parameters already live on CPU) and DeepSpeed ZeRO-3 with ``GatheredParameters``, all
    collectives; floating tensors are cast to ``dtype`` on their device before the copy to the
    host, and tied weights share one copy. Unsharded models (single process, DDP) are copied
    by the main process alone, the others return at once. The tensors are fresh copies: later
    optimizer steps do not change them. ``dtype`` casts floating tensors (``save_dtype``).
    With ``accelerator`` given and a DeepSpeed engine as ``model``, ``accelerator.get_state_dict``
    gathers instead. ``buffers``: an earlier result that is no longer in use, whose tensors are
    overwritten instead of allocating new memory (unsharded, FSDP2 and ZeRO-3 models).
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
