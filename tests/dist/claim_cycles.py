"""One racer of tests/test_one_writer.py: ``claim_cycles.py FOLDER COUNTER ROLE CYCLES READY GO``.

A ``writer`` takes FOLDER's claim CYCLES times, exclusively, and in each turn reads COUNTER,
writes ``N+1 pending``, then ``N+1`` (a plain read-modify-write: interleaved turns lose
updates or leave ``pending`` seen); a ``reader`` takes the claim shared CYCLES times and checks it
never sees a ``pending`` value. Barriers are files: READY once imported, then wait for GO.
With ``--no-flock`` ``fcntl.flock`` fails with ENOLCK, as on a filesystem without locks.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path


def main() -> int:
    folder, counter, role, cycles, ready, go = sys.argv[1:7]
    if "--no-flock" in sys.argv[7:]:
        import fcntl

        def no_locks(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        fcntl.flock = no_locks
    from hf_pma.utils.fs import CLAIM_WAIT_S, hold_claim, read_claim

    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.001)
    seen = 0
    for _ in range(int(cycles)):
        if role == "writer":
            with hold_claim(folder, wait=CLAIM_WAIT_S, what="counter folder"):
                fd = os.open(counter, os.O_RDWR)
                try:
                    value = int(os.pread(fd, 64, 0).split()[0]) + 1
                    for text in (f"{value} pending", str(value)):  # cut to length, never to 0 (ext4 flushes those at close)
                        os.pwrite(fd, text.encode(), 0)
                        os.ftruncate(fd, len(text))
                finally:
                    os.close(fd)
        else:
            with read_claim(folder, what="counter folder"):
                with open(counter, "rb") as fh:
                    text = fh.read()
                if b"pending" in text or not text:
                    print(f"reader saw a write in progress: {text!r}", file=sys.stderr)
                    return 1
                seen += 1
    print(seen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
