"""The JSON records of a merged folder that the card and the plot read, and their sanitizing.

A merged folder (``<output_dir>/pma/merged``) holds, beside the model:

* ``pma_merge.json``: how it was merged (written by the merge engine; required for a card);
* ``pma_eval.json``: evaluation results of the last snapshot, the merge, an annealed run;
* ``pma_training.json``: the Trainer's ``log_history`` and what the run was (tokens, schedule,
  hardware, time, the reproducing command).

Only ``pma_merge.json`` is required; the others are read when present. Everything that comes
out of :func:`load_records` is sanitized: no access token and no absolute local path survive,
so a card or a plot built from it can be published.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import (
    EVAL_RECORD_NAME,
    MANIFEST_NAME,
    MERGE_RECORD_NAME,
    PMA_SUBDIR,
    TRAINING_RECORD_NAME,
    check_eval_comparison,
    check_eval_results,
    read_manifest,
)
from hf_pma.io.guarded import read_json
from hf_pma.utils.logs import get_logger
from hf_pma.utils.parsing import is_int, is_number
from hf_pma.utils.secrets import find_named_secrets, find_token_shapes, redact, redact_obj
from hf_pma.utils.text import escape, shown

__all__ = [
    "FolderRecords",
    "check_eval_results",
    "label_rank",
    "load_records",
    "sanitize_text",
    "sanitize",
    "find_tokens",
    "find_local_paths",
    "find_secrets",
]


# An absolute POSIX path (/a/b, ~/a) or a Windows path (C:\a, C:/a). The look-behind keeps URLs
# ("https://host/x"), relative paths ("a/b") and placeholders ("<output_dir>/pma") intact.
_POSIX_PATH_RE = re.compile(r"(?<![\w.:/\-~<>])~?/(?:[\w.@+\-]+/)*[\w.@+\-]+/?")
_WINDOWS_PATH_RE = re.compile(r"\b[A-Za-z]:[\\/](?:[^\s\\/\"'`|<>]+[\\/])*[^\s\\/\"'`|<>]*")


def _shorten_path(path: str) -> str:
    name = re.split(r"[\\/]", path.rstrip("\\/"))[-1]
    return f".../{name}" if name else "..."


def sanitize_text(text: str) -> str:
    """``text`` with access tokens replaced by ``***`` (by name and by value, see
    :func:`hf_pma.utils.secrets.redact`) and absolute paths cut to ``.../name``."""
    return _shorten_paths(redact(text))


def _shorten_paths(text: str) -> str:
    text = _WINDOWS_PATH_RE.sub(lambda m: _shorten_path(m.group(0)), text)
    # Single-component paths like "/step" inside prose are left alone: they cannot name a file
    # on someone's machine, while "/home/user/run" can.
    return _POSIX_PATH_RE.sub(
        lambda m: _shorten_path(m.group(0)) if m.group(0).strip("/~").count("/") >= 1 else m.group(0), text
    )


def find_tokens(text: str, flag_values: bool = True) -> list[str]:
    """The access tokens found in ``text``: Hugging Face token shapes, and with ``flag_values``
    any value given to a token flag or variable (``--hub_token X``, ``HF_TOKEN=X``)."""
    found = find_token_shapes(text)
    return found + find_named_secrets(text) if flag_values else found


def find_local_paths(text: str) -> list[str]:
    """The absolute local paths (``/a/b``, ``~/a``, ``C:\\a``) found in ``text``."""
    found = [m.group(0) for m in _WINDOWS_PATH_RE.finditer(text)]
    return found + [
        m.group(0) for m in _POSIX_PATH_RE.finditer(text) if m.group(0).strip("/~").count("/") >= 1
    ]


def find_secrets(text: str) -> list[str]:
    """The access tokens and absolute local paths found in ``text`` (empty when it is clean)."""
    return find_tokens(text) + find_local_paths(text)


def sanitize(obj: Any) -> Any:
    """A copy of a JSON-like value with every string passed through :func:`sanitize_text` (and the
    value of every key named like a secret, ``"hub_token": ...``, replaced by ``***``)."""
    obj = redact_obj(obj)
    return _sanitize_paths(obj)


def _sanitize_paths(obj: Any) -> Any:
    if isinstance(obj, str):
        return _shorten_paths(obj)
    if isinstance(obj, dict):
        return {_shorten_paths(k) if isinstance(k, str) else k: _sanitize_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize_paths(v) for v in obj]
    return obj


def label_rank(label: str) -> int:
    """Order of an evaluated model's label: 0 last snapshot / live, 1 the PMA merge, 2 annealed,
    3 anything else."""
    low = label.lower()
    if "last" in low or "live" in low:
        return 0
    if "merge" in low or "pma" in low:
        return 1
    if "anneal" in low:
        return 2
    return 3


@dataclasses.dataclass
class FolderRecords:
    """What a merged folder says about itself. Absent records are ``None``; ``name`` is the
    folder's name and ``run_name`` the training output folder's name when the merged folder
    sits in ``<output_dir>/pma/``."""

    merge: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    name: str | None = None
    run_name: str | None = None

    @property
    def sources(self) -> list[dict[str, Any]]:
        """The merged snapshots, oldest first (empty without a merge record)."""
        return list((self.merge or {}).get("sources") or [])

    @property
    def log_history(self) -> list[dict[str, Any]]:
        """The Trainer's ``log_history`` (empty without a training record)."""
        return list((self.training or {}).get("log_history") or [])


# What a record's values may be. Integers past 2**63 (a count of tokens, a step) cannot come from
# a run and break the arithmetic that formats them; a date past the year 9999 cannot be shown.
_MAX_INT = 2**63
_MAX_TIMESTAMP = 253_402_300_799  # 9999-12-31T23:59:59Z
# A strategy is a name (sma, wma, ema, linear-decay, custom...), never text to format or show.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


def _check_integers(path: Path, data: Any) -> None:
    # Iterative: the reader bounds the nesting already, and this must not recurse either.
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, f"{where}[{shown(k, 40)}]") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif is_int(value) and abs(value) >= _MAX_INT:
            raise ValueError(
                f"{escape(path)}: {where or 'the value'} is an integer of {len(str(abs(value)))} digits"
            )


def _check_field(path: Path, data: dict[str, Any], key: str, ok: Any, expected: str, where: str = "") -> None:
    value = data.get(key)
    if value is not None and not ok(value):
        raise ValueError(
            f"{escape(path)}: {where}[{shown(key, 40)}] should be {expected}, found {shown(value, 80)}"
        )


def _read_optional(path: Path, required_type: type, required_keys: tuple[str, ...] = ()) -> Any:
    if not path.exists() and not path.is_symlink():
        return None
    data = read_json(path, path.parent, kind="record")  # confined, regular, bounded in size and depth
    if not isinstance(data, required_type):
        raise ValueError(
            f"{escape(path)} should hold a JSON {required_type.__name__}, found {type(data).__name__}"
        )
    missing = [k for k in required_keys if k not in data]
    if missing:
        raise ValueError(f"{escape(path)} lacks the key(s) {missing}")
    _check_integers(path, data)
    return data


def _check_merge_record(path: Path, data: dict[str, Any]) -> None:
    sources = data.get("sources")
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise ValueError(f"{escape(path)}: 'sources' should be a list of objects (one per merged snapshot)")
    strategy = data.get("strategy")
    if not isinstance(strategy, str) or not _NAME_RE.fullmatch(strategy):
        raise ValueError(
            f"{escape(path)}: 'strategy' should be a strategy name such as 'sma', found {shown(strategy, 80)}"
        )
    _check_field(
        path, data, "created", lambda v: is_number(v) and 0 <= v <= _MAX_TIMESTAMP, "a time in seconds"
    )
    for key in ("alpha", "interval_tokens", "num_sources"):
        _check_field(path, data, key, is_number, "a number")
    _check_field(
        path,
        data,
        "weights",
        lambda v: isinstance(v, list) and all(is_number(w) for w in v),
        "a list of numbers",
    )
    for i, source in enumerate(sources):
        for key in ("tokens", "step"):
            _check_field(path, source, key, is_number, "a number", f"sources[{i}]")
        for key in ("name", "path", "phase", "repo_id", "revision", "commit"):
            _check_field(path, source, key, lambda v: isinstance(v, str), "a string", f"sources[{i}]")


def _find_run_manifest(folder: Path) -> Path | None:
    # A merged folder made by a run sits at <output_dir>/pma/merged, beside the manifest.
    for candidate in (folder.parent / MANIFEST_NAME, folder.parent / PMA_SUBDIR / MANIFEST_NAME):
        if candidate.is_file():
            return candidate
    return None


def load_records(folder: str | os.PathLike[str], require_merge: bool = True) -> FolderRecords:
    """Read (and sanitize) the records of a merged folder.

    Raises ``FileNotFoundError`` when ``folder`` does not exist or, with ``require_merge``,
    has no ``pma_merge.json``; ``ValueError`` naming the file when a record is malformed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{escape(folder)} is not a folder")
    merge_path = folder / MERGE_RECORD_NAME
    merge = _read_optional(merge_path, dict, ("strategy", "sources"))
    if merge is None and require_merge:
        raise FileNotFoundError(
            f"{escape(folder)} has no {MERGE_RECORD_NAME}: it is not a merged folder (make one with merge_checkpoints "
            "or `hf-pma merge`)"
        )
    if merge is not None:
        _check_merge_record(merge_path, merge)
    evaluation = _read_optional(folder / EVAL_RECORD_NAME, dict, ("results",))
    if evaluation is not None:
        check_eval_results(evaluation["results"], f"{escape(folder / EVAL_RECORD_NAME)}: results")
        check_eval_comparison(
            evaluation.get("comparison"), f"{escape(folder / EVAL_RECORD_NAME)}: comparison"
        )
    training = _read_optional(folder / TRAINING_RECORD_NAME, dict)
    if training is not None:
        history = training.get("log_history", [])
        if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
            raise ValueError(
                f"{escape(folder / TRAINING_RECORD_NAME)}: 'log_history' should be a list of objects"
            )
        for key in ("total_tokens", "max_steps"):
            _check_field(folder / TRAINING_RECORD_NAME, training, key, is_number, "a number")
    manifest_path = _find_run_manifest(folder.resolve())
    manifest = None
    if manifest_path is not None:
        try:
            manifest = read_manifest(manifest_path.parent)  # checked, as every reader of it
        except ValueError as err:
            # The run's manifest only adds context: a bad one is left out, not fatal here.
            get_logger(__name__).warning(f"Leaving out the run's manifest: {err}")
            manifest = None
    resolved = folder.resolve()
    run_name = resolved.parent.parent.name if resolved.parent.name == PMA_SUBDIR else None
    return FolderRecords(
        merge=sanitize(merge),
        eval=sanitize(evaluation),
        training=sanitize(training),
        manifest=sanitize(manifest),
        name=resolved.name,
        run_name=run_name or None,
    )
