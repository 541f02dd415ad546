"""Parse and check what users give: dtypes and sizes (``"bf16"``, ``"5GB"``), and the one check of
"an integer, not a bool, in range" (:func:`is_int`, :func:`check_int`) and of "a number, not a
bool" (:func:`is_number`), with errors naming the argument. Torch-free.

Errors in library words: a function names its own parameter (``last must be a positive
integer, got 0``), through :func:`parameter_error`, which remembers the name; the ``hf-pma``
command shows that name as its flag (``--last must be ...``: :func:`hf_pma.cli.flag_words`).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from hf_pma.utils.text import shown

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT_DTYPE_NAMES",
    "check_int",
    "is_int",
    "parameter_error",
    "is_number",
    "parse_dtype",
    "parse_dtype_name",
    "parse_size",
]

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


def parameter_error(parameter: str, rest: str, kind: type[Exception] = ValueError) -> Exception:
    """The error for a bad value of the parameter ``parameter``: ``kind(f"{parameter} {rest}")``
    (``last must be a positive integer, got 0``), which remembers the name as its ``parameter``
    attribute (kept when the error is pickled to the other ranks), so that the ``hf-pma``
    command can show the name as its flag (``--last must be ...``)."""
    err = kind(f"{parameter} {rest}")
    err.parameter = parameter  # type: ignore[attr-defined]
    return err


def is_int(value: Any, minimum: int | None = None, maximum: int | None = None) -> bool:
    """Whether ``value`` is an ``int`` (``True`` and ``False`` are not: JSON and Python both let a
    bool pass as one) within ``minimum`` and ``maximum`` (each included; ``None``: no bound)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def is_number(value: Any, finite: bool = False) -> bool:
    """Whether ``value`` is an ``int`` or a ``float`` (not a bool); with ``finite``, not NaN or an
    infinity either."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


def _range_words(minimum: int | None, maximum: int | None) -> str:
    if maximum is None:
        return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
    return f"an integer <= {maximum}" if minimum is None else f"an integer from {minimum} to {maximum}"


def check_int(
    value: Any,
    name: str,
    minimum: int | None = 1,
    maximum: int | None = None,
    allow_none: bool = False,
) -> Any:
    """``value`` when it is an integer (not a bool) from ``minimum`` to ``maximum`` (or ``None``
    with ``allow_none``); else a one-line ``ValueError`` naming ``name``: ``"last must be a
    positive integer, got 0"``. The default range is the positive integers."""
    if (value is None and allow_none) or is_int(value, minimum, maximum):
        return value
    either = " or None" if allow_none else ""
    raise parameter_error(name, f"must be {_range_words(minimum, maximum)}{either}, got {shown(value, 60)}")
