"""Thin torch adapters over :mod:`hf_pma.io.safetensors`, for the code that computes with torch.

The IO layer speaks safetensors dtype names and raw bytes; torch code needs torch dtypes and
tensors. :class:`TorchTensors` gives any raw reader (a
:class:`~hf_pma.io.safetensors.SafetensorsReader`, a
:class:`~hf_pma.io.sharded.ShardedCheckpointTensors`) a ``read`` that returns typed torch
tensors sharing the reader's buffer, and :func:`tensor_bytes` turns a tensor into the bytes a
:class:`~hf_pma.io.safetensors.SafetensorsWriter` takes. :func:`local_tensor` is this process's
part of a (possibly sharded) tensor, for the snapshot writers and the weight swap alike. The
torch-free merge never imports this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hf_pma.io.safetensors import TensorInfo

__all__ = [
    "DTYPE_FROM_SAFETENSORS",
    "SAFETENSORS_FROM_DTYPE",
    "TorchTensors",
    "is_dtensor",
    "local_tensor",
    "safetensors_dtype",
    "tensor_bytes",
]

DTYPE_FROM_SAFETENSORS: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_FROM_DTYPE = {v: k for k, v in DTYPE_FROM_SAFETENSORS.items()}


def safetensors_dtype(dtype: torch.dtype, name: str = "tensor") -> str:
    """The safetensors name of ``dtype``; ``ValueError`` naming ``name`` if the format cannot store it."""
    try:
        return SAFETENSORS_FROM_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store") from None


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is sharded across processes the way a ``torch.distributed`` DTensor is
    (FSDP2's parameters): it has a callable ``to_local``."""
    return callable(getattr(tensor, "to_local", None))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: a DTensor's local shard (``to_local()``), any other
    tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``tensor`` (flattened, contiguous, on the CPU) as a ``uint8`` array (no copy when possible)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


class TorchTensors:
    """A raw reader whose ``read`` returns typed torch tensors (views of the reader's buffer)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype (a safetensors name), shape and location of every tensor."""
        return self.raw.infos

    def torch_dtype(self, name: str) -> torch.dtype:
        """The torch dtype of tensor ``name``."""
        return DTYPE_FROM_SAFETENSORS[self.raw.infos[name].dtype]

    def read(
        self, name: str, start: int = 0, stop: int | None = None, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name``, flattened; ``buffer``: an optional uint8
        tensor to read into (the result is a view of it)."""
        raw = self.raw.read(name, start, stop, None if buffer is None else buffer.numpy())
        return torch.from_numpy(raw).view(self.torch_dtype(name))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, loaded and reshaped (for small models and tests)."""
        return {n: self.read(n).clone().reshape(i.shape) for n, i in self.infos.items()}

    def close(self) -> None:
        """Close the underlying files."""
        self.raw.close()

    def __enter__(self) -> TorchTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
