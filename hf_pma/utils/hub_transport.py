"""Hub answers bounded in total: a deadline per answer and a size after decompression.

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

Torch-free; imported with ``huggingface_hub``'s HTTP client (``httpx2``), never by the CLI's parser.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpcore2
import httpx2

__all__ = [
    "MAX_ANSWER_BYTES",
    "MIN_DOWNLOAD_RATE",
    "HubAnswerTooLarge",
    "BoundedTransport",
    "bound_network_reads",
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
_HEADS_KEPT = 4096

_current = threading.local()


class HubAnswerTooLarge(ValueError):
    """A Hub answer larger than its bound (announced size or :data:`MAX_ANSWER_BYTES`) after
    decompression, or compressed in an encoding hf-pma cannot bound."""


class _Answer:
    """The deadline of one answer: ``budget`` seconds from its first read, plus one second per
    ``rate`` bytes received (downloads)."""

    def __init__(self, budget: float, rate: float | None) -> None:
        self.budget, self.rate = budget, rate
        self.started: float | None = None
        self.received = 0

    def remaining(self) -> float:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        extra = self.received / self.rate if self.rate else 0.0
        return self.started + self.budget + extra - now


class _DeadlineStream:
    """A network stream whose reads wait at most until the current answer's deadline."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        answer: _Answer | None = getattr(_current, "answer", None)
        if answer is not None:
            left = answer.remaining()
            if left <= 0:
                raise httpcore2.ReadTimeout(f"no complete answer within {answer.budget:g} s")
            timeout = left if timeout is None else min(timeout, left)
        data = self._inner.read(max_bytes, timeout)
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


def _announced_size(response: Any, encoded: bool) -> int | None:
    """The size the Hub announced for this body after decompression, if any."""
    names = ("x-linked-size",) if encoded else ("content-length", "x-linked-size")
    for name in names:
        value = response.headers.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


class _BoundedBody(httpx2.SyncByteStream):
    """A response body read under its answer's deadline, inflated when compressed, and refused past ``limit`` bytes."""

    def __init__(self, inner: Any, request: Any, answer: _Answer, limit: int, encoding: str | None) -> None:
        self._inner, self._request, self._answer = inner, request, answer
        self._limit, self._encoding = limit, encoding
        self._size = 0

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
                raise httpx2.ReadTimeout(f"no complete answer within {self._answer.budget:g} s", request=self._request)
            yield chunk

    def _count(self, data: bytes) -> bytes:
        self._size += len(data)
        if self._size > self._limit:
            raise HubAnswerTooLarge(
                f"the Hub at {self._request.url.scheme}://{self._request.url.netloc.decode('ascii', 'replace')} sent more "
                f"than {self._limit:,} bytes for {self._request.url.path} (after decompression); refused"
            )
        return data

    def __iter__(self) -> Iterator[bytes]:
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
    """An ``httpx2`` transport that bounds every answer of ``inner`` in time and size (see the
    module). ``read_timeout`` gives the deadline of an answer in seconds, read at each request."""

    def __init__(self, inner: Any, read_timeout: Any) -> None:
        self._inner = inner
        self._read_timeout = read_timeout
        self._heads: dict[str, int] = {}  # the sizes HEAD answers announced for file downloads, by URL
        bound_network_reads(inner)

    def handle_request(self, request: Any) -> Any:
        download = _is_download(request)
        # One deadline for a request and the redirects it follows (httpx2 passes the extensions on).
        answer = request.extensions.get(_ANSWER)
        if not isinstance(answer, _Answer):
            answer = _Answer(float(self._read_timeout()), MIN_DOWNLOAD_RATE if download else None)
        request.extensions = {**request.extensions, _ANSWER: answer, **({_DOWNLOAD: True} if download else {})}
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
        url = str(request.url)
        if request.method == "HEAD":
            # What the GET of the same file may send at most (a redirect's own length is not the file's).
            if announced is not None and download and response.status_code == 200:
                if len(self._heads) >= _HEADS_KEPT:
                    self._heads.clear()
                self._heads[url] = announced
        elif download and self._heads.get(url) is not None:
            # The size the HEAD announced is what transformers and huggingface_hub expect: a GET
            # announcing more (or nothing) may send no more than that; the smaller one holds.
            announced = self._heads[url] if announced is None else min(announced, self._heads[url])
        # A download may send what was announced for it; any other answer at most MAX_ANSWER_BYTES.
        limit = MAX_ANSWER_BYTES if announced is None else announced if download else min(announced, MAX_ANSWER_BYTES)
        headers = [
            (k, v) for k, v in response.headers.raw
            if encoding is None or k.lower() not in (b"content-encoding", b"content-length")
        ]
        return httpx2.Response(
            status_code=response.status_code,
            headers=headers,
            stream=_BoundedBody(response.stream, request, answer, limit, encoding),
            extensions=response.extensions,
            request=request,
        )

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> BoundedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
