"""Put merged weights into a live model, and take them out again.

Used for merged-model evaluation (swap the merge in, evaluate, swap the live weights back),
PMA-init and loss-spike recovery. Works on plain modules, DDP-wrapped modules (pass the
unwrapped one) and FSDP2-sharded modules: the live weights are backed up as each process's
*local* tensors on the CPU (no second copy on the accelerator), and a full merged state dict
is loaded through ``torch.distributed.checkpoint.state_dict.set_model_state_dict``, which
scatters it to the shards. PEFT models load adapter-only state dicts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.utils import logging

from hf_pma.io.torch_adapters import is_dtensor, local_tensor
from hf_pma.utils.distributed import is_peft_model

logger = logging.get_logger(__name__)

__all__ = ["backup_weights", "restore_weights", "load_weights", "check_compatible"]


def _named_tensors(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    tensors = {n: p for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    if not trainable_only:
        tensors.update(dict(model.named_buffers()))
    return tensors


def backup_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of this process's parameters and buffers (adapter parameters only for PEFT)."""
    tensors = _named_tensors(model, trainable_only=is_peft_model(model))
    return {name: local_tensor(t.detach()).to("cpu", copy=True) for name, t in tensors.items()}


@torch.no_grad()
def restore_weights(model: torch.nn.Module, backup: Mapping[str, torch.Tensor]) -> None:
    """Copy a :func:`backup_weights` backup back into the model, in place."""
    tensors = _named_tensors(model, trainable_only=is_peft_model(model))
    for name, saved in backup.items():
        local_tensor(tensors[name].data).copy_(saved)


def _full_state_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_compatible(model: torch.nn.Module, state: Mapping[str, torch.Tensor], origin: str = "merged weights") -> None:
    """Raise ``ValueError`` naming the tensor when ``state`` does not fit ``model``.

    Keys absent from ``state`` are allowed only for tensors tied to a key that is present (the
    output embedding tied to the input embedding is stored once).
    """
    if is_peft_model(model):
        return  # adapter names are mapped by peft itself; it raises on mismatches
    shapes = _full_state_shapes(model)
    unexpected = sorted(set(state) - set(shapes))
    if unexpected:
        raise ValueError(f"{origin} hold tensor(s) the model does not have: {', '.join(unexpected[:5])}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{origin}: tensor {name!r} has shape {list(tensor.shape)} but the model expects {list(shapes[name])}"
            )
    missing = set(shapes) - set(state)
    if missing:
        by_storage: dict[int, set[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_storage.setdefault(id(p), set()).add(name)
        tied_ok = {n for names in by_storage.values() if names & set(state) for n in names}
        untied = sorted(missing - tied_ok)
        if untied:
            raise ValueError(f"{origin} lack tensor(s) the model needs: {', '.join(untied[:5])}")


@torch.no_grad()
def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], origin: str = "merged weights") -> None:
    """Load a full (unsharded) state dict into a live model, sharded or not, after checking it."""
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, dict(state))
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"{origin} hold adapter tensor(s) the model does not have: {', '.join(unexpected[:5])}")
        return
    check_compatible(model, state, origin)
    params = dict(model.named_parameters())
    if any(is_dtensor(p) for p in params.values()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))
        return
    live = model.state_dict()
    for name, tensor in state.items():
        live[name].copy_(tensor)
