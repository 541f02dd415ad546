"""How hf-pma talks to the Hugging Face Hub (or an ``HF_ENDPOINT`` mirror), and what it accepts back.

A Hub is a server hf-pma does not control: its answers are input, like a file in a run folder.

* **Timeouts.** ``huggingface_hub`` sends most API requests (``model_info``, ``list_repo_refs``)
  without any timeout, so a server that accepts the connection and never answers hangs a
  command. :func:`install_hub_client` gives ``huggingface_hub``'s shared HTTP client a connect
  and a read timeout for every request (a request that asks for a shorter one keeps it):
  ``--hub-timeout SECONDS`` (or ``CONNECT,READ``) on the commands that reach the Hub, or the
  ``HF_PMA_HUB_TIMEOUT`` environment variable; 10 s to connect and 60 s between two reads by
  default. :func:`hub_failure_line` turns a timeout into one line ("the Hub at ... did not
  answer within N s").
* **Answers bounded in total.** The client's transport (:class:`hf_pma.utils.hub_transport.BoundedTransport`)
  gives every answer a deadline (the read timeout, counted from the request sent to the last
  byte; a file download's moves on with the bytes received) and a size bound after
  decompression (the size the Hub announced, else 64 MiB): a server that sends one byte every
  half second, or a small gzip body that inflates to gigabytes, ends in one line.
* **Answers used as names.** A commit id is 40 lowercase hex characters
  (:func:`check_commit_id`), a content hash 40 (git blob) or 64 (sha256) of them
  (:func:`check_content_hash`), a file name one plain path component (:func:`check_file_name`),
  a branch or tag name a git ref name that shows as it is (:func:`check_ref_name`). Each check
  raises :class:`HubAnswerError` (a ``ValueError``: one line, the value escaped) before the
  value reaches a path, a cache look-up or a record.
* **Answers of the right type.** A repo's info, tree listing, paths-info and refs are checked
  by :func:`check_api_answer` as they arrive (the client's transport calls it, whoever asked:
  hf-pma, ``huggingface_hub``, transformers): the JSON types of the fields that
  ``huggingface_hub`` reads, else :class:`HubAnswerError` (one line) instead of a traceback.

Torch-free.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from hf_pma.utils.logs import get_logger
from hf_pma.utils.text import is_printable, shown

logger = get_logger(__name__)

__all__ = [
    "HUB_TIMEOUT_ENV",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
    "HubAnswerError",
    "parse_hub_timeout",
    "hub_timeouts",
    "set_hub_timeout",
    "install_hub_client",
    "add_hub_timeout_argument",
    "hub_failure_line",
    "check_commit_id",
    "check_content_hash",
    "check_file_name",
    "check_ref_name",
    "api_answer_check",
    "api_answer_kinds",
    "check_api_answer",
]

HUB_TIMEOUT_ENV = "HF_PMA_HUB_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0

_COMMIT = re.compile(r"[0-9a-f]{40}")
_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_MAX_NAME_BYTES = 255

_lock = threading.Lock()
_chosen: tuple[float, float] | None = None  # set by --hub-timeout / set_hub_timeout
_installed_timeouts: tuple[float, float] | None = None


class HubAnswerError(ValueError):
    """A Hub answered something hf-pma does not use: a malformed commit id, hash, file or ref name."""


# ---------------------------------------------------------------- timeouts


def parse_hub_timeout(text: Any, what: str = "hub timeout") -> tuple[float, float]:
    """``"30"`` -> ``(30.0, 30.0)``, ``"5,120"`` -> ``(5.0, 120.0)`` (connect, read), in seconds;
    a one-line ``ValueError`` naming ``what`` (``--hub-timeout`` on the command line,
    ``HF_PMA_HUB_TIMEOUT`` for the environment) for anything else (zero, negative, not a number)."""
    parts = str(text).split(",") if text is not None else []
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(
            f"{what} {shown(text)} is not a timeout: give SECONDS or CONNECT,READ seconds, each above 0 (like 30 or 5,120)"
        )
    return (values[0], values[-1])


def hub_timeouts() -> tuple[float, float]:
    """The (connect, read) timeouts in seconds of every Hub request: :func:`set_hub_timeout`'s,
    else ``HF_PMA_HUB_TIMEOUT``'s, else 10 s and 60 s."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(HUB_TIMEOUT_ENV)
    if env:
        return parse_hub_timeout(env, HUB_TIMEOUT_ENV)
    return (DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT)


def set_hub_timeout(value: float | str | tuple[float, float] | None) -> tuple[float, float]:
    """Set the (connect, read) timeouts of every Hub request of this process (``None``: back to
    ``HF_PMA_HUB_TIMEOUT`` or the defaults) and install them (:func:`install_hub_client`);
    returns them."""
    global _chosen
    if value is None:
        chosen = None
    elif isinstance(value, tuple):
        chosen = parse_hub_timeout(",".join(str(v) for v in value))
    else:
        chosen = parse_hub_timeout(value)
    with _lock:
        _chosen = chosen
    install_hub_client()
    return hub_timeouts()


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _fill_timeouts(request: Any) -> None:
    """Request hook: every phase of the request gets at most hf-pma's timeout (``None`` would wait forever)."""
    connect, read = hub_timeouts()
    limits = {"connect": connect, "read": read, "write": read, "pool": connect}
    asked = dict(request.extensions.get("timeout") or {})
    request.extensions = {
        **request.extensions,
        "timeout": {
            key: limit if asked.get(key) is None else min(asked[key], limit) for key, limit in limits.items()
        },
    }


def _client_factory() -> Any:
    import httpx2
    from huggingface_hub.utils._http import hf_request_event_hook

    from hf_pma.utils.hub_transport import BoundedTransport

    connect, read = hub_timeouts()
    client = httpx2.Client(
        event_hooks={"request": [hf_request_event_hook, _fill_timeouts]},
        follow_redirects=True,
        timeout=httpx2.Timeout(read, connect=connect, pool=connect),
        transport=BoundedTransport(httpx2.HTTPTransport(), lambda: hub_timeouts()[1], api_answer_check),
    )
    # Proxies from the environment get transports of their own: bounded the same way.
    client._mounts = {
        pattern: None if transport is None else BoundedTransport(transport, lambda: hub_timeouts()[1], api_answer_check)
        for pattern, transport in client._mounts.items()
    }
    return client


def install_hub_client() -> None:
    """Give ``huggingface_hub``'s shared HTTP client hf-pma's timeouts (:func:`hub_timeouts`),
    unless the program set a client factory of its own (``huggingface_hub.set_client_factory``),
    which is then left as it is. Idempotent; the client is rebuilt only when the timeouts change."""
    global _installed_timeouts
    from huggingface_hub.utils import _http

    timeouts = hub_timeouts()
    with _lock:
        current = _http._GLOBAL_CLIENT_FACTORY
        if current is _client_factory and _installed_timeouts == timeouts:
            return
        if current is not _http.default_client_factory and current is not _client_factory:
            logger.debug(
                "huggingface_hub has a client factory of its program's own: hf-pma's Hub timeouts are not set"
            )
            return
        _installed_timeouts = timeouts
    _http.set_client_factory(_client_factory)  # closes the shared client: the next request builds one


class _HubTimeoutAction(argparse.Action):
    """``--hub-timeout``: checked and set for the whole process when the command line is read."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Any = None,
    ) -> None:
        try:
            timeouts = set_hub_timeout(parse_hub_timeout(values, option_string or "--hub-timeout"))
        except ValueError as err:
            parser.error(str(err))
        setattr(namespace, self.dest, timeouts)


def add_hub_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """``--hub-timeout SECONDS`` (or ``CONNECT,READ``) on a command that reaches the Hub."""
    parser.add_argument(
        "--hub-timeout",
        metavar="SECONDS",
        action=_HubTimeoutAction,
        help=f"give up on a Hub request after SECONDS without an answer (or CONNECT,READ seconds; default "
        f"{DEFAULT_CONNECT_TIMEOUT:g},{DEFAULT_READ_TIMEOUT:g}; env {HUB_TIMEOUT_ENV})",
    )


def hub_failure_line(err: BaseException, endpoint: str | None = None) -> str | None:
    """One line for a Hub request that timed out ("the Hub at ENDPOINT did not answer within N s"),
    found in ``err`` or the errors it came from; ``None`` when none did."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if name.endswith("Timeout") and type(current).__module__.split(".")[0] in (
            "httpx2",
            "httpx",
            "httpcore",
        ):
            connect, read = hub_timeouts()
            where = f"the Hub at {endpoint}" if endpoint else "the Hub"
            if name == "ConnectTimeout" or name == "PoolTimeout":
                what = f"did not accept a connection within {_seconds(connect)}"
            else:
                what = f"did not answer within {_seconds(read)}"
            return f"{where} {what} (set_hub_timeout, --hub-timeout or {HUB_TIMEOUT_ENV} sets the limit)"
        current = current.__cause__ or current.__context__
    return None


# ---------------------------------------------------------------- answers used as names


def check_commit_id(value: Any, what: str) -> str:
    """``value`` if it is a full commit id (40 lowercase hex characters); ``HubAnswerError`` otherwise."""
    if not isinstance(value, str) or not _COMMIT.fullmatch(value):
        raise HubAnswerError(
            f"{what}: the Hub answered the commit id {shown(value, 80)}, which is not 40 hex characters"
        )
    return value


def check_content_hash(value: Any, what: str) -> str:
    """``value`` if it is a git blob id (40 hex) or a sha256 (64 hex); ``HubAnswerError`` otherwise."""
    if not isinstance(value, str) or not _HASH.fullmatch(value):
        raise HubAnswerError(
            f"{what}: the Hub answered the content hash {shown(value, 80)}, which is no sha1 or sha256"
        )
    return value


def check_file_name(value: Any, what: str) -> str:
    """``value`` if it is one plain file name: printable, no ``/`` or ``\\``, not ``.`` or ``..``,
    at most 255 bytes; ``HubAnswerError`` otherwise."""
    ok = (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and "/" not in value
        and "\\" not in value
        and is_printable(value)
        and len(value.encode("utf-8", "surrogatepass")) <= _MAX_NAME_BYTES
    )
    if not ok:
        raise HubAnswerError(
            f"{what}: the Hub answered the file name {shown(value, 80)}, which is not a plain file name"
        )
    return value


def check_ref_name(value: Any, what: str) -> str:
    """``value`` if it is a branch or tag name that git accepts and that shows as it is (no
    control, bidi or other invisible character); ``HubAnswerError`` otherwise."""
    from hf_pma.utils.names import check_revision_name

    try:
        if not isinstance(value, str) or not is_printable(value):
            raise ValueError("not printable")
        check_revision_name(value)
    except ValueError:
        raise HubAnswerError(
            f"{what}: the Hub answered the ref name {shown(value, 80)}, which holds a control, bidi or other "
            "character a branch or tag name cannot hold"
        ) from None
    return value


# ---------------------------------------------------------------- answers of the right type

# The API endpoints whose answers are checked: ``kind`` names the answer; a path of one
# segment more than a repo's info (``/api/models/gpt2/refs``) may be either.
_API_PATH = re.compile(
    r"/api/(?:models|datasets|spaces)/(?P<repo>[^/]+(?:/[^/]+)?)"
    r"/(?P<kind>revision|tree|paths-info|refs)(?:/(?P<rest>.*))?$"
)
_API_INFO = re.compile(r"/api/(?:models|datasets|spaces)/[^/]+(?:/[^/]+)?$")
_API_KINDS = {"revision": "info", "tree": "tree", "paths-info": "tree", "refs": "refs"}
_TEXT, _COUNT = "text", "count"


def api_answer_kinds(path: str) -> tuple[str, ...]:
    """The kinds of answer the API path ``path`` may give: ``"info"`` (a repo's info or
    revision), ``"tree"`` (a tree listing or paths-info), ``"refs"``; more than one where the
    path reads two ways (``/api/models/org/refs``: the refs of ``org``, or the info of
    ``org/refs``); ``()`` for another path."""
    found = _API_PATH.search(path)
    if found is None:
        return ("info",) if _API_INFO.search(path) else ()
    kind = _API_KINDS[found.group("kind")]
    if found.group("rest") is None and "/" not in found.group("repo"):
        return (kind, "info")  # one segment after a one-part repo: also a two-part repo's info
    return (kind,)


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "a number", float: "a number", type(None): "null"}.get(type(value), "not JSON")


def _need(value: Any, kind: Any, where: str, what: str, optional: bool = False) -> Any:
    """``value`` if it is of ``kind`` (``dict``, ``list``, :data:`_TEXT`, :data:`_COUNT`: an
    integer from 0), or ``None`` when ``optional``; ``HubAnswerError`` otherwise."""
    ok = {
        dict: isinstance(value, dict),
        list: isinstance(value, list),
        _TEXT: isinstance(value, str),
        _COUNT: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
    }[kind]
    if ok or (optional and value is None):
        return value
    wanted = {dict: "an object", list: "a list", _TEXT: "a string", _COUNT: "a byte count"}[kind]
    raise HubAnswerError(
        f"the Hub's answer to {shown(where, 120)} is malformed: {what} is {_type_name(value)}, where {wanted} "
        "belongs; refused"
    )


def _check_lfs(lfs: Any, where: str, what: str, hash_key: str) -> None:
    if _need(lfs, dict, where, what, optional=True) is not None:
        _need(lfs.get(hash_key), _TEXT, where, f"{what}.{hash_key}")
        _need(lfs.get("size"), _COUNT, where, f"{what}.size")


def _check_info(data: Any, where: str) -> None:
    _need(data, dict, where, "the repo's info")
    _need(data.get("sha"), _TEXT, where, "sha", optional=True)
    _need(data.get("lastModified"), _TEXT, where, "lastModified", optional=True)
    for i, tag in enumerate(_need(data.get("tags"), list, where, "tags", optional=True) or []):
        _need(tag, _TEXT, where, f"tags[{i}]")
    for i, item in enumerate(_need(data.get("siblings"), list, where, "siblings", optional=True) or []):
        _need(item, dict, where, f"siblings[{i}]")
        _need(item.get("rfilename"), _TEXT, where, f"siblings[{i}].rfilename")
        _need(item.get("size"), _COUNT, where, f"siblings[{i}].size", optional=True)
        _need(item.get("blobId"), _TEXT, where, f"siblings[{i}].blobId", optional=True)
        _check_lfs(item.get("lfs"), where, f"siblings[{i}].lfs", "sha256")


def _check_tree(data: Any, where: str) -> None:
    for i, item in enumerate(_need(data, list, where, "the tree listing")):
        _need(item, dict, where, f"entry {i}")
        kind = _need(item.get("type"), _TEXT, where, f"entry {i}'s type")
        _need(item.get("path"), _TEXT, where, f"entry {i}'s path")
        _need(item.get("oid"), _TEXT, where, f"entry {i}'s oid")
        if kind == "file":
            _need(item.get("size"), _COUNT, where, f"entry {i}'s size")
            _check_lfs(item.get("lfs"), where, f"entry {i}'s lfs", "oid")


def _check_refs(data: Any, where: str) -> None:
    _need(data, dict, where, "the refs")
    for group in ("branches", "tags", "converts", "pullRequests"):
        items = _need(data.get(group), list, where, group, optional=group == "pullRequests") or []
        for i, item in enumerate(items):
            _need(item, dict, where, f"{group}[{i}]")
            for key in ("name", "ref", "targetCommit"):
                _need(item.get(key), _TEXT, where, f"{group}[{i}].{key}")


_CHECKS = {"info": _check_info, "tree": _check_tree, "refs": _check_refs}


def api_answer_check(path: str) -> Callable[[Any], Any] | None:
    """The check of the parsed JSON answer at the API path ``path`` (:func:`check_api_answer`
    of its kinds), ``None`` for a path whose answers are not checked; what the client's
    transport calls for every API answer."""
    kinds = api_answer_kinds(path)
    if not kinds:
        return None
    return lambda data: check_api_answer(kinds, data, path)


def check_api_answer(kinds: tuple[str, ...], data: Any, where: str) -> Any:
    """``data`` (a parsed JSON answer of one of ``kinds``, see :func:`api_answer_kinds`) if it
    has the types ``huggingface_hub`` reads in it; :class:`HubAnswerError` naming ``where`` (the
    API path) and the first field of another type otherwise (not JSON at all included)."""
    first: HubAnswerError | None = None
    for kind in kinds:
        try:
            _CHECKS[kind](data, where)
            return data
        except HubAnswerError as err:
            first = first or err
    if first is not None:
        raise first
    return data
