"""Intermediate checkpoints published as revisions of one Hub repo: name, find, order, download.

Open pre-training runs publish their checkpoints as branches (or tags) of one model repo:
Pythia's ``step0`` ... ``step143000``, OLMo's ``stage1-step150-tokens1B`` or
``step1000-tokens4B``. This module turns what a user writes into those revisions:

* ``org/model@REV``: one revision (a branch, a tag or a commit id);
* ``org/model`` with a pattern (:func:`list_revisions`): the branches and tags whose name
  matches a glob (``step14*``) or a regular expression (``/^step14\\d{4}$/`` or
  ``re:^step14\\d{4}$``; found anywhere in the name unless anchored);
* the training progress each name carries (:func:`parse_progress`: ``step``, ``tokens`` with
  a ``K``/``M``/``B``/``T`` suffix, OLMo's ``stage``), or a regular expression's named groups
  ``step`` / ``tokens`` / ``stage`` for other conventions; revisions are ordered by it, and by
  commit date (with a notice) when the names carry none.

:func:`download_revisions` fetches only the weights, configuration and tokenizer files of
each revision into the ``huggingface_hub`` cache (or ``cache_dir``, same layout), after checking
that their total size (from the repo's file metadata) fits on the disk. Files already in the
cache are not fetched again, so a rerun after an interruption fetches only what is missing; an
interrupted file transfer is resumed with an HTTP range request.

The Hub's answers are input (:mod:`hf_pma.utils.hub_client`): commit ids, file names, content
hashes and ref names are checked before they name a path, a cache entry or a record; every
request has a connect and a read timeout; a download stops at the size the metadata announced
and is verified against the hash it gave (sha256 for LFS files, the git blob id for the
others) before it enters the cache. Each file is one transfer over all its requests and
redirects (:func:`hf_pma.utils.hub_transport.expect_transfer`): its resumes are bounded in
number and share one deadline.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hf_pma.core.manifest import MAX_RECORD_INT, MODEL_SUPPORT_FILES
from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.fs import free_bytes
from hf_pma.utils.hub_client import (
    HubAnswerError,
    check_commit_id,
    check_content_hash,
    check_file_name,
    check_ref_name,
    hub_failure_line,
    install_hub_client,
)
from hf_pma.utils.hub_transport import header_size
from hf_pma.utils.logs import get_logger, progress_bar
from hf_pma.utils.names import parse_hub_id
from hf_pma.utils.parsing import is_int, parameter_error
from hf_pma.utils.text import escape, shown

logger = get_logger(__name__)

__all__ = [
    "HubRevision",
    "HubRevisionError",
    "NotEnoughDiskSpaceError",
    "parse_hub_spec",
    "is_hub_spec",
    "revision_matcher",
    "parse_progress",
    "parse_token_count",
    "list_revisions",
    "resolve_revision",
    "order_revisions",
    "download_revisions",
    "DOWNLOAD_PATTERNS",
]

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# A field is delimited by the start or end of the name, or by - _ . / (so "restep3" is no step).
_FIELD = r"(?:\A|(?<=[-_./])){key}[-_]?(?P<value>\d+(?:\.\d+)?)(?P<suffix>[KMBGTkmbgt])?(?=\Z|[-_./])"
_BUILTIN = {
    "step": re.compile(_FIELD.format(key=r"(?:global_)?step")),
    "tokens": re.compile(_FIELD.format(key=r"tokens?")),
    "stage": re.compile(_FIELD.format(key=r"stage")),
}
_PROGRESS_GROUPS = ("step", "tokens", "stage")

# What a merge, an evaluation or a sweep needs from a revision: weights, configuration, tokenizer
# (and the modelling code of remote-code models, which is never run by hf-pma).
WEIGHT_PATTERNS = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
)
BIN_WEIGHT_PATTERNS = (
    "pytorch_model.bin",
    "pytorch_model-*-of-*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.bin",
)
SUPPORT_PATTERNS = (*MODEL_SUPPORT_FILES, "*.py")
DOWNLOAD_PATTERNS = WEIGHT_PATTERNS + BIN_WEIGHT_PATTERNS + SUPPORT_PATTERNS


class HubRevisionError(ValueError):
    """A Hub repo or revision cannot be used: not found, no match, no weights, download failed,
    or the Hub answered something hf-pma does not use (a malformed commit id, name or hash)."""


class NotEnoughDiskSpaceError(HubRevisionError):
    """The files to download do not fit in the free space of the cache folder."""


@dataclasses.dataclass
class HubFile:
    """One file of a revision, with its size and content id from the repo's metadata: the
    sha256 of an LFS file (``lfs``), the git blob id of the others."""

    path: str
    size: int | None
    blob: str | None
    lfs: bool = False


@dataclasses.dataclass
class HubRevision:
    """One revision of a Hub repo and the training progress its name says.

    ``name`` is the branch or tag (or the revision as the user wrote it), ``commit`` the
    commit id it resolves to; ``files`` are filled by :func:`resolve_revision` /
    :func:`download_revisions`.
    """

    repo_id: str
    name: str
    commit: str | None = None
    step: int | None = None
    tokens: int | None = None
    stage: int | None = None
    date: datetime.datetime | None = None
    files: list[HubFile] | None = None

    @property
    def spec(self) -> str:
        """``org/model@name``."""
        return f"{self.repo_id}@{self.name}"

    @property
    def record(self) -> dict[str, Any]:
        """What a merge record keeps of it: repo, revision, commit (and stage when known)."""
        out: dict[str, Any] = {"repo_id": self.repo_id, "revision": self.name, "commit": self.commit}
        if self.stage is not None:
            out["stage"] = self.stage
        return out


# ---------------------------------------------------------------- names and patterns


def parse_hub_spec(text: Any) -> tuple[str, str | None] | None:
    """``"org/model@REV"`` -> ``("org/model", "REV")``, ``"org/model"`` -> ``("org/model", None)``;
    ``None`` for anything else (a local path, a bare name): :func:`hf_pma.utils.names.parse_hub_id`."""
    return parse_hub_id(text)


def is_hub_spec(text: Any) -> bool:
    """Whether ``text`` reads as ``org/model`` or ``org/model@REV``."""
    return parse_hub_id(text) is not None


def revision_matcher(pattern: str) -> tuple[re.Pattern[str], bool]:
    """The compiled form of a ``--revisions`` pattern and whether it is a regular expression.

    ``/REGEX/`` or ``re:REGEX`` is a regular expression, searched anywhere in the name (anchor
    it with ``^...$``); anything else is a glob matched against the whole name (``step14*``,
    ``stage1-*``, ``step1[34]*``).
    """
    if not isinstance(pattern, str) or not pattern:
        raise parameter_error("revisions", f"needs a non-empty pattern, got {shown(pattern, 60)}", HubRevisionError)
    if pattern.startswith("re:") or (len(pattern) > 2 and pattern.startswith("/") and pattern.endswith("/")):
        source = pattern[3:] if pattern.startswith("re:") else pattern[1:-1]
        try:
            return re.compile(source), True
        except re.error as err:
            raise parameter_error(
                "revisions", f"{shown(pattern, 120)} is not a valid regular expression: {err}", HubRevisionError
            ) from err
    return re.compile(fnmatch.translate(pattern)), False


def parse_token_count(text: str) -> int:
    """``"4B"`` -> ``4_000_000_000``; ``K``, ``M``, ``B`` (or ``G``) and ``T`` suffixes, decimals allowed."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBGTkmbgt]?)", str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a token count (like 4194304, 1.5B or 4T)")
    return int(round(float(match.group(1)) * _SUFFIX[match.group(2).upper()]))


def _group_value(key: str, value: str | None) -> int | None:
    """A progress number from a ref name (a Hub answer), or ``None`` when it is none hf-pma can
    record: digits other than ASCII (``step１２３`` shows like ``step123``), or a value past a
    record's range (2**63 - 1: a merge's ``pma_merge.json`` could not be read back)."""
    if value is None or value == "" or not value.isascii():
        return None
    try:
        number = parse_token_count(value) if key == "tokens" else int(value)
    except ValueError:
        return None
    return number if 0 <= number <= MAX_RECORD_INT else None


def parse_progress(name: str, regex: re.Pattern[str] | None = None) -> dict[str, int | None]:
    """Training progress in a revision name: ``{"step", "tokens", "stage"}`` (``None`` when absent).

    Built in: ``step143000`` (Pythia), ``stage1-step150-tokens1B`` and ``step1000-tokens4B``
    (OLMo; tokens with ``K``/``M``/``B``/``T``). A ``regex`` with named groups ``step``,
    ``tokens`` or ``stage`` replaces the built-in rules.
    """
    if regex is not None and set(_PROGRESS_GROUPS) & set(regex.groupindex):
        match = regex.search(name)
        groups = match.groupdict() if match else {}
        return {key: _group_value(key, groups.get(key)) for key in _PROGRESS_GROUPS}
    out: dict[str, int | None] = {}
    for key, rule in _BUILTIN.items():
        match = rule.search(name)
        out[key] = _group_value(key, match.group("value") + (match.group("suffix") or "")) if match else None
    return out


# ---------------------------------------------------------------- the Hub


def _api(endpoint: str | None, token: str | bool | None) -> Any:
    from huggingface_hub import HfApi

    install_hub_client()  # timeouts on every request
    return HfApi(endpoint=endpoint, token=token)


def _hub_error(err: Exception, repo_id: str, what: str, endpoint: str | None = None) -> HubRevisionError:
    """A one-line error for a failed Hub request about ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(err, HubAnswerError):
        return HubRevisionError(str(err))
    timed_out = hub_failure_line(err, endpoint or constants.ENDPOINT)
    if timed_out is not None:
        return HubRevisionError(f"cannot {what} of {repo_id}: {timed_out}")
    if isinstance(err, OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE:
        return HubRevisionError(f"cannot {what} of {repo_id}: the Hub is off (HF_HUB_OFFLINE is set)")
    if isinstance(err, GatedRepoError):
        return HubRevisionError(f"{repo_id} is gated: accept its conditions on the Hub and log in (HF_TOKEN)")
    if isinstance(err, RepositoryNotFoundError):
        return HubRevisionError(
            f"Hub repo {repo_id} not found (or it is private and no token gives access to it)"
        )
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return HubRevisionError(f"cannot {what} of {repo_id}: {escape(first_line)}")


def _list_refs(api: Any, repo_id: str) -> list[tuple[str, str, str]]:
    """``(name, kind, commit)`` of every branch and tag of the repo whose name is a ref name that
    shows as it is (:func:`~hf_pma.utils.hub_client.check_ref_name`); the others are left out
    with a warning, their names escaped. Commit ids are checked where a ref is used."""
    try:
        refs = api.list_repo_refs(repo_id)
    except Exception as err:  # noqa: BLE001 - every failure becomes one clear line
        raise _hub_error(err, repo_id, "list the branches and tags", api.endpoint) from err
    out, refused = [], []
    for kind, items in (("branch", refs.branches), ("tag", refs.tags)):
        for r in items:
            try:
                out.append((check_ref_name(r.name, f"{repo_id}: a {kind}"), kind, r.target_commit))
            except HubAnswerError:
                refused.append(shown(r.name, 80))
    if refused:
        logger.warning(
            f"{repo_id}: left out {len(refused)} branch(es) or tag(s) whose names hold control, bidi or other "
            f"characters a ref name cannot hold: {_examples(refused)}"
        )
    return out


def _examples(names: Sequence[str], limit: int = 6) -> str:
    listed = ", ".join(escape(n) for n in names[:limit])
    return listed + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _select_files(repo_id: str, name: str, siblings: Sequence[Any]) -> list[HubFile]:
    """The files to fetch: safetensors weights when there are any (else ``.bin``), config, tokenizer."""

    def matching(patterns: Sequence[str]) -> list[Any]:
        return [
            s
            for s in siblings
            if "/" not in s.rfilename and any(fnmatch.fnmatchcase(s.rfilename, p) for p in patterns)
        ]

    for s in siblings:
        if not isinstance(s.rfilename, str):
            raise HubRevisionError(
                f"{repo_id}@{name}: the Hub answered a file name that is no text: {shown(s.rfilename, 80)}"
            )
    weights = matching(WEIGHT_PATTERNS) or matching(BIN_WEIGHT_PATTERNS)
    if not weights:
        raise HubRevisionError(
            f"{repo_id}@{name} holds no model weights (model.safetensors, pytorch_model.bin or their shards): "
            f"it has {_examples(sorted(s.rfilename for s in siblings)) or 'no files'}"
        )
    chosen = weights + matching(SUPPORT_PATTERNS)
    return [_hub_file(repo_id, name, s) for s in sorted(chosen, key=lambda s: s.rfilename)]


def _hub_file(repo_id: str, name: str, sibling: Any) -> HubFile:
    """A sibling of the repo's metadata as a file to fetch, its name, size and hash checked."""
    where = f"{repo_id}@{name}"
    path = check_file_name(sibling.rfilename, where)
    lfs = sibling.lfs is not None
    content = sibling.lfs.sha256 if lfs else sibling.blob_id
    size = sibling.lfs.size if lfs and sibling.lfs.size is not None else sibling.size
    if content is not None:
        content = check_content_hash(content, f"{where}/{path}")
        if lfs and len(content) != 64:
            raise HubRevisionError(
                f"{where}/{path}: the Hub answered an LFS sha256 of {len(content)} characters"
            )
    if size is not None and not is_int(size, 0):
        raise HubRevisionError(
            f"{where}/{path}: the Hub answered the size {shown(size, 40)}, which is no byte count"
        )
    return HubFile(path, size, content, lfs)


def _fill(api: Any, revision: HubRevision, default_branch: bool = False) -> HubRevision:
    """Resolve the revision's commit, date and files from the repo's metadata."""
    from huggingface_hub.errors import RevisionNotFoundError

    ask = revision.commit or (None if default_branch else revision.name)
    try:
        info = api.model_info(revision.repo_id, revision=ask, files_metadata=True)
    except RevisionNotFoundError as err:
        names = [n for n, _, _ in _list_refs(api, revision.repo_id)]
        raise HubRevisionError(
            f"revision {revision.name!r} not found in {revision.repo_id} "
            f"(its branches and tags: {_examples(names) or 'none'})"
        ) from err
    except Exception as err:  # noqa: BLE001
        raise _hub_error(err, revision.repo_id, f"read revision {revision.name}", api.endpoint) from err
    try:
        commit = check_commit_id(info.sha, revision.spec)
    except HubAnswerError as err:
        raise HubRevisionError(str(err)) from None
    asked = revision.commit or (revision.name if _is_commit(revision.name) else None)
    if asked is not None and commit != asked:
        raise HubRevisionError(f"{revision.spec}: asked for commit {asked}, the Hub answered commit {commit}")
    revision.commit = commit
    revision.date = info.last_modified
    revision.files = _select_files(revision.repo_id, revision.name, info.siblings or [])
    return revision


def _is_commit(text: str) -> bool:
    try:
        check_commit_id(text, "")
    except HubAnswerError:
        return False
    return True


def resolve_revision(
    repo_id: str,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> HubRevision:
    """One revision (branch, tag or commit id; ``None``: the default branch) with its commit,
    date, files and the progress its name says; ``HubRevisionError`` when it does not exist."""
    name = revision or "main"
    progress = parse_progress(name)
    return _fill(
        _api(endpoint, token), HubRevision(repo_id, name, **progress), default_branch=revision is None
    )


def order_revisions(
    revisions: Sequence[HubRevision],
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> list[HubRevision]:
    """Oldest first: by ``(stage, tokens, step)`` when every name carries tokens, else by
    ``(stage, step)`` when every name carries a step, else by commit date (with a notice)."""
    revisions = list(revisions)
    if all(r.tokens is not None for r in revisions):
        return sorted(revisions, key=lambda r: (r.stage or 0, r.tokens, r.step or 0))
    if all(r.step is not None for r in revisions):
        return sorted(revisions, key=lambda r: (r.stage or 0, r.step))
    if len(revisions) > 1:
        api = _api(endpoint, token)
        for r in revisions:
            if r.date is None:
                _fill(api, r)
        unknown = [r.name for r in revisions if r.step is None and r.tokens is None]
        logger.warning(
            f"The names of {len(unknown)} revision(s) ({_examples(unknown)}) carry no step or token count: "
            f"ordering the {len(revisions)} revisions by commit date instead (name a step/tokens group in a "
            f"revisions regular expression (revisions=, --revisions) to order them by their names)"
        )
        epoch = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
        return sorted(revisions, key=lambda r: r.date or epoch)
    return revisions


def list_revisions(
    repo_id: str,
    pattern: str = "*",
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> list[HubRevision]:
    """The branches and tags of ``repo_id`` whose name matches ``pattern``, oldest first.

    See :func:`revision_matcher` for the pattern and :func:`parse_progress` for the order. Refs
    that point to the same commit (Pythia's ``main`` and ``step143000``) count once, under the
    name that carries progress. Raises ``HubRevisionError`` when nothing matches.
    """
    regex, is_regex = revision_matcher(pattern)
    api = _api(endpoint, token)
    refs = _list_refs(api, repo_id)
    matched = [(n, k, c) for n, k, c in refs if (regex.search(n) if is_regex else regex.fullmatch(n))]
    if not matched:
        raise parameter_error(
            "revisions",
            f"{shown(pattern, 120)} matches none of the {len(refs)} branches and tags of {repo_id} "
            f"({_examples(sorted(n for n, _, _ in refs)) or 'none'})",
            HubRevisionError,
        )
    by_commit: dict[str, HubRevision] = {}
    for name, _kind, commit in matched:
        try:
            check_commit_id(commit, f"{repo_id}@{escape(name)}")
        except HubAnswerError as err:
            raise HubRevisionError(str(err)) from None
        progress = parse_progress(name, regex if is_regex else None)
        candidate = HubRevision(repo_id, name, commit, **progress)
        kept = by_commit.get(commit)
        if kept is None:
            by_commit[commit] = candidate
            continue
        has_progress = candidate.step is not None or candidate.tokens is not None
        if has_progress and kept.step is None and kept.tokens is None:
            kept, candidate = candidate, kept
            by_commit[commit] = kept
        logger.info(
            f"{repo_id}: {candidate.name} is the same commit as {kept.name}; using it once, as {kept.name}"
        )
    revisions = order_revisions(list(by_commit.values()), endpoint=endpoint, token=token)
    logger.info(
        f"{repo_id}: {len(revisions)} revision(s) match {pattern!r}: {_examples([r.name for r in revisions])}"
    )
    return revisions


# ---------------------------------------------------------------- downloads


def _cache_dir(cache_dir: str | Path | None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def _is_cached(repo_id: str, commit: str, path: str, cache_dir: Path) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, path, cache_dir=str(cache_dir), revision=commit), str)


def _missing_bytes(revisions: Sequence[HubRevision], cache_dir: Path) -> tuple[int, int, list[str]]:
    """Bytes still to download (each distinct file content once), number of such files, and
    the files whose size the metadata does not give."""
    seen: set[str] = set()
    total, count, unknown = 0, 0, []
    for r in revisions:
        for f in r.files or []:
            if _is_cached(r.repo_id, r.commit, f.path, cache_dir):
                continue
            key = f"{r.repo_id}:{f.blob or r.commit + '/' + f.path}"
            if key in seen:
                continue
            seen.add(key)
            count += 1
            if f.size is None:
                unknown.append(f"{r.spec}/{f.path}")
            else:
                total += f.size
    return total, count, unknown


def check_disk_space(revisions: Sequence[HubRevision], cache_dir: str | Path | None = None) -> int:
    """Bytes :func:`download_revisions` will fetch; ``NotEnoughDiskSpaceError`` (naming both
    numbers) when they exceed the free space of the cache folder."""
    folder = _cache_dir(cache_dir)
    need, count, unknown = _missing_bytes(revisions, folder)
    if unknown:
        logger.warning(
            f"The Hub gives no size for {_examples(unknown)}: the disk-space check leaves them out"
        )
    free = free_bytes(folder)
    if free is not None and need > free:
        repos = sorted({r.repo_id for r in revisions})
        raise NotEnoughDiskSpaceError(
            f"downloading {len(revisions)} revision(s) of {', '.join(repos)} needs {format_bytes(need)} ({need} bytes, "
            f"{count} files) in {folder} but only {format_bytes(free)} ({free} bytes) is free: free some space, pick fewer "
            f"revisions (last=, --last) or use another cache folder (cache_dir=, --cache-dir)"
        )
    return need


# A transfer that breaks off (the connection dropped) is resumed this many times in a row
# without a byte arriving before the download gives up.
_RESUMES = 5


class _DownloadRefused(HubRevisionError):
    """The Hub sent something other than the file its metadata announced: nothing of it is kept."""


def _normal_etag(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    value = value[2:] if value.startswith("W/") else value
    return value.strip('"')


def _check_response(response: Any, r: HubRevision, f: HubFile, hub_origin: tuple[str, str]) -> None:
    """The headers of every answer from the Hub itself (redirects included): the commit it
    serves is the one asked for, the ETags it names are content hashes."""
    for answer in [*response.history, response]:
        if (answer.url.scheme, answer.url.netloc.decode("ascii", "replace")) != hub_origin:
            continue  # a CDN after the Hub's redirect: its ETags are its own
        commit = answer.headers.get("X-Repo-Commit")
        if commit is not None and commit != r.commit:
            raise _DownloadRefused(
                f"downloading {f.path} of {r.spec}: the Hub serves it from commit {shown(commit, 80)}, not {r.commit}"
            )
        for header in ("X-Linked-Etag", "ETag"):
            etag = _normal_etag(answer.headers.get(header))
            if etag is not None:
                check_content_hash(etag, f"{r.spec}/{f.path} ({header})")


def _hasher(f: HubFile) -> Any:
    import hashlib

    if f.lfs:
        return hashlib.sha256()
    digest = hashlib.sha1()  # noqa: S324 - git's blob id, compared with the Hub's
    digest.update(b"blob %d\0" % f.size)
    return digest


def _fetch(
    session: Any,
    url: str,
    headers: dict[str, str],
    r: HubRevision,
    f: HubFile,
    target: Path,
    origin: tuple[str, str],
) -> None:
    """Download ``f`` into ``target`` (``<blob>.incomplete``, resumed where a run stopped): at
    most the announced size, verified against the announced hash. A refusal (more bytes than
    announced, another hash, a malformed header) removes ``target``; a transfer that broke off
    keeps it for a rerun."""
    from huggingface_hub.utils import hf_raise_for_status

    from hf_pma.utils.hub_transport import HubTransferRefused, expect_transfer

    size = f.size
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(target, flags, 0o644)
    try:
        with os.fdopen(fd, "r+b") as out:
            digest = _hasher(f)
            have = 0
            if os.fstat(out.fileno()).st_size > size:
                out.truncate(0)
            for block in iter(lambda: out.read(1 << 20), b""):  # resume: the bytes of an earlier run count
                digest.update(block)
                have += len(block)
            stalls = 0
            # One transfer, whatever requests it takes: the size, a number of resumes and one
            # deadline bound it in all (a Hub answering 16 bytes at a time is not resumed forever).
            expect_transfer(url, size)
            while have < size:
                asked = dict(headers, Range=f"bytes={have}-") if have else headers
                before = have
                try:
                    with session.stream("GET", url, headers=asked, follow_redirects=True) as response:
                        _check_response(response, r, f, origin)
                        hf_raise_for_status(response)
                        if have and response.status_code != 206:  # the server ignored the range: start over
                            out.seek(0)
                            out.truncate(0)
                            digest, have = _hasher(f), 0
                        length = header_size(response.headers.get("Content-Length"))
                        plain = response.headers.get("Content-Encoding", "identity") == "identity"
                        if plain and length is not None and have + length > size:
                            raise _DownloadRefused(
                                f"downloading {f.path} of {r.spec}: the Hub announces {have + length} bytes, "
                                f"its metadata {size}"
                            )
                        for chunk in response.iter_bytes():
                            if have + len(chunk) > size:
                                raise _DownloadRefused(
                                    f"downloading {f.path} of {r.spec}: the Hub sent more than the {size} bytes "
                                    "its metadata announced"
                                )
                            out.write(chunk)
                            digest.update(chunk)
                            have += len(chunk)
                except _DownloadRefused:
                    raise
                except HubTransferRefused as err:
                    raise _DownloadRefused(f"downloading {f.path} of {r.spec}: {err}") from None
                except Exception as err:  # noqa: BLE001 - a transfer that broke off is resumed
                    if type(err).__name__ not in ("RemoteProtocolError", "ReadError"):
                        raise
                stalls = 0 if have > before else stalls + 1
                if have < size and stalls > _RESUMES:
                    raise HubRevisionError(
                        f"downloading {f.path} of {r.spec}: the Hub ended the transfer at {have} of {size} bytes"
                    )
            if f.blob is not None and digest.hexdigest() != f.blob:
                raise _DownloadRefused(
                    f"downloading {f.path} of {r.spec}: its content does not match the "
                    f"{'sha256' if f.lfs else 'git blob id'} the Hub's metadata gives ({f.blob}); nothing of it is kept"
                )
    except (_DownloadRefused, HubAnswerError):
        target.unlink(missing_ok=True)
        raise


def _place(blob: Path, pointer: Path) -> None:
    """The snapshot's entry for a blob: a relative link, as ``huggingface_hub`` makes (a copy
    where links are not allowed)."""
    import shutil

    pointer.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(pointer):
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:
        shutil.copyfile(blob, pointer)


def _download_file(session: Any, api: Any, r: HubRevision, f: HubFile, folder: Path) -> Path:
    """One file of a revision into the cache (``models--org--name/blobs/<hash>``, linked from
    ``snapshots/<commit>/<name>``); its snapshot path. Skipped when already there."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    storage = folder / _repo_folder(r.repo_id)
    pointer = storage / "snapshots" / r.commit / f.path
    if pointer.is_file():
        return pointer
    if f.size is None or f.blob is None:
        raise _DownloadRefused(
            f"downloading {f.path} of {r.spec}: the Hub's metadata gives no {'size' if f.size is None else 'hash'} "
            "for it, so its transfer cannot be bounded and verified"
        )
    blob = storage / "blobs" / f.blob
    lock = folder / ".locks" / storage.name / f"{f.blob}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if not (blob.is_file() and not blob.is_symlink() and blob.stat().st_size == f.size):
            url = hf_hub_url(r.repo_id, f.path, revision=r.commit, endpoint=api.endpoint)
            split = urlsplit(api.endpoint)
            target = blob.with_name(blob.name + ".incomplete")
            _fetch(
                session, url, build_hf_headers(token=api.token), r, f, target, (split.scheme, split.netloc)
            )
            os.replace(target, blob)
        _place(blob, pointer)
    return pointer


def download_revisions(
    revisions: Sequence[HubRevision],
    *,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    progress: bool | None = None,
) -> list[Path]:
    """Download the weights, configuration and tokenizer files of each revision; return each
    revision's snapshot folder in the ``huggingface_hub`` cache (same order).

    Files are fetched by commit id (a branch that moves meanwhile changes nothing), after the
    disk-space check of :func:`check_disk_space`; files already cached are not fetched again.
    Each transfer stops at the size the repo's metadata announced and is verified against the
    hash it gave before it enters the cache (one-line ``HubRevisionError`` otherwise, nothing
    kept); a transfer that broke off is resumed with a range request.
    ``progress``: one bar over revisions (``None``: shown on terminals only).
    """
    from huggingface_hub.utils import are_progress_bars_disabled, get_session

    revisions = list(revisions)
    api = _api(endpoint, token)
    for r in revisions:
        if r.files is None or r.commit is None:
            _fill(api, r)
    folder = _cache_dir(cache_dir)
    need = check_disk_space(revisions, folder)
    if need:
        logger.info(f"Downloading {format_bytes(need)} for {len(revisions)} revision(s) into {folder}")
    disable = (
        True if progress is False or are_progress_bars_disabled() else (None if progress is None else False)
    )
    bar = progress_bar(revisions, desc="Downloading revisions", unit="revision", disable=disable)
    session = get_session()
    out = []
    for r in bar:
        bar.set_postfix_str(r.spec, refresh=False)
        check_commit_id(r.commit, r.spec)
        for f in r.files or []:
            check_file_name(f.path, r.spec)
            try:
                _download_file(session, api, r, f, folder)
            except _DownloadRefused:
                raise
            except HubAnswerError as err:
                raise HubRevisionError(f"downloading {f.path} of {r.spec}: {err}") from None
            except Exception as err:  # noqa: BLE001 - one clear line; the cache keeps what arrived
                detail = hub_failure_line(err, api.endpoint)
                if detail is None:
                    detail = (
                        escape(str(err).strip().splitlines()[0]) if str(err).strip() else type(err).__name__
                    )
                raise HubRevisionError(
                    f"downloading {f.path} of {r.spec} (commit {r.commit}) failed: {detail}; run again to resume "
                    f"(files already downloaded stay in {folder})"
                ) from err
        out.append(folder / _repo_folder(r.repo_id) / "snapshots" / r.commit)
    bar.close()
    return out


def _repo_folder(repo_id: str) -> str:
    """The cache folder name of a model repo (``models--org--name``)."""
    from huggingface_hub.file_download import repo_folder_name

    return repo_folder_name(repo_id=repo_id, repo_type="model")
