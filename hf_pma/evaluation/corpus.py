"""Text corpora: read documents from files, folders or datasets, and split them train / held-out.

:func:`split_documents` is the one split that training and evaluation share: train on its
``train`` part, evaluate (perplexity, generated tasks) on its ``heldout`` part, with the same
``eval_fraction`` and ``seed``, and no held-out document is ever trained on.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hf_pma.io.guarded import check_file
from hf_pma.utils.logs import get_logger
from hf_pma.utils.names import is_hub_id
from hf_pma.utils.text import escape

logger = get_logger(__name__)

__all__ = ["TABLE_SUFFIXES", "load_documents", "split_documents", "document_id", "documents_fingerprint", "check_texts"]

# Files read as tables of documents (one per row, text in a column); every other file is one document.
TABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def document_id(text: str) -> str:
    """A stable id of a document's content (sha256 of its UTF-8 bytes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_texts(texts: Sequence[Any]) -> None:
    """``TypeError`` naming the first of ``texts`` that is not a string (held-out documents)."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is a {type(text).__name__}, not a string")


def documents_fingerprint(texts: Sequence[str]) -> str:
    """The identity of a held-out set: ``sha256:`` of its documents' ids, in order. Two sets have
    the same fingerprint exactly when they hold the same documents in the same order, whatever
    they are called (a run's ``32 held-out documents`` and the ``heldout.jsonl`` it wrote)."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(document_id(text).encode("ascii"))
    return f"sha256:{digest.hexdigest()}"


def _text_or_error(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string of text, found {type(value).__name__}")
    return value


def _rows_from_json(path: Path) -> list[dict]:
    raw = path.read_text(encoding="utf-8")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        # A dict of columns, as pandas/datasets write it.
        if data and all(isinstance(v, list) for v in data.values()):
            n = len(next(iter(data.values())))
            return [{k: v[i] for k, v in data.items()} for i in range(n)]
        return [data]
    rows = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not valid JSON: {err}") from err
    return rows


def _read_table(path: Path, text_column: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_column not in table.column_names:
            raise ValueError(
                f"{path} has no column {text_column!r} (columns: {', '.join(table.column_names)})"
            )
        values = table.column(text_column).to_pylist()
    else:
        if suffix == ".csv":
            with open(path, encoding="utf-8", newline="") as fh:
                rows = list(csv.DictReader(fh))
        else:
            rows = _rows_from_json(path)
        if rows and not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: expected one object per row, with the text under {text_column!r}")
        missing = next((i for i, r in enumerate(rows) if text_column not in r), None)
        if missing is not None:
            keys = ", ".join(sorted(rows[missing])) or "none"
            raise ValueError(f"{path}: row {missing} has no column {text_column!r} (its columns: {keys})")
        values = [r[text_column] for r in rows]
    return [_text_or_error(v, f"{path} column {text_column!r}") for v in values]


def _read_text_file(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_folder(folder: Path) -> list[str]:
    docs, skipped = [], 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue
        text = _read_text_file(path)
        if text is None:
            skipped += 1
            continue
        docs.append(text)
    if skipped:
        logger.warning(f"{folder}: skipped {skipped} file(s) that are not UTF-8 text")
    return docs


def _read_dataset(name: str, text_column: str, split: str) -> list[str]:
    import datasets

    path = Path(name)
    if path.is_dir():
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{path} has no split {split!r} (splits: {', '.join(data)})")
            data = data[split]
    else:
        from hf_pma.utils.hub_client import install_hub_client

        install_hub_client()  # datasets downloads it: bounded in bytes and time, like hf-pma's own
        repo, _, config = name.partition(":")
        data = datasets.load_dataset(repo, config or None, split=split)
    if text_column not in data.column_names:
        raise ValueError(
            f"dataset {name} has no column {text_column!r} (columns: {', '.join(data.column_names)})"
        )
    return [_text_or_error(v, f"dataset {name} column {text_column!r}") for v in data[text_column]]


_CONFIG_NAME_RE = re.compile(r"[\w.-]+")


def _looks_like_dataset_name(text: str) -> bool:
    # "wikitext:wikitext-2-raw-v1" or "org/name"; "data/train.txt" is a missing file, not a dataset.
    name, colon, config = text.partition(":")
    return is_hub_id(name, bare=True) and (not colon or bool(_CONFIG_NAME_RE.fullmatch(config)))


def _read_hub_dataset(name: str, text_column: str, split: str) -> list[str]:
    try:
        return _read_dataset(name, text_column, split)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as err:  # datasets raises many types when a dataset is unreachable
        raise FileNotFoundError(
            f"{name} is neither a local file or folder nor a loadable dataset ({type(err).__name__}: {err})"
        ) from err


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def load_documents(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    text_column: str = "text",
    split: str = "train",
    limit: int | None = None,
) -> list[str]:
    """Documents (strings) from one source or several, in order.

    A source is:

    * a ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file: one document per row, its text in
      ``text_column``;
    * any other file: one document (UTF-8 text);
    * a folder: every UTF-8 text file under it, one document each, in path order (hidden files
      and binary files are skipped); a folder written by ``datasets.save_to_disk`` is read as a
      dataset (``split`` selects the split of a ``DatasetDict``);
    * otherwise a dataset name for ``datasets.load_dataset``, ``name`` or ``name:config``, read at
      ``split`` (this needs the dataset to be reachable: the Hub, or the local cache).

    ``limit`` keeps the first ``limit`` documents.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of documents, got {limit}")
    items = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not items:
        raise ValueError("no document source given")
    docs: list[str] = []
    for item in items:
        path = Path(item)
        if path.is_file():
            if path.suffix.lower() in TABLE_SUFFIXES:
                docs.extend(_read_table(path, text_column))
            else:
                text = _read_text_file(path)
                if text is None:
                    raise ValueError(f"{path} is not a UTF-8 text file")
                docs.append(text)
        elif path.is_dir():
            docs.extend(
                _read_dataset(str(path), text_column, split)
                if _is_saved_dataset(path)
                else _read_folder(path)
            )
        elif os.path.lexists(path):  # there, but no file or folder: a FIFO (a read would hang), a device, a dangling link
            check_file(path, Path(path.absolute().anchor))  # raises, in one line naming it and what it is
            raise ValueError(f"document source {escape(item)} is not a regular file")
        elif _looks_like_dataset_name(str(item)):
            docs.extend(_read_hub_dataset(str(item), text_column, split))
        else:
            raise FileNotFoundError(f"document source {item} does not exist")
        if limit is not None and len(docs) >= limit:
            break
    return docs[:limit] if limit is not None else docs


def split_documents(
    documents: Iterable[str], eval_fraction: float = 0.1, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Split documents into ``(train, heldout)``, deterministically for a seed.

    Each distinct document gets a key, sha256 of the seed and its text; the
    ``ceil(eval_fraction * distinct)`` documents with the smallest keys are held out. So the
    split depends only on the documents' contents and the seed (not on their order), copies of
    one document always land on the same side, and both parts keep the input order. Held-out
    copies are kept once; train keeps every copy.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction}")
    documents = list(documents)
    for i, doc in enumerate(documents):
        _text_or_error(doc, f"document {i}")
    distinct = list(dict.fromkeys(documents))
    if len(distinct) < 2:
        raise ValueError(f"need at least 2 distinct documents to split, got {len(distinct)}")
    n_heldout = min(len(distinct) - 1, max(1, math.ceil(eval_fraction * len(distinct))))
    ranked = sorted(distinct, key=lambda doc: hashlib.sha256(f"{seed}\x00{doc}".encode()).digest())
    heldout_set = set(ranked[:n_heldout])
    train = [doc for doc in documents if doc not in heldout_set]
    heldout = [doc for doc in distinct if doc in heldout_set]
    return train, heldout
