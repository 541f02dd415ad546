"""Why a merge helps (or not): the geometry of a run's snapshots, from one Gram matrix.

The PMA paper (arXiv 2505.12082) explains it: around an optimum, the merge of N snapshots beats the
average of its members when their deviations are complementary (the snapshots oscillate around
the basin on different sides). The diagnostics report cheap proxies of that, in four modules,
whose names this one gathers:

* :mod:`hf_pma.analysis.gram`: the Gram matrix of K checkpoints' weights, read tensor by
  tensor in bounded memory (:func:`compute_gram`);
* :mod:`hf_pma.analysis.geometry`: the pure linear algebra on it (:func:`window_diagnostics`,
  :func:`training_series`; the module's docstring says what each number means);
* :mod:`hf_pma.analysis.diagnostics_text` and :mod:`hf_pma.analysis.diagnostics_plot`: the
  numbers as plain-text tables, a one-sentence reading, and a figure;
* :mod:`hf_pma.analysis.snapshot_listing`: a run's snapshots as rows and a table.

:mod:`hf_pma.analysis.inspection` puts them together as ``hf-pma inspect`` does.
"""

from __future__ import annotations

from hf_pma.analysis.diagnostics_plot import plot_diagnostics
from hf_pma.analysis.diagnostics_text import diagnostics_table, reading, series_table
from hf_pma.analysis.geometry import (
    WindowDiagnostics,
    centered_gram,
    cosine_matrix,
    distances_to_merge,
    pairwise_distance,
    strategy_weights,
    training_series,
    window_diagnostics,
    window_indices,
)
from hf_pma.analysis.gram import GramMatrix, compute_gram
from hf_pma.analysis.snapshot_listing import snapshot_rows, snapshot_table, source_row

__all__ = [
    "GramMatrix",
    "WindowDiagnostics",
    "compute_gram",
    "centered_gram",
    "cosine_matrix",
    "distances_to_merge",
    "pairwise_distance",
    "window_diagnostics",
    "training_series",
    "window_indices",
    "snapshot_rows",
    "source_row",
    "snapshot_table",
    "diagnostics_table",
    "series_table",
    "reading",
    "plot_diagnostics",
    "strategy_weights",
]
