"""Hub answers bounded in total: a deadline and a size per answer, and per file over all its requests.

A read timeout only bounds the gap between two reads: a server that sends one byte every half
second never trips it, and a small gzip body can inflate to gigabytes. :class:`BoundedTransport`
wraps the transport of ``huggingface_hub``'s shared HTTP client (:func:`hf_pma.utils.hub_client.install_hub_client`)
so that every answer, whoever asked for it (hf-pma, ``huggingface_hub``, transformers, datasets):

* **ends by a deadline.** Its clock starts when the request has been sent (an upload's body
  does not count) and covers the headers and the body, and the redirects it follows: ``READ`` seconds of the Hub timeout
  (``HF_PMA_HUB_TIMEOUT``, ``--hub-timeout``) for an API answer; for a file download (a
  ``/resolve/`` request, and the redirects it follows) the deadline moves on by one second for
  every :data:`MIN_DOWNLOAD_RATE` bytes received, so a large file arriving at any useful speed
  completes and a trickle does not. Every socket read waits at most until the deadline; then
  ``httpx2.ReadTimeout``, which :func:`hf_pma.utils.hub_client.hub_failure_line` turns into one line.
* **is bounded in size after decompression.** Only ``identity`` is asked for; an answer
  compressed anyway (``gzip``, ``deflate``) is inflated here, at most a bounded piece at a
  time, and refused once it passes its bound; any other encoding is refused. The bound of a file
  download is the size the Hub announced for it (``Content-Length`` of an uncompressed body,
  ``X-Linked-Size``, and what the ``HEAD`` of the same URL announced: transformers and
  ``huggingface_hub`` ask it first; the smaller when they differ), else :data:`MAX_ANSWER_BYTES`; of any other answer, at most
  :data:`MAX_ANSWER_BYTES`. A refusal is :class:`HubAnswerTooLarge` (one line).
* **is one file's transfer, whatever requests it takes.** The size the Hub announces for a file
  (the ``HEAD`` of its ``/resolve/`` URL: ``X-Linked-Size``, else the ``Content-Length`` of a
  ``200``; or :func:`expect_transfer` for hf-pma's own downloads, which know it from the repo's
  metadata) makes a :class:`_Transfer`, kept by URL and by the ``Location`` the Hub redirects to
  (a CDN on another host), and carried along the redirects a ``GET`` follows. Every ``GET`` of it
  (resumes included, with a ``Range``) counts against it: at most :data:`MAX_FILE_REQUESTS`
  requests, one deadline for all of them (the read timeout plus one second per
  :data:`MIN_DOWNLOAD_RATE` bytes announced, from the first ``GET``), each answer at most the
  announced size from the byte it resumes at, and all of them at most twice the announced size
  (once more for a server that ignores a resume's range and starts over); a block read (a
  closed range, as ``HfFileSystem`` and ``datasets`` read) is an answer of its own, at most the
  bytes it asks for. A refusal is :class:`HubTransferRefused` (one line), raised where
  ``huggingface_hub`` does not retry.
* **fits on the disk.** A ``HEAD`` announcing more than the free space of the Hub cache
  (``HF_HUB_CACHE``) is refused (:class:`hf_pma.utils.fs.NoSpaceError`) before any ``GET``,
  unless the cache holds that content already (a blob named by its ETag).
* **has the JSON type its endpoint promises.** A repo's info, tree listing, paths-info and refs
  are checked when their last byte arrives (:func:`hf_pma.utils.hub_client.api_answer_check`):
  a wrong type is :class:`hf_pma.utils.hub_client.HubAnswerError` (one line), not a traceback
  from the code that reads it.

Torch-free; imported with ``huggingface_hub``'s HTTP client (``httpx2``), never by the CLI's parser.
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpcore2
import httpx2

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_FILE_REQUESTS",
    "MIN_DOWNLOAD_RATE",
    "HubAnswerTooLarge",
    "HubTransferRefused",
    "BoundedTransport",
    "bound_network_reads",
    "expect_transfer",
    "header_size",
]

# The most an answer may hold after decompression when the Hub announced no size for it (API
# answers: a repo listing of many thousands of files is a few MB).
MAX_ANSWER_BYTES = 64 * 2**20
# Bytes per second that move a download's deadline on by one second.
MIN_DOWNLOAD_RATE = 64 * 2**10
# How much one inflating step may produce (memory held at once, whatever the ratio).
_INFLATE_STEP = 1 << 20
_DOWNLOAD = "hf_pma_download"  # request extension marking a file download (kept across redirects)
_ANSWER = "hf_pma_answer"  # request extension: the answer's deadline, shared with its redirects
_FILE = "hf_pma_file"  # request extension: the file transfer a GET belongs to, shared with its redirects
_TRANSFERS_KEPT = 4096
# GET requests one file's transfer may take: the first and the resumes after answers cut short.
MAX_FILE_REQUESTS = 8
_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a content hash: the only ETag taken for a cache name
_RESOLVE = re.compile(r"/(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/[^/]+/(?P<file>.+)$")

_current = threading.local()
_transfers: dict[str, _Transfer] = {}  # by URL: the resolve URL, the Location it redirects to
_transfers_lock = threading.Lock()


class HubTransferRefused(ValueError):
    """A Hub transfer past one of its bounds (bytes, requests, deadline): one line."""


class HubAnswerTooLarge(HubTransferRefused):
    """A Hub answer larger than its bound (announced size or :data:`MAX_ANSWER_BYTES`) after
    decompression, or compressed in an encoding hf-pma cannot bound."""


class _Transfer:
    """One file's transfer over all its requests: ``size`` announced bytes, a deadline set at
    the first ``GET``, the bytes and requests it took."""

    def __init__(self, url: str, size: int | None) -> None:
        split = httpx2.URL(url)
        self.origin = f"{split.scheme}://{split.netloc.decode('ascii', 'replace')}"
        self.path, self.size = split.path, size
        self.total = MAX_ANSWER_BYTES if size is None else 2 * size
        self.received = self.requests = 0
        self.seconds: float | None = None
        self.deadline: float | None = None
        self.done = False

    def start_request(self, read_timeout: float) -> None:
        """Count one more ``GET``; :class:`HubTransferRefused` past :data:`MAX_FILE_REQUESTS` or the deadline."""
        now = time.monotonic()
        if self.deadline is None:
            self.seconds = read_timeout + (self.size or 0) / MIN_DOWNLOAD_RATE
            self.deadline = now + self.seconds
        if self.requests >= MAX_FILE_REQUESTS:
            raise HubTransferRefused(
                f"the Hub at {self.origin} did not complete {self.path} in {MAX_FILE_REQUESTS} requests "
                "(each answer cut short, then resumed); refused"
            )
        if now >= self.deadline:
            raise self.expired()
        self.requests += 1

    def remaining(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> HubTransferRefused:
        return HubTransferRefused(
            f"the Hub at {self.origin} did not complete {self.path} within {self.seconds or 0:,.0f} s, resumes "
            "included (set_hub_timeout, --hub-timeout or HF_PMA_HUB_TIMEOUT sets the limit)"
        )

    def count(self, n: int) -> None:
        """Count ``n`` bytes received; :class:`HubAnswerTooLarge` past twice the announced size in all."""
        self.received += n
        if self.received > self.total:
            raise HubAnswerTooLarge(
                f"the Hub at {self.origin} sent more than {self.total:,} bytes in all for {self.path} "
                f"({self.size if self.size is not None else 'no size'} announced, resumes included); refused"
            )


def _url_key(url: Any) -> str:
    return str(httpx2.URL(str(url)).copy_with(fragment=None))


def _keep(url: Any, transfer: _Transfer) -> None:
    with _transfers_lock:
        if len(_transfers) >= _TRANSFERS_KEPT:
            _transfers.clear()
        _transfers[_url_key(url)] = transfer


def _kept(url: Any) -> _Transfer | None:
    with _transfers_lock:
        transfer = _transfers.get(_url_key(url))
    return None if transfer is None or transfer.done else transfer


def expect_transfer(url: str, size: int) -> None:
    """Start the transfer of the file at ``url`` (a ``/resolve/`` URL) of ``size`` bytes, as the
    repo's metadata announced it: every ``GET`` of ``url`` from now on, and the redirects it
    follows, count against it (see the module). For downloads that send no ``HEAD`` first."""
    _keep(url, _Transfer(url, size))


def _check_free_space(url: Any, size: int, response: Any) -> None:
    """:class:`~hf_pma.utils.fs.NoSpaceError` when the Hub cache cannot hold ``size`` more bytes
    (a file whose content the cache holds already needs none: ``huggingface_hub`` asks first)."""
    from huggingface_hub import constants

    from hf_pma.utils.fs import raise_if_no_space

    folder = Path(constants.HF_HUB_CACHE)
    match = _RESOLVE.search(httpx2.URL(str(url)).path)
    if match is not None:  # the file's place in the cache, as huggingface_hub names it
        repo = folder / "--".join([match.group("type") or "models", *match.group("repo").split("/")])
        etag = (response.headers.get("x-linked-etag") or response.headers.get("etag") or "").strip()
        etag = etag.removeprefix("W/").strip('"')
        if _HASH.fullmatch(etag) and (repo / "blobs" / etag).is_file():
            return
        folder = repo / unquote(match.group("file"))
    raise_if_no_space(folder, size)


# A size or offset in a header: ASCII digits only (``"²".isdigit()`` is true, ``int("²")`` fails) and
# at most 19 of them (below 2**63; Python refuses to read numbers of over 4,300 digits).
_NUMBER = r"([0-9]{1,19})"


def header_size(value: Any) -> int | None:
    """A size a header gives (``Content-Length``, ``X-Linked-Size``): ``None`` unless it is a
    plain number of at most 19 ASCII digits, so that no header makes the bounds fail to read it."""
    found = re.fullmatch(rf"\s*{_NUMBER}\s*", value) if isinstance(value, str) else None
    return int(found.group(1)) if found else None


def _range_start(request: Any) -> int:
    found = re.fullmatch(rf"\s*bytes={_NUMBER}-[0-9]*\s*", request.headers.get("Range", ""))
    return int(found.group(1)) if found else 0


def _range_length(request: Any) -> int | None:
    """The bytes a closed range asks for (``bytes=a-b``: a block read, as ``HfFileSystem`` and
    ``datasets`` make them, not a resume); ``None`` for no range or an open one."""
    found = re.fullmatch(rf"\s*bytes={_NUMBER}-{_NUMBER}\s*", request.headers.get("Range", ""))
    return max(int(found.group(2)) - int(found.group(1)) + 1, 0) if found else None


class _Answer:
    """The deadline of one answer: ``budget`` seconds from its first read, plus one second per
    ``rate`` bytes received (downloads)."""

    def __init__(self, budget: float, rate: float | None) -> None:
        self.budget, self.rate = budget, rate
        self.started: float | None = None
        self.received = 0
        self.transfer: _Transfer | None = None  # a file's transfer: its deadline holds too

    def remaining(self) -> float:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        extra = self.received / self.rate if self.rate else 0.0
        left = self.started + self.budget + extra - now
        return left if self.transfer is None else min(left, self.transfer.remaining())

    def expired(self, timeout: type[Exception], **kwargs: Any) -> Exception:
        """What a read past the deadline raises: the transfer's refusal when its deadline passed
        (``huggingface_hub`` would resume after a timeout), else ``timeout``."""
        if self.transfer is not None and self.transfer.remaining() <= 0:
            return self.transfer.expired()
        return timeout(f"no complete answer within {self.budget:g} s", **kwargs)


class _DeadlineStream:
    """A network stream whose reads wait at most until the current answer's deadline."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        answer: _Answer | None = getattr(_current, "answer", None)
        if answer is not None:
            left = answer.remaining()
            if left <= 0:
                raise answer.expired(httpcore2.ReadTimeout)
            timeout = left if timeout is None else min(timeout, left)
        try:
            data = self._inner.read(max_bytes, timeout)
        except httpcore2.ReadTimeout:
            if answer is not None and answer.remaining() <= 0:
                raise answer.expired(httpcore2.ReadTimeout) from None
            raise
        if answer is not None:
            answer.received += len(data)
        return data

    def start_tls(self, *args: Any, **kwargs: Any) -> _DeadlineStream:
        return _DeadlineStream(self._inner.start_tls(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:  # write, close, get_extra_info
        return getattr(self._inner, name)


class _DeadlineBackend:
    """A network backend whose streams are :class:`_DeadlineStream`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def connect_tcp(self, *args: Any, **kwargs: Any) -> _DeadlineStream:
        return _DeadlineStream(self._inner.connect_tcp(*args, **kwargs))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> _DeadlineStream:
        return _DeadlineStream(self._inner.connect_unix_socket(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:  # sleep
        return getattr(self._inner, name)


def bound_network_reads(transport: Any) -> bool:
    """Make every socket read of ``transport`` (an ``httpx2.HTTPTransport``) wait at most until
    the current answer's deadline; ``False`` when its connection pool is not one this knows (the
    deadline is then checked between the chunks of a body only)."""
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if backend is None or not hasattr(backend, "connect_tcp"):
        return False
    if not isinstance(backend, _DeadlineBackend):
        pool._network_backend = _DeadlineBackend(backend)
    return True


def _is_download(request: Any) -> bool:
    path = request.url.path
    return "/resolve/" in path or "/resolve-cache/" in path or bool(request.extensions.get(_DOWNLOAD))


def _file_size(response: Any) -> int | None:
    """The size of the whole file an answer announces, as ``huggingface_hub`` reads it:
    ``X-Linked-Size``, the total of a ``Content-Range``, the ``Content-Length`` of a ``200``."""
    linked = header_size(response.headers.get("x-linked-size"))
    if linked is not None:
        return linked
    total = re.fullmatch(rf"\s*bytes [0-9]+-[0-9]+/{_NUMBER}\s*", response.headers.get("content-range", ""))
    if total:
        return int(total.group(1))
    length = header_size(response.headers.get("content-length"))
    if response.status_code == 200 and length is not None and "content-encoding" not in response.headers:
        return length
    return None


def _json_check(request: Any, check_answer: Any) -> Callable[[bytes], None] | None:
    """The check of an API answer's JSON (``check_answer(path)``: a check of the parsed answer,
    or ``None`` for an endpoint it does not know) as a check of the answer's bytes."""
    check = check_answer(request.url.path) if check_answer is not None else None
    if check is None:
        return None

    def check_bytes(body: bytes) -> None:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = _NOT_JSON
        check(data)

    return check_bytes


_NOT_JSON = object()


def _announced_size(response: Any, encoded: bool) -> int | None:
    """The size the Hub announced for this body after decompression, if any."""
    names = ("x-linked-size",) if encoded else ("content-length", "x-linked-size")
    for name in names:
        value = header_size(response.headers.get(name))
        if value is not None:
            return value
    return None


class _BoundedBody(httpx2.SyncByteStream):
    """A response body read under its answer's deadline, inflated when compressed, and refused past ``limit`` bytes."""

    def __init__(
        self,
        inner: Any,
        request: Any,
        answer: _Answer,
        limit: int,
        encoding: str | None,
        start: int = 0,
        check: Callable[[bytes], None] | None = None,
    ) -> None:
        self._inner, self._request, self._answer = inner, request, answer
        self._limit, self._encoding = limit, encoding
        self._size = 0
        self._start, self._check = start, check  # a file's first byte here; an API answer's JSON check

    def _chunks(self) -> Iterator[bytes]:
        iterator = iter(self._inner)
        while True:
            previous = getattr(_current, "answer", None)
            _current.answer = self._answer
            try:
                chunk = next(iterator, None)
            finally:
                _current.answer = previous
            if chunk is None:
                return
            if self._answer.remaining() <= 0:
                raise self._answer.expired(httpx2.ReadTimeout, request=self._request)
            yield chunk

    def _count(self, data: bytes) -> bytes:
        self._size += len(data)
        if self._size > self._limit:
            raise HubAnswerTooLarge(
                f"the Hub at {self._request.url.scheme}://{self._request.url.netloc.decode('ascii', 'replace')} sent more "
                f"than {self._limit:,} bytes for {self._request.url.path} (after decompression); refused"
            )
        if self._answer.transfer is not None:
            self._answer.transfer.count(len(data))
        return data

    def __iter__(self) -> Iterator[bytes]:
        kept: list[bytes] | None = [] if self._check is not None else None
        for data in self._inflated():
            if kept is not None:
                kept.append(data)
            yield data
        transfer = self._answer.transfer
        if transfer is not None and transfer.size is not None and self._start + self._size >= transfer.size:
            transfer.done = True  # the next GET of this URL is another transfer
        if self._check is not None and kept is not None:
            self._check(b"".join(kept))

    def _inflated(self) -> Iterator[bytes]:
        if self._encoding is None:
            for chunk in self._chunks():
                yield self._count(chunk)
            return
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if self._encoding == "gzip" else zlib.MAX_WBITS)
        first = True
        for chunk in self._chunks():
            if first and self._encoding == "deflate" and chunk and (chunk[0] & 0x0F) != 8:
                inflater = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, as some servers send it
            first = False
            data = chunk
            while data:
                try:
                    out = inflater.decompress(data, _INFLATE_STEP)
                except zlib.error as err:
                    raise HubAnswerTooLarge(f"the Hub's {self._encoding} answer for {self._request.url.path} does not inflate ({err})") from None
                if out:
                    yield self._count(out)
                data = inflater.unconsumed_tail
        rest = inflater.flush(_INFLATE_STEP)
        if rest:
            yield self._count(rest)

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()


class BoundedTransport(httpx2.BaseTransport):
    """An ``httpx2`` transport that bounds every answer of ``inner`` in time and size, and every
    file's transfer over all its requests (see the module). ``read_timeout`` gives the deadline
    of an answer in seconds, read at each request; ``check_answer(path)`` a check of the parsed
    JSON of an API answer at ``path`` (``None`` where there is none to make), which raises when
    the answer is malformed (:func:`hf_pma.utils.hub_client.api_answer_check`)."""

    def __init__(self, inner: Any, read_timeout: Any, check_answer: Any = None) -> None:
        self._inner = inner
        self._read_timeout = read_timeout
        self._check_answer = check_answer  # path -> a check of that API answer's JSON, or None
        bound_network_reads(inner)

    def _transfer_of(self, request: Any) -> _Transfer | None:
        """The file transfer a GET belongs to, counted once per GET (its redirects share it); a
        block read (a closed range) is an answer of its own, bounded by the bytes it asks for."""
        if request.method != "GET" or _range_length(request) is not None:
            return None
        transfer = request.extensions.get(_FILE)
        if isinstance(transfer, _Transfer):
            return transfer  # a redirect of a GET already counted
        transfer = _kept(request.url)
        if transfer is not None:
            transfer.start_request(float(self._read_timeout()))
        return transfer

    def handle_request(self, request: Any) -> Any:
        transfer = self._transfer_of(request)
        download = _is_download(request) or transfer is not None
        # One deadline for a request and the redirects it follows (httpx2 passes the extensions on).
        answer = request.extensions.get(_ANSWER)
        if not isinstance(answer, _Answer):
            answer = _Answer(float(self._read_timeout()), MIN_DOWNLOAD_RATE if download else None)
        answer.transfer = transfer
        request.extensions = {
            **request.extensions,
            _ANSWER: answer,
            **({_DOWNLOAD: True} if download else {}),
            **({_FILE: transfer} if transfer is not None else {}),
        }
        request.headers["Accept-Encoding"] = "identity"
        previous = getattr(_current, "answer", None)
        _current.answer = answer
        try:
            response = self._inner.handle_request(request)
        finally:
            _current.answer = previous
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
        encoding = {"identity": None, "x-gzip": "gzip"}.get(encoding, encoding)
        if encoding not in (None, "gzip", "deflate"):
            response.close()
            raise HubAnswerTooLarge(
                f"the Hub answered {request.url.path} in the encoding {encoding[:40]!r}, which hf-pma did not ask for "
                "and cannot bound; refused"
            )
        announced = _announced_size(response, encoded=encoding is not None)
        block = _range_length(request)
        if download and request.method in ("HEAD", "GET") and block is None:
            try:
                transfer = self._follow(request, response, transfer, answer)
            except BaseException:
                response.close()  # refused at its headers: the connection goes back, or away
                raise
        start = _range_start(request) if response.status_code == 206 else 0
        if transfer is not None and transfer.size is not None:
            # The size announced for the file is what it may send, from the byte it resumes at;
            # an answer announcing less (cut short) is held to that: the smaller one holds.
            own = announced if response.status_code in (200, 206) else None
            announced = max(transfer.size - start, 0) if own is None else min(own, max(transfer.size - start, 0))
        if block is not None:  # a block read gets the bytes it asked for, whatever the answer announces
            announced = block if announced is None else min(announced, block)
        # A download may send what was announced for it; any other answer at most MAX_ANSWER_BYTES.
        limit = MAX_ANSWER_BYTES if announced is None else announced if download else min(announced, MAX_ANSWER_BYTES)
        check = None
        if not download and request.method != "HEAD" and response.status_code == 200:
            check = _json_check(request, self._check_answer)
        headers = [
            (k, v) for k, v in response.headers.raw
            if encoding is None or k.lower() not in (b"content-encoding", b"content-length")
        ]
        return httpx2.Response(
            status_code=response.status_code,
            headers=headers,
            stream=_BoundedBody(response.stream, request, answer, limit, encoding, start, check),
            extensions=response.extensions,
            request=request,
        )

    def _follow(self, request: Any, response: Any, transfer: _Transfer | None, answer: _Answer) -> _Transfer | None:
        """Start a file's transfer where the Hub announces its size (a HEAD, or a GET with none
        started), checked against the free space, and carry it to the ``Location`` it redirects to."""
        status = response.status_code
        if transfer is None and (status == 200 or 300 <= status < 400):
            size = _file_size(response)
            if size is not None or request.method == "GET":
                transfer = _Transfer(str(request.url), size)
                if request.method == "HEAD" and size is not None:
                    _check_free_space(request.url, size, response)
                _keep(request.url, transfer)
                if request.method == "GET":
                    transfer.start_request(float(self._read_timeout()))
                    answer.transfer = transfer
                    request.extensions = {**request.extensions, _FILE: transfer}
        location = response.headers.get("Location")
        if transfer is not None and location and 300 <= status < 400:
            try:
                _keep(request.url.join(location), transfer)  # the CDN's URL: the file's size goes with it
            except Exception:  # noqa: BLE001 - a Location httpx2 cannot read: the redirect fails there
                pass
        return transfer

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> BoundedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
