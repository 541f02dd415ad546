"""hf-pma: Pre-trained Model Averaging (arXiv 2505.12082) for Hugging Face Transformers.

Heavy submodules (torch, transformers) are imported lazily so that ``import hf_pma`` and the
pure parts (strategies, schedule) stay cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "merge_weights": "hf_pma.strategies",
    "STRATEGIES": "hf_pma.strategies",
    "merge_checkpoints": "hf_pma.merge",
    "merge_state_dict": "hf_pma.merge",
    "MergeError": "hf_pma.merge",
    "resolve_sources": "hf_pma.sources",
    "read_manifest": "hf_pma.snapshots",
    "SnapshotRecord": "hf_pma.snapshots",
    "PMACallback": "hf_pma.callback",
    "SnapshotWriter": "hf_pma.snapshot_writer",
    "gather_full_state_dict": "hf_pma.snapshot_writer",
    "PMATrainer": "hf_pma.trainer",
    "PMATrainingArguments": "hf_pma.training_args",
    "LossSpikeError": "hf_pma.trainer",
    "evaluate_language_modeling": "hf_pma.evaluation",
    "evaluate_model": "hf_pma.evaluation",
    "evaluate_models": "hf_pma.evaluation",
    "write_eval_record": "hf_pma.evaluation",
    "split_documents": "hf_pma.corpus",
    "make_tasks": "hf_pma.tasks",
    "build_model_card": "hf_pma.card",
    "write_model_card": "hf_pma.card",
    "plot_training": "hf_pma.plot",
    "push_folder_to_hub": "hf_pma.hub",
    "enable_logging": "hf_pma.logs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_pma' has no attribute {name!r}")
