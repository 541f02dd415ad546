"""Snapshot diagnostics: the math on known geometries, the chunked Gram matrix, and ``hf-pma inspect``."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_pma.analysis.diagnostics import (
    centered_gram,
    compute_gram,
    cosine_matrix,
    distances_to_merge,
    training_series,
    window_diagnostics,
    window_indices,
)
from hf_pma.core.strategies import merge_coefficients
from hf_pma.merging.sources import resolve_sources
from tests.helpers.cli import run_cli
from tests.helpers.output import text_rows
from tests.helpers.snapshot_runs import INTERVAL, noise_deviation, write_run


def _gram(points: torch.Tensor) -> torch.Tensor:
    points = points.double()
    return points @ points.T


# ---------------------------------------------------------------- pure math, known geometries


def test_orthogonal_deviations_are_complementary():
    # theta_i = c + s * e_i: isotropic, equal-norm deviations that the merge averages away.
    n, s = 5, 3.0
    c = torch.arange(8, dtype=torch.float64)
    points = torch.stack([c + s * torch.eye(8, dtype=torch.float64)[i] for i in range(n)])
    ref = torch.cat([points, c[None]])  # the centre as the reference ("theta*")
    diag = window_diagnostics(_gram(ref), list(range(n)), reference=n)
    off = [diag.cosine[a][b] for a in range(n) for b in range(n) if a != b]
    assert all(math.isclose(v, -1 / (n - 1), abs_tol=1e-12) for v in off)
    assert math.isclose(diag.mean_cosine, -1 / (n - 1), abs_tol=1e-12)
    # |e_i s - mean| = s sqrt(1 - 1/n); the SMA merge is the window mean.
    assert all(math.isclose(d, s * math.sqrt(1 - 1 / n), rel_tol=1e-12) for d in diag.deviation_norms)
    assert diag.distances_to_merge == pytest.approx(diag.deviation_norms, rel=1e-12)
    # The mean deviation from the optimum is s / sqrt(n) against s for each member: ratio 1/sqrt(n).
    assert diag.reference["merge_to_reference"] == pytest.approx(s / math.sqrt(n), rel=1e-12)
    assert diag.reference["members_to_reference"] == pytest.approx([s] * n, rel=1e-12)
    assert diag.reference["ratio"] == pytest.approx(1 / math.sqrt(n), rel=1e-12)
    # Every step is s*sqrt(2), first to last too.
    assert diag.straightness == pytest.approx(1 / (n - 1), rel=1e-12)


def test_anti_correlated_pairs_and_straight_drift():
    v = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.float64)
    c = torch.tensor([10.0, 0.0, -3.0, 1.0], dtype=torch.float64)
    # Oscillation: c+v, c-v, c+v, c-v: each deviation is +-v, perfectly anti-correlated with its neighbours.
    osc = torch.stack([c + (-1) ** i * v for i in range(4)])
    diag = window_diagnostics(_gram(osc), [0, 1, 2, 3])
    expected = [[(-1.0) ** (a + b) for b in range(4)] for a in range(4)]
    torch.testing.assert_close(
        torch.tensor(diag.cosine, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-12,
        rtol=0,
    )
    assert diag.merge_shift == pytest.approx(float(v.norm()), rel=1e-12)  # the mean is c, the newest c - v
    assert diag.path_length == pytest.approx(3 * 2 * float(v.norm()), rel=1e-12)
    assert diag.straightness == pytest.approx(1 / 3, rel=1e-12)
    # Straight drift: theta_i = c + i v. Deviations (i - 1.5) v: cos = sign product, straightness 1.
    drift = torch.stack([c + i * v for i in range(4)])
    diag = window_diagnostics(_gram(drift), [0, 1, 2, 3])
    signs = [-1, -1, 1, 1]
    expected = [[float(signs[a] * signs[b]) for b in range(4)] for a in range(4)]
    torch.testing.assert_close(
        torch.tensor(diag.cosine, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-12,
        rtol=0,
    )
    assert diag.straightness == pytest.approx(1.0, rel=1e-12)
    # SMA lags the newest by 1.5 v; WMA (1,2,3,4)/10 by 1.0 v.
    assert diag.merge_shift == pytest.approx(1.5 * float(v.norm()), rel=1e-12)
    wma = window_diagnostics(_gram(drift), [0, 1, 2, 3], merge_coefficients(4, "wma"))
    assert wma.merge_shift == pytest.approx(1.0 * float(v.norm()), rel=1e-12)


def test_gram_math_is_reference_free_and_matches_direct_computation():
    torch.manual_seed(0)
    points = torch.randn(6, 50, dtype=torch.float64) + 7.0
    shifted = points - points[2]  # any common origin gives the same answers
    w = merge_coefficients(4, "ema", 0.3)
    idx = [1, 3, 4, 5]
    merge = sum(wi * points[i] for wi, i in zip(w, idx))
    direct = [float((points[i] - merge).norm()) for i in idx]
    for g in (_gram(points), _gram(shifted)):
        assert distances_to_merge(g, idx, w) == pytest.approx(direct, rel=1e-9)
        dev = points[idx] - points[idx].mean(0)
        cos = torch.nn.functional.cosine_similarity(dev[:, None], dev[None], dim=-1)
        torch.testing.assert_close(cosine_matrix(centered_gram(g, idx)), cos, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="sum to 1"):
        distances_to_merge(_gram(points), [0, 1], [0.5, 0.6])
    with pytest.raises(ValueError, match="must not be one of the merged"):
        window_diagnostics(_gram(points), [0, 1], reference=1)


def test_window_indices_and_series():
    assert window_indices(10, 3) == [7, 8, 9]
    assert window_indices(10, 3, every=4) == [1, 5, 9]
    assert window_indices(10, 4, every=4) is None
    assert window_indices(10, 2, every=2, end=4) == [2, 4]
    points = torch.stack([torch.full((3,), float(i)) for i in range(6)])
    series = training_series(_gram(points), window=3)
    assert [d.indices for d in series] == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert all(d.straightness == pytest.approx(1.0) for d in series)


# ---------------------------------------------------------------- Gram matrix from snapshot folders


def test_compute_gram_matches_stacked_weights_in_any_chunking(tmp_path):
    # Snapshots built with a known structure in every tensor: theta_0 = b + u, theta_1 = b - u
    # (anti-correlated), theta_2 = b + w, theta_3 = b + u + w.
    def deviation(i, name, base):
        g = torch.Generator().manual_seed(len(name) * 7 + base.numel())
        u, w = 0.01 * torch.randn(base.shape, generator=g), 0.01 * torch.randn(base.shape, generator=g)
        return [u, -u, w, u + w][i]

    run, states = write_run(tmp_path / "run", 4, deviation)
    flat = torch.stack([torch.cat([s[n].reshape(-1).double() for n in sorted(s)]) for s in states])
    centred = flat - flat.mean(0)
    expected = centred @ centred.T
    sources = resolve_sources([run])
    big = compute_gram(sources, progress=False)
    small = compute_gram(
        sources, chunk_bytes=4 * 8 * 1000, progress=False
    )  # 1000 elements a chunk: many chunks per tensor
    for got in (big, small):
        torch.testing.assert_close(got.gram, expected, rtol=1e-6, atol=1e-9)
    assert big.numel == flat.shape[1] and big.tokens == [INTERVAL * (i + 1) for i in range(4)]
    diag = window_diagnostics(big.gram, [0, 1])
    assert diag.cosine[0][1] == pytest.approx(-1.0, abs=1e-6)  # u and -u
    with pytest.raises(ValueError, match="at least 2"):
        compute_gram(sources[:1], progress=False)


# ---------------------------------------------------------------- hf-pma inspect


def test_inspect_cli(tmp_path):
    run, states = write_run(tmp_path / "run", 6, noise_deviation(), excluded=[2])
    reference = tmp_path / "reference"
    # The reference: the exact mean of the usable snapshots' states.
    shutil.copytree(run / "pma" / "snapshot-6000", reference)
    weights = load_file(reference / "model.safetensors")
    usable = [s for i, s in enumerate(states) if i != 2]
    save_file(
        {n: sum(s[n] for s in usable) / len(usable) for n in weights},
        reference / "model.safetensors",
        metadata={"format": "pt"},
    )

    out = run_cli(
        "inspect",
        run,
        "--window",
        "4",
        "--plot",
        tmp_path / "i.png",
        "-o",
        tmp_path / "i.json",
        "--reference",
        reference,
        "-q",
    )
    assert out.returncode == 0, out.stderr
    rows = text_rows(out.stdout)
    assert rows[0][:7] == ["snapshot", "tokens", "step", "lr", "phase", "loss", "size"]
    assert "\\|" not in out.stdout and not any(
        line.startswith("|") for line in out.stdout.splitlines()
    )  # plain text
    row = next(r for r in rows if r[0] == "snapshot-3000")
    assert row[1] == "3,000" and row[4] == "stable" and row[7] == "excluded (loss spike at step 99)"
    assert "mean off-diagonal cosine" in out.stdout and "Over training" in out.stdout
    assert (tmp_path / "i.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "i.json").read_text())
    # snapshot-3000 is excluded from merges: the window of 4 skips it.
    assert report["window"]["names"] == ["snapshot-2000", "snapshot-4000", "snapshot-5000", "snapshot-6000"]
    # Independent noise: the window's deviations are close to the -1/(N-1) of complementary snapshots.
    assert report["window"]["mean_cosine"] == pytest.approx(-1 / 3, abs=0.05)
    # Distances recomputed from the states.
    window_states = [usable[i] for i in range(1, 5)]
    mean = {n: sum(s[n].double() for s in window_states) / 4 for n in window_states[0]}
    direct = [
        math.sqrt(sum(float(((s[n].double() - mean[n]) ** 2).sum()) for n in mean)) for s in window_states
    ]
    assert report["window"]["distances_to_merge"] == pytest.approx(direct, rel=1e-5)
    # 5 usable snapshots, window 4: series of 2 windows; the reference is the mean of all 5.
    assert len(report["series"]) == 2 and report["series"][-1]["x"] == 6000
    ref = report["window"]["reference"]
    assert ref["merge_to_reference"] < ref["newest_to_reference"]


def test_inspect_cli_listing_and_errors(tmp_path):
    run, _ = write_run(tmp_path / "run", 3, noise_deviation())
    done = run_cli("inspect", run, "--no-diagnostics", "--plot", "")
    assert done.returncode == 0, done.stderr
    listing = done.stdout
    assert "Window" not in listing and "snapshot-3000" in listing and not (tmp_path / "inspect.png").exists()
    done = run_cli("inspect", tmp_path / "nope")
    assert done.returncode == 2 and "nope does not exist" in done.stderr
    done = run_cli("inspect", run, "--plot", tmp_path / "no" / "dir.png")
    assert done.returncode == 2 and "the folder of --plot" in done.stderr
    # A window larger than the run shrinks to the run (with a warning), and still reports.
    done = run_cli("inspect", run, "--window", "10", "--plot", tmp_path / "p.png", "-q")
    assert done.returncode == 0 and "Window: 3 snapshots" in done.stdout, done.stderr


def test_inspect_writes_files_only_where_asked_and_a_full_disk_leaves_nothing(tmp_path, small_filesystem):
    run, _ = write_run(tmp_path / "run", 3, noise_deviation())
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = run_cli("inspect", run, "--window", "2", "-q", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    # No plot unless asked: nothing new in the run folder nor in the folder the user stands in.
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before and list(elsewhere.iterdir()) == []
    assert "plot:" not in done.stdout
    done = run_cli("inspect", run, "--window", "2", "-q", "--plot", "i.png", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert (elsewhere / "i.png").stat().st_size > 10_000 and "plot: i.png" in done.stdout

    # A full disk: one line naming the plot, nothing half-written beside it.
    filler = small_filesystem / "filler"
    with pytest.raises(OSError):
        with open(filler, "wb") as fh:
            while True:
                fh.write(b"x" * 4096)
                fh.flush()
    filler.write_bytes(filler.read_bytes()[: -12 * 1024])  # 12 kB free: less than the plot
    done = run_cli("inspect", run, "--window", "2", "-q", "--plot", small_filesystem / "i.png", cwd=elsewhere)
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(
        "hf-pma inspect: error: no space left on the device to write"
    )
    assert str(small_filesystem / "i.png") in error[0] and "free in" in error[0]
    assert sorted(p.name for p in small_filesystem.iterdir()) == ["filler"]


def _inspect(run, *args) -> str:
    done = run_cli("inspect", run, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_inspect_uses_the_runs_own_window_shows_one_distance_for_sma_and_reads_the_numbers(tmp_path):
    run, _ = write_run(tmp_path / "run", 6, noise_deviation())
    merged = run / "pma" / "merged"
    merged.mkdir()
    # No record: the automatic window (the loss still falls: the last snapshot alone).
    out = " ".join(_inspect(run, "-q").split())
    assert "Window: 1 snapshots (auto window: the last snapshot alone:" in out
    # The training record's pma_window.
    (merged / "pma_training.json").write_text(json.dumps({"pma_window": 5}))
    out = _inspect(run, "-q")
    assert "Window: 5 snapshots (the run's own, pma/merged/pma_training.json)" in out
    # The merge record wins: the number of snapshots it merged, or its window in tokens.
    (merged / "pma_merge.json").write_text(json.dumps({"num_sources": 4, "sources": []}))
    out = _inspect(run, "-q")
    assert "Window: 4 snapshots (the run's own, pma/merged/pma_merge.json)" in out
    window = {"unit": "tokens", "first": 4000, "last": 6000, "span": 2000, "requested": 3 * INTERVAL}
    (merged / "pma_merge.json").write_text(json.dumps({"num_sources": 3, "window": window}))
    out = _inspect(run, "-q")
    assert "Window: 3 snapshots (the last 3,000 tokens; the run's own, pma/merged/pma_merge.json)" in out
    # SMA: the distance to the merge is the deviation from the mean: one column.
    header = next(r for r in text_rows(out) if r[0] == "snapshot" and "weight" in r)
    assert header[:3] == ["snapshot", "weight", "dist to merge (= |dev from mean|)"] and "cos[0]" in header
    # Independent noise: the snapshots oscillate, and the last line says so in words.
    last = out.strip().splitlines()[-1]
    assert last.startswith("Reading: the 3 snapshots") and "oscillate around a common centre" in last
    # The command line wins; WMA weights differ: two distance columns.
    out = _inspect(run, "--window-tokens", "4k", "--strategy", "wma", "-q")
    assert "Window: 4 snapshots (the last 4,000 tokens; --window-tokens)" in out
    header = next(r for r in text_rows(out) if r[0] == "snapshot" and "weight" in r)
    assert header[2:4] == ["|dev from mean|", "dist to merge"]


def test_reading_tells_drift_from_oscillation():
    from hf_pma.analysis.diagnostics import reading, window_diagnostics

    # A straight drift: snapshots on a line.
    points = torch.arange(5, dtype=torch.float64).reshape(5, 1) * torch.tensor([[1.0, 2.0]])
    gram = points @ points.T
    assert "drift along a nearly straight path" in reading(window_diagnostics(gram, list(range(5))))
    # Back and forth along one axis and around a centre: oscillation.
    points = torch.tensor(
        [[1.0, 0.0], [-1.0, 0.1], [1.0, 0.05], [-1.0, -0.1], [1.0, 0.0]], dtype=torch.float64
    )
    assert "oscillate around a common centre" in reading(
        window_diagnostics(points @ points.T, list(range(5)))
    )
    assert "too small" in reading(window_diagnostics(gram[:2, :2], [0, 1]))
