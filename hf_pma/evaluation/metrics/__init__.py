"""Evaluation modules for the `evaluate` library, shipped inside hf-pma.

``evaluate.load("accuracy")`` fetches its script from the Hub, so it fails offline, and
``evaluate.load(<path>)`` copies the script into ``HF_HOME/modules`` and imports it from there
(where another user of a shared cache can plant code, and which a read-only ``HF_HOME`` refuses).
:func:`load_metric` instead builds the module's class from the installed package, imported as
any other module of hf-pma: no network, no copy, no import from a cache. hf-pma's own held-out
evaluation does not go through `evaluate` at all (:mod:`hf_pma.evaluation.metrics.totals`).
"""

from __future__ import annotations

import importlib
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
    """The shipped evaluate module ``name``, built from the installed package (kept in memory;
    ``kwargs`` go to its constructor): never ``evaluate.load``, so no Hub access and no code
    imported from ``HF_HOME/modules``."""
    metric_path(name)  # an unknown name is refused in one line
    try:
        import evaluate
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("hf-pma evaluation needs the `evaluate` package: pip install 'hf-pma[eval]'") from err
    module = importlib.import_module(f"{__name__}.{name}")
    classes = [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, evaluate.EvaluationModule) and value.__module__ == module.__name__
    ]
    kwargs.setdefault("keep_in_memory", True)
    return classes[0](**kwargs)
