"""Parse what users write for dtypes and sizes (``"bf16"``, ``"5GB"``), with errors naming the argument."""

from __future__ import annotations

import re

import torch

__all__ = ["FLOAT_DTYPES", "parse_dtype", "parse_size"]

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype | None, name: str = "dtype") -> torch.dtype | None:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; ``None`` stays ``None``.

    Only floating dtypes: weights are averaged or cast in them.
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point dtype, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in FLOAT_DTYPES:
        raise ValueError(f"unknown {name} {dtype!r}; choose float32, bfloat16 or float16")
    return FLOAT_DTYPES[key]


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
