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
    "MergeError": "hf_pma.merge",
    "resolve_sources": "hf_pma.sources",
    "read_manifest": "hf_pma.snapshots",
    "SnapshotRecord": "hf_pma.snapshots",
    "PMACallback": "hf_pma.callback",
    "PMATrainer": "hf_pma.trainer",
    "PMATrainingArguments": "hf_pma.trainer",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_pma' has no attribute {name!r}")
