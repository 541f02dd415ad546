"""Push a model folder (a PMA merge, with its card) to the Hugging Face Hub through ``HfApi``.

Going through ``HfApi.create_repo`` and ``HfApi.upload_folder`` means ``HF_TOKEN``,
``HF_ENDPOINT`` and the cached login (``hf auth login``) work as everywhere else. Everything
that can be checked locally is checked before the first request: the repo id, the revision
name, the token, the folder (a complete model: config and every weight file the index names),
the records (no access token inside), and every file (none holds the token in use). A 401 or 403 from the Hub becomes a :class:`HubAuthError` that says what
to do.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from hf_pma.core.manifest import CARD_NAME, EVAL_RECORD_NAME, MERGE_RECORD_NAME, TRAINING_RECORD_NAME
from hf_pma.publishing.records import find_local_paths, find_tokens, load_records
from hf_pma.utils.fs import read_json
from hf_pma.utils.logs import get_logger
from hf_pma.utils.names import check_revision_name

logger = get_logger(__name__)

__all__ = [
    "HubAuthError",
    "HubError",
    "check_model_folder",
    "check_no_token_in_files",
    "check_repo_id",
    "resolve_token",
    "push_folder_to_hub",
]

# Temporary files of interrupted atomic writes never go to the Hub.
# (hf_pma.utils.fs names them ``.<name>.tmp-*`` / ``.<name>.deleting-*``; the others are older names).
DEFAULT_IGNORE_PATTERNS = [
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
    """``repo_id`` if it is a valid Hub repo id ("namespace/name" or "name"); a clear
    ``ValueError`` otherwise."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(
            f"invalid repo id {repo_id!r}: expected 'namespace/name', e.g. 'my-org/my-model-pma'"
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(
            f"invalid repo id {repo_id!r}: expected 'namespace/name' with letters, digits, '-', '_' and '.' ({err})"
        ) from None
    return repo_id


def _check_safetensors(path: Path) -> None:
    # The header lists every tensor's byte range: a file shorter than the last range is truncated.
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(
                f"{path.name} is truncated: its header says {header_len} bytes, the file has {size}"
            )
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path.name} is not a safetensors file: unreadable header ({err})") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise ValueError(f"{path.name} is truncated: {size} bytes, its header needs {expected}")


def check_model_folder(folder: str | os.PathLike[str]) -> list[Path]:
    """Check that ``folder`` holds a complete Transformers model and return its weight files.

    Complete means: a readable ``config.json``; a single weight file, or an index whose every
    shard exists; safetensors files not truncated. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the missing or broken file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder.name} is not a complete model folder: config.json is missing")
    if not isinstance(read_json(config), dict):
        raise ValueError(f"{config.name} in {folder.name} is not a JSON object")
    weights: list[Path] = []
    for index_name in _WEIGHT_INDEXES:
        index_path = folder / index_name
        if not index_path.is_file():
            continue
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_name} in {folder.name} has no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ValueError(
                f"{folder.name} is not a complete model: {index_name} names missing shard(s) {missing}"
            )
        weights += [folder / s for s in shards]
    weights += [folder / n for n in _WEIGHT_FILES if (folder / n).is_file()]
    if not weights:
        raise ValueError(
            f"{folder.name} is not a complete model folder: no weights (model.safetensors, an index with its "
            "shards, or pytorch_model.bin)"
        )
    for path in weights:
        if path.suffix == ".safetensors":
            _check_safetensors(path)
    return weights


def _check_no_secrets(folder: Path) -> None:
    # The records and the card are small text files written by tools: a token there would be
    # published with the model.
    for name in (CARD_NAME, MERGE_RECORD_NAME, EVAL_RECORD_NAME, TRAINING_RECORD_NAME):
        path = folder / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if find_tokens(text, flag_values=False):
            raise ValueError(
                f"{path.name} in {folder.name} contains what looks like an access token: remove it before pushing"
            )
        paths = find_local_paths(text)
        if paths:
            logger.warning(
                f"{path.name} in {folder.name} names {len(paths)} absolute local path(s); they will be public"
            )


def check_no_token_in_files(folder: str | os.PathLike[str], token: str) -> None:
    """``ValueError`` naming the first file under ``folder`` that contains ``token`` (the exact
    string, whatever its shape), read in chunks; pushes check this before the first request."""
    needle = token.encode("utf-8")
    if not needle:
        return
    overlap = len(needle) - 1
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if not path.is_file():
                continue
            tail = b""
            with open(path, "rb") as fh:
                while chunk := fh.read(_SCAN_CHUNK_BYTES):
                    window = tail + chunk
                    if needle in window:
                        shown = path.relative_to(folder)
                        raise ValueError(
                            f"{shown} in {Path(folder).name} contains the access token this push would use: "
                            "remove it (and revoke the token if it was shared) before pushing"
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

    Raises, before anything is uploaded: ``ValueError`` for an invalid repo id or revision (git's
    ref-name rules), an incomplete folder, a token inside the records, a file holding the token
    in use, or ``HF_HUB_OFFLINE`` set; ``FileNotFoundError`` for a
    missing folder; :class:`HubAuthError` without a token or when the Hub answers 401 / 403.
    """
    from huggingface_hub import HfApi
    from huggingface_hub import constants as hf_constants
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(folder)
    check_repo_id(repo_id)
    if revision is not None:
        check_revision_name(revision, "revision")
    check_model_folder(folder)
    _check_no_secrets(folder)
    token = resolve_token(token)
    if hf_constants.is_offline_mode():
        raise ValueError("HF_HUB_OFFLINE is set: huggingface_hub blocks every request; unset it to push")
    check_no_token_in_files(folder, token)

    needs_card = not (folder / CARD_NAME).is_file() and (folder / MERGE_RECORD_NAME).is_file()
    if needs_card:
        load_records(folder)  # malformed records fail here, before any request
    elif not (folder / CARD_NAME).is_file():
        logger.warning(
            f"{folder.name} has no {CARD_NAME} and no {MERGE_RECORD_NAME}: pushing it without a model card"
        )

    api = HfApi(endpoint=endpoint, token=token)
    where = f"{repo_id}" + (f" (branch {revision})" if revision else "")
    try:
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        # A bare name lands in the token owner's namespace: the card must show the full id.
        full_id = repo_url.repo_id or repo_id
        if needs_card:
            from hf_pma.publishing.card import write_model_card

            write_model_card(folder, repo_id=full_id)
        if revision is not None and not revision.startswith("refs/pr/"):
            api.create_branch(full_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=full_id,
            folder_path=folder,
            revision=revision,
            commit_message=commit_message or f"Upload {folder.name} with hf-pma",
            ignore_patterns=list(ignore_patterns)
            if ignore_patterns is not None
            else list(DEFAULT_IGNORE_PATTERNS),
        )
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
    logger.info(f"Pushed {folder.name} to {api.endpoint}/{full_id}: {info.commit_url}")
    return str(info.commit_url)
