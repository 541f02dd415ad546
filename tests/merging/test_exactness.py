"""The numpy merge against today's torch arithmetic, per stored dtype.

torch accumulated ``acc.copy_(x_0).mul_(w_0)``, then ``acc.add_(x_i, alpha=w_i)`` (one fused
multiply-add per element) in float32, and cast with ``copy_``. numpy rounds each product
before adding it. So: bit-identical where the products are exact (the SMA of 4 sources,
weights 1/4; integer tensors), and otherwise within one ulp of the output dtype plus the
float32 accumulation error ``2^-21 * sum_i |w_i x_i|``: for 16- and 8-bit dtypes almost always
bit-identical, for float32 outputs most elements (the last bit of the accumulator differs).
float8 sources, which torch could not promote, are compared with torch on their exact float32
upcast.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_pma.core.strategies import merge_coefficients
from hf_pma.merging.engine import merge_checkpoints

DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _sources(tmp_path, dtype: torch.dtype, n: int = 4) -> tuple[list, list[dict[str, torch.Tensor]]]:
    folders, states = [], []
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=generator) * 4
    for i in range(n):
        # similar checkpoints (as snapshots are), some values near the dtype's limits
        w = base + torch.randn(3000, generator=generator) * 0.05
        w[:8] = torch.tensor([0.0, -0.0, 1e-3, -2e-3, 3e-5, 200.0, -300.0, 1.0])
        state = {"w": w.to(dtype), "count": torch.arange(5)}
        folder = tmp_path / f"s{i}"
        folder.mkdir()
        save_file(state, folder / "model.safetensors")
        (folder / "config.json").write_text("{}")
        folders.append(folder)
        states.append(state)
    return folders, states


def _torch_merge(states, weights, out_dtype=None, accumulate=torch.float32) -> torch.Tensor:
    """What the merge engine computed with torch before it computed with numpy (float8 sources,
    which torch does not promote, raised then: here they are upcast first, an exact step)."""
    xs = [s["w"].float() if s["w"].dtype.itemsize == 1 else s["w"] for s in states]
    acc = torch.empty(xs[0].shape, dtype=accumulate)
    acc.copy_(xs[0])
    acc.mul_(weights[0])
    for w, x in zip(weights[1:], xs[1:]):
        acc.add_(x, alpha=w)
    return torch.empty(acc.shape, dtype=out_dtype or states[0]["w"].dtype).copy_(acc)


def _merged(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_sma_of_four_is_bit_identical_to_torch(tmp_path, dtype):
    folders, states = _sources(tmp_path, DTYPES[dtype])
    merged = _merged(merge_checkpoints(folders, tmp_path / "m", progress=False))
    expected = _torch_merge(states, [0.25] * 4)
    assert merged["w"].dtype == DTYPES[dtype]
    assert torch.equal(merged["w"].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(merged["count"], states[0]["count"])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_other_weights_are_within_one_ulp_plus_the_float32_accumulation_error(tmp_path, dtype):
    folders, states = _sources(tmp_path, DTYPES[dtype])
    weights = merge_coefficients(4, "ema", alpha=0.3)
    ours = _merged(merge_checkpoints(folders, tmp_path / "m", strategy="ema", alpha=0.3, progress=False))[
        "w"
    ].double()
    theirs = _torch_merge(states, weights).double()
    ulp = torch.finfo(DTYPES[dtype]).eps * torch.maximum(
        theirs.abs(), torch.tensor(torch.finfo(DTYPES[dtype]).tiny)
    )
    accumulation = sum(w * s["w"].double().abs() for w, s in zip(weights, states)) * 2.0**-21
    assert bool(((ours - theirs).abs() <= ulp + accumulation).all())
    # float32 outputs keep the accumulator's last bit, where the two roundings differ; the
    # narrower dtypes round it away
    assert (ours == theirs).double().mean() > (0.5 if dtype == "F32" else 0.99)


@pytest.mark.parametrize("out", ["bfloat16", "float16"])
def test_output_dtype_is_rounded_as_torch_rounds(tmp_path, out):
    folders, states = _sources(tmp_path, torch.float32)
    merged = _merged(merge_checkpoints(folders, tmp_path / "m", dtype=out, progress=False))
    assert torch.equal(merged["w"], _torch_merge(states, [0.25] * 4, getattr(torch, out)))


def test_float64_accumulation_is_bit_identical_to_torch_for_exact_products(tmp_path):
    folders, states = _sources(tmp_path, torch.float32)
    merged = _merged(merge_checkpoints(folders, tmp_path / "m", accumulate_dtype="float64", progress=False))
    assert torch.equal(merged["w"], _torch_merge(states, [0.25] * 4, accumulate=torch.float64))
    np.testing.assert_array_equal(merged["count"].numpy(), np.arange(5))
