"""Run ``hf-pma merge`` (the CLI's ``main``) and stall half-way through the first output file.

Launched by tests/merging/test_merge_crash.py, which waits for the ``STALLED`` line and then
kills this process with SIGKILL from outside: a merge killed mid-write, at a known point.
"""

from __future__ import annotations

import sys
import time

from hf_pma.cli import main
from hf_pma.merging import safetensors_io


def stall_mid_write() -> None:
    """Make the output writer write half of its first chunk, report it, and wait to be killed."""
    original = safetensors_io.SafetensorsWriter.write

    def write(self, name, chunk):
        original(self, name, chunk[: max(1, chunk.numel() // 2)])
        self._fh.flush()
        sys.stdout.write(f"STALLED {self.path}\n")
        sys.stdout.flush()
        time.sleep(600)
        raise SystemExit("the merge should have been killed while stalled")

    safetensors_io.SafetensorsWriter.write = write


if __name__ == "__main__":
    stall_mid_write()
    sys.exit(main(["merge", *sys.argv[1:]]))
