"""``tests.helpers.launcher.launch``, the one launcher of the multi-process tests: a failed launch
explains itself with the first failing rank's full traceback, not the ranks' interleaved output;
a failed scenario of a shared launch fails its own tests only."""

from __future__ import annotations

import pytest

from tests.helpers.launcher import launch, rank_reports, shared_launch_job

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


shared_launch_job("fail-then-ping")(
    lambda out: launch("scenarios.py", "--out", out, "fail", "ping", nproc=2, check=False)
)


@pytest.mark.shared_launch("fail-then-ping")
def test_a_failed_scenario_fails_alone(shared_launch):
    """Scenario ``fail`` raises on rank 1 only; ``ping``, after it on the same process group, runs
    and its tests pass; the tests of ``fail`` fail with rank 1's traceback; the launch says which
    failed (exit status 1)."""
    reports = rank_reports(shared_launch("fail-then-ping", "ping"), 2)
    assert reports == [{"sum": 3}, {"sum": 3}]
    with pytest.raises(pytest.fail.Exception) as failure:
        shared_launch("fail-then-ping", "fail")
    message = str(failure.value)
    assert (
        message.startswith("scenario 'fail' failed on rank 1;") and "ranks [" not in message.splitlines()[0]
    )
    # Its log: what rank 1 printed while the scenario ran (not before, not after), then the traceback.
    log = message.split("during the scenario (last 6000 characters) ---\n")[1].split("\n--- rank 1: the")[0]
    assert log.startswith("scenario fail failed on rank 1:") and "scenarios failed" not in log
    assert "Traceback (most recent call last)" in message and message.rstrip().endswith(
        "ValueError: scenario fail fails on purpose on rank 1"
    )
    done = shared_launch.result("fail-then-ping", "ping")
    assert done.returncode == 1 and "scenarios failed: fail" in done.output(1, "stderr")
    with pytest.raises(pytest.fail.Exception):
        shared_launch.result("fail-then-ping")  # the whole launch failed
