"""``tests.testing_utils.launch``, the one launcher of the multi-process tests: a failed launch
explains itself with the first failing rank's full traceback, not the ranks' interleaved output."""

from __future__ import annotations

import pytest

from tests.testing_utils import launch

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("args", [[], ["--no-record"]], ids=["error-file", "stderr-log"])
def test_a_failed_launch_shows_the_first_failing_ranks_traceback(args):
    done = launch("rank_fails.py", *args, nproc=2, check=False)
    assert done.returncode != 0 and not done.timed_out
    assert [log.rank for log in done.rank_logs()] == [0, 1]
    assert "rank 0 says hello" in done.output(0) and "rank 0 noise line 1999" in done.output(0, "stderr")
    first = done.first_failure()
    assert first is not None and first.rank == 1
    report = done.report()
    assert "--- first failing rank: 1 " in report
    # The whole traceback of rank 1, from the entry point down to the nested call and the error ...
    section = report.split("--- first failing rank: 1 ")[1].split("(ranks [0] failed after it)")[0]
    assert (
        "Traceback (most recent call last)" in section
        and "in main" in section
        and "in nested_failure" in section
    )
    assert section.rstrip().endswith("ValueError: rank 1 fails on purpose")
    # ... and none of rank 0's noise.
    assert "noise line" not in report
    with pytest.raises(AssertionError) as failure:
        done.check()
    assert str(failure.value).startswith(report)
    done.discard_logs()
    assert not done.log_dir.exists() and "rank 0 says hello" in done.output(0)
