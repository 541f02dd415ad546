"""Bounded-memory safetensors IO: read byte ranges of tensors, write a file tensor by tensor.

The ``safetensors`` library memory-maps whole files; with N sources open at once every page
touched stays resident, so a merge's RSS would grow with N. Here a tensor (or a slice of its
elements) is read with ``pread`` into a reusable buffer, and an output file is written from a
header planned up front, so peak memory is a few chunk buffers whatever N and the model size.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the tensor bytes, offsets relative to the end of the header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "CheckpointFormatError",
    "TensorInfo",
    "SafetensorsReader",
    "SafetensorsWriter",
    "DTYPE_FROM_SAFETENSORS",
    "SAFETENSORS_FROM_DTYPE",
]

DTYPE_FROM_SAFETENSORS: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_FROM_DTYPE = {v: k for k, v in DTYPE_FROM_SAFETENSORS.items()}

# A header larger than this is not a real checkpoint (safetensors itself caps it at 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointFormatError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or inconsistent; the message names it."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a file: dtype, shape and absolute byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


class SafetensorsReader:
    """Read tensors, or element ranges of them, from one safetensors file with ``pread``.

    The header is validated on open: every tensor must lie inside the file and have exactly
    the bytes its dtype and shape need, so a truncated or corrupt file fails here, naming the
    file and the tensor, before any merge work starts.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError as err:
            raise CheckpointFormatError(f"weights file {self.path} does not exist") from err
        try:
            self.metadata, self.tensors = self._read_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path} is not a valid safetensors file: {why}")

    def _read_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._fail(f"file is {size} bytes long (truncated?)")
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise self._fail(f"header length {header_len} does not fit in a {size}-byte file (truncated or corrupt)")
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._fail(f"header is not valid JSON ({err})") from err
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype = DTYPE_FROM_SAFETENSORS[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise self._fail(f"tensor {name!r} has a malformed header entry {entry!r}") from err
            expected = math.prod(shape) * dtype.itemsize
            if end - begin != expected or begin < 0:
                raise self._fail(f"tensor {name!r} spans {end - begin} bytes, but {entry['dtype']}{list(shape)} needs {expected}")
            if data_start + end > size:
                raise self._fail(
                    f"tensor {name!r} ends at byte {data_start + end} but the file has only {size} bytes (truncated)"
                )
            tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)
        return metadata, tensors

    def read(
        self,
        name: str,
        start: int = 0,
        stop: int | None = None,
        buffer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name``, flattened, as a 1-D tensor.

        ``buffer`` is an optional uint8 tensor to read into (reused across calls to keep memory
        flat); the result is a view of it.
        """
        info = self.tensors[name]
        stop = info.numel if stop is None else stop
        item = info.dtype.itemsize
        nbytes = (stop - start) * item
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        raw = buffer[:nbytes]
        view = memoryview(raw.numpy())
        offset, done = info.begin + start * item, 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise self._fail(f"unexpected end of file while reading tensor {name!r}")
            done += got
        return raw.view(info.dtype)

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()


class SafetensorsWriter:
    """Write a safetensors file whose tensors are known in advance, one chunk at a time.

    The header (names, dtypes, shapes, offsets) is written first, then the bytes of each tensor
    in the planned order (:meth:`write`), or of any element range of any tensor at its place,
    from several threads at once (:meth:`write_at`); :meth:`close` checks that every byte was
    written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._sizes: list[tuple[str, int]] = []
        self._places: dict[str, tuple[int, int, int]] = {}  # name -> (offset, bytes, itemsize)
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_FROM_DTYPE[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._sizes.append((name, nbytes))
            self._places[name] = (offset, nbytes, dtype.itemsize)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._fh.write(struct.pack("<Q", len(blob)))
        self._fh.write(blob)
        self._fh.flush()
        self._data_start = 8 + len(blob)
        self._total = offset
        self._placed = 0  # bytes written by write_at
        self._lock = threading.Lock()
        self._index = 0
        self._left = self._sizes[0][1] if self._sizes else 0

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append the next elements of tensor ``name`` (the tensors must come in planned order)."""
        while self._left == 0 and self._index < len(self._sizes) - 1:
            self._index += 1
            self._left = self._sizes[self._index][1]
        expected = self._sizes[self._index][0] if self._sizes else None
        if name != expected:
            raise RuntimeError(f"{self.path}: expected data for tensor {expected!r}, got {name!r}")
        data = chunk.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > self._left:
            raise RuntimeError(f"{self.path}: too many bytes for tensor {name!r}")
        self._fh.write(memoryview(data))
        self._left -= data.nbytes

    def write_at(self, name: str, start: int, chunk: torch.Tensor) -> None:
        """Write ``chunk`` as elements ``start, start + 1, ...`` of tensor ``name`` (thread-safe).

        Ranges must not overlap, and this mode must not be mixed with :meth:`write`.
        """
        offset, nbytes, itemsize = self._places[name]
        data = memoryview(chunk.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        if start < 0 or start * itemsize + data.nbytes > nbytes:
            raise RuntimeError(f"{self.path}: elements {start}..{start + data.nbytes // itemsize} lie outside tensor {name!r}")
        pos, done = self._data_start + offset + start * itemsize, 0
        while done < data.nbytes:
            done += os.pwrite(self._fh.fileno(), data[done:], pos + done)
        with self._lock:
            self._placed += data.nbytes

    def close(self) -> None:
        """Flush, fsync and close; fail if a planned tensor did not get all its bytes."""
        sequential = self._left == 0 and all(n == 0 for _, n in self._sizes[self._index + 1 :])
        written_all = sequential if self._placed == 0 else self._placed == self._total
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if not written_all:
            raise RuntimeError(f"{self.path}: closed before every tensor was written")
