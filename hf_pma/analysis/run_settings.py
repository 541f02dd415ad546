"""What each run recorded about how it was trained, and the groups of runs that share settings
(``hf-pma compare --group seed``: rank only runs that differ in what the comparison is about).

A run's settings are the scalar fields of its training record (``pma/merged/pma_training.json``,
written by :class:`hf_pma.training.trainer.PMATrainer`: ``seed``, ``learning_rate``,
``max_steps``, ``lr_scheduler_type``...), then those of its model's ``config.json``
(``hidden_size``, ``num_hidden_layers``...). Both are read through :mod:`hf_pma.io.guarded`; a
file that is missing adds nothing, one that is not a JSON object is a one-line ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import PMA_SUBDIR, TRAINING_RECORD_NAME
from hf_pma.io.guarded import read_json
from hf_pma.merging.sources import CheckpointSource, run_layout
from hf_pma.utils.parsing import parameter_error
from hf_pma.utils.text import escape, shown

__all__ = ["group_runs", "parse_group_keys", "recorded_settings", "settings_files"]

_SCALARS = (str, int, float, bool)


def settings_files(run: Path, snapshot: CheckpointSource) -> list[tuple[Path, Path, str]]:
    """Where a run's settings are read, first first: ``(file, folder it is confined to, kind)``."""
    layout = run_layout(run)
    pma = layout.manifest.parent if layout.manifest is not None else run / PMA_SUBDIR
    merged = pma / "merged"
    return [
        (merged / TRAINING_RECORD_NAME, merged, "trainer_state"),
        (snapshot.path / "config.json", snapshot.confined_to, "config"),
    ]


def recorded_settings(run: Path, snapshot: CheckpointSource) -> dict[str, Any]:
    """The run's scalar settings (see the module docstring): a key of the training record wins
    over the same key of the model config."""
    settings: dict[str, Any] = {}
    for path, folder, kind in settings_files(run, snapshot):
        if not (path.is_file() or path.is_symlink()):
            continue
        record = read_json(path, folder, kind=kind)
        if not isinstance(record, dict):
            raise ValueError(f"{escape(path)}: expected a JSON object")
        for key, value in record.items():
            if isinstance(value, _SCALARS) and key not in settings:
                settings[key] = value
    return settings


def parse_group_keys(text: str | Sequence[str] | None) -> list[str]:
    """``"seed,max_steps"`` (or a list) -> ``["seed", "max_steps"]``; ``ValueError`` for an empty key."""
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    keys = [str(k).strip() for k in items]
    if not keys or any(not k for k in keys):
        raise parameter_error("group", f"{shown(text)}: expected KEY[,KEY...] (e.g. seed)")
    return list(dict.fromkeys(keys))


def group_runs(settings: Mapping[str, Mapping[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """The runs grouped by their values of ``keys``, groups in the order of their first run:
    ``[{"label": "seed=1", "values": {"seed": 1}, "runs": [...]}, ...]``. A run that records
    none of a key is a one-line ``ValueError`` naming the run and the key."""
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, recorded in settings.items():
        missing = [k for k in keys if k not in recorded]
        if missing:
            raise parameter_error(
                "group",
                f"{shown(missing[0])}: run {escape(name)} records no {shown(missing[0])} (in its "
                f"pma/merged/{TRAINING_RECORD_NAME}, written by PMATrainer, or its model's config.json)",
            )
        values = {k: recorded[k] for k in keys}
        token = tuple(repr(values[k]) for k in keys)
        label = ", ".join(f"{k}={shown(values[k])}" for k in keys)
        groups.setdefault(token, {"label": label, "values": values, "runs": []})["runs"].append(name)
    return list(groups.values())
