"""Run ``hf-pma merge`` (the CLI's ``main``) and stall half-way through the first output file.

Launched by tests/merging/test_merge_crash.py, which waits for the ``STALLED`` line and then
kills this process with SIGKILL from outside: a merge killed mid-write, at a known point.
"""

from __future__ import annotations

import sys
import time

from hf_pma.cli import main
from hf_pma.io import safetensors as safetensors_io


def stall_mid_write() -> None:
    """Make the output writer write half of its first chunk, report it, and wait to be killed
    (the merge engine writes in place with ``write_at``)."""
    original = safetensors_io.SafetensorsWriter.write_at

    def write_at(self, name, start, chunk):
        original(self, name, start, chunk[: max(1, len(chunk) // 2)])
        sys.stdout.write(f"STALLED {self.path}\n")
        sys.stdout.flush()
        time.sleep(600)
        raise SystemExit("the merge should have been killed while stalled")

    safetensors_io.SafetensorsWriter.write_at = write_at


if __name__ == "__main__":
    stall_mid_write()
    sys.exit(main(["merge", *sys.argv[1:]]))
