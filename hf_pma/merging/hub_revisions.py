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
each revision into the ``huggingface_hub`` cache (or ``cache_dir``), after checking that
their total size (from the repo's file metadata) fits on the disk. Files already in the cache
are not fetched again, so a rerun after an interruption fetches only what is missing; an
interrupted file transfer is resumed by ``huggingface_hub`` with an HTTP range request.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hf_pma.core.manifest import MODEL_SUPPORT_FILES
from hf_pma.utils.formatting import format_bytes
from hf_pma.utils.fs import free_bytes
from hf_pma.utils.logs import get_logger

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

_HUB_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^\s@]+))?")
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# A field is delimited by the start or end of the name, or by - _ . / (so "restep3" is no step).
_FIELD = r"(?:^|(?<=[-_./])){key}[-_]?(?P<value>\d+(?:\.\d+)?)(?P<suffix>[KMBGTkmbgt])?(?=$|[-_./])"
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
    """A Hub repo or revision cannot be used: not found, no match, no weights, download failed."""


class NotEnoughDiskSpaceError(HubRevisionError):
    """The files to download do not fit in the free space of the cache folder."""


@dataclasses.dataclass
class HubFile:
    """One file of a revision, with its size and content id from the repo's metadata."""

    path: str
    size: int | None
    blob: str | None


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
    ``None`` for anything else (a local path, a bare name)."""
    if not isinstance(text, str) or text.startswith((".", "/", "~")):
        return None
    match = _HUB_SPEC.fullmatch(text)
    if match is None:
        return None
    return match.group("repo"), match.group("rev")


def is_hub_spec(text: Any) -> bool:
    """Whether ``text`` reads as ``org/model`` or ``org/model@REV``."""
    return parse_hub_spec(text) is not None


def revision_matcher(pattern: str) -> tuple[re.Pattern[str], bool]:
    """The compiled form of a ``--revisions`` pattern and whether it is a regular expression.

    ``/REGEX/`` or ``re:REGEX`` is a regular expression, searched anywhere in the name (anchor
    it with ``^...$``); anything else is a glob matched against the whole name (``step14*``,
    ``stage1-*``, ``step1[34]*``).
    """
    if not isinstance(pattern, str) or not pattern:
        raise HubRevisionError(f"--revisions needs a non-empty pattern, got {pattern!r}")
    if pattern.startswith("re:") or (len(pattern) > 2 and pattern.startswith("/") and pattern.endswith("/")):
        source = pattern[3:] if pattern.startswith("re:") else pattern[1:-1]
        try:
            return re.compile(source), True
        except re.error as err:
            raise HubRevisionError(f"--revisions {pattern!r} is not a valid regular expression: {err}") from err
    return re.compile(fnmatch.translate(pattern)), False


def parse_token_count(text: str) -> int:
    """``"4B"`` -> ``4_000_000_000``; ``K``, ``M``, ``B`` (or ``G``) and ``T`` suffixes, decimals allowed."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBGTkmbgt]?)", str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a token count (like 4194304, 1.5B or 4T)")
    return int(round(float(match.group(1)) * _SUFFIX[match.group(2).upper()]))


def _group_value(key: str, value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return parse_token_count(value) if key == "tokens" else int(value)
    except ValueError:
        return None


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

    return HfApi(endpoint=endpoint, token=token)


def _hub_error(err: Exception, repo_id: str, what: str) -> HubRevisionError:
    """A one-line error for a failed Hub request about ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(err, OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE:
        return HubRevisionError(f"cannot {what} of {repo_id}: the Hub is off (HF_HUB_OFFLINE is set)")
    if isinstance(err, GatedRepoError):
        return HubRevisionError(f"{repo_id} is gated: accept its conditions on the Hub and log in (HF_TOKEN)")
    if isinstance(err, RepositoryNotFoundError):
        return HubRevisionError(f"Hub repo {repo_id} not found (or it is private and no token gives access to it)")
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return HubRevisionError(f"cannot {what} of {repo_id}: {first_line}")


def _list_refs(api: Any, repo_id: str) -> list[tuple[str, str, str]]:
    """``(name, kind, commit)`` of every branch and tag of the repo."""
    try:
        refs = api.list_repo_refs(repo_id)
    except Exception as err:  # noqa: BLE001 - every failure becomes one clear line
        raise _hub_error(err, repo_id, "list the branches and tags") from err
    return [(r.name, "branch", r.target_commit) for r in refs.branches] + [
        (r.name, "tag", r.target_commit) for r in refs.tags
    ]


def _examples(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _select_files(repo_id: str, name: str, siblings: Sequence[Any]) -> list[HubFile]:
    """The files to fetch: safetensors weights when there are any (else ``.bin``), config, tokenizer."""

    def matching(patterns: Sequence[str]) -> list[Any]:
        return [s for s in siblings if "/" not in s.rfilename and any(fnmatch.fnmatchcase(s.rfilename, p) for p in patterns)]

    weights = matching(WEIGHT_PATTERNS) or matching(BIN_WEIGHT_PATTERNS)
    if not weights:
        raise HubRevisionError(
            f"{repo_id}@{name} holds no model weights (model.safetensors, pytorch_model.bin or their shards): "
            f"it has {_examples(sorted(s.rfilename for s in siblings)) or 'no files'}"
        )
    chosen = weights + matching(SUPPORT_PATTERNS)
    return [
        HubFile(s.rfilename, s.size, (s.lfs.sha256 if s.lfs is not None else None) or s.blob_id)
        for s in sorted(chosen, key=lambda s: s.rfilename)
    ]


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
        raise _hub_error(err, revision.repo_id, f"read revision {revision.name}") from err
    revision.commit = info.sha or revision.commit
    revision.date = info.last_modified
    revision.files = _select_files(revision.repo_id, revision.name, info.siblings or [])
    return revision


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
    return _fill(_api(endpoint, token), HubRevision(repo_id, name, **progress), default_branch=revision is None)


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
            f"--revisions regular expression to order them by their names)"
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
        raise HubRevisionError(
            f"--revisions {pattern!r} matches none of the {len(refs)} branches and tags of {repo_id} "
            f"({_examples(sorted(n for n, _, _ in refs)) or 'none'})"
        )
    by_commit: dict[str, HubRevision] = {}
    for name, _kind, commit in matched:
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
        logger.info(f"{repo_id}: {candidate.name} is the same commit as {kept.name}; using it once, as {kept.name}")
    revisions = order_revisions(list(by_commit.values()), endpoint=endpoint, token=token)
    logger.info(f"{repo_id}: {len(revisions)} revision(s) match {pattern!r}: {_examples([r.name for r in revisions])}")
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
        logger.warning(f"The Hub gives no size for {_examples(unknown)}: the disk-space check leaves them out")
    free = free_bytes(folder) or 0
    if need > free:
        repos = sorted({r.repo_id for r in revisions})
        raise NotEnoughDiskSpaceError(
            f"downloading {len(revisions)} revision(s) of {', '.join(repos)} needs {format_bytes(need)} ({need} bytes, "
            f"{count} files) in {folder} but only {format_bytes(free)} ({free} bytes) is free: free some space, pick fewer "
            f"revisions (--last) or use another --cache-dir"
        )
    return need


class _QuietTqdm(tqdm):
    """The per-file bars of ``hf_hub_download``, silenced: one bar over revisions is shown instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


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
    ``progress``: one bar over revisions (``None``: shown on terminals only).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import are_progress_bars_disabled

    revisions = list(revisions)
    api = _api(endpoint, token)
    for r in revisions:
        if r.files is None or r.commit is None:
            _fill(api, r)
    folder = _cache_dir(cache_dir)
    need = check_disk_space(revisions, folder)
    if need:
        logger.info(f"Downloading {format_bytes(need)} for {len(revisions)} revision(s) into {folder}")
    disable = True if progress is False or are_progress_bars_disabled() else (None if progress is None else False)
    bar = tqdm(revisions, desc="Downloading revisions", unit="revision", disable=disable)
    out = []
    for r in bar:
        bar.set_postfix_str(r.spec, refresh=False)
        local = None
        for f in r.files or []:
            try:
                local = hf_hub_download(
                    r.repo_id, f.path, revision=r.commit, cache_dir=str(folder), endpoint=endpoint, token=token,
                    tqdm_class=_QuietTqdm,
                )
            except Exception as err:  # noqa: BLE001 - one clear line; the cache keeps what arrived
                detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise HubRevisionError(
                    f"downloading {f.path} of {r.spec} (commit {r.commit}) failed: {detail}; run again to resume "
                    f"(files already downloaded stay in {folder})"
                ) from err
        out.append(Path(local).parent)
    bar.close()
    return out
