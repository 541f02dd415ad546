"""hf-pma: Pre-trained Model Averaging (arXiv 2505.12082) for Hugging Face Transformers.

Heavy submodules (torch, transformers) are imported lazily so that ``import hf_pma`` and the
pure parts (strategies, schedule) stay cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0.dev0"  # the top heading of CHANGELOG.md; tests/test_package.py checks it

_LAZY = {
    "merge_weights": "hf_pma.core.strategies",
    "STRATEGIES": "hf_pma.core.strategies",
    "merge_checkpoints": "hf_pma.merging.engine",
    "merge_state_dict": "hf_pma.merging.engine",
    "MergeError": "hf_pma.merging.engine",
    "resolve_sources": "hf_pma.merging.sources",
    "read_manifest": "hf_pma.core.manifest",
    "SnapshotRecord": "hf_pma.core.manifest",
    "PMACallback": "hf_pma.snapshots.callback",
    "PMASnapshots": "hf_pma.training.loop",
    "SnapshotTaker": "hf_pma.snapshots.taker",
    "TakenSnapshot": "hf_pma.snapshots.taker",
    "SnapshotWriter": "hf_pma.snapshots.writer",
    "SnapshotSchedule": "hf_pma.core.schedule",
    "SnapshotSink": "hf_pma.snapshots.sinks",
    "DiskSnapshotSink": "hf_pma.snapshots.sinks",
    "OnlineAverageSink": "hf_pma.snapshots.sinks",
    "gather_full_state_dict": "hf_pma.snapshots.gather",
    "PMATrainer": "hf_pma.training.trainer",
    "PMATrainingArguments": "hf_pma.training.arguments",
    "LossSpikeError": "hf_pma.training.recovery",
    "SpikeDetector": "hf_pma.training.recovery",
    "SpikeRecovery": "hf_pma.training.recovery",
    "recover_from_spike": "hf_pma.training.recovery",
    "pma_init": "hf_pma.training.recovery",
    "evaluate_language_modeling": "hf_pma.evaluation.evaluator",
    "evaluate_model": "hf_pma.evaluation.evaluator",
    "evaluate_models": "hf_pma.evaluation.evaluator",
    "write_eval_record": "hf_pma.evaluation.evaluator",
    "split_documents": "hf_pma.evaluation.corpus",
    "make_tasks": "hf_pma.evaluation.generated_tasks",
    "build_model_card": "hf_pma.publishing.card",
    "write_model_card": "hf_pma.publishing.card",
    "plot_training": "hf_pma.publishing.plot",
    "push_folder_to_hub": "hf_pma.publishing.hub",
    "enable_logging": "hf_pma.utils.logs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_pma' has no attribute {name!r}")
