"""The checks ``hf-pma eval`` makes before it evaluates anything: every model names a readable
local folder (with a tokenizer) or a model the Hub has. Torch-free, so that a mistyped name is
one line at once, before torch and transformers are imported (:mod:`hf_pma.commands.eval`)."""

from __future__ import annotations

import os
from pathlib import Path

from hf_pma.core.manifest import EVAL_RECORD_NAME, MANIFEST_NAME, PMA_SUBDIR
from hf_pma.utils.fs import check_output_file
from hf_pma.utils.names import looks_local

__all__ = ["check_hub_model", "check_record_folder", "hub_model_folder", "resolve_model"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)
# Hub models that check_hub_model found in this process (the command checks before the evaluator does).
_FOUND_ON_HUB: set[tuple[str, str]] = set()
# Their folders in the cache, once downloaded by hub_model_folder.
_HUB_FOLDERS: dict[tuple[str, str], str] = {}


def _find_tokenizer_folder(folder: Path) -> Path | None:
    # A snapshot (<run>/pma/snapshot-N) often holds weights only: look in the run folder too.
    for candidate in (folder, folder.parent, folder.parent.parent):
        if any((candidate / name).is_file() for name in _TOKENIZER_FILES):
            return candidate
    return None


def _check_model_folder(path: Path) -> None:
    from hf_pma.io.sharded import sharded_weight_files
    from hf_pma.merging.sources import find_weight_files

    if not path.is_dir():
        raise ValueError(f"model {path} is a file: give the model folder that holds it")
    weights = find_weight_files(path)
    if weights is None and sharded_weight_files(path) is not None:  # a sharded snapshot
        weights = ("model", sharded_weight_files(path))
    if (path / "config.json").is_file() and weights is not None and weights[0] == "model":
        return
    if (path / MANIFEST_NAME).is_file() or (path / PMA_SUBDIR / MANIFEST_NAME).is_file():
        raise ValueError(
            f"model {path} is a PMA run folder, not a model: evaluate its snapshots (pma/snapshot-*) or merge "
            f"(pma/merged) instead"
        )
    missing = [
        what
        for what, ok in (("config.json", (path / "config.json").is_file()), ("weights", weights))
        if not ok
    ]
    raise FileNotFoundError(f"model folder {path} is not readable: no {' and no '.join(missing)} in it")


def resolve_model(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    find_tokenizer: bool = True,
) -> tuple[str, str | None]:
    """(model name, tokenizer name) after checking that a local model folder is readable and holds
    (or sits in a run folder that holds) a tokenizer, or that the Hub has the model; one-line
    ``FileNotFoundError`` / ``ValueError`` / ``ConnectionError`` otherwise."""
    path = Path(model)
    if path.exists():
        _check_model_folder(path)
        if tokenizer is None and find_tokenizer:
            found = _find_tokenizer_folder(path)
            if found is None:
                raise FileNotFoundError(
                    f"no tokenizer in model folder {path} (nor in its parent folders): pass one with --tokenizer"
                )
            tokenizer = found
        return str(path), None if tokenizer is None else str(tokenizer)
    if looks_local(model):
        raise FileNotFoundError(f"model folder {model} does not exist")
    folder = hub_model_folder(str(model))  # a Hub model id: one request now, not a loader's retries
    if tokenizer is not None and not Path(tokenizer).exists():
        if looks_local(tokenizer):
            raise FileNotFoundError(f"tokenizer folder {tokenizer} does not exist")
        if str(tokenizer) != str(model):
            check_hub_model(str(tokenizer))
    return folder, str(tokenizer or folder)


def hub_model_folder(name: str) -> str:
    """The local folder of the Hub model ``name`` (its default branch), downloaded into the
    Hugging Face cache through the checked path of :func:`hf_pma.merging.hub_revisions.download_revisions`
    (commit id, file names and hashes checked, sizes bounded, contents verified) after
    :func:`check_hub_model`; ``name`` itself with ``HF_HUB_OFFLINE`` (the loader reads the cache)."""
    from huggingface_hub import HfApi, constants

    check_hub_model(name)
    if constants.HF_HUB_OFFLINE:
        return name
    key = (HfApi().endpoint, name)
    if key not in _HUB_FOLDERS:
        from hf_pma.merging.hub_revisions import download_revisions, resolve_revision

        revision = resolve_revision(name, endpoint=key[0])
        _HUB_FOLDERS[key] = str(download_revisions([revision], endpoint=key[0], progress=False)[0])
    return _HUB_FOLDERS[key]


def check_hub_model(name: str) -> None:
    """Check that the Hub (``HF_ENDPOINT``) has the model ``name``, or that the Hugging Face cache
    holds it, with one request (no retries); one-line errors: ``FileNotFoundError`` when it has
    no such model, ``ConnectionError`` when it cannot be reached and the cache does not hold it,
    or it answers another error (HTTP 5xx)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    from hf_pma.utils.hub_client import hub_failure_line, install_hub_client

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    install_hub_client()  # timeouts on every request
    api = HfApi()
    if (api.endpoint, name) in _FOUND_ON_HUB:
        return
    where = f"the Hub at {api.endpoint}"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"{name} is not a local folder, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
        )
    try:
        api.model_info(name)
        _FOUND_ON_HUB.add((api.endpoint, name))
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{name} is neither a local folder nor a model on {where} (or it is private and no token gives access)"
        ) from None
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        raise ConnectionError(
            f"{where} answered HTTP {status} for model {name}: {_first_line(err)}"
        ) from None
    except Exception as err:  # noqa: BLE001 - a network failure: one line
        timed_out = hub_failure_line(err, api.endpoint)
        if timed_out is not None:
            raise ConnectionError(f"{name} is not a local folder, and {timed_out}") from None
        raise ConnectionError(
            f"{name} is not a local folder, and {where} cannot be reached ({_first_line(err)}); check the name, "
            "the network or HF_ENDPOINT"
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_record_folder(folder: str | os.PathLike[str]) -> Path:
    """The ``pma_eval.json`` that evaluation results will be recorded in, inside ``folder``,
    checked before anything is evaluated: ``FileNotFoundError`` when ``folder`` is not a folder,
    ``FileExistsError`` / ``PermissionError`` when the record cannot be written there (a link, a
    folder, a read-only folder; see :func:`hf_pma.utils.fs.check_output_file`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--record folder {folder} does not exist")
    path = folder / EVAL_RECORD_NAME
    check_output_file(path, "--record")
    return path
