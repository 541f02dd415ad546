"""The Gram matrix of K checkpoints' weights, read tensor by tensor in bounded memory.

:func:`compute_gram` reads every floating-point tensor of the K checkpoints a chunk of elements
at a time (``K x chunk`` float64, whatever the model size), centres each chunk on the K
checkpoints' mean and accumulates ``G += D D^T``. Everything :mod:`hf_pma.analysis.geometry`
reports derives from that one matrix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

from hf_pma.io.guarded import check_one_version, pin_folders, reads_one_version
from hf_pma.merging.sources import CheckpointSource, CheckpointTensors, open_all, resolve_sources
from hf_pma.utils.logs import progress_bar

__all__ = ["GramMatrix", "compute_gram"]

# Working matrix of a Gram chunk (K rows of float64): bounds the memory of compute_gram.
_DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass
class GramMatrix:
    """Inner products of K checkpoints' floating-point weights, centred on their mean.

    ``gram[i, j] = <theta_i - c, theta_j - c>`` over every floating-point element (float64),
    with ``c`` the mean of the K checkpoints; ``names``, ``tokens`` and ``steps`` describe the
    checkpoints, oldest first.
    """

    gram: torch.Tensor
    names: list[str]
    tokens: list[int | None]
    steps: list[int | None]
    numel: int
    num_tensors: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "names": self.names,
            "tokens": self.tokens,
            "steps": self.steps,
            "numel": self.numel,
            "num_tensors": self.num_tensors,
            "gram": self.gram.tolist(),
        }


def _float_tensors(
    sources: Sequence[CheckpointSource], opened: Sequence[CheckpointTensors]
) -> list[tuple[str, int]]:
    """(name, numel) of the floating-point tensors, after checking every checkpoint has them alike."""
    ref = opened[0].infos
    for source, tensors in zip(sources[1:], opened[1:]):
        infos = tensors.infos
        if set(infos) != set(ref):
            diff = sorted(set(infos) ^ set(ref))
            raise ValueError(
                f"{source.path} and {sources[0].path} hold different tensors (e.g. {', '.join(diff[:3])}): "
                "not snapshots of one model"
            )
        for name, info in ref.items():
            if infos[name].shape != info.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {list(infos[name].shape)} in {source.path} "
                    f"but {list(info.shape)} in {sources[0].path}"
                )
    return [(name, ref[name].numel) for name in sorted(ref) if ref[name].is_floating_point]


@reads_one_version
def compute_gram(
    sources: Sequence[str | os.PathLike[str] | CheckpointSource],
    chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
    progress: bool = True,
) -> GramMatrix:
    """The centred Gram matrix of K checkpoints (oldest first), tensor by tensor.

    For each floating-point tensor, elements are read in chunks of at most ``chunk_bytes /
    (8 K)`` from every checkpoint (:meth:`CheckpointSource.open` ``.read(name, start, stop)``),
    centred on the chunk's mean over the K checkpoints and accumulated into ``G += D D^T`` in
    float64. Memory: about ``chunk_bytes`` whatever the model size. The checkpoints are read as
    one version each (:func:`hf_pma.io.guarded.one_version`), or refused naming the file changed.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    srcs = (
        list(sources)
        if sources and all(isinstance(s, CheckpointSource) for s in sources)
        else resolve_sources(sources)
    )
    if len(srcs) < 2:
        raise ValueError(f"diagnostics need at least 2 checkpoints, got {len(srcs)}")
    pin_folders(s.path for s in srcs)
    k = len(srcs)
    chunk = max(1, int(chunk_bytes) // (8 * k))
    opened = open_all(srcs)
    try:
        tensors = _float_tensors(srcs, opened)
        if not tensors:
            raise ValueError(f"{srcs[0].path} holds no floating-point tensor")
        gram = torch.zeros(k, k, dtype=torch.float64)
        work = torch.empty(k, chunk, dtype=torch.float64)
        buf = torch.empty(chunk * 8, dtype=torch.uint8)
        total = sum(n for _, n in tensors)
        with progress_bar(total=total, desc="Gram matrix", unit="elem", unit_scale=True, disable=not progress) as bar:
            for name, numel in tensors:
                for start in range(0, numel, chunk):
                    stop = min(numel, start + chunk)
                    rows = work[:, : stop - start]
                    for i, tensors_i in enumerate(opened):
                        rows[i].copy_(tensors_i.read(name, start, stop, buf))
                    rows.sub_(rows.mean(dim=0, keepdim=True))
                    gram.addmm_(rows, rows.T)
                    bar.update(stop - start)
    finally:
        for t in opened:
            t.close()
    check_one_version()  # what was read is one version of every checkpoint
    if not bool(torch.isfinite(gram).all()):
        raise ValueError("the checkpoints hold non-finite weights (NaN or Inf): no geometry to report")
    gram = 0.5 * (gram + gram.T)  # exact symmetry despite rounding
    return GramMatrix(
        gram=gram,
        names=[s.name for s in srcs],
        tokens=[s.tokens for s in srcs],
        steps=[s.step for s in srcs],
        numel=total,
        num_tensors=len(tensors),
    )
