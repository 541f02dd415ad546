"""The torch-free casts equal torch's on every bit pattern that matters.

Decoding: every bfloat16, float16 and float8 bit pattern. Encoding: float32 values at and
around every rounding boundary (each of the 65536 upper halves with low halves that round
down, tie, round up), NaN, infinities, subnormals, plus a million random bit patterns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_pma.merging.casts import decode_float, encode_float

TORCH = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
UINT = {1: np.uint8, 2: np.uint16}


def _float32_probes() -> np.ndarray:
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lower = np.array(
        [0, 1, 0x0FFF, 0x1000, 0x1001, 0x17FF, 0x7000, 0x7FFF, 0x8000, 0x8001, 0x8FFF, 0xFFFF],
        dtype=np.uint32,
    )
    structured = (upper[:, None] | lower[None, :]).reshape(-1)
    random = np.random.default_rng(0).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([structured, random]).view(np.float32)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bit-equal, or both NaN (torch's own scalar and vectorized casts disagree on NaN payloads)."""
    return (a.view(UINT.get(a.itemsize, np.uint32)) == b.view(UINT.get(b.itemsize, np.uint32))) | (
        np.isnan(a) & np.isnan(b)
    )


@pytest.mark.parametrize("dtype", sorted(TORCH))
def test_decoding_every_bit_pattern_equals_torch(dtype):
    itemsize = torch.empty(0, dtype=TORCH[dtype]).element_size()
    raw = np.arange(1 << (8 * itemsize), dtype=np.uint32).astype(UINT[itemsize]).view(np.uint8)
    ours = decode_float(raw, dtype)
    theirs = torch.from_numpy(raw.copy()).view(TORCH[dtype]).float().numpy()
    assert ours.dtype == np.float32 and bool(_same(ours, theirs).all())


@pytest.mark.parametrize("dtype", sorted(TORCH))
def test_encoding_float32_equals_torch_round_to_nearest_even(dtype):
    values = _float32_probes()
    ours = encode_float(values, dtype)
    theirs = torch.from_numpy(values.copy()).to(TORCH[dtype]).view(torch.uint8).numpy()
    equal_bits = (ours == theirs).reshape(values.size, -1).all(axis=1)
    both_nan = np.isnan(decode_float(ours, dtype)) & np.isnan(decode_float(theirs, dtype))
    mismatched = ~(equal_bits | both_nan)
    assert not mismatched.any(), values[mismatched][:5]
    # overflow, as the module's docstring says: e4m3fn saturates, the others become infinite
    big = np.finfo(np.float32).max
    assert decode_float(encode_float(np.float32([big, -np.inf]), dtype), dtype).tolist() == (
        [448.0, -448.0] if dtype == "F8_E4M3" else [np.inf, -np.inf]
    )


@pytest.mark.parametrize("dtype", sorted(TORCH))
def test_encoding_float64_goes_through_float32_as_torch_does(dtype):
    values = np.random.default_rng(1).standard_normal(1 << 16) * np.float64(2.0) ** np.random.default_rng(
        2
    ).integers(-30, 30, 1 << 16)
    theirs = torch.from_numpy(values).to(TORCH[dtype]).view(torch.uint8).numpy()
    assert np.array_equal(encode_float(values, dtype), theirs)
