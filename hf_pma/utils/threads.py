"""CPU threads for the ``hf-pma`` command on a machine shared with other work.

torch starts one intra-op thread per core. When other processes keep some of those cores busy,
every parallel region waits for its slowest thread and a CPU forward pass gets several times
slower than with fewer threads (measured in the "CPU threads" section of the evaluation page
of the documentation). The command therefore uses the cores that the 1-minute load average
leaves free, at least one, unless the user set ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import os
import sys

from hf_pma.utils.logs import get_logger

logger = get_logger(__name__)

__all__ = ["usable_cores", "free_core_threads", "fit_cpu_threads"]

# Setting any of these is the user's choice of threads: hf-pma leaves torch alone then.
_USER_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def free_core_threads(current: int, cores: int, load: float) -> int:
    """Threads for a process that would use ``current``: no more than the ``cores`` that a load
    average of ``load`` (runnable processes besides this one) leaves free, at least 1."""
    return max(1, min(current, cores - round(load)))


def fit_cpu_threads() -> int | None:
    """Lower torch's intra-op threads to the cores other processes leave free (never raise them).

    Returns the threads set, or ``None`` when nothing changed (the user set
    ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, no load average, or enough free cores). Logs the
    change at DEBUG, with how to override it.
    """
    if any(os.environ.get(name) for name in _USER_THREAD_VARIABLES) or not hasattr(os, "getloadavg"):
        return None
    cores, load = usable_cores(), os.getloadavg()[0]
    if free_core_threads(cores, cores, load) >= cores:
        return None  # enough free cores: torch is not even imported (light commands stay light)
    if "torch" not in sys.modules:  # torch reads it when imported; a torch-free merge never is
        threads = free_core_threads(cores, cores, load)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        logger.debug(
            f"hf-pma: the machine is busy (1-minute load {load:.1f} on {cores} cores): torch, if used, gets {threads} thread(s)"
        )
        return threads
    import torch

    current = torch.get_num_threads()
    threads = free_core_threads(current, cores, load)
    if threads >= current:
        return None
    torch.set_num_threads(threads)
    logger.debug(
        f"hf-pma: the machine is busy (1-minute load {load:.1f} on {cores} cores): torch uses {threads} "
        f"thread(s) instead of {current} (set OMP_NUM_THREADS to choose)"
    )
    return threads
