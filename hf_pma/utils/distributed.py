"""Distributed helpers: work on the main process while the others wait, steps whose failure on
any rank is raised on every rank, and the check that every rank sees the folder rank 0 writes.

Evaluation under ``accelerate launch`` / ``torchrun`` must neither run N times nor hang. hf-pma's
choice: evaluation runs on the global main process (rank 0) only; the other ranks block until
it is done and then receive the same result (or the same exception), so a script that calls
an evaluation function on every rank goes on identically everywhere.

Every wait happens on a dedicated gloo group with a long timeout, not on the training group:
NCCL's default timeout would kill the waiting ranks during a long evaluation or merge.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import os
import pickle
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "DEFAULT_WAIT_TIMEOUT",
    "RankFailure",
    "all_ranks_checked",
    "check_folder_shared",
    "distributed_rank_and_size",
    "local_world_size",
    "release_wait_groups",
    "wait_group",
    "is_main_process",
    "run_locally",
    "run_on_main_process",
    "unwrap_model",
    "sharding_kind",
    "require_unsharded_model",
    "is_peft_model",
    "warn_if_fewer_processes",
]

T = TypeVar("T")

# How long the other ranks wait for the main process (a large evaluation can take hours).
DEFAULT_WAIT_TIMEOUT = datetime.timedelta(hours=24)

# True while the main process is inside run_on_main_process: nested calls then run directly
# (a collective there would hang, the other ranks are not taking part).
_INSIDE = contextvars.ContextVar("hf_pma_inside_main_process", default=False)
_WAIT_GROUPS: dict[int, Any] = {}


def distributed_rank_and_size() -> tuple[int, int]:
    """(global rank, world size); ``(0, 1)`` outside a multi-process launch.

    Under a launcher (``WORLD_SIZE`` > 1) whose script has not set up ``torch.distributed``
    yet, the default process group is initialized through ``accelerate.PartialState``.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available():
        from accelerate import PartialState

        logger.debug("WORLD_SIZE > 1 and no process group yet: initializing it through accelerate")
        PartialState()
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """Whether this is the global main process (always true in a single process)."""
    return distributed_rank_and_size()[0] == 0


@contextlib.contextmanager
def run_locally() -> Iterator[None]:
    """Inside this block, hf-pma evaluation runs right here, without any collective: for code that
    only one rank executes (``if trainer.is_world_process_zero(): ...``), where waiting for the
    other ranks would hang."""
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)


def wait_group(timeout: datetime.timedelta = DEFAULT_WAIT_TIMEOUT) -> Any:
    """A gloo group over every rank for waits and small messages, created once per world.

    Its timeout (default 24 h) is the longest any rank may wait there; the first call is a
    collective (every rank makes it, in the same order as its other collectives).
    """
    import torch.distributed as dist

    key = (id(dist.group.WORLD), timeout)
    if key not in _WAIT_GROUPS:
        if not _WAIT_GROUPS:
            atexit.register(release_wait_groups)
        _WAIT_GROUPS[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _WAIT_GROUPS[key]


def release_wait_groups() -> None:
    """Destroy the gloo groups :func:`wait_group` made (registered to run at exit).

    Training scripts rarely call ``destroy_process_group()``; a gloo group left to the
    interpreter's final teardown can abort the process there ("terminate called without an
    active exception", seen under load), after training succeeded. Destroying a group is local
    (no collective), so each rank does it on its own way out.
    """
    import torch.distributed as dist

    groups = list(_WAIT_GROUPS.values())
    _WAIT_GROUPS.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return  # the user destroyed every group already
    for group in groups:
        with contextlib.suppress(Exception):  # already destroyed with its world
            dist.destroy_process_group(group)


def local_world_size() -> int:
    """Processes on this machine (``LOCAL_WORLD_SIZE`` as torchrun and accelerate set it; 1 otherwise)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class RankFailure(RuntimeError):
    """A step that every rank ran failed on some other rank(s); the message names them."""


def all_ranks_checked(
    fn: Callable[[], T], what: str, timeout: datetime.timedelta = DEFAULT_WAIT_TIMEOUT
) -> list[T]:
    """Run ``fn()`` on every rank and return every rank's result, rank 0 first.

    If ``fn`` fails on any rank, every rank raises: the failing ranks their own exception, the
    others a :class:`RankFailure` naming the failed ranks and the first error, so that no rank
    goes on to a collective that the others never reach. Results travel over the gloo
    :func:`wait_group` (small picklable values only). In a single process: ``[fn()]``.
    """
    rank, world_size = distributed_rank_and_size()
    if world_size == 1:
        return [fn()]
    import torch.distributed as dist

    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - reported to every rank, then re-raised here
        error = err
    status = ("error", f"{type(error).__name__}: {error}") if error is not None else _picklable(("ok", result))
    statuses: list[Any] = [None] * world_size
    dist.all_gather_object(statuses, status, group=wait_group(timeout))
    failed = [(r, s[1]) for r, s in enumerate(statuses) if s[0] == "error"]
    if error is not None:
        raise error
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        raise RankFailure(f"{what} failed on rank(s) {ranks}: {failed[0][1]}")
    return [s[1] for s in statuses]


def _picklable(payload: tuple[str, Any]) -> tuple[str, Any]:
    # A payload that cannot be pickled would fail on rank 0 only and leave the others waiting:
    # replace it by a description that can.
    try:
        pickle.dumps(payload)
        return payload
    except Exception as err:  # noqa: BLE001 - any pickling failure
        status, value = payload
        if status == "error":
            return "error", RuntimeError(f"evaluation failed on the main process: {value!r}")
        return "error", TypeError(f"the main process's result ({type(value).__name__}) cannot be sent to the other ranks: {err}")


def run_on_main_process(
    fn: Callable[..., T], *args: Any, timeout: datetime.timedelta = DEFAULT_WAIT_TIMEOUT, **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)`` on the global main process only; every rank returns its result.

    In a single process this is a plain call. Under several processes every rank must call it
    (in the same order as its other collectives): rank 0 runs ``fn``, the others wait up to
    ``timeout`` and receive the result through a broadcast; an exception on rank 0 is raised
    on every rank. Calls nested inside ``fn``, or inside :func:`run_locally`, run directly:
    code that runs on one rank only must use :func:`run_locally`, or it waits for ranks that
    never come.
    """
    if _INSIDE.get():
        return fn(*args, **kwargs)
    rank, world_size = distributed_rank_and_size()
    if world_size == 1:
        token = _INSIDE.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _INSIDE.reset(token)

    import torch.distributed as dist

    group = wait_group(timeout)
    payload: tuple[str, Any] | None = None
    error: BaseException | None = None
    if rank == 0:
        token = _INSIDE.set(True)
        try:
            payload = ("ok", fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others are told
            error = err
            payload = ("error", err)
        finally:
            _INSIDE.reset(token)
        payload = _picklable(payload)
    else:
        # Checks at start-up run here as well as evaluations: say which work, at DEBUG (every rank but one).
        logger.debug(f"rank {rank}: waiting for the main process to run {getattr(fn, '__qualname__', fn)}")
    box = [payload]
    dist.broadcast_object_list(box, src=0, group=group)
    status, value = box[0]
    if status == "error":
        raise error if error is not None else value
    return value if rank != 0 else payload[1]


def check_folder_shared(
    folder: str | os.PathLike[str], what: str = "folder", wait: float = 10.0, timeout: datetime.timedelta = DEFAULT_WAIT_TIMEOUT
) -> None:
    """Raise on every rank unless every rank sees the files that rank 0 writes into ``folder``.

    Rank 0 writes a file with a random token into its ``folder``; every rank looks for it in
    its own ``folder`` (retrying for up to ``wait`` seconds, for network file systems' caches);
    the answers are gathered on the gloo :func:`wait_group`. When some rank cannot see it
    (node-local disks on several machines) every rank stops with an error naming the folder
    and those ranks, instead of hanging later in a collective. Every rank must call it; in a
    single process it does nothing.
    """
    rank, world_size = distributed_rank_and_size()
    if world_size == 1:
        return
    import torch.distributed as dist

    folder = Path(folder).absolute()
    probe_name = f".hf-pma-visible-{uuid.uuid4().hex}"

    def write_probe() -> str | None:
        if rank != 0:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        (folder / probe_name).write_text(probe_name)
        return probe_name

    name = all_ranks_checked(write_probe, f"writing a probe file into the {what} {folder}", timeout)[0]
    deadline = time.monotonic() + wait
    while True:
        try:
            seen = (folder / name).read_text() == name
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    answers: list[Any] = [None] * world_size
    dist.all_gather_object(answers, (seen, str(folder), _host()), group=wait_group(timeout))
    if rank == 0:
        (folder / name).unlink(missing_ok=True)
    blind = [(r, f, h) for r, (ok, f, h) in enumerate(answers) if not ok]
    if blind:
        where = "; ".join(f"rank {r} on {h} (looking in {f})" for r, f, h in blind)
        raise RuntimeError(
            f"hf-pma: the {what} {answers[0][1]} that rank 0 writes on {answers[0][2]} is not visible to {where}: "
            "every process must see the same folder (put output_dir on a file system shared by all nodes)"
        )


def _host() -> str:
    import socket

    return socket.gethostname()


def is_peft_model(model: Any) -> bool:
    """True for a ``peft.PeftModel`` (snapshots then hold only the adapter weights)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def unwrap_model(model: Any) -> Any:
    """The model inside DDP / DataParallel / DeepSpeed / ``torch.compile`` wrappers.

    FSDP2 modules are the model itself (``fully_shard`` works in place); for FSDP1 this is the
    wrapped module, which carries the config (its parameters stay sharded: gather them with
    :func:`hf_pma.snapshots.writer.gather_full_state_dict`, never ``state_dict()`` of the result).
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel, FullyShardedDataParallel)
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        elif type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine") and hasattr(model, "module"):
            model = model.module
    return model


def sharding_kind(model: Any) -> str | None:
    """``"fsdp"`` (FSDP1 or FSDP2), ``"zero3"`` (DeepSpeed ZeRO-3) or ``None`` (full weights here)."""
    import itertools

    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    # Wrappers (DDP, DeepSpeed engine) are modules too: their modules() include the model's.
    for module in model.modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            return "fsdp"
    for param in itertools.islice(model.parameters(), 64):
        if hasattr(param, "ds_id"):
            return "zero3"
        if type(param.data).__name__ == "DTensor":
            return "fsdp"
    return None


def require_unsharded_model(model: Any) -> Any:
    """The full model that this process can run alone: :func:`unwrap_model`'s result, or
    ``ValueError`` for a sharded model (FSDP1/FSDP2, DTensor parameters, DeepSpeed ZeRO-3),
    whose forward needs every rank (evaluation runs on the main process only)."""
    kind = sharding_kind(model)
    if kind is not None:
        raise ValueError(
            f"the model is sharded ({'FSDP/DTensor' if kind == 'fsdp' else 'DeepSpeed ZeRO-3'}): evaluation runs on "
            "the main process alone; evaluate a full copy (e.g. a saved snapshot folder) instead"
        )
    return unwrap_model(model)


def _launcher_processes() -> int | None:
    """``--num_processes`` of the ``accelerate launch`` that started this process (Linux: read from
    the parent's command line), or ``None`` when not started so or not known."""
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "launch" not in parent[:4] or not any(Path(arg).name == "accelerate" for arg in parent[:3]):
        return None
    for i, arg in enumerate(parent):
        value = arg.partition("=")[2] if arg.startswith("--num_processes=") else None
        if arg == "--num_processes" and i + 1 < len(parent):
            value = parent[i + 1]
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def warn_if_fewer_processes(script: str) -> None:
    """A warning when ``accelerate launch --num_processes N`` (N > 1) started one process (on CPU,
    ``--cpu`` alone does not make several), with the command that starts N running ``script``."""
    asked = _launcher_processes()
    if asked is not None and asked > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        logger.warning(
            f"accelerate launch was asked for {asked} processes but this run has 1 (WORLD_SIZE is not set): on "
            f"CPU, start them with: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {asked} "
            f"{script} (or torchrun --nproc_per_node {asked} {script})"
        )
