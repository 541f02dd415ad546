"""The checks ``hf-pma eval`` makes before it evaluates anything: every model names a readable
local folder (with a tokenizer) or a model the Hub has. Torch-free, so that a mistyped name is
one line at once, before torch and transformers are imported (:mod:`hf_pma.commands.eval`).

No code from a folder runs: a model or tokenizer folder whose ``config.json`` or
``tokenizer_config.json`` names custom code (``auto_map``) is refused here
(:func:`check_no_custom_code`), and every load passes ``trust_remote_code=False``
(:data:`LOAD_KWARGS`), so transformers neither asks on standard input nor imports the folder's
Python. The JSON files a load reads are read first through the bounded reader
(:func:`hf_pma.io.guarded.read_json`), and the files it opens must be regular files inside
the folder (:func:`check_loadable_folder`)."""

from __future__ import annotations

import os
from pathlib import Path

from hf_pma.core.manifest import EVAL_RECORD_NAME, MANIFEST_NAME, PMA_SUBDIR, tokenizer_candidates
from hf_pma.io.guarded import check_file, read_json
from hf_pma.io.safetensors import SafetensorsReader
from hf_pma.utils.fs import check_output_file, restore_interrupted
from hf_pma.utils.names import looks_local
from hf_pma.utils.text import escape

__all__ = [
    "LOAD_KWARGS",
    "CustomCodeError",
    "check_hub_model",
    "check_loadable_folder",
    "check_no_custom_code",
    "check_record_folder",
    "custom_code_error",
    "hub_model_folder",
    "resolve_model",
]

# What every from_pretrained / AutoConfig / AutoTokenizer load of hf-pma passes: never run code
# from a folder or a Hub repo (left at None, transformers asks on standard input, and "y" runs it).
LOAD_KWARGS: dict[str, bool] = {"trust_remote_code": False}
# The JSON files a config or tokenizer load parses, and the other files it may open.
_CODE_DECLARING_FILES = ("config.json", "tokenizer_config.json")
_LOADED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "chat_template.jinja",
)
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# The suffixes of the files a model, config or tokenizer load may read, whatever their names
# (vocab.txt, source.spm, sentencepiece.bpe.model, tokenizer.tiktoken, bpe.codes, ...).
_LOADABLE_SUFFIXES = (
    ".json",
    ".txt",
    ".model",
    ".spm",
    ".jinja",
    ".tiktoken",
    ".bpe",
    ".codes",
    ".vocab",
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".msgpack",
    ".h5",
)

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
    for candidate in tokenizer_candidates(folder):
        if any((candidate / name).is_file() for name in _TOKENIZER_FILES):
            return candidate
    return None


class CustomCodeError(ValueError):
    """A model or tokenizer that needs custom code (``auto_map``): hf-pma does not run it."""


def _custom_code_line(where: str) -> str:
    return (
        f"{where} needs custom code (auto_map) that hf-pma does not run: it loads only models and "
        "tokenizers that transformers itself implements"
    )


def custom_code_error(name: str, err: BaseException) -> CustomCodeError | None:
    """The one-line :class:`CustomCodeError` for a transformers load of ``name`` that failed
    because it needs custom code (transformers asks for ``trust_remote_code=True``), else ``None``."""
    if "trust_remote_code" not in str(err):
        return None
    return CustomCodeError(_custom_code_line(f"model {escape(name)}"))


def check_no_custom_code(folder: str | os.PathLike[str]) -> None:
    """Refuse, in one line (:class:`CustomCodeError`), a model or tokenizer folder whose
    ``config.json`` or ``tokenizer_config.json`` declares custom code (``auto_map``). Both are
    read through the bounded reader: a file nested too deep, truncated or linked out of the
    folder is a one-line ``ValueError`` naming it."""
    folder = Path(folder)
    for name in _CODE_DECLARING_FILES:
        if not os.path.lexists(folder / name):
            continue
        data = read_json(folder / name, folder, kind="config")
        if not isinstance(data, dict):
            raise ValueError(f"{escape(folder / name)} is not a JSON object")
        if data.get("auto_map"):
            raise CustomCodeError(_custom_code_line(f"{escape(folder)} ({name} has auto_map)"))


def check_loadable_folder(folder: str | os.PathLike[str]) -> None:
    """Check a local model or tokenizer folder before transformers loads it: no custom code
    (:func:`check_no_custom_code`), and every file a load opens (config, weights and the shards
    an index names, tokenizer files) is a regular file inside the folder, not a link out of it
    nor a FIFO (:func:`hf_pma.io.guarded.check_file`), as is every other link or special file at
    its top (whatever a tokenizer class reads), and every safetensors header is valid
    (:class:`hf_pma.io.safetensors.SafetensorsReader`). One-line ``ValueError`` naming the file."""
    folder = Path(folder)
    check_no_custom_code(folder)
    names = [n for n in (*_LOADED_FILES, *_TOKENIZER_FILES) if os.path.lexists(folder / n)]
    # Whatever its name (a tokenizer class reads vocab.txt, source.spm, ...: no list holds them
    # all), a link or a special file at the folder's top with the suffix of a file a load may
    # read is checked too: a link leading out of the folder or a FIFO is refused before
    # transformers opens it (a run folder's train.log linked to a scratch disk is no concern).
    with os.scandir(folder) as entries:
        names += sorted(
            e.name
            for e in entries
            if e.name.lower().endswith(_LOADABLE_SUFFIXES)
            and ((e.is_symlink() and not e.is_dir()) or not (e.is_symlink() or e.is_file() or e.is_dir()))
        )
    for index_name in _WEIGHT_INDEXES:
        if index_name in names:
            index = read_json(folder / index_name, folder, kind="index")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if isinstance(weight_map, dict):
                names += sorted(
                    {v for v in weight_map.values() if isinstance(v, str) and os.path.lexists(folder / v)}
                )
    for name in dict.fromkeys(names):
        check_file(folder / name, folder)
        if name.endswith(".safetensors"):
            # The header as hf-pma's reader checks it (what the safetensors library refuses, and
            # the bounds beyond): a crafted header is one line here, not a Rust error in transformers.
            SafetensorsReader(folder / name, folder).close()


def _check_model_folder(path: Path) -> None:
    from hf_pma.io.sharded import sharded_weight_files
    from hf_pma.merging.sources import find_weight_files

    if not path.is_dir():
        raise ValueError(f"model {path} is a file: give the model folder that holds it")
    weights = find_weight_files(path)
    if weights is None and sharded_weight_files(path) is not None:  # a sharded snapshot
        weights = ("model", sharded_weight_files(path))
    if os.path.lexists(path / "config.json") and weights is not None and weights[0] == "model":
        check_loadable_folder(path)  # a config.json that is a FIFO or a link out is named there
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
    raise FileNotFoundError(
        f"model folder {path} is not readable: no {' and no '.join(missing)} in it; give a model folder "
        "(config.json and *.safetensors), such as a snapshot or a merge"
    )


def resolve_model(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    find_tokenizer: bool = True,
) -> tuple[str, str | None]:
    """(model name, tokenizer name) after checking that a local model folder is readable and holds
    (or sits in a run folder that holds) a tokenizer, or that the Hub has the model; one-line
    ``FileNotFoundError`` / ``ValueError`` / ``ConnectionError`` otherwise."""
    path = Path(model)
    restore_interrupted(path)  # a merge --overwrite killed midway: its new folder goes in place first
    if path.exists():
        _check_model_folder(path)
        if tokenizer is None and find_tokenizer:
            found = _find_tokenizer_folder(path)
            if found is None:
                raise FileNotFoundError(
                    f"no tokenizer in model folder {escape(path)} (nor in the run folder that holds it): "
                    "pass one (tokenizer=, --tokenizer)"
                )
            tokenizer = found
        if tokenizer is not None and Path(tokenizer).is_dir():
            check_loadable_folder(tokenizer)
        return str(path), None if tokenizer is None else str(tokenizer)
    if looks_local(model):
        raise FileNotFoundError(f"model folder {model} does not exist")
    folder = hub_model_folder(str(model))  # a Hub model id: one request now, not a loader's retries
    if Path(folder).is_dir():  # downloaded: the same checks as a local folder
        check_loadable_folder(folder)
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


def check_record_folder(folder: str | os.PathLike[str], what: str = "record") -> Path:
    """The ``pma_eval.json`` that evaluation results will be recorded in, inside ``folder``,
    checked before anything is evaluated: ``FileNotFoundError`` when ``folder`` is not a folder,
    ``FileExistsError`` / ``PermissionError`` when the record cannot be written there (a link, a
    folder, a read-only folder; see :func:`hf_pma.utils.fs.check_output_file`). ``what`` names
    it in the errors (the command passes its flag, ``--record``, as for every path it checks)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} folder {escape(folder)} does not exist")
    path = folder / EVAL_RECORD_NAME
    check_output_file(path, what, record=True)
    return path
