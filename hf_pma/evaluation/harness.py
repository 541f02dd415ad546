"""lm-evaluation-harness over an in-memory model: any task name, local YAML tasks offline.

The model and tokenizer are wrapped in lm-eval's ``HFLM`` (the tokenizer is passed too, or
``HFLM`` would look for one on the Hub by the model's name) and run through
``lm_eval.simple_evaluate``. Standard tasks (``hellaswag``, ``arc_easy``, ...) work wherever
their data is reachable; tasks from ``include_path`` folders (such as those of
:mod:`hf_pma.evaluation.generated_tasks`) work offline. Results keep lm-eval's format and flatten to
``{task: {metric: value, metric_stderr: value}}`` (:func:`flatten_lm_eval_results`).
"""

from __future__ import annotations

import difflib
import json
import logging as std_logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.utils import logging

from hf_pma.evaluation.options import DEFAULT_BOOTSTRAP_ITERS
from hf_pma.utils.parsing import is_number
from hf_pma.utils.text import escape

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

logger = logging.get_logger(__name__)

__all__ = [
    "TaskDataUnreachableError",
    "parse_task_names",
    "load_task_manager",
    "warn_if_task_code",
    "run_lm_eval",
    "private_modules_cache",
    "flatten_lm_eval_results",
    "jsonable",
]


def _import_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("lm-eval tasks need the `lm_eval` package: pip install 'hf-pma[eval]'") from err


def parse_task_names(tasks: str | Sequence[str]) -> list[str]:
    """Task names from ``"a,b"`` or ``["a", "b,c"]``, in order, without duplicates."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [name.strip() for item in items for name in str(item).split(",") if name.strip()]
    return list(dict.fromkeys(names))


def _include_paths(include_path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None) -> list[str]:
    if include_path is None:
        return []
    items = [include_path] if isinstance(include_path, (str, os.PathLike)) else list(include_path)
    paths = []
    for item in items:
        path = Path(item)
        if not path.is_dir():
            raise FileNotFoundError(f"task folder {escape(path)} (include_path) does not exist or is not a folder")
        warn_if_task_code(path)
        paths.append(str(path.absolute()))
    return paths


_TASK_CODE_SCAN_BYTES = 1 << 20


def warn_if_task_code(folder: str | os.PathLike[str]) -> list[str]:
    """Warn (once per folder) when a task YAML under ``folder`` names Python code (``!function``):
    lm-eval imports and runs it when the task loads; hf-pma leaves that to lm-eval by design and
    runs nothing of the folder itself. Returns the YAML files that name code (relative paths)."""
    from hf_pma.io.guarded import read_bytes

    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder):  # lists only: links to folders are not followed
        dirs.sort()
        for name in sorted(files):
            if not name.endswith((".yaml", ".yml")):
                continue
            try:
                text = read_bytes(Path(root) / name, folder, max_bytes=_TASK_CODE_SCAN_BYTES)
            except (OSError, ValueError):
                continue  # lm-eval says what is wrong with it when it loads the task
            if b"!function" in text:
                found.append((Path(root) / name).relative_to(folder).as_posix())
    if found:
        logger.warning(
            f"task folder {escape(folder)}: {escape(found[0])}"
            + (f" and {len(found) - 1} other YAML file(s) name" if len(found) > 1 else " names")
            + " Python code (!function), which lm-eval runs when the task loads: use only task folders you trust"
        )
    return found


def _unknown(names: Sequence[str], manager: TaskManager) -> list[str]:
    known = set(manager.all_tasks)
    # A path to a task YAML file is also a valid spec for lm-eval.
    return [n for n in names if n not in known and not (n.endswith((".yaml", ".yml")) and Path(n).is_file())]


def load_task_manager(
    tasks: str | Sequence[str],
    include_path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
) -> tuple[list[str], TaskManager]:
    """The task names and a ``TaskManager`` that knows them all; ``ValueError`` listing the close
    matches for any unknown name.

    Tasks found in ``include_path`` alone are loaded without indexing lm-eval's thousands of
    built-in tasks (about 10 s); otherwise the built-in tasks are indexed too.
    """
    _import_lm_eval()
    from lm_eval.tasks import TaskManager

    names = parse_task_names(tasks)
    if not names:
        raise ValueError("no task names given")
    paths = _include_paths(include_path)
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if not _unknown(names, local):
            return names, local
    manager = TaskManager(include_path=paths or None)
    unknown = _unknown(names, manager)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hints.append(f"{name!r} (close matches: {', '.join(close)})" if close else f"{name!r} (no close match)")
        where = f" in lm-eval or {', '.join(paths)}" if paths else " in lm-eval (local YAML tasks need include_path)"
        raise ValueError(f"unknown task(s){where}: {'; '.join(hints)}")
    return names, manager


@contextmanager
def _quiet(logger_name: str, level: int = std_logging.ERROR):
    # HFLM warns "do not launch via accelerate" for any in-memory model; hf-pma handles that
    # itself (main process only), so the warning would only mislead.
    target = std_logging.getLogger(logger_name)
    old = target.level
    target.setLevel(level)
    try:
        yield
    finally:
        target.setLevel(old)


# lm-eval's simple_evaluate ends by describing the machine for its results file: `git describe`
# (which prints "fatal: not a git repository" outside a checkout) and torch's collect_env, which
# runs pip, nvidia-smi and a dozen more subprocesses (0.7 s of CPU here, more on a cluster node)
# at every evaluation: a sweep pays it per combination. hf-pma keeps none of it.
_ENVIRONMENT_REPORT = ("add_env_info", "get_git_commit_hash")
_environment_report_lock = threading.Lock()
_environment_report_saved: dict[str, Any] = {}
_environment_report_off = 0  # how many evaluations are running without it


@contextmanager
def _without_environment_report():
    """lm-eval's machine report skipped while hf-pma evaluates (threads may overlap: the last
    one out puts lm-eval's functions back)."""
    import lm_eval.evaluator as evaluator

    global _environment_report_off
    with _environment_report_lock:
        if _environment_report_off == 0:
            for name in _ENVIRONMENT_REPORT:
                if callable(getattr(evaluator, name, None)):
                    _environment_report_saved[name] = getattr(evaluator, name)
                    setattr(evaluator, name, _no_environment_report)
        _environment_report_off += 1
    try:
        yield
    finally:
        with _environment_report_lock:
            _environment_report_off -= 1
            if _environment_report_off == 0:
                for name, original in _environment_report_saved.items():
                    setattr(evaluator, name, original)
                _environment_report_saved.clear()


def _no_environment_report(*_args: Any) -> None:
    return None


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: str | Sequence[str],
    include_path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
    log_samples: bool = False,
    task_manager: TaskManager | None = None,
    max_length: int | None = None,
    logits_cache: bool = False,
    **simple_evaluate_kwargs: Any,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on an in-memory causal LM; lm-eval's results dict.

    ``tasks``: names (``"hellaswag,arc_easy"`` or a list), groups, tags or YAML paths;
    ``include_path``: folders of local YAML tasks; ``limit``: examples per task (for quick
    checks: a partial task is not comparable to published numbers). Pass a ``task_manager``
    from :func:`load_task_manager` to reuse it across models. The model's train/eval mode is
    restored afterwards. Under several processes this runs on the main process only.

    ``logits_cache`` is off by default: in lm-eval 0.4.13, HFLM's cache shares one forward pass
    among requests whose ``context + continuation[:-1]`` tokens are equal, and when their
    continuations differ in length it scores the shorter one on the first positions of the
    longer one's logits instead of the last, which gives wrong log-likelihoods (seen here when
    the same text is split at two places, e.g. a next-line and a cloze item on one line).
    """
    from hf_pma.utils.distributed import run_on_main_process

    hflm_kwargs = {"batch_size": batch_size, "max_length": max_length, "logits_cache": logits_cache}
    if task_manager is None:
        names, task_manager = load_task_manager(tasks, include_path)
    else:
        names = parse_task_names(tasks)
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    return run_on_main_process(
        _run_lm_eval,
        model,
        tokenizer,
        names,
        task_manager,
        dict(
            limit=limit,
            batch_size=batch_size,
            num_fewshot=num_fewshot,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            **simple_evaluate_kwargs,
        ),
        hflm_kwargs,
    )


def _run_lm_eval(
    model: Any,
    tokenizer: Any,
    names: list[str],
    task_manager: TaskManager,
    kwargs: dict[str, Any],
    hflm_kwargs: dict[str, Any],
) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from hf_pma.utils.distributed import require_unsharded_model

    model = require_unsharded_model(model)
    was_training = model.training
    try:
        with _quiet("lm_eval.models.huggingface"):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, **hflm_kwargs)
        logger.info(f"lm-eval: {', '.join(names)}")
        try:
            with _without_environment_report(), private_modules_cache():
                results = simple_evaluate(model=lm, tasks=names, task_manager=task_manager, **kwargs)
        except ConnectionError as err:
            raise TaskDataUnreachableError.from_error(names, task_manager, err) from err
    finally:
        model.train(was_training)
    if results is None:  # simple_evaluate answers on its rank 0 only
        raise RuntimeError("lm_eval.simple_evaluate returned no results on the main process")
    return results


@contextmanager
def private_modules_cache() -> Iterator[Path]:
    """Point `evaluate`'s module cache at a fresh folder of this process while lm-eval runs.

    A task naming a metric lm-eval does not ship is loaded by lm-eval with ``evaluate.load(name)``,
    which imports the metric's script from ``HF_HOME/modules`` (offline: the newest copy found
    there), a cache another user may write. Inside this block it can only import what it fetches
    itself, into a folder created here (mode 0700) and removed afterwards, with its place on
    ``sys.path`` and the modules imported from it. Yields the folder."""
    import shutil
    import sys
    import tempfile

    try:
        from evaluate import config as evaluate_config
    except ImportError:  # pragma: no cover - lm-eval installs evaluate
        yield Path(tempfile.gettempdir())
        return
    folder = Path(tempfile.mkdtemp(prefix="hf-pma-evaluate-modules-"))
    before = evaluate_config.HF_MODULES_CACHE
    evaluate_config.HF_MODULES_CACHE = folder
    # Packages imported from the shared cache earlier in this process would be found first.
    shared = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] == "evaluate_modules"}
    try:
        yield folder
    finally:
        evaluate_config.HF_MODULES_CACHE = before
        sys.modules.update(shared)
        sys.path[:] = [p for p in sys.path if p != str(folder)]
        for name in [n for n, m in sys.modules.items() if str(getattr(m, "__file__", "") or "").startswith(str(folder))]:
            del sys.modules[name]
        shutil.rmtree(folder, ignore_errors=True)


class TaskDataUnreachableError(ConnectionError):
    """An lm-eval task needs a dataset from the Hugging Face Hub, which cannot be reached (no
    network, or ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set) and is not in the local cache.

    The message names the task(s) and the dataset, and how to run offline.
    """

    def __init__(self, tasks: Sequence[str], dataset: str | None, reason: str) -> None:
        self.tasks, self.dataset, self.reason = list(tasks), dataset, reason
        needs = f"needs the dataset {dataset!r}" if dataset else "needs a dataset"
        super().__init__(
            f"lm-eval task {', '.join(self.tasks)} {needs} from the Hugging Face Hub, which is not reachable ({reason}); "
            "to evaluate offline, use local YAML tasks (include_path=, --include-path DIR; e.g. from `hf-pma make-tasks`), or a "
            "local copy of the data: a task YAML whose dataset_path points to local files, or the datasets cache "
            "filled once while online"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.tasks, self.dataset, self.reason)

    @classmethod
    def from_error(cls, names: Sequence[str], task_manager: Any, error: BaseException) -> TaskDataUnreachableError:
        """The error for ``datasets``' ``ConnectionError`` while building ``names``: the dataset
        is read from its message, the task(s) from the task manager's index."""
        match = re.search(r"reach '([^']+)'", str(error))
        dataset = match[1] if match else None
        tasks = [n for n in names if dataset is not None and _dataset_path(task_manager, n) == dataset] or list(names)
        return cls(tasks, dataset, str(error))


def _dataset_path(task_manager: Any, name: str) -> str | None:
    """The ``dataset_path`` of a task in lm-eval's index, when it is known without loading the task."""
    entry = getattr(task_manager, "task_index", {}).get(name)
    config = getattr(entry, "cfg", None)
    return config.get("dataset_path") if isinstance(config, dict) else None


def flatten_lm_eval_results(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{task: {metric: value, metric_stderr: value}}`` from lm-eval's results (or its
    ``"results"`` section).

    lm-eval's keys are ``"<metric>,<filter>"``: the default filter ``none`` is dropped
    (``"acc,none"`` -> ``"acc"``, ``"acc_stderr,none"`` -> ``"acc_stderr"``), other filters are
    kept (``"exact_match,strict-match"``). A stderr lm-eval could not compute (``"N/A"``) is
    ``None``. Non-metric entries (alias, sample counts) are left out.
    """
    section = results.get("results", results)
    flat: dict[str, dict[str, float | None]] = {}
    for task, metrics in section.items():
        if not isinstance(metrics, dict):
            continue
        row: dict[str, float | None] = {}
        for key, value in metrics.items():
            if "," not in str(key) or isinstance(value, bool):
                continue
            metric, _, filt = str(key).partition(",")
            name = metric if filt == "none" else str(key)
            if is_number(value):
                row[name] = float(value)
            elif metric.endswith("_stderr"):
                row[name] = None
        if row:
            flat[str(task)] = row
    return flat


def jsonable(results: dict[str, Any], keep_samples: bool = False) -> dict[str, Any]:
    """lm-eval's results as plain JSON values (per-sample logs dropped unless ``keep_samples``)."""
    from lm_eval.utils import handle_non_serializable

    data = {k: v for k, v in results.items() if keep_samples or k != "samples"}
    return json.loads(json.dumps(data, default=handle_non_serializable))
