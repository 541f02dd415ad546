"""Launched by tests/test_launcher.py: rank 1 raises inside a nested call while rank 0 fills its
stderr with noise and then waits in a collective (which fails once rank 1 is gone). With
``--no-record`` no rank writes torch elastic's error file."""

from __future__ import annotations

import sys

import torch.distributed as dist


def nested_failure() -> None:
    raise ValueError("rank 1 fails on purpose")


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        nested_failure()
    for i in range(2000):
        print(f"rank 0 noise line {i}", file=sys.stderr)
    print("rank 0 says hello")
    dist.barrier()  # rank 1 never comes: this fails after rank 1 died


if __name__ == "__main__":
    if "--no-record" in sys.argv:  # no error file: the launcher reads the ranks' stderr logs
        main()
    else:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(main)()
