"""Parse what users write for dtypes and sizes (``"bf16"``, ``"5GB"``), with errors naming the argument."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["FLOAT_DTYPE_NAMES", "parse_dtype", "parse_dtype_name", "parse_size"]

# What users write -> the dtype's name in torch (``torch.<name>``).
FLOAT_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float64": "float64",
    "fp64": "float64",
}


def parse_dtype_name(dtype: Any, name: str = "dtype") -> str | None:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``"bfloat16"``, without importing torch;
    ``None`` stays ``None``. Only floating dtypes: weights are averaged or cast in them."""
    if dtype is None:
        return None
    key = str(dtype).lower().removeprefix("torch.")
    if key not in FLOAT_DTYPE_NAMES:
        if str(dtype).startswith("torch."):
            raise ValueError(f"{name} must be a floating-point dtype, got {dtype}")
        raise ValueError(f"unknown {name} {dtype!r}; choose float32, bfloat16 or float16")
    return FLOAT_DTYPE_NAMES[key]


def parse_dtype(dtype: str | torch.dtype | None, name: str = "dtype") -> torch.dtype | None:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; ``None`` stays ``None``.

    Only floating dtypes: weights are averaged or cast in them.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point dtype, got {dtype}")
        return dtype
    key = parse_dtype_name(dtype, name)
    return None if key is None else getattr(torch, key)


def parse_size(size: int | str, name: str = "size") -> int:
    """Bytes: ``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2 * 2**30, ``1000`` -> 1000."""
    if isinstance(size, bool):
        raise ValueError(f"{name} must be a size like '5GB' or a number of bytes, got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
        if not match:
            raise ValueError(f"cannot parse {name} {size!r}; use bytes or a value like '5GB' or '500MiB'")
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(number * base ** "BKMGT".index(unit[0]))
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {size!r}")
    return value
