"""Run ``hf-pma ARGS`` (the CLI's ``main``), pausing once at a named function:
``pause_at.py MODULE:ATTR[.ATTR] ARGS...``.

Before the first call of that function, ``PAUSED <target>`` goes to stderr and the process waits
for a line (or the end) of stdin, then goes on. Launched by tests/test_way_out.py: a command
caught at a known stage (claimed, writing, publishing, recording) and signalled there.
"""

from __future__ import annotations

import functools
import importlib
import sys

from hf_pma.cli import main


def pause_before(target: str) -> None:
    """Wrap ``MODULE:ATTR[.ATTR]`` so that its first call pauses until stdin has a line or ends."""
    module_name, _, attr_path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    paused = []

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not paused:
            paused.append(True)
            sys.stderr.write(f"PAUSED {target}\n")
            sys.stderr.flush()
            sys.stdin.readline()
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


if __name__ == "__main__":
    pause_before(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
