"""The evaluation record (``pma_eval.json``) that the model card reads, and flat results as a table.

:func:`write_eval_record` adds results to a folder's record under the folder's claim (two jobs
recording into one folder both keep theirs); :func:`read_eval_record` reads it back, checked;
:func:`results_table` renders flat results (``{label: {task: {metric: value}}}``) as markdown.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_pma.core.manifest import EVAL_RECORD_NAME, check_eval_comparison, check_eval_results
from hf_pma.io.guarded import read_json
from hf_pma.utils.distributed import run_on_main_process
from hf_pma.utils.formatting import MISSING, format_metric, markdown_table, metric_label
from hf_pma.utils.fs import atomic_write_json, hold_claim
from hf_pma.utils.logs import get_logger
from hf_pma.utils.text import escape, shown

logger = get_logger(__name__)

__all__ = ["EVAL_RECORD_NAME", "write_eval_record", "read_eval_record", "results_table"]


def _other_documents(earlier: Mapping[str, Any], eval_dataset: Any, eval_documents: Any) -> bool:
    """Whether results on a held-out set are on other documents than a record's (``earlier``).
    Fingerprints (``eval_documents``: :func:`~hf_pma.evaluation.corpus.documents_fingerprint`)
    decide where both have one, whatever the sets are called; otherwise (a record written before
    fingerprints) their names do. A record or an update that names neither is taken to be on the same."""
    before = earlier.get("eval_documents")
    if isinstance(before, str) and isinstance(eval_documents, str):
        return before != eval_documents
    name = earlier.get("eval_dataset")
    return name is not None and eval_dataset is not None and str(name) != str(eval_dataset)


def write_eval_record(
    folder: str | os.PathLike[str],
    results: Mapping[str, Mapping[str, Mapping[str, float | None]]],
    eval_dataset: str | None = None,
    update: bool = True,
    eval_documents: str | None = None,
) -> Path:
    """Write ``pma_eval.json`` into ``folder`` (atomically): ``{"results": {label: {task:
    {metric: value}}}, "eval_dataset": ...}``, the record the model card reads.

    ``results`` is ``evaluate_models(...)["results"]`` or ``{label: evaluate_model(...)["results"]}``,
    labels such as ``"last snapshot"``, ``"PMA merge"``, ``"annealed"``. With ``update`` the new
    results are merged into an existing record: models, tasks and metrics are added or updated,
    everything else is kept (the other models' results, the metrics not given again, the record's
    other keys such as ``comparison``, and its ``eval_dataset`` unless a new one is given).
    A record is of one held-out set, identified by ``eval_documents`` (the fingerprint of its
    documents, ``evaluate_models(...)["eval_documents"]``; by ``eval_dataset``, its name, where
    the record or the update has none): results on other documents start it afresh, and the log
    says that the earlier results and their ``comparison`` (computed on the other documents) were
    dropped. ``update=False`` starts afresh. Under several processes
    only the main process writes.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    check_eval_results(results)
    path = folder / EVAL_RECORD_NAME

    def write() -> Path:
        # Read, update and replace under the folder's claim: two jobs recording into one folder
        # both keep their results (the second waits for the first), and a merge replacing it is waited for.
        with hold_claim(folder, what="--record folder"):
            record: dict[str, Any] = {"results": {}, "eval_dataset": None}
            if update and path.is_file():
                earlier = read_eval_record(folder)
                if _other_documents(earlier, eval_dataset, eval_documents):
                    logger.warning(
                        f"{escape(path)} held results on {shown(earlier.get('eval_dataset'))}; these are on "
                        f"{shown(eval_dataset)}: the record now holds only them (the earlier results and their "
                        "comparison, computed on other documents, are dropped)"
                    )
                else:
                    record.update(earlier)  # every key kept (e.g. "comparison")
            merged = {str(k): {str(t): dict(m) for t, m in v.items()} for k, v in record["results"].items()}
            for label, tasks in results.items():
                for task, metrics in tasks.items():
                    merged.setdefault(str(label), {}).setdefault(str(task), {}).update(metrics)
            record["results"] = merged
            if eval_dataset is not None:
                record["eval_dataset"] = str(eval_dataset)
            if eval_documents is not None:
                record["eval_documents"] = str(eval_documents)
            atomic_write_json(path, record)
        logger.info(f"Wrote {path}")
        return path

    return run_on_main_process(write)


def read_eval_record(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``pma_eval.json`` record of ``folder``; ``ValueError`` naming the file when malformed."""
    path = Path(folder) / EVAL_RECORD_NAME
    data = read_json(path, folder, kind="record")
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError(
            f"{escape(path)} should hold an object with a 'results' object (label -> task -> metric)"
        )
    check_eval_results(data["results"], f"{escape(path)}: results")
    check_eval_comparison(data.get("comparison"), f"{escape(path)}: comparison")  # the card reads it
    return data


def results_table(results: Mapping[str, Mapping[str, Mapping[str, float | None]]]) -> str:
    """A markdown table of flat results: one row per ``task/metric``, one column per model
    label; a metric's stderr is shown beside it (``0.3120 ± 0.0140``)."""
    labels = list(results)
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for label in labels:
        for task, metrics in results[label].items():
            for metric, value in metrics.items():
                base, _, filt = metric.partition(",")
                if base.endswith("_stderr"):
                    continue
                stderr = metrics.get(f"{base}_stderr{',' + filt if filt else ''}")
                rows.setdefault((task, metric), {})[label] = format_metric(value, stderr)
    body = [
        [f"{task}/{metric_label(task, metric)}", *(cells.get(label, MISSING) for label in labels)]
        for (task, metric), cells in rows.items()
    ]
    return markdown_table(["metric", *labels], body)
