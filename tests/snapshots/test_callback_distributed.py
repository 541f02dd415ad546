"""PMACallback and the gather path in real multi-process runs (gloo on CPU).

* 2-process DDP under ``accelerate launch`` (the shared 2-process launch of
  tests/dist/scenarios.py): the same token boundaries as a single process with the same global
  batch, exactly one writer, snapshot weights equal to the model's weights at that step.
* FSDP2 (``fully_shard``) and FSDP1 (same shared launch): the gathered state dict equals the
  unsharded model. The Trainer cannot run FSDP on CPU (it does not shard with
  ``use_cpu``), so the gather + write path the callback uses is tested directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.launcher import rank_reports

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory) -> dict:
    """The same training in this process: one process, 2 micro-batches of 2 = the global batch of 2x2."""
    from tests.dist import train_ddp

    out = tmp_path_factory.mktemp("single")
    return train_ddp.main(out, per_device=2, grad_accum=2, expect_world_size=1)


def check_ddp_reports(reports: list[dict], reference: dict, out: Path) -> None:
    rank0, rank1 = reports
    assert [r["rank"] for r in reports] == [0, 1]
    assert rank0["world_size"] == rank1["world_size"] == 2
    # The global token count: identical on both ranks and to the single process.
    assert rank0["token_count"] == "non_padding"
    assert rank0["tokens_by_step"] == rank1["tokens_by_step"] == reference["tokens_by_step"]
    assert rank0["snapshots"] == reference["snapshots"] and len(rank0["snapshots"]) >= 4
    # Exactly one writer: rank 0 wrote every snapshot, rank 1 none.
    assert rank0["has_writer"] and not rank1["has_writer"] and rank1["written"] == []
    assert rank0["written"] == [f"snapshot-{tokens}" for tokens, _, _ in rank0["snapshots"]]
    assert rank0["folders"] == ["manifest.json", *sorted(rank0["written"])]
    assert sorted(p.name for p in (out / "pma").iterdir()) == rank0["folders"]
    # Each snapshot holds exactly the weights the model had after that step.
    assert rank0["max_diff"] == 0.0


@pytest.mark.shared_launch("world2")
def test_ddp_accelerate_launch(shared_launch, single_process_reference):
    out = shared_launch("world2", "ddp")
    check_ddp_reports(rank_reports(out, 2), single_process_reference, out)


@pytest.mark.shared_launch("world2")
def test_fsdp_gather_equals_unsharded_model(shared_launch):
    out = shared_launch("world2", "fsdp_gather")
    reports = rank_reports(out, 2)
    for kind in ("fsdp2", "fsdp1"):
        rank0, rank1 = (r[kind] for r in reports)
        assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
        assert rank0["kind"] == rank1["kind"] == "fsdp"
        assert rank1["none_off_main"] and rank1["none_off_main_after_training"]
        assert rank0["initial_max_diff"] == 0.0
        assert rank0["changed_by_training"] and rank0["trained_max_diff"] < 1e-6
        assert rank0["copy_unchanged_by_later_step"]
        assert rank0["snapshot_max_diff"] == 0.0 and rank0["architectures"] == ["LlamaForCausalLM"]
        # Only rank 0 wrote.
        assert sorted(p.name for p in (out / kind).iterdir()) == ["manifest.json", "snapshot-100"]
