"""Benchmark the streaming merge (``hf-pma merge``) against a naive merge, mergekit and ``cat``.

Makes N sharded fp32 checkpoints of a ~160M-parameter Llama (about 650 MB each: one random
init, then small seeded perturbations) in a scratch folder, then for each N in ``--sizes``
runs every method in its own subprocess, so that its wall time and peak RSS are its own:

- ``hf-pma wK``: :func:`hf_pma.merging.engine.merge_checkpoints` (SMA) with ``workers=K``, what
  ``hf-pma merge --workers K`` runs, for each K in ``--workers`` (default: 1 and 2): the
  torch-free path (numpy arithmetic; the worker checks that neither torch nor transformers
  was imported);
- ``naive``: load every state dict (``safetensors.torch.load_file``), average, save;
- ``mergekit``: the ``mergekit-yaml`` CLI with a ``linear`` config, run under the Python of
  the venv given by ``--mergekit-bin`` (skipped when it is not there). Install it apart:
  ``python -m venv /tmp/mergekit-venv && /tmp/mergekit-venv/bin/pip install torch==2.13.0 mergekit``
  (torch first, so that pip keeps the CPU build);
- ``cat``: ``cat inputs > /dev/null`` with the inputs already in the page cache: the time it
  takes just to read them.

Before every timed run the inputs are read once (so every method reads from the page cache)
and ``sync`` runs (so one method's writeback does not slow the next); methods are interleaved
across repetitions and the median is reported.

    python benchmarks/bench_merge.py                          # 160M model, N = 2, 4, 8
    python benchmarks/bench_merge.py --hidden 256 --layers 2 --vocab 8000 --sizes 2,4 --repeat 1
    python benchmarks/bench_merge.py --mergekit-bin /tmp/mergekit-venv/bin --keep --scratch /tmp/bm

Columns: ``wall s``, the whole process (interpreter start-up and imports of torch,
transformers or mergekit included); ``import s``, the imports of the method's modules as the
worker times them; ``work s``, the merge call alone as the worker times it (mergekit: its
``run_merge``); ``+ fsync s``, the time to fsync the output after the process
exits (hf-pma fsyncs before it returns, the others leave it to the kernel); peak RSS (the
child's own ``ru_maxrss``) and its ratio to one checkpoint; speedup against mergekit; ratios
to ``cat``. Then the issue's targets, read at the largest N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MB = 1024 * 1024


# --------------------------------------------------------------------------- workers
# Each worker runs in its own process (``--worker NAME``) and writes {"work_s": ...} to the
# path in ``--result``: the time of the work alone, without interpreter start-up and imports.


def _worker_make(args: argparse.Namespace) -> None:
    """Create ``args.count`` checkpoints: one random init, then cheap seeded perturbations."""
    from common import llama, perturbed_copies

    model = llama(
        hidden=args.hidden, layers=args.layers, vocab=args.vocab, intermediate=args.intermediate, tie=False
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters, {n_params * 4 / MB:.0f} MiB in fp32", flush=True)
    folders = [Path(args.out) / f"ckpt-{i}" for i in range(args.count)]
    perturbed_copies(model, folders, max_shard_size=args.shard_size)
    print(f"wrote {len(folders)} checkpoints in {args.out}", flush=True)


def _worker_hf_pma(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    from hf_pma.merging.engine import merge_checkpoints

    imported = time.perf_counter()
    merge_checkpoints(args.inputs, args.out, strategy="sma", progress=False, workers=args.merge_workers)
    heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    if heavy:
        raise RuntimeError(f"the torch-free merge imported {heavy}")
    return {"import_s": imported - start, "work_s": time.perf_counter() - imported}


def _worker_naive(args: argparse.Namespace) -> dict:
    """What a script written in five minutes does: every state dict in memory, then average."""
    begin = time.perf_counter()
    import torch
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    start = time.perf_counter()
    states = []
    for folder in args.inputs:
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(f))
        states.append(state)
    merged = {}
    for name in states[0]:
        acc = states[0][name].clone()
        for state in states[1:]:
            acc += state[name]
        merged[name] = acc / len(states)
    Path(args.out).mkdir(parents=True)
    save_torch_state_dict(merged, args.out, max_shard_size="5GB")
    shutil.copy2(Path(args.inputs[-1]) / "config.json", Path(args.out) / "config.json")
    return {"import_s": start - begin, "work_s": time.perf_counter() - start}


def _worker_mergekit(args: argparse.Namespace) -> dict:
    """``mergekit-yaml CONFIG OUT ...`` exactly as its CLI runs it, timing its ``run_merge`` call.

    Runs under the mergekit venv's Python; this file imports only the standard library at the top.
    """
    begin = time.perf_counter()
    from mergekit.scripts import run_yaml

    timed = {"import_s": time.perf_counter() - begin}
    run_merge = run_yaml.run_merge

    def timed_run_merge(*a, **kw):
        start = time.perf_counter()
        run_merge(*a, **kw)
        timed["work_s"] = time.perf_counter() - start

    run_yaml.run_merge = timed_run_merge
    run_yaml.main([str(Path(args.out).with_suffix(".yml")), args.out, *MERGEKIT_FLAGS], standalone_mode=False)
    return timed


# mergekit's memory options (--low-cpu-memory, --read-to-gpu) are for accelerators; on CPU the
# lazy unpickler is the only one that applies (it matters for .bin inputs, not safetensors).
MERGEKIT_FLAGS = ["--lazy-unpickle", "--no-copy-tokenizer", "--no-write-model-card", "--quiet"]
WORKERS = {
    "make": _worker_make,
    "hf-pma": _worker_hf_pma,
    "naive": _worker_naive,
    "mergekit": _worker_mergekit,
}


def _run_worker(args: argparse.Namespace) -> None:
    result = WORKERS[args.worker](args)
    if args.result and result:
        Path(args.result).write_text(json.dumps(result))


# --------------------------------------------------------------------------- measuring


def _measure(cmd: list[str], log: Path | None, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd``; its wall time and its own peak RSS (``wait4`` gives the child's rusage)."""
    with open(log or os.devnull, "w") as fh:
        # cat's output is the thing timed: it goes to /dev/null; the others' logs to ``log``.
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # already reaped by wait4
    if proc.returncode != 0:
        tail = log.read_text()[-3000:] if log else ""
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... failed with exit code {proc.returncode}; log {log}:\n{tail}"
        )
    return {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024}  # ru_maxrss is in KiB on Linux


def _fsync_tree(folder: Path) -> float:
    """Seconds to get ``folder`` onto disk after its writer exited.

    hf-pma fsyncs its output before renaming it into place (a crash never leaves a half-written
    model); the naive script and mergekit leave theirs dirty in the page cache, written back
    later. Their wall time plus this is the time until each merge is durable.
    """
    start = time.perf_counter()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _warm(files: list[Path]) -> None:
    """Read the inputs once so that they sit in the page cache, and flush pending writes."""
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    os.sync()


def _mergekit_config(inputs: list[Path], path: Path) -> None:
    lines = ["merge_method: linear", "dtype: float32", "models:"]
    for folder in inputs:
        lines += [f"  - model: {folder}", "    parameters:", "      weight: 1.0"]
    path.write_text("\n".join(lines) + "\n")


def _method_command(
    method: str, inputs: list[Path], out: Path, result: Path, args: argparse.Namespace
) -> list[str]:
    if method == "cat":
        return ["cat", *[str(f) for folder in inputs for f in _weight_files(folder)]]
    python = sys.executable
    if method == "mergekit":
        _mergekit_config(inputs, out.with_suffix(".yml"))
        python = str(Path(args.mergekit_bin) / "python")
    if method.startswith("hf-pma w"):
        worker = [python, str(HERE), "--worker", "hf-pma", "--merge-workers", method.removeprefix("hf-pma w")]
    else:
        worker = [python, str(HERE), "--worker", method]
    return worker + ["--out", str(out), "--result", str(result), "--inputs", *map(str, inputs)]


def _run_method(method: str, inputs: list[Path], scratch: Path, args: argparse.Namespace) -> dict:
    tag = method.replace(" ", "-")
    out = scratch / f"out-{tag}"
    result = scratch / f"result-{tag}.json"
    for stale in (out, result):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    _warm([f for folder in inputs for f in _weight_files(folder)])
    cmd = _method_command(method, inputs, out, result, args)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    measured = _measure(cmd, None if method == "cat" else scratch / f"log-{tag}.txt", env)
    if method == "cat":
        measured["work_s"] = measured["wall_s"]
    else:
        measured["fsync_s"] = _fsync_tree(out)
    if result.is_file():
        measured.update(json.loads(result.read_text()))
    shutil.rmtree(out, ignore_errors=True)
    out.with_suffix(".yml").unlink(missing_ok=True)
    os.sync()
    return measured


# --------------------------------------------------------------------------- report


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _rounded(run: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}


def _summary(n: int, method: str, runs: list[dict]) -> dict:
    """Median times (robust to one lucky or unlucky run on shared cores), largest RSS."""
    row: dict = {"n": n, "method": method, "runs": runs, "rss_mb": max(r["rss_mb"] for r in runs)}
    for key in ("wall_s", "import_s", "work_s", "fsync_s"):
        values = [r[key] for r in runs if key in r]
        if values:
            row[key] = _median(values)
    walls = [r["wall_s"] for r in runs]
    row["wall_range"] = (min(walls), max(walls))
    return row


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _table(rows: list[dict], ckpt_mb: float) -> str:
    head = (
        "| N | method | wall s | import s | work s | + fsync s | peak RSS MB | RSS / one checkpoint "
        "| speedup vs mergekit (wall / work) | wall / cat | work / cat |"
    )
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({r["n"] for r in rows}):
        group = {r["method"]: r for r in rows if r["n"] == n}
        mergekit = group.get("mergekit", {}).get("wall_s")
        mergekit_work = group.get("mergekit", {}).get("work_s")
        cat = group.get("cat", {}).get("wall_s")
        for method in [m for m in group if m.startswith("hf-pma")] + ["naive", "mergekit", "cat"]:
            r = group.get(method)
            if r is None:
                continue
            speedup = mergekit / r["wall_s"] if mergekit and method != "cat" else None
            work_speedup = mergekit_work / r["work_s"] if mergekit_work and method != "cat" else None
            ratio = r["wall_s"] / cat if cat else None
            work_ratio = r["work_s"] / cat if cat and r.get("work_s") else None
            lines.append(
                f"| {n} | {method} | {r['wall_s']:.2f} ({r['wall_range'][0]:.2f}–{r['wall_range'][1]:.2f}) | "
                f"{_fmt(r.get('import_s') if method != 'cat' else None, '.2f')} | "
                f"{_fmt(r.get('work_s'), '.2f')} | "
                f"{_fmt(r.get('fsync_s'), '.2f')} | {r['rss_mb']:.0f} | "
                f"{r['rss_mb'] / ckpt_mb:.2f} | {_fmt(speedup, '.1f', 'x')} / {_fmt(work_speedup, '.1f', 'x')} | "
                f"{_fmt(ratio, '.1f', 'x')} | "
                f"{_fmt(work_ratio, '.1f', 'x')} |"
            )
    return "\n".join(lines)


def _verdict(rows: list[dict], ckpt_mb: float) -> str:
    """The issue's targets, read off the table at the largest N."""
    n = max(r["n"] for r in rows)
    group = {r["method"]: r for r in rows if r["n"] == n}
    ours_all = sorted((m for m in group if m.startswith("hf-pma")), key=lambda m: int(m.split("w")[-1]))
    if not ours_all:
        return "(hf-pma not run: no targets to check)"
    best = ours_all[-1]
    ours = group[best]
    lines = [f"Targets at N = {n}, for {best}:"]
    if "mergekit" in group:
        speedup = group["mergekit"]["wall_s"] / ours["wall_s"]
        work = group["mergekit"].get("work_s", float("nan")) / ours["work_s"]
        lines.append(
            f"- wall at least 4x faster than mergekit linear: {speedup:.1f}x whole process "
            f"({'met' if speedup >= 4 else 'missed'}), {work:.1f}x merge work"
        )
    rss = ours["rss_mb"] / ckpt_mb
    lines.append(f"- peak RSS at most 0.5x one checkpoint: {rss:.2f}x ({'met' if rss <= 0.5 else 'missed'})")
    all_rss = [r["rss_mb"] for r in rows if r["method"] == best]
    lines.append(
        f"- peak RSS flat in N: {min(all_rss):.0f}-{max(all_rss):.0f} MB over N = {sorted({r['n'] for r in rows})}"
    )
    if "cat" in group:
        cat = group["cat"]["wall_s"]
        work, wall = ours["work_s"] / cat, ours["wall_s"] / cat
        lines.append(
            f"- merge work at most 1.3x reading the inputs from the page cache (cat): {work:.2f}x "
            f"({'met' if work <= 1.3 else 'missed'}); whole process at most 2.5x cat: {wall:.2f}x "
            f"({'met' if wall <= 2.5 else 'missed'})"
        )
    if len(ours_all) > 1:
        first = group[ours_all[0]]
        lines.append(
            f"- {ours_all[0]} -> {best}: merge work {first['work_s']:.2f} s -> {ours['work_s']:.2f} s "
            f"({first['work_s'] / ours['work_s']:.2f}x), output bit-identical (tested)"
        )
    return "\n".join(lines)


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {sys.version.split()[0]}"


# --------------------------------------------------------------------------- main


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2,4,8", help="numbers of checkpoints to merge (default: 2,4,8)")
    p.add_argument("--hidden", type=int, default=768, help="hidden size (default: 768, ~160M parameters)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default: 12)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 4 x hidden)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: 32000)")
    p.add_argument(
        "--shard-size", default="200MB", help="max_shard_size of the input checkpoints (default: 200MB)"
    )
    p.add_argument(
        "--repeat", type=int, default=5, help="runs per method and N; the median is reported (default: 5)"
    )
    p.add_argument("--methods", default="hf-pma,naive,mergekit,cat", help="comma-separated subset to run")
    p.add_argument("--workers", default="1,2", help="hf-pma worker counts to compare (default: 1,2)")
    p.add_argument(
        "--scratch", default=None, help="folder for checkpoints and outputs (default: a new one under /tmp)"
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the scratch folder (checkpoints are reused next time)"
    )
    p.add_argument(
        "--mergekit-bin",
        default=os.environ.get("MERGEKIT_BIN", "/tmp/mergekit-venv/bin"),
        help="folder holding mergekit-yaml, e.g. a venv's bin/ (default: $MERGEKIT_BIN or /tmp/mergekit-venv/bin)",
    )
    p.add_argument("--json", default=None, help="also write the raw measurements to this file")
    # Internal: run one worker in this process.
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--inputs", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--merge-workers", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        try:
            args.size_list = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
        except ValueError:
            p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
        if not args.size_list or min(args.size_list) < 2:
            p.error(f"--sizes must list numbers >= 2, got {args.sizes!r}")
        args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = set(args.method_list) - {"hf-pma", "naive", "mergekit", "cat"}
        if unknown:
            p.error(f"unknown method(s) in --methods: {', '.join(sorted(unknown))}")
        if args.repeat < 1:
            p.error("--repeat must be at least 1")
        try:
            worker_counts = sorted({int(w) for w in args.workers.split(",") if w.strip()})
        except ValueError:
            p.error(f"--workers must be comma-separated integers, got {args.workers!r}")
        if "hf-pma" in args.method_list:
            at = args.method_list.index("hf-pma")
            args.method_list[at : at + 1] = [f"hf-pma w{w}" for w in worker_counts]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _run_worker(args)
        return 0

    methods = args.method_list
    if "mergekit" in methods and not (Path(args.mergekit_bin) / "mergekit-yaml").is_file():
        print(
            f"mergekit-yaml not found in {args.mergekit_bin}: skipping mergekit (install it, see the docstring)"
        )
        methods = [m for m in methods if m != "mergekit"]

    scratch = (
        Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="bench-merge-", dir="/tmp"))
    )
    created = not scratch.exists() or not args.scratch
    scratch.mkdir(parents=True, exist_ok=True)
    spec = {k: getattr(args, k) for k in ("hidden", "layers", "intermediate", "vocab", "shard_size")}
    spec_file = scratch / "checkpoints.json"
    try:
        if spec_file.is_file() and json.loads(spec_file.read_text()) != spec:
            print(f"{scratch} holds checkpoints of another model: recreating them")
            for old in scratch.glob("ckpt-*"):
                shutil.rmtree(old)
        spec_file.write_text(json.dumps(spec))
        count = max(args.size_list)
        print(f"creating {count} checkpoints in {scratch} ...", flush=True)
        subprocess.run(
            [sys.executable, str(HERE), "--worker", "make", "--out", str(scratch), "--count", str(count)]
            + [f"--{k.replace('_', '-')}={v}" for k, v in spec.items() if v is not None],
            check=True,
        )
        ckpts = [scratch / f"ckpt-{i}" for i in range(count)]
        ckpt_mb = sum(f.stat().st_size for f in _weight_files(ckpts[0])) / MB
        print(
            f"one checkpoint: {ckpt_mb:.0f} MiB in {len(_weight_files(ckpts[0]))} shards; {_machine()}",
            flush=True,
        )

        load_start = os.getloadavg()[0]
        rows = []
        for n in args.size_list:
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for _ in range(args.repeat):  # methods interleaved, so a busy spell hits them all
                for method in methods:
                    runs[method].append(_run_method(method, ckpts[:n], scratch, args))
                    print(f"N={n} {method}: " + json.dumps(_rounded(runs[method][-1])), flush=True)
            rows += [_summary(n, method, method_runs) for method, method_runs in runs.items()]
        print()
        print(
            f"Machine: {_machine()}. One checkpoint: {ckpt_mb:.0f} MiB (fp32, {len(_weight_files(ckpts[0]))} shards)."
        )
        load = f"load average (1 min) {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
        print(f"Times: median of {args.repeat} run(s) (min-max); peak RSS: the largest; {load}.\n")
        print(_table(rows, ckpt_mb))
        print()
        print(_verdict(rows, ckpt_mb))
        if args.json:
            Path(args.json).write_text(
                json.dumps({"machine": _machine(), "ckpt_mb": ckpt_mb, "rows": rows}, indent=2)
            )
    finally:
        if not args.keep:
            _clean(scratch, created)
    return 0


def _clean(scratch: Path, created: bool) -> None:
    """Remove the scratch folder if this run made it, else only what this script put there."""
    if created:
        shutil.rmtree(scratch, ignore_errors=True)
        return
    for pattern in ("ckpt-*", "out-*", "result-*.json", "log-*.txt", "checkpoints.json"):
        for path in scratch.glob(pattern):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
