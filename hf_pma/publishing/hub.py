"""Push a model folder (a PMA merge, with its card) to the Hugging Face Hub through ``HfApi``.

Going through ``HfApi.create_repo`` and ``HfApi.create_commit`` means ``HF_TOKEN``,
``HF_ENDPOINT`` and the cached login (``hf auth login``) work as everywhere else. Everything
that can be checked locally is checked before the first request: the repo id, the revision
name, the token, the folder (a complete model: config and every weight file the index names),
what is uploaded (exactly the regular files inside the folder: a symbolic link that leaves it,
a FIFO, a socket or a device stops the push), the records (valid, and no access token inside)
and the card (rendered from them), and every file (none holds the token in use). A 401 or 403
from the Hub becomes a :class:`HubAuthError` that says what to do.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from hf_pma.core.manifest import (
    CARD_NAME,
    EVAL_RECORD_NAME,
    MERGE_RECORD_NAME,
    PLOT_NAME,
    TRAINING_RECORD_NAME,
)
from hf_pma.io.guarded import (
    JSON_LIMITS,
    SourceChangedError,
    check_one_version,
    open_file,
    opened,
    pin_folder,
    read_bytes,
    read_json,
    reads_one_version,
    regular_files,
)
from hf_pma.io.safetensors import SafetensorsReader
from hf_pma.io.sharded import sharded_weight_files
from hf_pma.publishing.records import find_local_paths, find_tokens, load_records
from hf_pma.utils.fs import check_output_file, read_claim, restore_interrupted
from hf_pma.utils.hub_client import install_hub_client
from hf_pma.utils.limits import allow_open_files
from hf_pma.utils.logs import get_logger
from hf_pma.utils.names import check_revision_name, is_hub_id
from hf_pma.utils.text import command_line, escape, shown

logger = get_logger(__name__)

__all__ = [
    "HubAuthError",
    "HubError",
    "check_model_folder",
    "check_no_token_in_files",
    "check_repo_id",
    "files_to_push",
    "resolve_token",
    "push_folder_to_hub",
]

# Temporary files of interrupted atomic writes never go to the Hub.
# (hf_pma.utils.fs names them ``.<name>.tmp-*`` / ``.<name>.deleting-*``; the others are older names).
# Nor does what huggingface_hub's own upload_folder leaves out (.git, .cache/huggingface).
DEFAULT_IGNORE_PATTERNS = [
    ".git",
    ".git/*",
    "*/.git/*",
    ".cache/huggingface/*",
    "*/.cache/huggingface/*",
    ".*.tmp-*",
    "**/.*.tmp-*",
    ".*.deleting-*",
    "**/.*.deleting-*",
    "*.tmp",
    "**/*.tmp",
    ".deleting-*",
    ".deleting-*/**",
]
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SCAN_CHUNK_BYTES = 1 << 22
_LOGIN_HELP = "set the HF_TOKEN environment variable, run `hf auth login`, or pass token="


class HubAuthError(PermissionError):
    """No token, or the Hub refused it (HTTP 401 / 403)."""


class HubError(ConnectionError):
    """The Hub failed a request for another reason (HTTP 5xx, 404, a network error): one line."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is a valid Hub repo id ("namespace/name" or "name", as
    :func:`hf_pma.utils.names.is_hub_id` reads it); a one-line ``ValueError`` otherwise."""
    if not is_hub_id(repo_id, bare=True):
        raise ValueError(
            f"invalid repo id {shown(repo_id, 120)}: expected 'namespace/name' (e.g. 'my-org/my-model-pma') "
            "with letters, digits, '-', '_' and '.', no '--' or '..', at most 96 characters a part"
        )
    return repo_id


def _check_safetensors(path: Path, folder: Path) -> None:
    # The reader validates the header (every tensor's byte range inside the file: a truncated
    # file fails here) through the one way in (confined, regular file).
    with SafetensorsReader(path, folder):
        pass


def check_model_folder(folder: str | os.PathLike[str]) -> list[Path]:
    """Check that ``folder`` holds a complete Transformers model and return its weight files.

    Complete means: a readable ``config.json``; a single weight file, or an index whose every
    shard exists; safetensors files not truncated. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the missing or broken file.
    """
    folder = Path(folder)
    restore_interrupted(folder)  # a merge --overwrite killed midway: its new folder goes in place first
    if not folder.is_dir():
        raise FileNotFoundError(f"{escape(folder)} is not a folder")
    # A dangling or outside link counts as present: the guarded reader then says what is wrong with it.
    present = {n for n in ("config.json", *_WEIGHT_INDEXES, *_WEIGHT_FILES) if os.path.lexists(folder / n)}
    if "config.json" not in present:
        raise ValueError(f"{escape(folder.name)} is not a complete model folder: config.json is missing")
    if not isinstance(read_json(folder / "config.json", folder, kind="config"), dict):
        raise ValueError(f"config.json in {escape(folder.name)} is not a JSON object")
    weights: list[Path] = []
    for index_name in _WEIGHT_INDEXES:
        if index_name not in present:
            continue
        index = read_json(folder / index_name, folder, kind="index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_name} in {escape(folder.name)} has no weight_map")
        shards = sorted({str(v) for v in weight_map.values()})
        missing = [s for s in shards if not os.path.lexists(folder / s)]
        if missing:
            raise ValueError(
                f"{escape(folder.name)} is not a complete model: {index_name} names missing shard(s) "
                f"{escape(missing[:5])}"
            )
        weights += [folder / s for s in shards]
    weights += [folder / n for n in _WEIGHT_FILES if n in present]
    if not weights and sharded_weight_files(folder):
        # A sharded snapshot or online average (one file per rank): transformers cannot load it from the Hub.
        raise ValueError(
            f"{escape(folder.name)} is a sharded folder (one weight file per rank, as FSDP and ZeRO-3 runs write): "
            f"`{command_line(['hf-pma', 'consolidate', folder, '-o', 'FULL'])}` makes a model folder to push"
        )
    if not weights:
        raise ValueError(
            f"{escape(folder.name)} is not a complete model folder: no weights (model.safetensors, an index with "
            "its shards, or pytorch_model.bin)"
        )
    for path in weights:
        if path.suffix == ".safetensors":
            _check_safetensors(path, folder)
    return weights


def _ignored(relative: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(relative, p) for p in patterns)


def files_to_push(folder: str | os.PathLike[str], ignore_patterns: Sequence[str] | None = None) -> list[str]:
    """The files a push of ``folder`` uploads, as POSIX paths relative to it, sorted: every regular
    file inside it (a symbolic link to a file inside is uploaded under its own name with the
    bytes of the file it names), less those matching ``ignore_patterns`` (default
    :data:`DEFAULT_IGNORE_PATTERNS`: hf-pma's temporaries, ``.git``).

    :class:`hf_pma.io.guarded.UnsafeFileError` (a ``ValueError``, one line naming the entry) when
    the folder holds a symbolic link that leads outside it (to ``/etc/passwd``, a key, a cached Hub
    login) or nowhere, a FIFO, a socket or a device, or a name with a control character: nothing is
    pushed then, whatever the ignore patterns say.
    """
    patterns = list(DEFAULT_IGNORE_PATTERNS if ignore_patterns is None else ignore_patterns)
    return [rel.as_posix() for rel in regular_files(folder) if not _ignored(rel.as_posix(), patterns)]


def _check_no_secrets(folder: Path, files: Sequence[str]) -> None:
    # The records and the card are small text files written by tools: a token there would be
    # published with the model.
    for name in (CARD_NAME, MERGE_RECORD_NAME, EVAL_RECORD_NAME, TRAINING_RECORD_NAME):
        if name not in files:
            continue
        limit = JSON_LIMITS["trainer_state"] if name == TRAINING_RECORD_NAME else JSON_LIMITS["record"]
        text = read_bytes(folder / name, folder, max_bytes=limit).decode("utf-8", errors="replace")
        if find_tokens(text, flag_values=False):
            raise ValueError(
                f"{name} in {escape(folder.name)} contains what looks like an access token: remove it before "
                "pushing"
            )
        paths = find_local_paths(text)
        if paths:
            logger.warning(
                f"{name} in {escape(folder.name)} names {len(paths)} absolute local path(s); they will be public"
            )


def check_no_token_in_files(
    folder: str | os.PathLike[str], token: str, files: Sequence[str] | None = None
) -> None:
    """``ValueError`` naming the first file under ``folder`` that contains ``token`` (the exact
    string, whatever its shape), read in chunks; pushes check this before the first request.
    ``files`` (paths relative to ``folder``) default to :func:`files_to_push` with no pattern
    left out."""
    needle = token.encode("utf-8")
    if not needle:
        return
    folder = Path(folder)
    overlap = len(needle) - 1
    for relative in files if files is not None else files_to_push(folder, ()):
        tail = b""
        with opened(folder / relative, folder) as fd:
            while chunk := os.read(fd, _SCAN_CHUNK_BYTES):
                window = tail + chunk
                if needle in window:
                    raise ValueError(
                        f"{escape(relative)} in {escape(folder.name)} contains the access token this push would "
                        "use: remove it (and revoke the token if it was shared) before pushing"
                    )
                tail = window[-overlap:] if overlap else b""


def resolve_token(token: str | None = None) -> str:
    """``token``, else the one ``huggingface_hub`` finds (``HF_TOKEN``, then the cached login);
    a :class:`HubAuthError` saying how to log in when there is none."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubAuthError(f"no Hugging Face token found: {_LOGIN_HELP}")
    return token


def _http_status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def _check_uploaded_one_version(commit_url: str) -> None:
    """A file changed while it was uploaded: the commit is made, and may mix two versions; say
    which, in one line, for the user to push again."""
    try:
        check_one_version()
    except SourceChangedError as err:
        raise SourceChangedError(f"{err} (the commit {commit_url} may hold a mix of both: push again)") from None


@reads_one_version
def push_folder_to_hub(
    folder: str | os.PathLike[str],
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    *,
    ignore_patterns: Sequence[str] | None = None,
) -> str:
    """Upload a model folder to the Hub repo ``repo_id`` and return the commit's URL.

    The repo is created when needed (``private`` applies to a new repo only; a bare name goes to
    the token owner's namespace); ``revision`` is a branch, created from ``main`` when missing.
    When the folder has no ``README.md`` and is a PMA merge (``pma_merge.json``), its card (and
    plot) is written into it before the upload, with the repo's full id. ``token`` defaults to
    ``HF_TOKEN`` or the cached login; ``endpoint`` to ``HF_ENDPOINT`` or the public Hub.

    Exactly the regular files inside the folder are uploaded (:func:`files_to_push`), each read
    through :func:`hf_pma.io.guarded.open_file`; ``ignore_patterns`` (default
    :data:`DEFAULT_IGNORE_PATTERNS`) leaves some out. The folder is read as one version
    (:func:`hf_pma.io.guarded.one_version`): a file changed after it was checked is refused,
    naming it, before the commit (and named after it when it changed during the upload).

    Raises, before any request: ``ValueError`` for an invalid repo id or revision (git's ref-name
    rules), an incomplete folder, a symbolic link leading outside the folder or a special file
    in it (:class:`hf_pma.io.guarded.UnsafeFileError`), a malformed record or a card that cannot
    be rendered from them, a token inside the records, a file holding the token in use, or
    ``HF_HUB_OFFLINE`` set; ``FileNotFoundError`` for a missing folder; ``FileExistsError`` /
    ``PermissionError`` when the card cannot be written into the folder; :class:`HubAuthError`
    without a token or when the Hub answers 401 / 403.
    """
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub import constants as hf_constants
    from huggingface_hub.errors import HfHubHTTPError

    from hf_pma.publishing.card import build_model_card, write_model_card

    folder = Path(folder)
    check_repo_id(repo_id)
    if revision is not None:
        check_revision_name(revision, "revision")
    pin_folder(folder, tree=True)  # every file checked below is the version uploaded, or refused
    check_model_folder(folder)
    patterns = list(DEFAULT_IGNORE_PATTERNS if ignore_patterns is None else ignore_patterns)
    files = files_to_push(folder, patterns)  # links out of the folder, FIFOs, devices: refused here

    # Every record is read and checked, and the card rendered from them, before any request.
    needs_card = CARD_NAME not in files and MERGE_RECORD_NAME in files
    if any(name in files for name in (MERGE_RECORD_NAME, EVAL_RECORD_NAME, TRAINING_RECORD_NAME)):
        records = load_records(folder, require_merge=False)
        if needs_card:
            build_model_card(folder, repo_id=repo_id, records=records)
            check_output_file(folder / CARD_NAME, "the model card", record=True)
            check_output_file(folder / PLOT_NAME, "the training plot", record=True)
    if CARD_NAME not in files and not needs_card:
        logger.warning(
            f"{escape(folder.name)} has no {CARD_NAME} and no {MERGE_RECORD_NAME}: pushing it without a model card"
        )
    _check_no_secrets(folder, files)
    token = resolve_token(token)
    if hf_constants.is_offline_mode():
        raise ValueError("HF_HUB_OFFLINE is set: huggingface_hub blocks every request; unset it to push")
    check_no_token_in_files(folder, token, files)

    install_hub_client()  # connect and read timeouts on every request (HF_PMA_HUB_TIMEOUT)
    api = HfApi(endpoint=endpoint, token=token)
    where = f"{repo_id}" + (f" (branch {revision})" if revision else "")
    stack = contextlib.ExitStack()
    handles: dict[str, BinaryIO] = {}

    def open_handles(names: Sequence[str]) -> None:
        for relative in names:
            if relative not in handles:
                handles[relative] = stack.enter_context(os.fdopen(open_file(folder / relative, folder), "rb"))

    # Every file is opened (and held open until the commit) before any request: a folder with
    # more files than this process may open is one line here, not a repo created and left empty.
    allow_open_files(len(files), f"{escape(folder)} holds {len(files):,} files to push", "push fewer files")
    try:
        # Opened under the folder's shared claim: one version of it, even if a merge replaces it.
        with read_claim(folder, what="folder to push"):
            open_handles([f for f in files if not (needs_card and f in (CARD_NAME, PLOT_NAME))])
    except BaseException:
        stack.close()
        raise
    try:
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        # A bare name lands in the token owner's namespace: the card must show the full id.
        full_id = repo_url.repo_id or repo_id
        if needs_card:
            write_model_card(folder, repo_id=full_id)
            files = files_to_push(folder, patterns)
            check_no_token_in_files(folder, token, [f for f in files if f in (CARD_NAME, PLOT_NAME)])
            open_handles(files)
        if revision is not None and not revision.startswith("refs/pr/"):
            api.create_branch(full_id, branch=revision, exist_ok=True)
        operations = [
            CommitOperationAdd(path_in_repo=relative, path_or_fileobj=handles[relative]) for relative in files
        ]
        check_one_version()  # hashed above: still the version checked, or no commit
        info = api.create_commit(
            repo_id=full_id,
            operations=operations,
            commit_message=commit_message or f"Upload {folder.name} with hf-pma",
            revision=revision,
        )
        _check_uploaded_one_version(info.commit_url)
    except HfHubHTTPError as err:
        status = _http_status(err)
        if status == 401:
            raise HubAuthError(
                f"the Hub at {api.endpoint} rejected the token (HTTP 401) while pushing to {where}: it is invalid "
                f"or expired; {_LOGIN_HELP}"
            ) from None
        if status == 403:
            raise HubAuthError(
                f"the Hub at {api.endpoint} refused to write to {where} (HTTP 403): the token has no write access "
                "to this namespace or repo; use a token with the 'write' role"
            ) from None
        raise HubError(
            f"the Hub at {api.endpoint} failed while pushing to {where}: {_first_line(err)}"
        ) from None
    finally:
        stack.close()
    logger.info(f"Pushed {folder.name} to {api.endpoint}/{full_id}: {info.commit_url}")
    return str(info.commit_url)
