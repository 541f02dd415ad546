"""The ``main`` of a rank script (``tests/dist/*.py``) that takes ``--out`` and runs on gloo."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def run_on_gloo(run: Callable[[Path], object]) -> None:
    """Parse ``--out``, one thread, a gloo process group around ``run(out)``; under torch
    elastic's ``record``, so that the test names the first failing rank and shows its traceback."""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        parser = argparse.ArgumentParser()
        parser.add_argument("--out", type=Path, required=True)
        args = parser.parse_args()
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        run(args.out)
        dist.destroy_process_group()

    main()
