"""Snapshot cost under FSDP2 at several world sizes: full gather vs sharded snapshots, and the
online average (gathered to rank 0 vs shard-local).

A ~130M-parameter Llama (fp32 master weights) is sharded with ``fully_shard`` on gloo, one
thread per process, and snapshots are taken the way ``PMACallback`` takes them (``take`` in the
training thread, ``commit`` hands the write to the background, then the next snapshot). One
launch per (world size, method), so that the memory of one method does not hide another's.
Per rank and per method:

* ``peak extra MB``: ``VmHWM`` during two snapshots (the peak is reset through
  ``/proc/self/clear_refs`` first) minus the RSS before them;
* ``blocked s``: seconds the training thread spends in ``take`` + ``commit`` (mean of two);
* ``written MB``: bytes this rank wrote per snapshot.

Methods (one function each; add a measurement by adding a function to ``MEASUREMENTS``):

* ``gather``: ``DiskSnapshotSink`` (the full-gather path, tensor by tensor, cast on device);
* ``gather-old``: the previous full-gather code (``get_model_state_dict(full_state_dict=True)``,
  then ``clone``/``to(dtype)``), for reference;
* ``sharded``: ``ShardedSnapshotSink`` (every rank its own slices, DCP layout);
* ``dcp``: ``torch.distributed.checkpoint.save`` with ``HuggingFaceStorageWriter(save_distributed=True)``
  on the same (cast) local shards: the engine hf-pma's own writer is compared with;
* ``online-gather``: one update of the online average the way it is kept without sharding
  (``OnlineAverageSink``: the full fp32 weights gathered to rank 0, which folds them into its
  float32 average in the background thread);
* ``online-sharded``: one update of the shard-local online average (``ShardedOnlineAverageSink``,
  ``online_device="cpu"``: every rank copies its own slices into reused host buffers and folds
  them into its float32 copy in the background thread; nothing gathered);
* ``online-sharded-device``: the same with ``online_device="device"`` (folded in the training
  thread, no staging copy; on CPU the "device" is host memory).

The online methods ignore ``--save-dtype`` (the average is float32) and write nothing per
snapshot. They run one warm-up update (it allocates the average and the buffers), then
``--repeats`` timed updates; between two updates the fold in flight is waited for untimed (the
training steps between two snapshots), so ``blocked`` is what the training thread spends in
``take`` + ``commit``; the table gives, per update, the slowest rank's blocked time (the next
collective waits for it), as the median and the min-max over the repeats, the background fold's
median, and the peak extra RSS per rank over all the updates (the average included).

Usage::

    python benchmarks/bench_scale.py                       # world sizes 1 2 4, all methods, bf16 snapshots
    python benchmarks/bench_scale.py --worlds 2 --methods sharded gather --save-dtype float32
    python benchmarks/bench_scale.py --worlds 1 2 4 --methods online-gather online-sharded online-sharded-device \\
        --hidden 256 --layers 4 --intermediate 512 --vocab 8000 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SNAPSHOTS = 2


# ---------------------------------------------------------------------------------------------
# Measuring one process
# ---------------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Reset ``VmHWM`` to the current RSS; returns that RSS in kB."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from common import llama
    from torch.distributed.fsdp import fully_shard

    model = llama(
        hidden=args.hidden, layers=args.layers, vocab=args.vocab, intermediate=args.intermediate,
        max_positions=512, tie=False, meta=True,
    )
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")  # each rank materializes its own shards only
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    return model


def _timed_snapshots(take: Callable[[int], None], wait: Callable[[], None]) -> dict:
    """Run SNAPSHOTS snapshots; returns the peak extra RSS and the mean blocked time."""
    import torch.distributed as dist

    dist.barrier()
    base = reset_peak()
    blocked = []
    for i in range(SNAPSHOTS):
        start = time.perf_counter()
        take(i)
        blocked.append(time.perf_counter() - start)
        dist.barrier()  # the next "step"
    wait()
    dist.barrier()
    return {"peak_extra_mb": (_status_kb("VmHWM") - base) / 1024, "blocked_s": sum(blocked) / len(blocked)}


def _record(i: int):
    from hf_pma.core.manifest import SnapshotRecord, snapshot_dirname

    return SnapshotRecord(path=snapshot_dirname(1000 * (i + 1)), tokens=1000 * (i + 1), step=i + 1)


def _sink_measure(sink, model) -> dict:
    sink.open(None)
    sink.update_manifest()

    def take(i: int) -> None:
        sink.take(model, _record(i))
        sink.commit()

    result = _timed_snapshots(take, lambda: sink.close(model))
    return result


def measure_gather(model, out: Path, dtype, rank: int, world: int) -> dict:
    """The full-gather path: ``DiskSnapshotSink`` (rank 0 writes everything)."""
    from hf_pma.snapshots.sinks import DiskSnapshotSink

    sink = DiskSnapshotSink(out, is_main=rank == 0, save_dtype=dtype)
    result = _sink_measure(sink, model)
    written = sum(f.stat().st_size for f in out.glob("snapshot-*/*.safetensors")) if rank == 0 else 0
    return {**result, "written_mb": written / SNAPSHOTS / 2**20}


def measure_gather_old(model, out: Path, dtype, rank: int, world: int) -> dict:
    """The full gather as it was: ``get_model_state_dict(full_state_dict=True)`` then clone and cast,
    the previous copy still held while the next is gathered (measured without writing)."""
    import itertools

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    held: list = []

    def take(i: int) -> None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        if rank != 0:
            return
        live = {t.to_local().untyped_storage().data_ptr() for t in itertools.chain(model.parameters())}
        out_sd = {}
        for name, tensor in state.items():
            if tensor.untyped_storage().data_ptr() in live:
                tensor = tensor.clone()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            out_sd[name] = tensor
        held[:] = [out_sd]  # the job waiting for the writer

    result = _timed_snapshots(take, lambda: held.clear())
    return {**result, "written_mb": float("nan")}


def measure_sharded(model, out: Path, dtype, rank: int, world: int) -> dict:
    """Sharded snapshots: ``ShardedSnapshotSink`` (every rank writes its own slices)."""
    from hf_pma.snapshots.sharded import ShardedSnapshotSink

    sink = ShardedSnapshotSink(out, save_dtype=dtype)
    result = _sink_measure(sink, model)
    return {**result, "written_mb": sink.bytes_written / SNAPSHOTS / 2**20}


def measure_dcp(model, out: Path, dtype, rank: int, world: int) -> dict:
    """torch DCP's own engine on the same local shards, cast first (``dcp.save`` is synchronous)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def take(i: int) -> None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out / f"dcp-{i}"), save_distributed=True))

    result = _timed_snapshots(take, lambda: None)
    mine = out / "dcp-0" / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
    return {**result, "written_mb": (mine.stat().st_size if mine.exists() else 0) / 2**20}


REPEATS = 7  # timed online updates after the warm-up (``--repeats``)


def _online_measure(sink, model) -> dict:
    """One warm-up update, then ``REPEATS`` timed ones (the fold in flight waited for, untimed,
    between two); the average itself (allocated at the warm-up) counts in the peak."""
    import torch.distributed as dist

    sink.open(None)
    sink.update_manifest()
    dist.barrier()
    base = reset_peak()
    blocked = []
    for i in range(REPEATS + 1):
        dist.barrier()  # every rank starts the update together, as after an optimizer step
        start = time.perf_counter()
        sink.take(model, _record(i))
        sink.commit()
        if i:  # the first is the warm-up
            blocked.append(time.perf_counter() - start)
        sink.worker.wait()  # the training steps until the next snapshot: the fold lands meanwhile
    dist.barrier()
    return {
        "peak_extra_mb": (_status_kb("VmHWM") - base) / 1024,
        "blocked_s": statistics.median(blocked),
        "blocked_all_s": blocked,
        "fold_all_s": list(sink.worker.task_seconds[1:]),
        "written_mb": 0.0,
        "average_mb": sink.average.num_bytes / 2**20,
    }


def measure_online_gather(model, out: Path, dtype, rank: int, world: int) -> dict:
    """The online average without sharding: ``OnlineAverageSink`` gathers the full fp32 weights to
    rank 0, which folds them into its float32 average (in the background, as by default)."""
    from hf_pma.snapshots.sinks import OnlineAverageSink

    return _online_measure(OnlineAverageSink(out, online="sma", is_main=rank == 0), model)


def measure_online_sharded(model, out: Path, dtype, rank: int, world: int) -> dict:
    """The shard-local online average: ``ShardedOnlineAverageSink`` (every rank stages its own slices
    into reused host buffers and folds them into its float32 copy in the background; no gather)."""
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink

    return _online_measure(ShardedOnlineAverageSink(out, online="sma"), model)


def measure_online_sharded_device(model, out: Path, dtype, rank: int, world: int) -> dict:
    """The shard-local online average kept on the device (``online_device="device"``): folded in the
    training thread, nothing staged."""
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink

    return _online_measure(ShardedOnlineAverageSink(out, online="sma", online_device="device"), model)


MEASUREMENTS: dict[str, Callable[..., dict]] = {
    "online-gather": measure_online_gather,
    "online-sharded": measure_online_sharded,
    "online-sharded-device": measure_online_sharded_device,
    "gather": measure_gather,
    "gather-old": measure_gather_old,
    "sharded": measure_sharded,
    "dcp": measure_dcp,
}


def worker(args: argparse.Namespace) -> None:
    """One torchrun process: build the sharded model, run one method, write this rank's result."""
    import torch.distributed as dist

    global REPEATS
    REPEATS = args.repeats
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args)
    dtype = None if args.save_dtype == "float32" else getattr(torch, args.save_dtype)
    out = Path(args.out) / args.method
    result = MEASUREMENTS[args.method](model, out, dtype, rank, world)
    result["model_mb"] = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    Path(args.out, f"{args.method}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace, world: int, method: str, folder: Path) -> list[dict]:
    """Run one (world size, method) under torchrun; returns the per-rank results."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master-port", str(_free_port()),
        __file__, "--worker", "--method", method, "--out", str(folder), "--save-dtype", args.save_dtype,
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--intermediate", str(args.intermediate),
        "--vocab", str(args.vocab), "--repeats", str(args.repeats),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} at world size {world} failed:\n{proc.stderr[-4000:]}")
    return [json.loads((folder / f"{method}-rank{r}.json").read_text()) for r in range(world)]


ONLINE_NAMES = {
    "online-gather": "gather to rank 0",
    "online-sharded": "shard-local, cpu",
    "online-sharded-device": "shard-local, device",
}


def online_table(rows: list[tuple[int, str, list[dict]]]) -> str:
    """The online methods: per update the slowest rank's blocked seconds (median, min-max over the
    repeats), the background fold's median (slowest rank), peak extra RSS per rank, the average's size."""
    model_mb = rows[0][2][0]["model_mb"]
    lines = [
        f"model: {model_mb:.0f} MB of fp32 parameters; {len(rows[0][2][0]['blocked_all_s'])} timed updates per row",
        "",
        "| world | method | blocked s per update, median | blocked s, min-max | background fold s, median | peak extra MB, rank 0 | peak extra MB, max other rank | average MB, rank 0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, method, ranks in rows:
        slowest = [max(r["blocked_all_s"][i] for r in ranks) for i in range(len(ranks[0]["blocked_all_s"]))]
        # Ranks without a fold (off rank 0 when gathered; folded in the training thread on the device) count 0.
        folds = [max(r["fold_all_s"][i] if i < len(r["fold_all_s"]) else 0.0 for r in ranks) for i in range(len(slowest))]
        fold = f"{statistics.median(folds):.3f}" if any(folds) else "-"
        peaks = [r["peak_extra_mb"] for r in ranks]
        others = f"{max(peaks[1:]):.0f}" if len(peaks) > 1 else "-"
        lines.append(
            f"| {world} | {ONLINE_NAMES.get(method, method)} | {statistics.median(slowest):.3f} | "
            f"{min(slowest):.3f}-{max(slowest):.3f} | {fold} | {peaks[0]:.0f} | {others} | {ranks[0]['average_mb']:.0f} |"
        )
    return "\n".join(lines)


def table(rows: list[tuple[int, str, list[dict]]], save_dtype: str) -> str:
    model_mb = rows[0][2][0]["model_mb"]
    snapshot_mb = model_mb * (0.5 if save_dtype in ("bfloat16", "float16") else 1.0)
    lines = [
        f"model: {model_mb:.0f} MB of fp32 parameters; one {save_dtype} snapshot: {snapshot_mb:.0f} MB",
        "",
        "| world | method | peak extra MB, rank 0 | peak extra MB, max other rank | x snapshot/world (max rank) | blocked s (mean rank) | written MB per rank (rank 0 / others) |",
        "|---|---|---|---|---|---|---|",
    ]
    def mb(value: float) -> str:
        return "-" if value != value else f"{value:.0f}"  # NaN: not measured

    for world, method, ranks in rows:
        peaks = [r["peak_extra_mb"] for r in ranks]
        others = max(peaks[1:]) if len(peaks) > 1 else float("nan")
        ratio = max(peaks) / (snapshot_mb / world)
        blocked = sum(r["blocked_s"] for r in ranks) / len(ranks)
        written = [r["written_mb"] for r in ranks]
        other_written = mb(max(written[1:])) if len(written) > 1 else "-"
        lines.append(
            f"| {world} | {method} | {mb(peaks[0])} | {mb(others)} | {ratio:.2f} | {blocked:.2f} | {mb(written[0])} / {other_written} |"
        )
    return "\n".join(lines)


# Assumptions of the projection (state them with the numbers): bf16 snapshots of fp32 master
# weights, 8 GPUs per node, pinned device-to-host copies at 12 GB/s per GPU, 2 GB/s of disk
# (or parallel filesystem share) per node.
GPUS_PER_NODE = 8
D2H_GBPS = 12.0
DISK_GBPS_PER_NODE = 2.0


def projection_table(models: tuple[float, ...] = (7e9, 70e9), worlds: tuple[int, ...] = (8, 64, 512)) -> str:
    """Per-snapshot costs projected to real models: S = 2 bytes x P (one bf16 snapshot).

    * sharded: host RAM per rank S/W; training blocked (S/W)/D2H; written per node
      GPUS_PER_NODE*S/W, all nodes at once, in (GPUS_PER_NODE*S/W)/DISK.
    * gather (fixed): rank 0 holds S; blocked >= S/D2H (rank 0 copies the whole model to its host);
      one node writes S in S/DISK.
    * gather (before the fix): rank 0 held ~8P bytes (fp32 gather 4P + its bf16 cast 2P + the
      previous snapshot 2P).
    """
    lines = [
        "| model | GPUs | sharded: host GB per rank | sharded: blocked s | sharded: write s | gather: rank-0 host GB | gather: blocked s | gather: write s | old gather: rank-0 host GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for params in models:
        snapshot = 2 * params / 1e9  # GB
        for world in worlds:
            per_rank = snapshot / world
            per_node = per_rank * min(GPUS_PER_NODE, world)
            lines.append(
                f"| {params / 1e9:.0f}B | {world} | {per_rank:.2f} | {per_rank / D2H_GBPS:.2f} | "
                f"{per_node / DISK_GBPS_PER_NODE:.1f} | {snapshot:.0f} | {snapshot / D2H_GBPS:.1f} | "
                f"{snapshot / DISK_GBPS_PER_NODE:.0f} | {8 * params / 1e9:.0f} |"
            )
    return "\n".join(lines)


def online_projection_table(models: tuple[float, ...] = (7e9, 70e9), worlds: tuple[int, ...] = (8, 64, 512)) -> str:
    """Host memory of the online average projected to real models (P parameters, fp32 weights):
    shard-local, each rank holds one float32 copy of its slices, 4P/W bytes, and folds it in
    place; gathered to rank 0, rank 0 holds the float32 average (4P) plus the gathered fp32
    weights (4P) and receives the whole model at every snapshot (at least 4P/D2H seconds)."""
    lines = [
        "| model | GPUs | shard-local: host GB per rank | gather: rank-0 host GB | gather: rank-0 receives GB per update |",
        "|---|---|---|---|---|",
    ]
    for params in models:
        for world in worlds:
            lines.append(
                f"| {params / 1e9:.0f}B | {world} | {4 * params / 1e9 / world:.2f} | {8 * params / 1e9:.0f} | "
                f"{4 * params / 1e9:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["gather-old", "gather", "sharded", "dcp", "online-gather", "online-sharded", "online-sharded-device"],
        choices=sorted(MEASUREMENTS),
    )
    parser.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed online updates after one warm-up")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--project-only", action="store_true", help="print the projection to 7B/70B only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.project_only:
        print(projection_table())
        print()
        print(online_projection_table())
        return
    rows = []
    for world in args.worlds:
        for method in args.methods:
            folder = Path(tempfile.mkdtemp(prefix=f"bench-scale-{method}-{world}-"))
            try:
                rows.append((world, method, launch(args, world, method, folder)))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            print(f"done: world {world}, {method}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([{"world": w, "method": m, "ranks": r} for w, m, r in rows], indent=2))
    snapshots = [row for row in rows if not row[1].startswith("online")]
    online = [row for row in rows if row[1].startswith("online")]
    if snapshots:
        print(table(snapshots, args.save_dtype))
        print()
    if online:
        print(online_table(online))
        print()
    print(projection_table())
    print()
    print(online_projection_table())


if __name__ == "__main__":
    main()
