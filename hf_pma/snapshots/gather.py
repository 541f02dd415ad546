"""Gather the full weights of a (possibly sharded) model onto the main process's CPU.

:func:`gather_full_state_dict` returns a full CPU copy of the weights on the main process, from a
plain, DDP, FSDP1/FSDP2 or DeepSpeed ZeRO-3 model. Every rank must call it (sharded models
gather collectively); other ranks get ``None``. :func:`sharding_kind` says which case a model
is, :func:`unwrap_model` finds the model inside its wrappers (both from
:mod:`hf_pma.utils.distributed`). Nothing here writes files: that
is :mod:`hf_pma.snapshots.writer`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from hf_pma.utils.distributed import sharding_kind, unwrap_model
from hf_pma.utils.parsing import parse_dtype

__all__ = ["unwrap_model", "sharding_kind", "gather_full_state_dict"]


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
