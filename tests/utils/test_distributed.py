"""Multi-node safety: ranks that cannot see the snapshot folder rank 0 writes stop at once, all of them."""

from __future__ import annotations

import pytest

from tests.testing_utils import rank_reports

pytestmark = [pytest.mark.distributed, pytest.mark.shared_launch("world2")]


def test_two_nodes_with_separate_disks_stop_with_a_clear_error(shared_launch):
    # tests/dist/two_nodes.py in the shared 2-process launch; each rank trains into its own folder.
    tmp_path = shared_launch("world2") / "two_nodes"
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
