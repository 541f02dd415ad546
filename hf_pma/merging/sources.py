"""Turn what a user names (model folders, snapshots, Trainer checkpoints, runs, Hub models) into
the sources of a merge, oldest first: :func:`resolve_sources`.

A *source* is one folder of weights with what is known of its place in training
(:class:`~hf_pma.merging.checkpoint_source.CheckpointSource`). Resolution expands run folders
(:mod:`hf_pma.merging.run_layouts`: a PMA manifest, or a Trainer output folder with
``checkpoint-*``), orders everything by training progress and selects a window
(:mod:`hf_pma.merging.windows`), checks that the sources are one model of one run
(:mod:`hf_pma.merging.same_model`), and gives read access to their weight files
(:mod:`hf_pma.merging.weight_files`). Hub sources (``org/model``, ``org/model@REV``, or a repo's
revisions matching a pattern) are found, ordered and selected before anything is downloaded (see
:mod:`hf_pma.merging.hub_revisions`).

The names of those modules are importable from this one too, as they were before it was split.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import TOKENIZER_FILES
from hf_pma.core.selection import check_window
from hf_pma.core.window_choice import WindowChoice, check_window_count, is_auto
from hf_pma.merging.checkpoint_source import (
    CheckpointSource,
    model_source,
    open_all,
    recorded_interval,
    source_from_folder,
    tokenizer_folder,
    vanished_source_error,
)
from hf_pma.merging.hub_revisions import (
    HubRevision,
    download_revisions,
    list_revisions,
    parse_hub_spec,
    resolve_revision,
)
from hf_pma.merging.run_layouts import FINAL_LABEL, RunLayout, run_layout, run_sources
from hf_pma.merging.same_model import MEANING_FIELDS, check_one_run, check_same_model, config_differences
from hf_pma.merging.weight_files import (
    WEIGHT_PREFIXES,
    CheckpointTensors,
    find_weight_files,
    open_weight_files,
)
from hf_pma.merging.windows import (
    apply_window,
    describe_sources,
    order_by_progress,
    select_newest,
    select_window,
    sources_span,
)
from hf_pma.utils.fs import restore_interrupted
from hf_pma.utils.names import check_revision_name, looks_local
from hf_pma.utils.parsing import check_int, parameter_error
from hf_pma.utils.text import shown

__all__ = [
    "resolve_sources",
    "resolve_sources_and_window",
    # re-exported from the modules this one was split into
    "CheckpointSource",
    "CheckpointTensors",
    "FINAL_LABEL",
    "RunLayout",
    "run_layout",
    "model_source",
    "order_by_progress",
    "select_newest",
    "select_window",
    "sources_span",
    "describe_sources",
    "open_all",
    "vanished_source_error",
    "open_weight_files",
    "find_weight_files",
    "WEIGHT_PREFIXES",
    "MEANING_FIELDS",
    "TOKENIZER_FILES",
    "config_differences",
    "check_same_model",
    "check_one_run",
    "recorded_interval",
    "tokenizer_folder",
]


def resolve_sources(
    inputs: Sequence[str | os.PathLike[str]],
    last: int | str | None = None,
    *,
    every: int | None = None,
    revisions: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    include_final: bool = False,
    window_tokens: int | None = None,
    window_steps: int | None = None,
) -> list[CheckpointSource]:
    """Expand and order what the user named, oldest first; keep every ``every``-th counting back
    from the newest, then the newest ``last`` (or those within the last ``window_tokens``
    tokens, or ``window_steps`` steps, of the newest).

    A local folder resolves in this order: a PMA manifest (``manifest.json`` or
    ``pma/manifest.json``: its usable snapshots), else ``checkpoint-*`` subfolders; weights at
    the top of a folder that holds either are the run's final model, taken (as the newest
    source, named ``final``) only with ``include_final`` or when its weight file is named
    (``RUN/model.safetensors``). A folder with neither is one model. Two manifests, or a
    manifest without usable snapshots, are errors naming what the folder holds.

    ``inputs`` may mix model folders, snapshot folders, Trainer ``checkpoint-*`` folders, run
    folders, a model's weight file, and Hub models: ``org/model`` (its default branch, or with ``revisions`` its branches and
    tags matching that glob or ``/regex/``) and ``org/model@REV``. Hub revisions are ordered
    and selected first and only the selected ones are downloaded (into ``cache_dir``, default
    the ``huggingface_hub`` cache, from ``endpoint``, default ``HF_ENDPOINT``).

    ``last="auto"`` chooses the window from the run's records (see
    :func:`resolve_sources_and_window`, which also returns the choice and its reason).
    """
    return resolve_sources_and_window(
        inputs,
        last,
        every=every,
        revisions=revisions,
        cache_dir=cache_dir,
        endpoint=endpoint,
        include_final=include_final,
        window_tokens=window_tokens,
        window_steps=window_steps,
    )[0]


def resolve_sources_and_window(
    inputs: Sequence[str | os.PathLike[str]],
    last: int | str | None = None,
    *,
    every: int | None = None,
    revisions: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    include_final: bool = False,
    window_tokens: int | None = None,
    window_steps: int | None = None,
) -> tuple[list[CheckpointSource], WindowChoice | None]:
    """:func:`resolve_sources`, and the automatic window's choice (``None`` unless ``last="auto"``
    chose it). ``last="auto"`` applies where a run folder or a revision pattern expands into
    several checkpoints, before anything is downloaded: sources named one by one are all merged.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no sources given")
    last = check_window_count(last, "last", allow_none=True)
    auto = is_auto(last)
    if auto:
        last = None
    check_int(every, "every", allow_none=True)
    check_window(window_tokens, window_steps, last)
    check_one_run(inputs, revisions)
    if revisions is not None and not any(
        not Path(i).exists() and (spec := parse_hub_spec(i)) is not None and spec[1] is None for i in inputs
    ):
        raise parameter_error(
            "revisions", f"{shown(revisions)} applies to a Hub repo given as org/model, and no source is one"
        )
    items = [x for item in inputs for x in _expand(item, revisions, endpoint, include_final)]
    seen: dict[Any, Any] = {}
    for x in items:
        if _key(x) in seen:
            what = x.spec if isinstance(x, HubRevision) else x.path
            raise ValueError(
                f"source {what} is given twice (directly, through a run folder or as the same commit)"
            )
        seen[_key(x)] = x
    local_prefixes = {x.prefix for x in items if isinstance(x, CheckpointSource)}
    if len(local_prefixes) > 1:
        raise ValueError(
            "cannot merge full models with PEFT adapters: "
            + ", ".join(f"{x.path} ({x.prefix})" for x in items)
        )
    # The automatic window follows a run's records: sources named one by one are all merged.
    auto = auto and len(items) > len(inputs)
    selected, choice = apply_window(
        order_by_progress(items),
        last="auto" if auto else last,
        every=every,
        window_tokens=window_tokens,
        window_steps=window_steps,
    )
    sources = _download(selected, cache_dir, endpoint)
    prefixes = {s.prefix for s in sources}
    if len(prefixes) > 1:
        raise ValueError(
            "cannot merge full models with PEFT adapters: "
            + ", ".join(f"{s.name} ({s.prefix})" for s in sources)
        )
    return sources, choice


def _expand(
    item: str | os.PathLike[str],
    revisions: str | None = None,
    endpoint: str | None = None,
    include_final: bool = False,
) -> list[Any]:
    """The checkpoints an item names: local sources now, Hub revisions still to download."""
    path = Path(item)
    restore_interrupted(path)  # a merge --overwrite killed midway: its new folder goes in place first
    if not path.exists():
        spec = parse_hub_spec(item) if isinstance(item, str) and not looks_local(item) else None
        if spec is None:
            raise FileNotFoundError(f"source {item} does not exist")
        repo_id, revision = spec
        if revision is not None:
            check_revision_name(revision, f"revision of {item}")  # before any request
        if revision is None and revisions is not None:
            return list_revisions(repo_id, revisions, endpoint=endpoint)
        return [resolve_revision(repo_id, revision, endpoint=endpoint)]
    return run_sources(path, include_final)


def _download(
    items: list[Any], cache_dir: str | os.PathLike[str] | None, endpoint: str | None
) -> list[CheckpointSource]:
    """Download the selected Hub revisions (one disk-space check, one progress bar) into sources."""
    hub = [x for x in items if isinstance(x, HubRevision)]
    if not hub:
        return items
    folders = dict(zip(map(id, hub), download_revisions(hub, cache_dir=cache_dir, endpoint=endpoint)))
    out = []
    for x in items:
        if isinstance(x, HubRevision):
            source = source_from_folder(folders[id(x)])
            source.tokens, source.step, source.record, source.label = x.tokens, x.step, x.record, x.name
            x = source
        out.append(x)
    return out


def _key(item: Any) -> Any:
    return (item.repo_id, item.commit) if isinstance(item, HubRevision) else item.path.resolve()
