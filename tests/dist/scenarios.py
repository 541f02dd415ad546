"""Several multi-process scenarios in one launch, so that the suite pays the start of a process
group (and the torch and transformers imports of every rank) once for all of them.

    python -m torch.distributed.run --nproc_per_node W tests/dist/scenarios.py --out OUT NAME [NAME ...]
    accelerate launch --num_processes W tests/dist/scenarios.py --out OUT NAME [NAME ...]

Each scenario runs on the same gloo process group, one after the other, in ``OUT/<name>/``,
and writes its ``result-rank<r>.json`` there. Every rank records how each scenario ended in
``OUT/<name>/scenario-rank<r>.json`` (``{"ok": true}`` or its traceback): a scenario that raises
fails alone, the next one runs (``shared_launch(launch, scenario)`` in the tests reads that record
and fails only the tests of the failed scenario, with its traceback). After a failure the ranks
meet through those files, not through the process group, then check that the group still
answers (a rank that died inside a collective leaves it broken); if it does not, the scenarios
left are recorded as not run, with the reason. The launch exits with 1 when a scenario failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def _ddp(out: Path) -> None:
    from tests.dist import train_ddp

    train_ddp.main(out, per_device=2, grad_accum=1, expect_world_size=dist.get_world_size())


def _fsdp_gather(out: Path) -> None:
    from tests.dist import fsdp_gather

    fsdp_gather.run(out)


def _merged_eval(out: Path) -> None:
    from tests.dist import merged_eval

    merged_eval.run(out)


def _eval(out: Path) -> None:
    from tests.dist import eval_launch

    eval_launch.run(out)


def _compare(out: Path) -> None:
    from tests.dist import compare_launch

    compare_launch.run(out)


def _online(out: Path) -> None:
    from tests.dist import online_sharded

    online_sharded.run(out)


def _two_nodes(out: Path) -> None:
    from tests.dist import two_nodes

    two_nodes.run(out, separate=True)


def _sharded(out: Path) -> None:
    from tests.dist import sharded_snapshots

    sharded_snapshots.run_all(out)


def _fail(out: Path) -> None:
    if dist.get_rank() == 1:
        raise ValueError("scenario fail fails on purpose on rank 1")


def _ping(out: Path) -> None:
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    (out / f"result-rank{dist.get_rank()}.json").write_text(json.dumps({"sum": int(total)}))


SCENARIOS: dict[str, Callable[[Path], None]] = {
    "ddp": _ddp,  # tests/snapshots/test_callback_distributed.py
    "fsdp_gather": _fsdp_gather,  # tests/snapshots/test_callback_distributed.py
    "merged_eval": _merged_eval,  # tests/merging/test_slices_distributed.py
    "eval": _eval,  # tests/evaluation/test_eval_cli.py
    "sharded": _sharded,  # tests/snapshots/test_sharded.py
    "online": _online,  # tests/snapshots/test_online_sharded.py
    "compare": _compare,  # tests/analysis/test_compare_runs.py
    "two_nodes": _two_nodes,  # tests/utils/test_distributed.py (raises on every rank: keep it last)
    # tests/test_launcher.py: a scenario that fails on one rank, then one that needs the group.
    "fail": _fail,
    "ping": _ping,
}


# How long a rank waits in a collective, and for the other ranks' records after a scenario: a
# rank that died inside a collective must not hold the others for torch's default 30 minutes.
TIMEOUT_S = 300


def status_path(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` records how the scenario of ``folder`` ended."""
    return folder / f"scenario-rank{rank}.json"


def _record(folder: Path, rank: int, status: dict) -> None:
    path = status_path(folder, rank)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"rank": rank, **status}))
    os.replace(partial, path)  # whole or absent: the other ranks poll for it


def _log_positions() -> dict[str, int | None]:
    """Where this rank's stdout and stderr log files are (the launcher's ``--log-dir`` makes them
    files), so that a scenario's record says which part of each log is its own."""
    positions: dict[str, int | None] = {}
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        getattr(sys, stream).flush()
        try:
            positions[stream] = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:  # a pipe or a terminal: no position
            positions[stream] = None
    return positions


def _run(name: str, folder: Path, rank: int) -> bool:
    """Run one scenario; record and return whether it ended without an exception."""
    folder.mkdir(parents=True, exist_ok=True)
    start, log_start = time.monotonic(), _log_positions()
    status: dict = {"ok": True}
    try:
        SCENARIOS[name](folder)
    except BaseException as error:  # KeyboardInterrupt from a scenario's own simulated crash too
        if not (isinstance(error, SystemExit) and error.code in (0, None)):
            status = {"ok": False, "traceback": traceback.format_exc()}
            sys.stderr.write(f"scenario {name} failed on rank {rank}:\n{traceback.format_exc()}")
    log_end = _log_positions()
    status["log"] = {s: [log_start[s], log_end[s]] for s in log_start}  # byte ranges of its output
    _record(folder, rank, {**status, "seconds": time.monotonic() - start})
    return status["ok"]


def _everyone_recorded(folder: Path, world: int) -> bool:
    """Wait (at most ``TIMEOUT_S`` and a minute) until every rank recorded the scenario of ``folder``."""
    deadline = time.monotonic() + TIMEOUT_S + 60
    while time.monotonic() < deadline:
        if all(status_path(folder, r).is_file() for r in range(world)):
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("names", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed: list[str] = []
    for k, name in enumerate(args.names):
        folder = args.out / name
        ok = _run(name, folder, rank)
        failed += [] if ok else [name]
        why = None
        if failed and not _everyone_recorded(folder, world):  # the usual path polls no file
            why = f"a rank never finished scenario {name} (stuck in a collective after another rank failed)"
        else:
            try:
                dist.barrier()
            except Exception as error:
                why = f"the process group broke in scenario {name}: {type(error).__name__}: {error}"
        if why is not None:
            for left in args.names[k + 1 :]:
                (args.out / left).mkdir(parents=True, exist_ok=True)
                _record(args.out / left, rank, {"ok": False, "traceback": f"not run: {why}"})
            failed += args.names[k + 1 :]
            sys.stderr.write(f"scenarios failed: {', '.join(failed)}\n")
            os._exit(1)  # the group cannot be torn down cleanly
    dist.destroy_process_group()
    if failed:
        sys.stderr.write(f"scenarios failed: {', '.join(failed)}\n")
        sys.exit(1)


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
