"""The weight files of one model folder, and read access to them by element ranges.

:func:`find_weight_files` finds a folder's weight files (single-file or sharded safetensors,
following a shard index; ``.bin`` through ``torch.load(weights_only=True)``; PEFT adapters);
:func:`open_weight_files` reads them by the raw bytes of element ranges of tensors (torch-free
for safetensors; a folder of per-rank files, a sharded snapshot or what torch DCP's
``HuggingFaceStorageWriter(save_distributed=True)`` writes, through :mod:`hf_pma.io.sharded`),
and :class:`CheckpointTensors` gives the same as torch tensors. Every file is opened through
:mod:`hf_pma.io.guarded`, confined to the folder the user gave.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_pma.io.guarded import check_file, read_json
from hf_pma.io.safetensors import CheckpointFormatError, SafetensorsCheckpoint, TensorInfo
from hf_pma.io.sharded import ShardedCheckpointTensors
from hf_pma.utils.text import escape, shown

if TYPE_CHECKING:
    import torch

__all__ = ["WEIGHT_PREFIXES", "find_weight_files", "open_weight_files", "CheckpointTensors", "file_present"]

# "model" for full models, "adapter_model" for PEFT adapters.
WEIGHT_PREFIXES = ("model", "adapter_model")


def _is_file_name(name: object) -> bool:
    """A plain file name (what a shard index may list): no folder, no ``..``, nothing absolute."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    return not any(c in name for c in ("/", "\\", "\x00"))


def file_present(path: Path) -> bool:
    """Whether something is at ``path`` (a file, a link, a FIFO, ...): what is there is then
    opened through :mod:`hf_pma.io.guarded`, which refuses anything but a regular file."""
    return not path.is_dir() and os.path.lexists(path)


def find_weight_files(folder: Path, root: Path | None = None) -> tuple[str, list[Path]] | None:
    """The weight files of a model folder and their prefix, or ``None`` if it holds none.

    Prefers safetensors over ``.bin``; follows a shard index when there is one (its shards must
    be plain file names in ``folder``: a Hub cache's symlinked files are fine, a path is not).
    The index is read through :func:`hf_pma.io.guarded.read_json`, confined to ``root`` (the
    folder the user gave; default ``folder``).
    """
    for prefix in WEIGHT_PREFIXES:
        for suffix in ("safetensors", "bin"):
            stem = prefix if prefix == "adapter_model" or suffix == "safetensors" else "pytorch_model"
            index = folder / f"{stem}.{suffix}.index.json"
            single = folder / f"{stem}.{suffix}"
            if file_present(index):
                data = read_json(index, root or folder, kind="index")
                weight_map = data.get("weight_map") if isinstance(data, dict) else None
                if not isinstance(weight_map, dict):
                    raise CheckpointFormatError(
                        f"{escape(index)} is not a valid shard index: no 'weight_map' object"
                    )
                names = list(dict.fromkeys(weight_map.values()))
                bad = next((n for n in names if not _is_file_name(n)), None)
                if bad is not None:
                    raise CheckpointFormatError(
                        f"{escape(index)} lists the shard {shown(bad)}: a shard must be a file name in {escape(folder)}, "
                        "without folders, '..' or an absolute path"
                    )
                files = [folder / name for name in names]
                missing = [escape(f.name) for f in files if not file_present(f)]
                if missing:
                    raise CheckpointFormatError(
                        f"{escape(index)} lists shard(s) that do not exist: {', '.join(missing[:5])}"
                    )
                return prefix, files
            if file_present(single):
                return prefix, [single]
    return None


class _BinCheckpoint:
    """``.bin`` state dicts loaded with ``torch.load(weights_only=True, mmap=True)``; ``read``
    gives raw bytes, as the safetensors readers do."""

    def __init__(self, files: Sequence[Path], root: Path | None = None) -> None:
        import torch

        from hf_pma.io.torch_adapters import safetensors_dtype

        self._state: dict[str, Any] = {}
        self._infos: dict[str, TensorInfo] = {}
        for path in files:
            real = check_file(path, root)  # confined, regular: torch.load opens the file it names
            try:
                state = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file
                raise CheckpointFormatError(
                    f"{path} could not be read as a PyTorch state dict: {err}"
                ) from err
            if not isinstance(state, dict):
                raise CheckpointFormatError(f"{path} does not hold a state dict (got {type(state).__name__})")
            for name, tensor in state.items():
                if not isinstance(tensor, torch.Tensor):
                    continue
                if name in self._state:
                    raise CheckpointFormatError(f"tensor {name!r} appears in two shards: {path} and another")
                dtype = safetensors_dtype(tensor.dtype, name)
                self._state[name] = tensor
                self._infos[name] = TensorInfo(
                    name, dtype, tuple(tensor.shape), 0, tensor.numel() * tensor.element_size()
                )

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def read(self, name: str, start: int = 0, stop: int | None = None, buffer: Any = None) -> Any:
        from hf_pma.io.torch_adapters import tensor_bytes

        return tensor_bytes(self._state[name].reshape(-1)[start:stop])

    def close(self) -> None:
        self._state = {}


def open_weight_files(files: Sequence[Path], sharded: bool = False, root: Path | None = None) -> Any:
    """Read access to weight files by the raw bytes of element ranges of tensors.

    ``sharded``: the files are one per rank (DCP layout). Safetensors files are read without
    torch; ``.bin`` files are loaded with ``torch.load(weights_only=True, mmap=True)``. Every
    file is opened through :mod:`hf_pma.io.guarded`, confined to ``root`` (the folder the user
    gave; default: each file's folder).
    """
    if sharded:
        return ShardedCheckpointTensors(files, root)
    if any(Path(f).suffix != ".safetensors" for f in files):
        return _BinCheckpoint([Path(f) for f in files], root)
    return SafetensorsCheckpoint(files, root)


class CheckpointTensors:
    """Read access to every tensor of one checkpoint folder, across its weight files, as torch tensors.

    The files are read as :func:`open_weight_files` reads them; :meth:`read` gives torch
    tensors (torch is imported when this class is first used).
    """

    def __init__(self, files: Sequence[Path], sharded: bool = False, root: Path | None = None) -> None:
        from hf_pma.io.torch_adapters import TorchTensors

        self.raw = open_weight_files([Path(f) for f in files], sharded, root)
        self._torch = TorchTensors(self.raw)

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype (a safetensors name), shape and location of every tensor."""
        return self.raw.infos

    def read(
        self, name: str, start: int = 0, stop: int | None = None, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name``, flattened (a view of ``buffer``, a uint8
        tensor, when given)."""
        return self._torch.read(name, start, stop, buffer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, loaded and reshaped (for small models and tests)."""
        return {n: self.read(n).clone().reshape(i.shape) for n, i in self.infos.items()}

    def close(self) -> None:
        """Close every file."""
        self.raw.close()

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
