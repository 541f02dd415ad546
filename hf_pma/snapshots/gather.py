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


def _gather_zero3(model: torch.nn.Module, is_main: bool, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
    """Full weights of a ZeRO-3 model on CPU, gathering one module's own parameters at a time."""
    import deepspeed  # only reached when parameters carry DeepSpeed's ``ds_id``

    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if is_main:
                for name, tensor in itertools.chain(
                    module.named_parameters(recurse=False), module.named_buffers(recurse=False)
                ):
                    full = f"{prefix}.{name}" if prefix else name
                    target = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
                    out[full] = tensor.detach().to("cpu", target, copy=True)
    return out if is_main else None


def gather_full_state_dict(
    model: torch.nn.Module,
    accelerator: Any | None = None,
    dtype: torch.dtype | str | None = None,
    is_main_process: bool | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor] | None:
    """A full copy of the model's weights on CPU in the main process; ``None`` elsewhere.

    Every process must call it: FSDP1/FSDP2 gather with
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (no offload when the
    parameters already live on CPU) and DeepSpeed ZeRO-3 with ``GatheredParameters``, both
    collectives. Unsharded models (single process, DDP) are copied
    by the main process alone, the others return at once. The tensors are fresh copies: later
    optimizer steps do not change them. ``dtype`` casts floating tensors (``save_dtype``).
    With ``accelerator`` given and a DeepSpeed engine as ``model``, ``accelerator.get_state_dict``
    gathers instead. ``buffers``: an earlier result that is no longer in use, whose tensors are
    overwritten instead of allocating new memory (unsharded models).
    """
    dtype = parse_dtype(dtype, "dtype")
    if is_main_process is None:
        is_main_process = accelerator.is_main_process if accelerator is not None else _is_main_process()
    if accelerator is not None and type(model).__name__ == "DeepSpeedEngine":
        state_dict = accelerator.get_state_dict(model)
        return _copy_to_cpu(state_dict, dtype) if is_main_process else None
    kind = sharding_kind(model)
    if kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Offload to CPU gathers on rank 0 only; with parameters already on CPU it is skipped
        # (FSDP1's offload breaks on CPU tensors) and every rank briefly holds the full copy.
        on_device = any(_local(p).device.type != "cpu" for p in model.parameters())
        options = StateDictOptions(full_state_dict=True, cpu_offload=on_device)
        state_dict = get_model_state_dict(model, options=options)
        if not is_main_process:
            return None
        # cpu_offload gives fresh CPU tensors, except for anything already unsharded on CPU:
        # copy those so the snapshot cannot alias live parameters.
        live = {_storage_ptr(t) for t in itertools.chain(model.parameters(), model.buffers())}
        out = {}
        for name, tensor in state_dict.items():
            if _storage_ptr(tensor) in live:
                tensor = tensor.clone()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            out[name] = tensor
        return out
    if kind == "zero3":
        return _gather_zero3(unwrap_model(model), is_main_process, dtype)
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
