"""Synthetic PMA runs for the sweep and diagnostics tests: snapshot folders with a manifest."""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hf_pma.core.manifest import PMA_SUBDIR, SnapshotRecord, write_manifest
from tests.helpers.models import make_tiny_model, save_model_folder

INTERVAL = 1000


def float_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a snapshot stores (tied duplicates once), by name."""
    return {n: p for n, p in model.named_parameters()}


def write_run(
    root: Path,
    count: int,
    deviation: Callable[[int, str, torch.Tensor], torch.Tensor],
    tokenizer=None,
    excluded: Sequence[int] = (),
    interval: int = INTERVAL,
    losses: Sequence[float] | None = None,
) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A run folder ``root`` whose ``pma/`` holds ``count`` snapshots ``theta_i = base + deviation(i, name, base)``
    taken every ``interval`` tokens (default ``INTERVAL``), listed in the manifest (``excluded`` indices marked so), with
    the tokenizer in the run folder; each records the training loss ``losses[i]`` (default ``4.0 - 0.05 i``: still
    falling, so the automatic window takes the last snapshot alone). Returns the folder and each snapshot's state
    (float32)."""
    pma = root / PMA_SUBDIR
    pma.mkdir(parents=True)
    base = make_tiny_model(seed=0)
    base_state = {n: p.detach().clone() for n, p in float_params(base).items()}
    records, states = [], []
    for i in range(count):
        model = make_tiny_model(seed=0)
        with torch.no_grad():
            for name, p in float_params(model).items():
                p.copy_(base_state[name] + deviation(i, name, base_state[name]))
        tokens = (i + 1) * interval
        record = SnapshotRecord(
            path=f"snapshot-{tokens}", tokens=tokens, step=10 * (i + 1), lr=3e-3, loss=4.0 - 0.05 * i if losses is None else losses[i], phase="stable",
            extra={"interval_tokens": interval},
        )
        if i in excluded:
            record.extra.update(excluded=True, excluded_reason="loss spike at step 99")
        save_model_folder(pma / record.path, model, extra=record.to_dict())
        records.append(record)
        states.append({n: p.detach().clone() for n, p in float_params(model).items()})
    write_manifest(pma, records, interval_tokens=interval)
    if tokenizer is not None:
        tokenizer.save_pretrained(root)
    return root, states


def noise_deviation(scale: float = 0.02, seed: int = 0) -> Callable[[int, str, torch.Tensor], torch.Tensor]:
    """Independent Gaussian noise per snapshot and tensor (deterministic)."""

    def deviation(i: int, name: str, base: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{i}/{name}".encode()))
        return scale * torch.randn(base.shape, generator=g)

    return deviation


def copy_run(run: Path, folder: Path) -> Path:
    """A copy of the run folder ``run`` as ``folder/run`` (links copied as links), for a test that
    changes it."""
    copy = Path(folder) / "run"
    shutil.copytree(run, copy, symlinks=True)
    return copy
