"""What one merged evaluation costs each process: bytes read and peak extra RSS, slice path vs full merge.

Writes N snapshots of a Llama (``--hidden``/``--layers``/``--vocab``; default ~30M parameters,
~120 MB in fp32) once, then for each world size W in ``--worlds`` launches ``torchrun
--nproc_per_node W`` (gloo, CPU) of this file, which per process and per method:

- ``slice``: :class:`hf_pma.merging.slices.SliceSwap` then ``restore()`` (what PMATrainer's
  merged evaluation does), on a replicated model (DDP-like: every process holds it all) and
  on an FSDP2-sharded one (``fully_shard``);
- ``full``: the path before it: every process ``merge_state_dict`` of all N snapshots,
  ``backup_weights``, ``load_weights``, ``restore_weights``.

Bytes read: ``rchar`` of ``/proc/self/io`` around the call (the page cache serves the reads,
so this counts what the process asked for, not disk traffic). Peak extra RSS: a thread samples
``VmRSS`` every 2 ms during the call; the peak minus the RSS before it. Prints a table with the
issue's targets: per-process reads <= 1.1 x N x model / W (sharded), total <= 1.1 x N x model
(replicated), per-process extra RSS <= 1.5 x model / W (sharded).

    python benchmarks/bench_merged_eval.py                      # W = 1, 2, 4; N = 4
    python benchmarks/bench_merged_eval.py --worlds 1,2 --hidden 256 --layers 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MB = 1024 * 1024


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _PeakRSS:
    """Samples VmRSS in a thread while the block runs."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _measure(fn) -> dict:
    import gc

    gc.collect()
    before = _rchar()
    start = time.perf_counter()
    with _PeakRSS() as rss:
        fn()
    gc.collect()
    return {"read_bytes": _rchar() - before, "extra_rss": rss.peak - rss.base, "seconds": time.perf_counter() - start}


def _model(args):
    from common import llama

    return llama(hidden=args.hidden, layers=args.layers, vocab=args.vocab, tie=False)


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from hf_pma.merging.engine import merge_state_dict
    from hf_pma.merging.slices import SliceSwap
    from hf_pma.merging.swap import backup_weights, load_weights, restore_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    snaps = sorted(Path(args.scratch).glob("snap-*"))[: args.snapshots]
    results = {}
    for layout in ("replicated", "sharded"):
        model = _model(args)
        if layout == "sharded":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)

        def slice_path(model=model):
            swap = SliceSwap(model, snaps, workers=1)
            swap.restore()

        def full_path(model=model):
            state = merge_state_dict(snaps, workers=1)
            backup = backup_weights(model)
            load_weights(model, state)
            restore_weights(model, backup)

        dist.barrier()
        results[f"{layout}/slice"] = _measure(slice_path)
        dist.barrier()
        results[f"{layout}/full"] = _measure(full_path)
        dist.barrier()
        del model
    Path(args.scratch, f"result-{dist.get_world_size()}-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _make_snapshots(args) -> int:
    from common import perturbed_copies

    return perturbed_copies(_model(args), [Path(args.scratch) / f"snap-{i}" for i in range(args.snapshots)], seed=0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--snapshots", type=int, default=4, help="snapshots merged, N (default: 4)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--scratch", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="bench-merged-eval-", dir="/tmp"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        args.scratch = str(scratch)
        model_bytes = _make_snapshots(args)
        n = args.snapshots
        print(f"model: {model_bytes / MB:.0f} MiB (fp32); N = {n} snapshots; {os.cpu_count()} cores", flush=True)
        rows = []
        for world in [int(w) for w in args.worlds.split(",")]:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master-port", str(_free_port()), str(HERE), "--worker", "--scratch", str(scratch), "--snapshots", str(n), "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            per_rank = [json.loads((scratch / f"result-{world}-{r}.json").read_text()) for r in range(world)]
            for key in per_rank[0]:
                layout, method = key.split("/")
                reads = [r[key]["read_bytes"] for r in per_rank]
                rss = [r[key]["extra_rss"] for r in per_rank]
                secs = max(r[key]["seconds"] for r in per_rank)
                rows.append((layout, method, world, max(reads), sum(reads), max(rss), secs))
        print()
        print("| layout | path | W | max read / rank MB | read / rank vs N x model / W | total read vs N x model | max extra RSS / rank MB | extra RSS vs model / W | s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for layout, method, world, rmax, rsum, rss, secs in rows:
            print(
                f"| {layout} | {method} | {world} | {rmax / MB:.0f} | {rmax / (n * model_bytes / world):.2f}x | "
                f"{rsum / (n * model_bytes):.2f}x | {rss / MB:.0f} | {rss / (model_bytes / world):.2f}x | {secs:.2f} |"
            )
    finally:
        if not args.scratch or "bench-merged-eval-" in str(scratch):
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
