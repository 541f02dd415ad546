"""Several multi-process scenarios in one launch, so that the suite pays the start of a process
group (and the torch and transformers imports of every rank) once for all of them.

    python -m torch.distributed.run --nproc_per_node W tests/dist/scenarios.py --out OUT NAME [NAME ...]
    accelerate launch --num_processes W tests/dist/scenarios.py --out OUT NAME [NAME ...]

Each scenario runs on the same gloo process group, one after the other, in ``OUT/<name>/``,
and writes its ``result-rank<r>.json`` there. A scenario that raises ends the launch; the test
launcher (``tests.testing_utils.launch``) then shows the first failing rank's traceback.
"""

from __future__ import annotations

import argparse
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


SCENARIOS: dict[str, Callable[[Path], None]] = {
    "ddp": _ddp,  # tests/snapshots/test_callback_distributed.py
    "fsdp_gather": _fsdp_gather,  # tests/snapshots/test_callback_distributed.py
    "merged_eval": _merged_eval,  # tests/merging/test_slices_distributed.py
    "eval": _eval,  # tests/evaluation/test_eval_cli.py
    "sharded": _sharded,  # tests/snapshots/test_sharded.py
    "online": _online,  # tests/snapshots/test_online_sharded.py
    "compare": _compare,  # tests/analysis/test_compare_runs.py
    "two_nodes": _two_nodes,  # tests/utils/test_distributed.py (raises on every rank: keep it last)
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("names", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in args.names:
        (args.out / name).mkdir(parents=True, exist_ok=True)
        SCENARIOS[name](args.out / name)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
