"""The annealing check: an annealed fork of a constant-LR run, and its comparison with the merge.

The merge of constant-LR snapshots predicts what annealing (the decay phase of a WSD schedule)
would give. To check the prediction on a run, fork it: resume the Trainer from one of its
checkpoints (weights, optimizer, scheduler, data position) with the learning rate decayed from
its constant value to 0 (linear, cosine or 1-sqrt) over the chosen steps or tokens, so that the
fork ends at the same tokens as a snapshot of the run. The fork is the same training as a WSD
run whose stable phase ends at the checkpoint, step for step and batch for batch.

- :func:`anneal_from_checkpoint` forks any Trainer run afterwards: pass the Trainer (the one that
  trained, or one built with the same model, arguments and data) and the checkpoint folder.
- ``PMATrainingArguments(pma_anneal_steps=...)`` (or ``pma_anneal_tokens``) makes
  :class:`~hf_pma.PMATrainer` save the checkpoint it needs and fork at the end of training.
- :func:`annealing_check` evaluates the last snapshot, the merge and the annealed model on the
  same held-out documents and writes the paired comparison into the merged folder's
  ``pma_eval.json`` (key ``comparison``), which the model card shows.

The fork writes ``<output_dir>/annealed/``: a model folder and ``pma_anneal.json`` (where it
started and ended, in steps and tokens, the decay, the peak learning rate, the checkpoint it
forked from). Under DDP and FSDP it resumes through the Trainer's own checkpoint loading
(sharded checkpoints included) on every process; nothing here gathers the model on one process
except the final save, which every process joins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as stdlib_logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.utils import logging

from hf_pma.analysis.comparison import paired_comparison, read_anneal_record, write_comparison
from hf_pma.core.manifest import ANNEAL_IN_PROGRESS, ANNEAL_RECORD_NAME, ANNEALED_DIR, PMA_SUBDIR
from hf_pma.core.strategies import DECAY_SHAPES
from hf_pma.io.guarded import read_json
from hf_pma.training.saving import save_full_model
from hf_pma.utils.distributed import run_on_main_process
from hf_pma.utils.fs import atomic_write_json
from hf_pma.utils.logs import notice
from hf_pma.utils.names import scheduler_name
from hf_pma.utils.parsing import check_int, is_int
from hf_pma.utils.text import escape, shown

__all__ = [
    "ANNEALED_DIR",
    "ANNEAL_RECORD_NAME",
    "CONSTANT_SCHEDULES",
    "DECAY_TYPES",
    "SaveCheckpointAt",
    "anneal_from_checkpoint",
    "annealing_check",
    "check_decay_type",
    "checkpoint_state",
    "fork_step",
    "schedule_name",
]

logger = logging.get_logger(__name__)

DECAY_TYPES = tuple(DECAY_SHAPES)  # linear, cosine, 1-sqrt: the shapes transformers' WSD schedule knows
CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")


# The old name of hf_pma.utils.names.scheduler_name.
schedule_name = scheduler_name


def check_decay_type(decay_type: str, name: str = "decay_type") -> None:
    """``ValueError`` naming ``name`` unless ``decay_type`` is linear, cosine or 1-sqrt."""
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"{name} must be linear, cosine or 1-sqrt, got {shown(decay_type)}")


def checkpoint_state(checkpoint: str | os.PathLike[str]) -> dict[str, int]:
    """``step``, ``tokens`` (global input tokens seen, 0 when not counted) and ``max_steps`` of a
    Trainer checkpoint folder, from its ``trainer_state.json``; one-line errors naming it."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {escape(folder)} is not a folder")
    state = read_json(folder / "trainer_state.json", folder, kind="trainer_state")
    values = {}
    for key, field in (
        ("step", "global_step"),
        ("tokens", "num_input_tokens_seen"),
        ("max_steps", "max_steps"),
    ):
        value = state.get(field, 0) if isinstance(state, dict) else None
        if not is_int(value, 0):
            raise ValueError(
                f"{escape(folder / 'trainer_state.json')}: {field} should be a count, got {shown(value)}"
            )
        values[key] = value
    return values


class _TiedKeysFilter(stdlib_logging.Filter):
    """Drops the Trainer's "There were missing keys in the checkpoint model loaded: [...]" when
    every key it names is a tied duplicate (``lm_head.weight`` tied to the input embeddings):
    checkpoints do not store those, and loading the embeddings fills them."""

    PREFIX = "There were missing keys in the checkpoint model loaded: "

    def __init__(self, tied: set[str]) -> None:
        super().__init__()
        self.tied = tied

    def filter(self, record: stdlib_logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        missing = set(re.findall(r"'([^']*)'", message[len(self.PREFIX) :]))
        return not (missing and missing <= self.tied)


@contextlib.contextmanager
def tied_keys_not_missing(model: Any) -> Iterator[None]:
    """While resuming ``model`` from a Trainer checkpoint: no warning that its tied weights are
    missing (transformers' Trainer warns unless they are in ``_keys_to_ignore_on_save``)."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = every - {name for name, _ in model.named_parameters()}
    trainer_logger = stdlib_logging.getLogger("transformers.trainer")
    log_filter = _TiedKeysFilter(tied)
    trainer_logger.addFilter(log_filter)
    try:
        yield
    finally:
        trainer_logger.removeFilter(log_filter)


class SaveCheckpointAt(TrainerCallback):
    """Saves a Trainer checkpoint (weights, optimizer, scheduler, data position) at one step:
    ``step``, or ``anneal_steps`` before the end of training, or, with ``anneal_tokens``, the step
    that many tokens before the end (tokens per step measured at the first step).
    ``forced`` says whether the Trainer would not have saved it anyway (so it may be deleted)."""

    def __init__(
        self, step: int | None = None, anneal_steps: int | None = None, anneal_tokens: int | None = None
    ):
        self.step, self.anneal_steps, self.anneal_tokens = step, anneal_steps, anneal_tokens
        self.forced = False

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback event
        if self.step is None and self.anneal_steps:
            self.step = fork_step(state.max_steps, self.anneal_steps, args)

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback event
        if self.step is None and self.anneal_tokens and state.global_step >= 1:
            tokens_per_step = state.num_input_tokens_seen / state.global_step
            if not tokens_per_step:
                raise ValueError(
                    "pma_anneal_tokens needs the input tokens counted: use pma_anneal_steps instead"
                )
            self.anneal_steps = max(1, round(self.anneal_tokens / tokens_per_step))
            self.step = fork_step(state.max_steps, self.anneal_steps, args)
        if state.global_step == self.step and not control.should_save:
            control.should_save, self.forced = True, True
        return control


def fork_step(max_steps: int, anneal_steps: int, args: Any) -> int:
    """The step a fork of ``anneal_steps`` starts from to end at ``max_steps``; ``ValueError`` when
    it would start in the warmup."""
    start = max_steps - anneal_steps
    warmup = args.get_warmup_steps(max_steps)
    if anneal_steps < 1 or start < max(1, warmup):
        raise ValueError(
            f"pma_anneal_steps ({anneal_steps}) must be shorter than the constant-LR part of the run "
            f"(max_steps {max_steps} minus the warmup, {warmup} steps)"
        )
    return start


def _fresh_model(model: Any) -> Any:
    """A new instance of ``model``'s class from its config (weights: the checkpoint's, loaded next)."""
    from transformers import PreTrainedModel

    cls = type(model)
    with contextlib.suppress(ImportError):
        from torch.distributed.fsdp import FSDPModule

        while issubclass(cls, FSDPModule):  # fully_shard made a subclass FSDP<Model>
            cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(
            f"cannot build a fresh {cls.__name__} for the fork: pass model= (or a Trainer with model_init)"
        )
    return cls._from_config(model.config, dtype=next(model.parameters()).dtype)


def _fork_arguments(
    args: Any, output_dir: Path, start: int, steps: int, max_steps: int, decay_type: str
) -> Any:
    """The run's arguments, changed into a WSD run whose stable phase ends at ``start`` (the
    scheduler's stable steps: ``max_steps`` minus the warmup and the decay)."""
    warmup = args.get_warmup_steps(max_steps)
    changes = dict(
        output_dir=str(output_dir),
        max_steps=start + steps,
        warmup_steps=warmup,
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={
            "num_decay_steps": steps,
            "decay_type": decay_type,
            "min_lr_ratio": 0.0,
        },
        eval_strategy="no",
        save_strategy="no",
        load_best_model_at_end=False,
        push_to_hub=False,
        resume_from_checkpoint=None,
        report_to="none",
    )
    if hasattr(args, "pma_anneal_steps"):  # PMATrainingArguments: the fork forks nothing itself
        changes.update(pma_anneal_steps=0, pma_anneal_tokens=None, pma_init_from=None)
    return dataclasses.replace(args, **changes)


def _check_and_mark_begun(out: Path, record: dict[str, Any]) -> None:
    """Refuse ``out`` when it holds anything but an earlier fork's, then mark it this fork's."""
    if out.exists() and any(out.iterdir()) and not (out / ANNEAL_RECORD_NAME).is_file():
        raise FileExistsError(
            f"{escape(out)} exists and holds no {ANNEAL_RECORD_NAME}: choose another output_dir"
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / ANNEAL_RECORD_NAME, record)


def _snapshot_at(run_dir: Path, tokens: int) -> str | None:
    """The name of the run's snapshot at ``tokens``, if its manifest lists one."""
    from hf_pma.core.manifest import manifest_snapshots

    pma_dir = run_dir / PMA_SUBDIR
    if not (pma_dir / "manifest.json").is_file():
        return None
    return next((r.path for r in manifest_snapshots(pma_dir) if r.tokens == tokens), None)


def anneal_from_checkpoint(
    trainer: Trainer,
    checkpoint: str | os.PathLike[str],
    *,
    steps: int | None = None,
    tokens: int | None = None,
    decay_type: str = "linear",
    output_dir: str | os.PathLike[str] | None = None,
    model: Any = None,
    callbacks: Sequence[Any] | None = None,
) -> Path:
    """Fork a constant-LR run at ``checkpoint`` (a ``checkpoint-<step>`` folder of
    ``trainer``'s run): resume it with the learning rate decayed to 0 over ``steps`` optimizer
    steps (or ``tokens`` global input tokens, turned into steps at the checkpoint's tokens per
    step), and save the annealed model. Call it on every process.

    ``trainer`` gives the arguments, the data (``train_dataset``, ``data_collator``,
    ``processing_class``), ``compute_loss_func`` and ``optimizer_cls_and_kwargs``; it may be the
    Trainer that trained the run, or one built like it with the same model class, arguments and
    datasets. The fork trains a new model instance: ``model``, else ``trainer.model_init()``,
    else a fresh one of the trainer's model class (its weights come from the checkpoint), with
    the Trainer's class (a plain ``transformers.Trainer`` for a ``PMATrainer``: a fork takes no
    snapshots; ``callbacks`` are added to it, e.g. a ``PMACallback`` with ``phases=["decay"]`` to
    snapshot the decay). Its run ends at ``step + steps``; with ``pma_interval_tokens`` chosen so that a
    snapshot falls there, the annealed model and that snapshot are at the same tokens.

    Writes ``output_dir`` (default ``<args.output_dir>/annealed``; replaced when it holds an
    earlier fork's ``pma_anneal.json``, refused when it holds anything else) with the model and
    ``pma_anneal.json``. Returns the folder. Errors (one line, before any training): a
    checkpoint that is not a folder or has no ``trainer_state.json``, a schedule that is not
    constant at the checkpoint, neither or both of ``steps`` and ``tokens``, a bad decay type.
    """
    args = trainer.args
    check_decay_type(decay_type)
    if (steps is None) == (tokens is None):
        raise ValueError("give the length of the decay as steps or as tokens (one of them)")
    if scheduler_name(args) not in CONSTANT_SCHEDULES:
        raise ValueError(
            f"the annealed fork needs a constant-LR run to fork from (lr_scheduler_type constant or "
            f"constant_with_warmup), got lr_scheduler_type {scheduler_name(args)}"
        )
    out = Path(output_dir) if output_dir is not None else Path(args.output_dir) / ANNEALED_DIR
    if out.is_symlink():  # the model and its record would land wherever it points
        raise ValueError(
            f"{escape(out)} is a symbolic link; the annealed fork writes only into a real folder (remove the "
            "link, or give output_dir)"
        )
    checkpoint = Path(checkpoint)
    state = checkpoint_state(checkpoint)
    if not any(p.name.startswith(("optimizer", "global_step")) for p in checkpoint.iterdir()):
        raise ValueError(
            f"{escape(checkpoint)} holds no optimizer state (saved with save_only_model?): the fork would "
            "restart Adam's moments; fork from a full Trainer checkpoint"
        )
    if tokens is not None:
        if not state["tokens"] or not state["step"]:
            raise ValueError(
                f"{escape(checkpoint)} counted no input tokens (include_num_input_tokens_seen): give steps"
            )
        steps = max(1, round(tokens * state["step"] / state["tokens"]))
    assert steps is not None
    check_int(steps, "steps")
    start = state["step"]
    main_max_steps = args.max_steps if args.max_steps > 0 else state["max_steps"]
    if start < args.get_warmup_steps(main_max_steps):
        raise ValueError(
            f"{escape(checkpoint)} is in the warmup (step {start}): fork from the constant-LR part"
        )
    # The folder is marked ours before the first byte of the fork lands in it: a fork killed
    # between its weights and its record leaves a folder that the next fork recognises and redoes
    # (and that no reader takes for a finished fork: read_anneal_record refuses it). The check and
    # the mark run together on the main process (its error is raised on every rank): checked on
    # every rank, a rank that looked while the main process was writing the mark saw a folder
    # holding only the mark's temporary file and refused it as someone else's.
    begun = {ANNEAL_IN_PROGRESS: True, "checkpoint": checkpoint.name, "start_step": state["step"], "steps": steps}
    run_on_main_process(lambda: _check_and_mark_begun(out, begun))

    fork_args = _fork_arguments(args, out, start, steps, main_max_steps, decay_type)
    if model is None:
        model = trainer.call_model_init() if trainer.model_init is not None else _fresh_model(trainer.model)
    # A PMATrainer's fork is a plain Trainer: it takes no snapshots.
    cls = Trainer if hasattr(trainer, "pma_callback") else type(trainer)
    extra = {}
    for name in ("compute_loss_func", "optimizer_cls_and_kwargs"):
        if getattr(trainer, name, None) is not None:
            extra[name] = getattr(trainer, name)
    fork = cls(
        model=model,
        args=fork_args,
        data_collator=trainer.data_collator,
        train_dataset=trainer.train_dataset,
        processing_class=trainer.processing_class,
        callbacks=list(callbacks) if callbacks else None,
        **extra,
    )
    notice(
        logger,
        f"Annealed fork: from {escape(checkpoint.name)} (step {start}), {decay_type} decay of the LR to 0 "
        f"over {steps} steps, to step {start + steps}"
    )
    with tied_keys_not_missing(model):
        output = fork.train(resume_from_checkpoint=str(checkpoint))
    save_full_model(fork, out)  # every process joins; FSDP with sharded checkpoints too
    end_tokens = int(fork.state.num_input_tokens_seen)
    record = {
        "checkpoint": checkpoint.name,
        "start_step": start,
        "start_tokens": state["tokens"],
        "end_step": int(fork.state.global_step),
        "end_tokens": end_tokens,
        "steps": steps,
        "tokens": end_tokens - state["tokens"],
        "decay_type": decay_type,
        "learning_rate": args.learning_rate,
        "lr_scheduler_type": "warmup_stable_decay",
        "train_loss": output.training_loss if math.isfinite(output.training_loss) else None,
        "snapshot": None,
    }

    def write() -> None:
        record["snapshot"] = _snapshot_at(Path(args.output_dir), end_tokens)
        if record["snapshot"] is None:
            logger.warning(
                f"no snapshot of the run at the fork's end ({end_tokens} tokens): the annealed model is not at the "
                "tokens of a snapshot (make the run's tokens a multiple of pma_interval_tokens)"
            )
        atomic_write_json(out / ANNEAL_RECORD_NAME, record)

    run_on_main_process(write)
    return out


def _live_model(trainer: Any, live: str | os.PathLike[str] | None) -> Path:
    """The live model at the end of training: ``live`` if the caller saved it there, else saved
    now (every process joins) to ``<output_dir>/final``."""
    if live is not None:
        if not Path(live).is_dir():
            raise ValueError(f"live={escape(live)} is not a folder: save the live model there first, or leave it out")
        return Path(live)
    final = Path(trainer.args.output_dir) / "final"
    save_full_model(trainer, final)
    logger.info(f"saved the live model at the end of training to {escape(final)} for the comparison")
    return final


def annealing_check(
    trainer: Any,
    texts: Sequence[str],
    *,
    annealed: str | os.PathLike[str] | None = None,
    tasks: str | None = None,
    include_path: str | os.PathLike[str] | None = None,
    block_size: int | None = None,
    eval_dataset: str | None = None,
    live: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Evaluate the last snapshot, the merge and the annealed model of a finished
    :class:`~hf_pma.PMATrainer` run on the same held-out ``texts`` (and lm-eval ``tasks``), write
    the results and the paired comparison into the merged folder's ``pma_eval.json``, and the
    card. Call it on every process (the evaluation runs on the main process).

    ``annealed``: the annealed model's folder (default: the trainer's fork, if any). Without one,
    a run with a decaying schedule contributes its live model at the end as the annealed model.
    When the last snapshot is not at the end of the run and there is a fork, the live model at
    the end stands in for the last snapshot. That live model is ``live`` (a folder you saved it
    to, e.g. with :func:`~hf_pma.training.saving.save_full_model`), else it is saved to
    ``<output_dir>/final`` when the comparison needs it. Everything is checked before anything
    is saved or evaluated: the merge, the snapshots, ``texts``, the fork's record, ``live``.
    Returns ``evaluate_models``' report with ``comparison`` added (``None`` without ``texts``:
    the paired comparison is of held-out documents).
    """
    from hf_pma.evaluation.evaluator import evaluate_models
    from hf_pma.evaluation.records import write_eval_record

    if trainer.pma_merged_dir is None:
        raise ValueError("no merged model: train with pma_merge_at_end (and at least one snapshot) first")
    if isinstance(texts, (str, bytes)) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a list of held-out documents (strings)")
    if not texts and not tasks:
        raise ValueError("nothing to compare on: give held-out texts and/or tasks")
    annealed = annealed if annealed is not None else getattr(trainer, "pma_annealed_dir", None)
    snapshots = trainer.pma_callback.snapshots()
    if not snapshots:
        raise ValueError("no snapshot to compare with")
    fork = read_anneal_record(annealed) if annealed is not None else None
    record, last = snapshots[-1]
    at_end = record.step == trainer.state.global_step
    models: dict[str, Any] = {"last snapshot": last, "PMA merge": trainer.pma_merged_dir}
    if annealed is not None and not at_end:
        logger.warning(
            f"the last snapshot is at step {record.step}, not at the end of the run (step "
            f"{trainer.state.global_step}): comparing with the live model at the end instead (make max_steps x "
            "tokens per step a multiple of pma_interval_tokens to compare with a snapshot)"
        )
        models = {"live model at the end": _live_model(trainer, live), "PMA merge": trainer.pma_merged_dir}
    if annealed is not None:
        models["annealed"] = annealed
    elif scheduler_name(trainer.args) not in CONSTANT_SCHEDULES:
        models["annealed"] = _live_model(trainer, live)  # with WSD the live model at the end is the annealed one
    results = evaluate_models(
        [str(p) for p in models.values()],
        labels=list(models),
        texts=list(texts),
        eval_dataset=eval_dataset or f"{len(texts)} held-out documents",
        tasks=tasks,
        include_path=include_path,
        block_size=block_size,
        batch_size=trainer.args.per_device_eval_batch_size,
    )
    write_eval_record(
        trainer.pma_merged_dir, results["results"], eval_dataset=results.get("eval_dataset"),
        eval_documents=results.get("eval_documents"),
    )  # fmt: skip

    def compare() -> dict[str, Any] | None:  # on the main process; the others receive the record
        from hf_pma.publishing.card import write_model_card

        if not results["lm"]:  # tasks only: nothing to pair
            write_model_card(trainer.pma_merged_dir, repo_id=trainer.args.hub_model_id)
            return None
        anneal = {k: fork.get(k) for k in ("steps", "tokens", "decay_type")} if fork is not None else None
        comparison = paired_comparison(
            results["lm"],
            reference=next(iter(results["lm"])),
            tokens=int(trainer.state.num_input_tokens_seen),
            model_tokens={"last snapshot": record.tokens, "annealed": (fork or {}).get("end_tokens")},
            anneal=anneal,
        )
        write_comparison(trainer.pma_merged_dir, comparison)
        write_model_card(trainer.pma_merged_dir, repo_id=trainer.args.hub_model_id)
        return comparison

    results["comparison"] = run_on_main_process(compare)
    return results
