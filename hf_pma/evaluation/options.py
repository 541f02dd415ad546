"""Evaluation options as one dataclass, shared by the library, ``hf-pma eval`` and ``hf-pma sweep``.

:class:`EvalOptions` says *how* models are evaluated (lm-eval tasks, limits, batch and window
sizes); :func:`hf_pma.evaluation.evaluator.evaluate_model`, :func:`~hf_pma.evaluation.evaluator.evaluate_models`
and :func:`hf_pma.analysis.sweep.run_sweep` take one, and the command-line flags are generated
from its fields (:meth:`EvalOptions.add_arguments`), so a default is written once. Torch-free:
the CLI builds its parser from it without loading torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from hf_pma.utils.argtypes import non_negative_int, positive_int
from hf_pma.utils.parsing import check_int

__all__ = ["DEFAULT_BOOTSTRAP_ITERS", "EvalOptions"]

# lm-eval's bootstrap resamples only for the stderr of metrics that are not plain means (the
# stderr of accuracies is computed in closed form), so 1,000 resamples (about 3% relative error
# on a stderr) are plenty for a comparison and cost 100x less than lm-eval's own 100,000.
DEFAULT_BOOTSTRAP_ITERS = 1000


def _field(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclasses.dataclass
class EvalOptions:
    """How models are evaluated: lm-eval tasks and the settings of every evaluation.

    ``texts`` (held-out documents) are passed beside it: they are data, not options.
    """

    tasks: str | Sequence[str] | None = _field(
        None,
        "comma-separated lm-eval task, group or tag names (e.g. hellaswag,arc_easy); a task's YAML can run "
        "Python (lm-eval's !function), so name only tasks you trust",
    )
    include_path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = _field(
        None,
        "folder of local lm-eval YAML tasks, e.g. from `hf-pma make-tasks` (repeatable; works offline). A task "
        "folder is code: lm-eval runs the Python its YAML names (!function), so give only folders you trust",
        action="append",
        metavar="DIR",
    )
    limit: int | None = _field(None, "at most K examples per task and K held-out documents", kind="positive", metavar="K")
    batch_size: int = _field(8, "batch size", kind="positive")
    block_size: int | None = _field(None, "held-out LM window (default: the model's context)", kind="positive")
    stride: int | None = _field(None, "held-out LM window step (default: block size / 2)", kind="positive")
    num_fewshot: int | None = _field(None, "few-shot examples for lm-eval tasks (default: the task's)", kind="non-negative")
    bootstrap_iters: int = _field(
        DEFAULT_BOOTSTRAP_ITERS, "lm-eval bootstrap resamples for the stderr of non-mean metrics (0: none)",
        kind="non-negative",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.metadata.get("kind")
            if kind is None or value is None:
                continue
            check_int(value, f.name, 1 if kind == "positive" else 0, allow_none=f.default is None)

    def replace(self, **fields: Any) -> EvalOptions:
        """A copy with ``fields`` changed (``ValueError`` naming an unknown or bad field)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unknown evaluation option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **fields)

    @classmethod
    def build(cls, options: EvalOptions | None = None, **fields: Any) -> EvalOptions:
        """``options`` (or the defaults) with ``fields`` changed: how the evaluation functions
        accept both an :class:`EvalOptions` and its fields as keyword arguments."""
        if options is not None and not isinstance(options, EvalOptions):
            raise TypeError(f"options must be an EvalOptions, got {type(options).__name__}")
        return (options or cls()).replace(**fields) if fields else (options or cls())

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one command-line flag per field (``--batch-size`` for ``batch_size``...)."""
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            help_text, kind = meta.pop("help"), meta.pop("kind", None)
            if f.default is not None:
                help_text += " (default: %(default)s)"  # rendered from the value the flag has
            if kind is not None:
                meta["type"] = positive_int if kind == "positive" else non_negative_int
            parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=help_text, **meta)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EvalOptions:
        """The options that :meth:`add_arguments`' flags were given."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

