"""What an output never replaces or joins: the files hf-pma and transformers read a folder by.

A model, a run, a Trainer checkpoint and a folder of generated tasks are read by the names of
the files in them: ``config.json`` and the weights make a folder a model for
``from_pretrained``, ``pma/manifest.json`` makes it a run for every hf-pma command, a ``pma*.json``
record says what a merge or a snapshot is. An output that took one of these names would break
what it replaced (``hf-pma eval M -o M/config.json``) or make a folder look like what it is not;
an output file dropped into such a folder would be pushed with the model or kept forever by a
snapshot's rotation. :func:`output_place_problem` says so before any work, for the one check of
every output (:func:`hf_pma.utils.fs.check_output_file`, :func:`hf_pma.utils.fs.check_output_folder`).

The names come from what is read: transformers' file-name constants (``transformers.utils``,
``transformers.tokenization_utils_base``, ``transformers.trainer``), PEFT's, and hf-pma's own
records. utils imports nothing above it, so hf-pma's record names are spelled here too;
``tests/test_protected_outputs.py`` keeps both lists complete (every such constant of
transformers and of hf-pma is here). Torch-free and without heavy imports.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

__all__ = [
    "HF_PMA_RECORD_NAMES",
    "MODEL_FILE_NAMES",
    "READ_FILE_PATTERNS",
    "MODEL_FOLDER_PATTERNS",
    "is_read_file_name",
    "folder_kind",
    "PEEK_MAX_BYTES",
    "PEEK_MAX_ENTRIES",
    "PEEK_MAX_PARTS",
    "listed_folder_among",
    "listed_paths",
    "output_place_problem",
    "peek_json",
]

# hf-pma's records: manifest, snapshot, merge, eval, training, annealing, PMA-init records, the
# index of a folder of generated tasks and its data, the online average's state.
HF_PMA_RECORD_NAMES = (
    "manifest.json",
    "pma.json",
    "pma_merge.json",
    "pma_eval.json",
    "pma_training.json",
    "pma_anneal.json",
    "pma_init.json",
    "tasks_info.json",
    "heldout.jsonl",
    "train.jsonl",
    "pma_online.safetensors",
)
# What transformers (config, generation, tokenizer, processors, Trainer checkpoints) and PEFT
# read from a model or checkpoint folder by name.
MODEL_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "modelcard.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
    "trainer_state.json",
    "training_args.bin",
    "optimizer.pt",
    "optimizer.bin",
    "scheduler.pt",
    "scaler.pt",
)
# Weights, shards and their indexes, sentencepiece / tiktoken vocabularies, RNG states and the
# shards of a distributed checkpoint, whatever their exact names.
READ_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.distcp",
    "*.model",
    "*.tiktoken",
    "vocab.*",
    "merges.*",
    "rng_state*.pth",
)
# Files that make a folder a model or checkpoint (what from_pretrained, PEFT and a Trainer resume
# load it by: its config and its weights), whatever else it holds. A folder of tokenizer files
# only (a run folder where the tokenizer was saved) or of someone's ``data.bin`` is not one.
MODEL_FOLDER_PATTERNS = (
    "config.json",
    "adapter_config.json",
    "trainer_state.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin.index.json",
    "pytorch_model*.bin",
    "adapter_model.bin",
    "*.distcp",
)


def is_read_file_name(name: str) -> bool:
    """Whether a file called ``name`` is one hf-pma or transformers reads a folder by (compared
    case-insensitively: on a case-insensitive filesystem ``Config.json`` is ``config.json``)."""
    name = name.lower()
    if name in HF_PMA_RECORD_NAMES or name in MODEL_FILE_NAMES:
        return True
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in READ_FILE_PATTERNS)


# What the checks of an output read of a record that is not the run's own (a manifest in a folder
# above or beside the output, which anyone who can write there may have put there): at most this
# many bytes, known by fstat before a byte is read, and this many entries and path components
# (each one a system call to resolve), counted before one is resolved. hf-pma lists a snapshot
# by its folder's name (one component, ~300 bytes of record), so these hold 10,000 snapshots; a
# larger file is not looked into (it lists nothing: it only ever gave a reason to refuse).
PEEK_MAX_BYTES = 4 * 2**20
PEEK_MAX_ENTRIES = 10_000
PEEK_MAX_PARTS = 2 * PEEK_MAX_ENTRIES


def peek_json(path: Path, limit: int = PEEK_MAX_BYTES) -> Any:
    """The JSON value of ``path`` when it is a regular file (not a link) of at most ``limit`` bytes
    holding valid JSON; ``None`` otherwise (a larger file is not read at all). Only for looking for
    a reason to refuse an output (the checks of the way out, :mod:`hf_pma.utils.fs`): utils sits
    below :mod:`hf_pma.io.guarded`, the way in of everything read for use (the layout test keeps
    subpackages importing downward only)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        return json.loads(_read_all(fd, limit + 1))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def _read_all(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _snapshot_entries(path: Path) -> list[Any] | None:
    """The ``snapshots`` list of the run manifest ``path`` (a regular file, not a link), read
    within :data:`PEEK_MAX_BYTES` and holding at most :data:`PEEK_MAX_ENTRIES` entries; ``None``
    for anything else (missing, too large, too many, not a manifest)."""
    data = peek_json(path)
    entries = data.get("snapshots") if isinstance(data, dict) else None
    return entries if isinstance(entries, list) and len(entries) <= PEEK_MAX_ENTRIES else None


def listed_paths(path: str | os.PathLike[str]) -> list[str]:
    """The snapshot paths (as written, not resolved) that the run manifest ``path`` lists, read
    bounded (:func:`_snapshot_entries`, and at most :data:`PEEK_MAX_PARTS` path components in all);
    none for a file that is missing, over the bounds or not a manifest. The one reader of a
    manifest that an output check finds above or beside an output (through :func:`listed_folder_among`:
    :func:`hf_pma.utils.fs.listed_snapshot_of`, :func:`hf_pma.core.outputs.listing_manifest`)."""
    entries = _snapshot_entries(Path(path)) or []
    names = (entry.get("path") if isinstance(entry, dict) else None for entry in entries)
    names = [name for name in names if isinstance(name, str) and name.strip() and "\x00" not in name]
    parts = sum(name.count("/") + name.count("\\") + 1 for name in names)
    return names if parts <= PEEK_MAX_PARTS else []


def listed_folder_among(path: str | os.PathLike[str], wanted: Collection[Path]) -> Path | None:
    """The first of ``wanted`` (resolved paths) that the run manifest ``path`` lists, after
    symbolic links, relative to the manifest's folder; ``None`` when it lists none of them (read
    bounded: :func:`listed_paths`). The manifest's folder is resolved once; a name of one
    component costs one ``lstat`` in it (a link among them is resolved in full), any other name
    is resolved in full (at most :data:`PEEK_MAX_PARTS` components in all)."""
    path = Path(path)
    names = listed_paths(path) if wanted else []
    if not names:
        return None
    wanted_by_name = {os.fspath(w): w for w in wanted}
    try:
        base = os.path.realpath(path.parent)
        fd = os.open(base, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    try:
        for name in names:
            found = wanted_by_name.get(_resolved_name(base, fd, name))
            if found is not None:
                return found
    finally:
        os.close(fd)
    return None


def _resolved_name(base: str, fd: int, name: str) -> str:
    """``base/name`` after symbolic links (``base`` resolved, ``fd`` open on it); ``""`` when it
    cannot be resolved."""
    joined = os.path.join(base, name)
    try:
        if "/" not in name and "\\" not in name and name not in (".", ".."):
            try:
                if not stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode):
                    return joined
            except FileNotFoundError:
                return joined  # missing: it resolves to itself, as a missing output does
        return os.path.realpath(joined)
    except (OSError, ValueError):
        return ""


def _lists_snapshots(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) holding a run manifest (a ``snapshots`` list)
    within the bounds of :func:`_snapshot_entries`."""
    return _snapshot_entries(path) is not None


def folder_kind(folder: str | os.PathLike[str]) -> str | None:
    """What hf-pma or transformers reads ``folder`` as, by the files directly inside it: ``"a model
    folder (it holds config.json)"``, ``"a run's record folder (...)"``, ...; ``None`` for a folder
    that holds none of them (or is missing), and for a run's own folder (``RUN``, holding
    ``pma/manifest.json``: where ``sweep`` writes by default, even when the Trainer saved the final
    model at its top; its files keep their protected names). Only names are looked at, and a
    manifest's top level."""
    folder = Path(folder)
    try:
        with os.scandir(folder) as entries:
            names = sorted(e.name for e in entries if not e.is_dir(follow_symlinks=False))
    except OSError:
        return None
    lowered = {name.lower(): name for name in names}
    if _lists_snapshots(folder / "pma" / "manifest.json"):
        return None  # a run's own folder (RUN/sweep.json), even with the final model at its top (run_clm, TRL)
    if "manifest.json" in lowered and _lists_snapshots(folder / lowered["manifest.json"]):
        return f"a run's record folder (it holds the run manifest {lowered['manifest.json']})"
    for name in ("trainer_state.json", "pma.json", "pma_merge.json", "pma_anneal.json", "tasks_info.json"):
        if name in lowered:
            what = "a folder of generated tasks" if name == "tasks_info.json" else "a model or checkpoint folder"
            return f"{what} (it holds {lowered[name]})"
    for name in names:
        if any(fnmatch.fnmatchcase(name.lower(), pattern) for pattern in MODEL_FOLDER_PATTERNS):
            return f"a model folder (it holds {name})"
    return None


def output_place_problem(path: str | os.PathLike[str], file: bool = True) -> str | None:
    """Why an output may not be written at ``path``, in a few words; ``None`` when it may.

    An output never takes a name that hf-pma or transformers reads (:func:`is_read_file_name`:
    it would replace that file, or make its folder look like a model or a run), and never goes
    into a model or checkpoint folder (:func:`folder_kind`); an output file never goes into a
    run's record folder or a folder of generated tasks either (an output folder may: the merge
    of a run is ``RUN/pma/merged``). Only names and a manifest's top level are read.
    """
    path = Path(path)
    if is_read_file_name(path.name):
        return f"{path.name} is a name hf-pma or transformers reads (a record, weights, config or tokenizer file)"
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:  # an output folder's missing parents are made inside it
        parent = parent.parent
    kind = folder_kind(parent)
    if kind is None or (not file and kind.startswith(("a run's record folder", "a folder of generated tasks"))):
        return None
    return f"its folder {parent} is {kind}"
