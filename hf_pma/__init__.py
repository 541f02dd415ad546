"""hf-pma: Pre-trained Model Averaging (arXiv 2505.12082) for Hugging Face Transformers.

Heavy submodules (torch, transformers) are imported lazily so that ``import hf_pma`` and the
pure parts (strategies, schedule) stay cheap: :data:`_LAZY` says which module each exported
name lives in, and the ``TYPE_CHECKING`` imports below say the same to type checkers and IDEs
(``tests/test_package.py`` checks that the two lists agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hf_pma.utils.version import __version__

# Exported name -> the module it is defined in (imported on first use).
_LAZY = {
    # merge coefficients, merging
    "merge_coefficients": "hf_pma.core.strategies",
    "merge_weights": "hf_pma.core.strategies",  # deprecated name of merge_coefficients
    "STRATEGIES": "hf_pma.core.strategies",
    "merge_checkpoints": "hf_pma.merging.engine",
    "merge_state_dict": "hf_pma.merging.engine",
    "MergeError": "hf_pma.merging.chunks",
    "resolve_sources": "hf_pma.merging.sources",
    # the on-disk contract
    "read_manifest": "hf_pma.core.manifest",
    "SnapshotRecord": "hf_pma.core.manifest",
    "EVAL_RECORD_NAME": "hf_pma.core.manifest",
    # snapshots
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
    # training
    "PMATrainer": "hf_pma.training.trainer",
    "PMATrainingArguments": "hf_pma.training.arguments",
    "parse_with_config": "hf_pma.training.arguments",
    "LossSpikeError": "hf_pma.training.recovery",
    "SpikeDetector": "hf_pma.training.recovery",
    "SpikeRecovery": "hf_pma.training.recovery",
    "recover_from_spike": "hf_pma.training.recovery",
    "pma_init": "hf_pma.training.recovery",
    "check_decay_type": "hf_pma.training.annealing",
    "save_full_model": "hf_pma.training.saving",
    "stdlib_documents": "hf_pma.training.pretrain_data",
    "read_documents": "hf_pma.training.pretrain_data",
    "train_bpe_tokenizer": "hf_pma.training.pretrain_data",
    "pack_dataset": "hf_pma.training.pretrain_data",
    "full_batches": "hf_pma.training.pretrain_data",
    # evaluation
    "EvalOptions": "hf_pma.evaluation.options",
    "evaluate_language_modeling": "hf_pma.evaluation.language_modeling",
    "evaluate_model": "hf_pma.evaluation.evaluator",
    "evaluate_models": "hf_pma.evaluation.evaluator",
    "write_eval_record": "hf_pma.evaluation.records",
    "read_eval_record": "hf_pma.evaluation.records",
    "results_table": "hf_pma.evaluation.records",
    "load_documents": "hf_pma.evaluation.corpus",
    "split_documents": "hf_pma.evaluation.corpus",
    "TaskOptions": "hf_pma.evaluation.task_options",
    "make_tasks": "hf_pma.evaluation.generated_tasks",
    "make_tasks_from_split": "hf_pma.evaluation.generated_tasks",
    "fits_context": "hf_pma.evaluation.generated_tasks",
    # publishing
    "build_model_card": "hf_pma.publishing.card",
    "write_model_card": "hf_pma.publishing.card",
    "comparison_table": "hf_pma.publishing.card",
    "plot_training": "hf_pma.publishing.plot",
    "push_folder_to_hub": "hf_pma.publishing.hub",
    "check_repo_id": "hf_pma.publishing.hub",
    "resolve_token": "hf_pma.publishing.hub",
    # processes, logging, shown text
    "enable_logging": "hf_pma.utils.logs",
    "is_main_process": "hf_pma.utils.distributed",
    "run_on_main_process": "hf_pma.utils.distributed",
    "warn_if_fewer_processes": "hf_pma.utils.distributed",
    "redact": "hf_pma.utils.secrets",
    "command_line": "hf_pma.utils.text",
    "CommandLineParser": "hf_pma.utils.parsing",
    "hf_argument_parser": "hf_pma.utils.parsing",
}

if TYPE_CHECKING:  # what _LAZY says, for type checkers and IDEs (nothing is imported at run time)
    from hf_pma.core.manifest import EVAL_RECORD_NAME, SnapshotRecord, read_manifest
    from hf_pma.core.schedule import SnapshotSchedule
    from hf_pma.core.strategies import STRATEGIES, merge_coefficients, merge_weights
    from hf_pma.evaluation.corpus import load_documents, split_documents
    from hf_pma.evaluation.evaluator import evaluate_model, evaluate_models
    from hf_pma.evaluation.generated_tasks import fits_context, make_tasks, make_tasks_from_split
    from hf_pma.evaluation.language_modeling import evaluate_language_modeling
    from hf_pma.evaluation.options import EvalOptions
    from hf_pma.evaluation.records import read_eval_record, results_table, write_eval_record
    from hf_pma.evaluation.task_options import TaskOptions
    from hf_pma.merging.chunks import MergeError
    from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.publishing.card import build_model_card, comparison_table, write_model_card
    from hf_pma.publishing.hub import check_repo_id, push_folder_to_hub, resolve_token
    from hf_pma.publishing.plot import plot_training
    from hf_pma.snapshots.callback import PMACallback
    from hf_pma.snapshots.gather import gather_full_state_dict
    from hf_pma.snapshots.sinks import DiskSnapshotSink, OnlineAverageSink, SnapshotSink
    from hf_pma.snapshots.taker import SnapshotTaker, TakenSnapshot
    from hf_pma.snapshots.writer import SnapshotWriter
    from hf_pma.training.annealing import check_decay_type
    from hf_pma.training.arguments import PMATrainingArguments, parse_with_config
    from hf_pma.training.loop import PMASnapshots
    from hf_pma.training.pretrain_data import (
        full_batches,
        pack_dataset,
        read_documents,
        stdlib_documents,
        train_bpe_tokenizer,
    )
    from hf_pma.training.recovery import (
        LossSpikeError,
        SpikeDetector,
        SpikeRecovery,
        pma_init,
        recover_from_spike,
    )
    from hf_pma.training.saving import save_full_model
    from hf_pma.training.trainer import PMATrainer
    from hf_pma.utils.distributed import is_main_process, run_on_main_process, warn_if_fewer_processes
    from hf_pma.utils.logs import enable_logging
    from hf_pma.utils.parsing import CommandLineParser, hf_argument_parser
    from hf_pma.utils.secrets import redact
    from hf_pma.utils.text import command_line

# Spelled out (not built from _LAZY) so that type checkers read it; tests/test_package.py checks it.
__all__ = [
    "__version__",
    "merge_coefficients",
    "merge_weights",
    "STRATEGIES",
    "merge_checkpoints",
    "merge_state_dict",
    "MergeError",
    "resolve_sources",
    "read_manifest",
    "SnapshotRecord",
    "EVAL_RECORD_NAME",
    "PMACallback",
    "PMASnapshots",
    "SnapshotTaker",
    "TakenSnapshot",
    "SnapshotWriter",
    "SnapshotSchedule",
    "SnapshotSink",
    "DiskSnapshotSink",
    "OnlineAverageSink",
    "gather_full_state_dict",
    "PMATrainer",
    "PMATrainingArguments",
    "parse_with_config",
    "LossSpikeError",
    "SpikeDetector",
    "SpikeRecovery",
    "recover_from_spike",
    "pma_init",
    "check_decay_type",
    "save_full_model",
    "stdlib_documents",
    "read_documents",
    "train_bpe_tokenizer",
    "pack_dataset",
    "full_batches",
    "EvalOptions",
    "evaluate_language_modeling",
    "evaluate_model",
    "evaluate_models",
    "write_eval_record",
    "read_eval_record",
    "results_table",
    "load_documents",
    "split_documents",
    "TaskOptions",
    "make_tasks",
    "make_tasks_from_split",
    "fits_context",
    "build_model_card",
    "write_model_card",
    "comparison_table",
    "plot_training",
    "push_folder_to_hub",
    "check_repo_id",
    "resolve_token",
    "enable_logging",
    "is_main_process",
    "run_on_main_process",
    "warn_if_fewer_processes",
    "redact",
    "command_line",
    "CommandLineParser",
    "hf_argument_parser",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'hf_pma' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
