"""Exact conversions between the stored floating-point dtypes and numpy floats, without torch.

numpy has float16, float32 and float64 but no bfloat16 or float8, so those are decoded and
encoded with integer bit operations and small lookup tables, rounding to nearest, ties to
even, exactly as torch's CPU casts do:

- decoding (stored dtype -> float32) is exact for every dtype: bfloat16 is the top half of a
  float32, float16 is numpy's own, each float8 code is looked up in a 256-entry table;
- encoding (float32 -> stored dtype) rounds to nearest even; float16 and float8 subnormals
  round as torch rounds them; float8 e4m3fn saturates (anything beyond 448, infinities
  included, becomes +-448) and float8 e5m2 overflows to infinity (from 61440), as torch's
  casts do; NaN stays NaN (its payload may differ: torch's own vectorized and scalar casts
  disagree on it).
- float64 is encoded through float32 (as torch converts a double to a half-precision dtype).

The tests compare every function here with torch's casts on every bfloat16, float16 and
float8 bit pattern and on float32 values around every rounding boundary.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FINITE_MAX", "NUMPY_FLOATS", "decode_float", "encode_float"]

# Dtypes numpy stores natively.
NUMPY_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}

# The largest finite magnitude of each stored dtype: a value beyond it does not survive the cast
# (float16, bfloat16, float32 and float8 e5m2 overflow to infinity, float8 e4m3fn saturates at
# 448). The merge checks its result against it before encoding (hf_pma.merging.chunks).
FINITE_MAX = {
    "F64": float(np.finfo(np.float64).max),
    "F32": float(np.finfo(np.float32).max),
    "F16": float(np.finfo(np.float16).max),  # 65504
    "BF16": float(np.uint32(0x7F7F0000).view(np.float32)),  # 3.3895e38
    "F8_E4M3": 448.0,
    "F8_E5M2": 57344.0,
}


def _fp8_values(exp_bits: int, man_bits: int, bias: int, finite_max_code: int) -> np.ndarray:
    """The float32 value of every non-negative code 0..127 of a float8 format (NaN/Inf per torch)."""
    values = np.empty(128, dtype=np.float64)
    for code in range(128):
        exp, man = code >> man_bits, code & ((1 << man_bits) - 1)
        if exp == 0:
            values[code] = man * 2.0 ** (1 - bias - man_bits)
        else:
            values[code] = (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)
    values[finite_max_code + 1 :] = np.nan
    return values


# e4m3fn: no infinities, 0x7F is NaN, 448 is the largest value. e5m2: IEEE-like, 0x7C is +inf.
_E4M3 = _fp8_values(4, 3, 7, 0x7E)
_E5M2 = _fp8_values(5, 2, 15, 0x7B)
_E5M2[0x7C] = np.inf


def _fp8_table(positive: np.ndarray) -> np.ndarray:
    table = np.concatenate([positive, -positive]).astype(np.float32)
    return table


_DECODE_FP8 = {"F8_E4M3": _fp8_table(_E4M3), "F8_E5M2": _fp8_table(_E5M2)}

# Encoding float8: the positive codes in value order, then the value at which a magnitude stops
# rounding to the largest finite code (the "virtual" next code) and the code it gets instead.
_ENCODE_FP8 = {
    # (finite values of codes 0..max, value of the virtual next code, code for |x| >= that, NaN code)
    "F8_E4M3": (_E4M3[:0x7F], 480.0, 0x7E, 0x7F),
    "F8_E5M2": (_E5M2[:0x7C], 65536.0, 0x7C, 0x7F),
}


def decode_float(raw: np.ndarray, dtype: str, scratch: np.ndarray | None = None) -> np.ndarray:
    """The float32 (float64 for ``F64``) values of ``raw``, the bytes of a ``dtype`` tensor.

    ``F32``/``F64`` return a view of ``raw`` (no copy); the others are decoded exactly into
    ``scratch`` (a float32 array at least as long, allocated when ``None``).
    """
    if dtype in ("F32", "F64"):
        return raw.view(NUMPY_FLOATS[dtype])
    count = raw.size // (2 if dtype in ("F16", "BF16") else 1)
    out = np.empty(count, dtype=np.float32) if scratch is None else scratch[:count]
    if dtype == "BF16":
        bits = out.view(np.uint32)
        np.left_shift(raw.view(np.uint16), 16, out=bits, dtype=np.uint32)
    elif dtype == "F16":
        np.copyto(out, raw.view(np.float16))
    elif dtype in _DECODE_FP8:
        np.take(_DECODE_FP8[dtype], raw, out=out)
    else:
        raise ValueError(f"{dtype} is not a floating-point dtype")
    return out


def encode_float(values: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """``values`` (float32 or float64) rounded to ``dtype``, as raw bytes (a ``uint8`` array).

    ``out``: a ``uint8`` array to write into (at least ``values.size * itemsize`` long).
    """
    if values.dtype == np.float64 and dtype != "F64":
        values = values.astype(np.float32)  # torch casts a double to a smaller float via float32
    itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype, 1)
    nbytes = values.size * itemsize
    out = np.empty(nbytes, dtype=np.uint8) if out is None else out[:nbytes]
    if dtype in NUMPY_FLOATS:
        with np.errstate(over="ignore"):  # overflow to infinity, as torch's casts do
            np.copyto(out.view(NUMPY_FLOATS[dtype]), values, casting="unsafe")
    elif dtype == "BF16":
        _encode_bf16(values, out.view(np.uint16))
    elif dtype in _ENCODE_FP8:
        _encode_fp8(values, dtype, out)
    else:
        raise ValueError(f"{dtype} is not a floating-point dtype")
    return out


def _encode_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """float32 -> bfloat16 bits, round to nearest even (NaN -> a quiet NaN of the same sign)."""
    bits = values.view(np.uint32)
    rounded = (bits >> np.uint32(16)) & np.uint32(1)
    rounded += np.uint32(0x7FFF)
    rounded += bits  # wraps only for NaN payloads near 0xFFFFFFFF, replaced below
    np.right_shift(rounded, np.uint32(16), out=rounded)
    out[...] = rounded
    nan = np.isnan(values)
    if nan.any():
        out[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)


def _encode_fp8(values: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """float32 -> float8 codes: the nearest code, ties to the even code, overflow as torch does."""
    finite, virtual, overflow_code, nan_code = _ENCODE_FP8[dtype]
    grid = np.append(finite, virtual)
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(values.astype(np.float64))
    below = np.searchsorted(grid, magnitude, side="right") - 1  # grid[below] <= |x| < grid[below + 1]
    below = np.clip(below, 0, grid.size - 2)
    above = below + 1
    to_low, to_high = magnitude - grid[below], grid[above] - magnitude
    code = np.where((to_high < to_low) | ((to_high == to_low) & (below % 2 == 1)), above, below)
    code = np.where(magnitude >= virtual, overflow_code, code)
    code = np.where(code == finite.size, overflow_code, code)  # rounded up to the virtual code
    code = np.where(np.isnan(magnitude), nan_code, code)
    sign = np.signbit(values).astype(np.uint8) << np.uint8(7)
    np.bitwise_or(code.astype(np.uint8), sign, out=out)
