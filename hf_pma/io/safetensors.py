"""Bounded-memory safetensors IO without torch: read byte ranges of tensors, write a file chunk by chunk.

The ``safetensors`` library memory-maps whole files; with N sources open at once every page
touched stays resident, so a merge's RSS would grow with N. Here a tensor (or a slice of its
elements) is read with ``pread`` into a reusable buffer, and an output file is written from a
header planned up front, so peak memory is a few chunk buffers whatever N and the model size.

Dtypes are the format's own names (``"F32"``, ``"BF16"``, ...; :data:`DTYPE_ITEMSIZE`) and
data are raw bytes (numpy ``uint8`` arrays, or anything with the buffer protocol), so this
module needs neither torch nor ``ml_dtypes``; :mod:`hf_pma.io.torch_adapters` maps both to
torch for the code that computes with torch.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the tensor bytes, offsets relative to the end of the header. As the ``safetensors`` library
does, a header is refused unless the tensors' byte ranges tile the data section exactly: no
overlap, no gap, nothing outside the file.

A header is also bounded by what a file can hold, so that a crafted one costs neither memory nor
time: at most :data:`MAX_TENSORS` tensors per file, at most :data:`MAX_DIMS` dimensions per
tensor, every dimension below ``2**63`` (torch's sizes are int64), and the product of the
dimensions never overflowing 64 bits, taken left to right as the ``safetensors`` library
computes it (``[2**64, 0]`` and ``[2**63, 2, 0]`` are refused). Files are opened through
:mod:`hf_pma.io.guarded`: confined to their folder after symbolic links, regular files only.
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
from typing import Any

import numpy as np

from hf_pma.io.guarded import open_file
from hf_pma.utils.parsing import is_int
from hf_pma.utils.text import escape, shown

__all__ = [
    "CheckpointFormatError",
    "DTYPE_ITEMSIZE",
    "FLOAT_DTYPES",
    "SAFETENSORS_NAMES",
    "TORCH_NAMES",
    "TensorInfo",
    "SafetensorsCheckpoint",
    "SafetensorsReader",
    "SafetensorsWriter",
]

# Every dtype the safetensors format names, and its bytes per element.
DTYPE_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
# The floating-point dtypes (averaged by a merge; the others must be equal in every source).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# Each dtype as torch names it (``torch.<name>``; config.json's ``dtype`` uses these names).
TORCH_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
SAFETENSORS_NAMES: dict[str, str] = {v: k for k, v in TORCH_NAMES.items()}

# A header larger than this is not a real checkpoint (the safetensors library's own cap).
_MAX_HEADER_BYTES = 100_000_000
# Tensors per file. Real checkpoints hold at most tens of thousands in one file (a 70B dense
# model ~700; an unsharded DeepSeek-V3, the most tensors of any public model, ~92,000: one per
# expert matrix and its scale): 2**18 leaves nearly 3x room. A header at the cap (24 MB)
# parsed in 2.1 s and held ~100 MB of Python objects (measured on a loaded 2-core machine); the
# 89 MB header of 1.5M empty tensors that cost 1.4 GB and 30 s per file is now refused once its
# parse reaches the cap (the counting hook below stops it there).
MAX_TENSORS = 2**18
# Dimensions per tensor: numpy holds at most 64, and no model uses more than a handful.
MAX_DIMS = 64
_U64 = 2**64 - 1
_MAX_DIM = 2**63 - 1


class CheckpointFormatError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or inconsistent; the message names it."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives in a file: dtype (a safetensors name), shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def is_floating_point(self) -> bool:
        """Whether the dtype is a floating-point one."""
        return self.dtype in FLOAT_DTYPES


def _is_count(value: Any, limit: int = _U64) -> bool:
    return is_int(value, 0, limit)


class _TooManyTensors(Exception):
    pass


def _counting_hook(limit: int):
    """An ``object_pairs_hook`` that builds dicts (last key wins, as ``json.loads`` does) and
    stops the parse once more than ``limit`` objects were built: a crafted header is refused
    before it costs the memory of its millions of entries."""
    count = 0

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal count
        count += 1
        if count > limit:
            raise _TooManyTensors
        return dict(pairs)

    return hook


class SafetensorsReader:
    """Read tensors, or element ranges of them, from one safetensors file with ``pread``.

    The header is validated on open: every tensor must have exactly the bytes its dtype and
    shape need, and the tensors' byte ranges must tile the data section (no overlap, no gap,
    nothing past the end of the file), so a truncated or corrupt file fails here, in one line
    naming the file and the tensor(s), before any merge work starts.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        folder: str | os.PathLike[str] | None = None,
        *,
        max_tensors: int | None = None,
    ) -> None:
        """Open ``path``, a file under ``folder`` (the folder the user gave; default: the folder
        holding it), through :func:`hf_pma.io.guarded.open_file`, and validate its header.
        ``max_tensors`` (default :data:`MAX_TENSORS`) caps the tensors it may list."""
        self.path = Path(path)
        self._fd = -1
        self._max_tensors = MAX_TENSORS if max_tensors is None else max_tensors
        try:
            self._fd = open_file(self.path, folder)
        except FileNotFoundError as err:
            raise CheckpointFormatError(f"weights file {self.path} does not exist") from err
        try:
            self.metadata, self.tensors = self._read_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{escape(self.path)} is not a valid safetensors file: {why}")

    def _read_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._fail(f"file is {size} bytes long (truncated?)")
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise self._fail(
                f"header length {header_len} does not fit in a {size}-byte file (truncated or corrupt)"
            )
        raw = os.pread(self._fd, header_len, 8)
        if not raw.startswith(b"{"):
            raise self._fail("header is not a JSON object")
        # One object per tensor, one for __metadata__, one for the header itself.
        hook = _counting_hook(self._max_tensors + 2)
        try:
            header = json.loads(raw, object_pairs_hook=hook)
        except _TooManyTensors:
            raise self._fail(f"header lists more than {self._max_tensors:,} tensors") from None
        except RecursionError:
            raise self._fail("header is not valid JSON (nested too deep)") from None
        except (UnicodeDecodeError, ValueError) as err:
            raise self._fail(f"header is not valid JSON ({shown(str(err), 200)})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._fail("__metadata__ is not an object of strings")
        if len(header) > self._max_tensors:
            raise self._fail(f"header lists more than {self._max_tensors:,} tensors")
        data_start = 8 + header_len
        tensors = {name: self._entry(name, entry, data_start) for name, entry in header.items()}
        self._check_layout(tensors, data_start, size - data_start)
        return metadata, tensors

    def _entry(self, name: str, entry: Any, data_start: int) -> TensorInfo:
        """One header entry, checked for types and for the byte count its dtype and shape need."""
        if not isinstance(entry, dict):
            raise self._fail(f"tensor {shown(name)} has a malformed header entry {shown(entry)}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise self._fail(f"tensor {shown(name)} has an unknown dtype {shown(dtype, 50)}")
        if not isinstance(shape, list) or not all(_is_count(d, _MAX_DIM) for d in shape):
            raise self._fail(
                f"tensor {shown(name)} has an invalid shape {shown(shape)} (dimensions: integers from 0 to 2**63 - 1)"
            )
        if len(shape) > MAX_DIMS:
            raise self._fail(f"tensor {shown(name)} has {len(shape)} dimensions (at most {MAX_DIMS})")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise self._fail(f"tensor {shown(name)} has invalid data_offsets {shown(offsets)}")
        numel = 1
        for dim in shape:  # left to right, as the safetensors library multiplies them
            numel *= dim
            if numel > _U64:
                raise self._fail(
                    f"tensor {shown(name)} has a shape {shown(shape)} whose size overflows 64 bits"
                )
        if numel * DTYPE_ITEMSIZE[dtype] * 8 > _U64:
            raise self._fail(f"tensor {shown(name)} has a shape {shown(shape)} whose size overflows 64 bits")
        begin, end = offsets
        expected = numel * DTYPE_ITEMSIZE[dtype]
        if end < begin or end - begin != expected:
            raise self._fail(
                f"tensor {shown(name)} spans {end - begin} bytes, but {dtype}{shape} needs {expected}"
            )
        return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)

    def _check_layout(self, tensors: dict[str, TensorInfo], data_start: int, data_bytes: int) -> None:
        """The byte ranges must tile the data section: sorted, each starting where the last ended."""
        position, previous = 0, None
        for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
            begin, end = info.begin - data_start, info.end - data_start
            if begin != position:
                if previous is None:
                    why = f"tensor {shown(info.name)} starts at byte {begin} of the data, not at 0"
                elif begin < position:
                    why = f"tensors {shown(previous)} and {shown(info.name)} overlap (bytes {begin}..{position})"
                else:
                    why = f"{begin - position} bytes between tensors {shown(previous)} and {shown(info.name)} belong to none"
                raise self._fail(f"invalid offset: {why}")
            if end > data_bytes:
                raise self._fail(
                    f"tensor {shown(info.name)} ends at byte {end} of the data but the file holds only {data_bytes} (truncated)"
                )
            position, previous = end, info.name
        if position != data_bytes:
            raise self._fail(
                f"{data_bytes - position} bytes after the last tensor belong to no tensor (corrupt)"
            )

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype, shape and location of every tensor."""
        return self.tensors

    def read(
        self, name: str, start: int = 0, stop: int | None = None, buffer: np.ndarray | None = None
    ) -> np.ndarray:
        """The bytes of elements ``[start, stop)`` of tensor ``name`` (flattened), as a ``uint8`` array.

        ``buffer`` is an optional ``uint8`` array to read into (reused across calls to keep memory
        flat); the result is a view of it.
        """
        info = self.tensors[name]
        stop = info.numel if stop is None else stop
        item = info.itemsize
        nbytes = (stop - start) * item
        if buffer is None or buffer.size < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
        raw = buffer[:nbytes]
        view = memoryview(raw)
        offset, done = info.begin + start * item, 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise self._fail(f"unexpected end of file while reading tensor {name!r}")
            done += got
        return raw

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


class SafetensorsCheckpoint:
    """Every tensor of one checkpoint stored in one or more safetensors files (the shards of an index).

    The same interface as :class:`SafetensorsReader`: ``infos`` and ``read``; a tensor in two
    files is refused.
    """

    def __init__(
        self, files: Sequence[str | os.PathLike[str]], folder: str | os.PathLike[str] | None = None
    ) -> None:
        """Open every file of ``files`` (under ``folder``, see :class:`SafetensorsReader`)."""
        self._readers: list[SafetensorsReader] = []
        self._owner: dict[str, SafetensorsReader] = {}
        try:
            for path in files:
                reader = SafetensorsReader(path, folder)
                self._readers.append(reader)
                for name in reader.tensors:
                    if name in self._owner:
                        raise CheckpointFormatError(
                            f"tensor {shown(name)} appears in two shards: {self._owner[name].path} and {reader.path}"
                        )
                    self._owner[name] = reader
        except BaseException:
            self.close()
            raise

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype, shape and location of every tensor."""
        return {name: reader.tensors[name] for name, reader in self._owner.items()}

    def read(
        self, name: str, start: int = 0, stop: int | None = None, buffer: np.ndarray | None = None
    ) -> np.ndarray:
        """The bytes of elements ``[start, stop)`` of tensor ``name`` (see :meth:`SafetensorsReader.read`)."""
        return self._owner[name].read(name, start, stop, buffer)

    def close(self) -> None:
        """Close every file."""
        for reader in self._readers:
            reader.close()
        self._readers = []

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to disk now, without waiting.

    ``POSIX_FADV_DONTNEED`` starts the writeback of the range's dirty pages (Linux; then drops
    the range's pages that are already clean from the page cache: none or few, just written)
    and returns, so the disk writes overlap the rest of the merge instead of all waiting for
    the final ``fsync`` (which still makes the file durable). A hint: ignored where missing.
    """
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


class SafetensorsWriter:
    """Write a safetensors file whose tensors are known in advance, one chunk at a time.

    ``tensors`` are ``(name, dtype, shape)`` with safetensors dtype names. The header (names,
    dtypes, shapes, offsets) is written first, then the bytes of each tensor in the planned
    order (:meth:`write`), or of any element range of any tensor at its place, from several
    threads at once (:meth:`write_at`); :meth:`close` checks that every byte was written.
    Chunks are anything with the buffer protocol holding the tensor's raw bytes (a contiguous
    numpy array, ``bytes``, a ``memoryview``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._sizes: list[tuple[str, int]] = []
        self._places: dict[str, tuple[int, int, int]] = {}  # name -> (offset, bytes, itemsize)
        for name, dtype, shape in tensors:
            if dtype not in DTYPE_ITEMSIZE:
                raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which safetensors cannot store")
            nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._sizes.append((name, nbytes))
            self._places[name] = (offset, nbytes, DTYPE_ITEMSIZE[dtype])
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

    def write(self, name: str, chunk: Any) -> None:
        """Append the next bytes of tensor ``name`` (the tensors must come in planned order)."""
        while self._left == 0 and self._index < len(self._sizes) - 1:
            self._index += 1
            self._left = self._sizes[self._index][1]
        expected = self._sizes[self._index][0] if self._sizes else None
        if name != expected:
            raise RuntimeError(f"{self.path}: expected data for tensor {expected!r}, got {name!r}")
        data = memoryview(chunk).cast("B")
        if data.nbytes > self._left:
            raise RuntimeError(f"{self.path}: too many bytes for tensor {name!r}")
        self._fh.write(data)
        self._left -= data.nbytes

    def write_at(self, name: str, start: int, chunk: Any) -> None:
        """Write ``chunk``'s bytes as elements ``start, start + 1, ...`` of tensor ``name`` (thread-safe).

        Ranges must not overlap, and this mode must not be mixed with :meth:`write`. The disk
        write of each range starts at once (see :func:`_start_writeback`), so that :meth:`close`'s
        ``fsync`` finds little left to wait for.
        """
        offset, nbytes, itemsize = self._places[name]
        data = memoryview(chunk).cast("B")
        if start < 0 or start * itemsize + data.nbytes > nbytes:
            raise RuntimeError(
                f"{self.path}: elements {start}..{start + data.nbytes // itemsize} lie outside tensor {name!r}"
            )
        pos, done = self._data_start + offset + start * itemsize, 0
        while done < data.nbytes:
            done += os.pwrite(self._fh.fileno(), data[done:], pos + done)
        if data.nbytes:
            _start_writeback(self._fh.fileno(), pos, data.nbytes)
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
