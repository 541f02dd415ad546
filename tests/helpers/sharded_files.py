"""Sharded snapshot folders written by hand: one DCP-layout safetensors file per rank, from
slices cut in every layout a reader must handle (FSDP rows, some ranks empty; boxes of a 2-D
mesh; ZeRO-3 flat partitions with padding), by the snapshot writer's own function."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_pma.io.sharded import rank_file_name
from hf_pma.snapshots.gather import LocalSlice, zero3_partition
from hf_pma.snapshots.sharded import StagingBuffers, write_rank_file


def rows(name: str, t: torch.Tensor, world: int) -> list[list[LocalSlice]]:
    """FSDP2's dim-0 split (torch.chunk sizes: uneven, trailing ranks may get nothing)."""
    out: list[list[LocalSlice]] = [[] for _ in range(world)]
    start = 0
    for rank, part in enumerate(torch.chunk(t, world, dim=0) if t.dim() else [t]):
        offsets = (start,) + (0,) * (t.dim() - 1) if t.dim() else ()
        out[rank].append(LocalSlice(name, part, offsets, tuple(part.shape), tuple(t.shape)))
        start += part.shape[0] if t.dim() else 0
    return out


def boxes(name: str, t: torch.Tensor, grid: tuple[int, int]) -> list[list[LocalSlice]]:
    """A 2-D mesh: rows over grid[0] ranks, columns over grid[1] (1-D tensors: rows only)."""
    if t.dim() != 2:
        return rows(name, t, grid[0] * grid[1])
    out: list[list[LocalSlice]] = []
    r0 = 0
    for row_part in torch.tensor_split(t, grid[0], dim=0):
        c0 = 0
        for part in torch.tensor_split(row_part, grid[1], dim=1):
            out.append([LocalSlice(name, part, (r0, c0), tuple(part.shape), tuple(t.shape))])
            c0 += part.shape[1]
        r0 += row_part.shape[0]
    return out


class FakeZero3Param:
    """What ZeRO-3 leaves on a parameter: its full shape and numel, and this rank's padded partition."""

    def __init__(self, t: torch.Tensor, world: int, rank: int) -> None:
        self.ds_shape, self.ds_numel = t.shape, t.numel()
        partition = -(-t.numel() // world) + 3  # DeepSpeed pads; extra padding must be ignored
        flat = torch.zeros(partition * world, dtype=t.dtype)
        flat[: t.numel()] = t.reshape(-1)
        self.ds_tensor = flat[rank * partition : (rank + 1) * partition].clone()
        self.ds_tensor.ds_numel = partition


def flat(name: str, t: torch.Tensor, world: int) -> list[list[LocalSlice]]:
    out = []
    for rank in range(world):
        param = FakeZero3Param(t, world, rank)
        start, length = zero3_partition(param, rank)
        out.append(
            [
                LocalSlice(
                    name, param.ds_tensor[:length], (start,), (length,), tuple(t.shape), flat=t.dim() != 1
                )
            ]
        )
    return out


def write_sharded(
    folder: Path, state: dict[str, torch.Tensor], split, dtype=None, config_from: Path | None = None
) -> Path:
    """Cut every tensor with ``split`` and write one DCP-layout file per rank."""
    per_rank: list[list[LocalSlice]] = []
    for name, t in state.items():
        for rank, slices in enumerate(split(name, t)):
            while len(per_rank) <= rank:
                per_rank.append([])
            per_rank[rank] += slices
    folder.mkdir(parents=True, exist_ok=True)
    for rank, slices in enumerate(per_rank):
        write_rank_file(folder / rank_file_name(rank), StagingBuffers().stage(slices, dtype))
    if config_from is not None:
        (folder / "config.json").write_text((config_from / "config.json").read_text())
    return folder


LAYOUTS = {
    "rows-2": lambda n, t: rows(n, t, 2),
    "rows-3": lambda n, t: rows(n, t, 3),
    "rows-64": lambda n, t: rows(n, t, 64),  # more ranks than rows: empty slices
    "boxes-2x2": lambda n, t: boxes(n, t, (2, 2)),
    "boxes-3x5": lambda n, t: boxes(n, t, (3, 5)),
    "zero3-3": lambda n, t: flat(n, t, 3),
}
