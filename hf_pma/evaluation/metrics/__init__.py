"""Evaluation modules for the `evaluate` library, shipped inside hf-pma.

``evaluate.load("accuracy")`` fetches its script from the Hub, so it fails offline. The modules
here are loaded from their installed path instead (:func:`load_metric`), which never touches
the network: evaluation works the same on an air-gapped cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import evaluate

__all__ = ["METRICS", "metric_path", "load_metric"]

# Modules shipped here: name -> what it computes.
METRICS = {
    "bits_per_byte": "loss, perplexity and bits-per-byte from per-document NLL sums, token and byte counts",
}


def metric_path(name: str) -> Path:
    """The script of the shipped evaluate module ``name`` (an absolute path)."""
    if name not in METRICS:
        raise ValueError(f"unknown hf-pma metric {name!r}; shipped metrics: {', '.join(sorted(METRICS))}")
    return Path(__file__).resolve().parent / f"{name}.py"


def load_metric(name: str, **kwargs: Any) -> evaluate.EvaluationModule:
    """``evaluate.load`` of a shipped module by its local path (kept in memory, no Hub access)."""
    try:
        import evaluate
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("hf-pma evaluation needs the `evaluate` package: pip install 'hf-pma[eval]'") from err
    kwargs.setdefault("keep_in_memory", True)
    # An absolute path to an existing .py file: evaluate loads it locally and never asks the Hub.
    return evaluate.load(str(metric_path(name)), **kwargs)
