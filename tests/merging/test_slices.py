"""Merging into a live model by local slice (one process here; several in test_slices_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hf_pma.merging.engine import merge_state_dict
from hf_pma.merging.slices import SliceSwap
from hf_pma.merging.swap import load_weights
from tests.helpers.models import make_tiny_model, save_model_folder


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    return [save_model_folder(root / f"s{i}", make_tiny_model(seed=i), max_shard_size="30KB", extra={"tokens": i + 1}) for i in range(3)]


def test_swap_equals_the_full_merge_and_restore_brings_back_every_bit(snapshots):
    model = make_tiny_model(seed=7)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    swap = SliceSwap(model, snapshots, strategy="ema", alpha=0.3, workers=2, chunk_bytes=4096)
    reference = make_tiny_model(seed=7)
    load_weights(reference, merge_state_dict(snapshots, strategy="ema", alpha=0.3))
    merged = model.state_dict()
    assert all(torch.equal(merged[k], v) for k, v in reference.state_dict().items())
    # One process reads every snapshot once and backs up one model's worth.
    model_bytes = sum(v.numel() * v.element_size() for k, v in live.items() if k != "lm_head.weight")
    assert swap.bytes_read == 3 * model_bytes and swap.backup_bytes == model_bytes
    swap.restore()
    assert all(torch.equal(live[k], v) for k, v in model.state_dict().items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_bf16_snapshots_round_like_the_full_merge(tmp_path):
    folders = [save_model_folder(tmp_path / f"b{i}", make_tiny_model(seed=i, dtype=torch.bfloat16), extra={"tokens": i}) for i in range(3)]
    model = make_tiny_model(seed=9)  # float32 live weights
    SliceSwap(model, folders)
    reference = make_tiny_model(seed=9)
    load_weights(reference, merge_state_dict(folders))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_mismatched_checkpoints_fail_naming_the_tensor_and_leave_the_model_alone(tmp_path, snapshots):
    model = make_tiny_model(seed=7)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    wide = save_model_folder(tmp_path / "wide", make_tiny_model(seed=0, hidden_size=64, intermediate_size=64), extra={"tokens": 1})
    with pytest.raises(ValueError, match=r"tensor 'model\.embed_tokens\.weight' has shape \[512, 64\] in the checkpoints but \[512, 32\]"):
        SliceSwap(model, [wide])
    state = make_tiny_model(seed=0).state_dict()
    extra = tmp_path / "extra"
    extra.mkdir()
    save_file({**{k: v for k, v in state.items() if k != "lm_head.weight"}, "bogus.weight": torch.ones(3)}, extra / "model.safetensors")
    with pytest.raises(ValueError, match="tensor.*the model does not have: bogus.weight"):
        SliceSwap(model, [extra])
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    save_file({k: v for k, v in state.items() if k not in ("lm_head.weight", "model.norm.weight")}, lacking / "model.safetensors")
    with pytest.raises(ValueError, match="lack tensor.*model.norm.weight"):
        SliceSwap(model, [lacking])
    assert all(torch.equal(live[k], v) for k, v in model.state_dict().items())
