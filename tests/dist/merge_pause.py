"""Run ``hf-pma merge`` (the CLI's ``main``) and pause after its first output bytes until a line
arrives on stdin; then finish normally.

Launched by tests/merging/test_exclusive_outputs.py: a merge caught mid-write at a known point
while another merge aims at the same folder.
"""

from __future__ import annotations

import sys

from hf_pma.cli import main
from hf_pma.io import safetensors as safetensors_io


def pause_after_first_write() -> None:
    """Make the output writer report ``PAUSED`` after its first chunk and wait for stdin."""
    original = safetensors_io.SafetensorsWriter.write_at
    paused = []

    def write_at(self, name, start, chunk):
        original(self, name, start, chunk)
        if not paused:
            paused.append(True)
            sys.stdout.write(f"PAUSED {self.path}\n")
            sys.stdout.flush()
            sys.stdin.readline()

    safetensors_io.SafetensorsWriter.write_at = write_at


if __name__ == "__main__":
    pause_after_first_write()
    sys.exit(main(["merge", *sys.argv[1:]]))
