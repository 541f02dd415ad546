"""Multi-node safety: ranks that cannot see the snapshot folder rank 0 writes stop at once, all of them."""

from __future__ import annotations

import pytest

from tests.helpers.launcher import rank_reports

pytestmark = [pytest.mark.distributed, pytest.mark.shared_launch("world2")]


def test_two_nodes_with_separate_disks_stop_with_a_clear_error(shared_launch):
    # tests/dist/two_nodes.py in the shared 2-process launch; each rank trains into its own folder.
    tmp_path = shared_launch("world2", "two_nodes")
    reports = rank_reports(tmp_path, 2)
    for report in reports:
        assert report["world_size"] == 2
        error = report["error"]
        assert error and f"snapshot folder {tmp_path / 'node0' / 'pma'} that rank 0 writes" in error
        assert (
            "not visible to rank 1 " in error
            and str(tmp_path / "node1" / "pma") in error
            and "rank 0 on" not in error
        )
    # Nothing trained, no snapshot written; the probe file is gone.
    assert sorted(p.name for p in (tmp_path / "node0" / "pma").iterdir()) == ["manifest.json"]


def test_wait_groups_are_released_at_exit_and_after_the_users_own_teardown(tmp_path):
    import torch.distributed as dist

    from hf_pma.utils import distributed

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = distributed.wait_group()
        assert distributed.wait_group() is group  # made once per world
        distributed.release_wait_groups()
        assert distributed._WAIT_GROUPS == {}
        assert group not in dist.distributed_c10d._world.pg_map  # destroyed: no longer a group of this world
        distributed.wait_group()
    finally:
        dist.destroy_process_group()
    distributed.release_wait_groups()  # after the user destroyed every group: nothing to do, no error
    assert distributed._WAIT_GROUPS == {}
