"""``hf-pma eval``: evaluate several models side by side (held-out LM metrics and lm-eval tasks)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hf_pma.commands import (
    add_heldout_arguments,
    add_revision_arguments,
    load_heldout,
    positive_int,
    set_verbosity,
)
from hf_pma.core.manifest import EVAL_RECORD_NAME
from hf_pma.evaluation.options import EvalOptions

# Where the results go without -o: the current folder (never a model folder, which may be published).
DEFAULT_OUTPUT = "eval_results.json"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma eval``."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate models side by side (perplexity, bits-per-byte, lm-eval tasks)",
        description=(
            "Evaluate MODELs one at a time (snapshot folders, the merged folder, an annealed run's output, any "
            "Hub model) on held-out text (--eval-file: loss, perplexity, bits-per-byte) and/or lm-eval tasks "
            "(--tasks; local YAML tasks with --include-path, e.g. from `hf-pma make-tasks`), then print one "
            "table (rows: metrics, columns: models) and write the results as JSON (-o FILE; default: "
            f"{DEFAULT_OUTPUT} in the current folder, replaced if present). A run folder is its final model; "
            "with --last or --every, it stands for its newest snapshots (its PMA snapshots, else its "
            "checkpoint-* folders). Under "
            "`accelerate launch` the main process evaluates and the others wait."
        ),
    )
    p.add_argument(
        "models",
        nargs="+",
        metavar="MODEL",
        help="model folder, Hub model id or Hub revision (org/model@REV)",
    )
    add_revision_arguments(p)
    p.add_argument(
        "--last",
        type=positive_int,
        help="with --revisions or a run folder: only the newest N revisions or snapshots",
    )
    EvalOptions.add_arguments(p)
    add_heldout_arguments(p)
    p.add_argument("--tokenizer", help="tokenizer for every model (default: each model folder's own)")
    p.add_argument("--labels", help="comma-separated column labels, one per model (default: folder names)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="device (default: cuda if available, else cpu)")
    p.add_argument(
        "-o", "--output", metavar="FILE", help=f"write the results as JSON here (default: ./{DEFAULT_OUTPUT})"
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="also write/update pma_eval.json (the record the model card reads) in this folder, e.g. the merge",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    p.set_defaults(func=run)


def _eval_dataset_name(source: str) -> str:
    # Recorded in pma_eval.json, which may be published: a file's name, never its local path.
    path = Path(source)
    return path.name if path.exists() else source


def _hub_models(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """The models to evaluate, Hub revisions downloaded (labelled ``model@REV``), and their labels
    when any is a revision (``None`` otherwise: the evaluator's labels)."""
    from hf_pma.merging.hub_revisions import parse_hub_spec
    from hf_pma.merging.sources import model_source, resolve_sources, run_layout

    runs = [m for m in args.models if Path(m).is_dir() and run_layout(m).is_run]
    if args.revisions is None and (args.last or args.every) and not runs:
        raise ValueError(
            "--last and --every select among a run folder's snapshots or a Hub repo's --revisions: give one of them"
        )
    models, labels, any_revision = [], [], False
    for model in args.models:
        if model in runs and (args.last or args.every):
            # A run folder stands for its newest snapshots (PMA manifest first, then checkpoint-*).
            for source in resolve_sources([model], last=args.last, every=args.every):
                models.append(str(source.path))
                labels.append(None)
            continue
        if model in runs and not run_layout(model).top_weights:
            # Alone, a run folder is its final model: say so before loading anything.
            raise ValueError(
                f"{model} is a run folder ({run_layout(model).found()}) without a final model at its top: "
                "--last N evaluates its newest N snapshots, or name a snapshot folder"
            )
        if Path(model).is_file():
            model = str(model_source(model).path)  # RUN/model.safetensors: the model at RUN's top
        spec = None if Path(model).exists() else parse_hub_spec(model)
        if spec is None or (spec[1] is None and args.revisions is None):
            models.append(model)
            labels.append(None)
            continue
        any_revision = True
        pattern = spec[1] is None  # --revisions, --last and --every select among a repo's revisions
        for source in resolve_sources(
            [model],
            last=args.last if pattern else None,
            every=args.every if pattern else None,
            revisions=args.revisions if pattern else None,
            cache_dir=args.cache_dir,
        ):
            models.append(str(source.path))
            labels.append(f"{spec[0].split('/')[-1]}@{source.name}")
    if not any_revision:
        return models, None
    from hf_pma.evaluation.evaluator import model_labels

    return models, [label or default for label, default in zip(labels, model_labels(models))]


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma eval``."""
    from hf_pma.evaluation.model_checks import check_record_folder, resolve_model
    from hf_pma.utils.fs import check_output_file

    set_verbosity(args)
    if not args.tasks and not args.eval_file:
        raise ValueError("nothing to evaluate: give --tasks and/or --eval-file")
    labels = [label.strip() for label in args.labels.split(",")] if args.labels else None
    # Every output is checked here, before a model is loaded: results are never lost at the end.
    output = Path(args.output or DEFAULT_OUTPUT)
    if args.output is None and not os.access(output.absolute().parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"cannot write {DEFAULT_OUTPUT} in the current folder {Path.cwd()}: give -o FILE"
        )
    check_output_file(output, "--output")
    if args.record:
        check_record_folder(args.record, "--record")
    texts = load_heldout(args)

    models, hub_labels = _hub_models(args)
    for model in models:  # a missing folder or an unknown Hub name: one line before torch is imported
        resolve_model(model, args.tokenizer)
    from hf_pma.evaluation.evaluator import evaluate_models
    from hf_pma.evaluation.records import read_eval_record
    from hf_pma.utils.distributed import is_main_process

    if args.record and (Path(args.record) / EVAL_RECORD_NAME).is_file():
        read_eval_record(args.record)  # the record is updated at the end: a malformed one fails now

    report = evaluate_models(
        models,
        labels=labels or hub_labels,
        tokenizer=args.tokenizer,
        texts=texts,
        eval_dataset=_eval_dataset_name(args.eval_file) if args.eval_file else None,
        options=EvalOptions.from_args(args),
        dtype=args.dtype,
        device=args.device,
        progress=not args.quiet,
    )
    _keep_results(report, output, args.record, is_main_process())
    return 0


def _keep_results(report: dict, output: Path, record: str | None, main: bool) -> None:
    """Keep what an evaluation computed, whatever fails on the way out (a full disk, a quota).

    The ``-o`` file is written first (the whole report), then the record (each atomically: the
    old file or the new one, never a part; the record's claim released either way); a failure
    of one does not stop the other. The table is printed in every case, so the numbers are never
    lost; then one line names what failed, and what was kept where."""
    from hf_pma.evaluation.records import results_table, write_eval_record
    from hf_pma.utils.fs import atomic_write_json
    from hf_pma.utils.text import escape, flush_out, write_line, write_lines

    failed: list[OSError] = []
    kept: list[str] = []
    if main:
        try:
            atomic_write_json(output, report)
            kept.append(f"written to {output}")
        except OSError as err:
            failed.append(err)
    if record:
        try:
            write_eval_record(
                record, report["results"], eval_dataset=report["eval_dataset"], eval_documents=report.get("eval_documents")
            )
            kept.append(f"recorded in {Path(record) / EVAL_RECORD_NAME}")
        except OSError as err:
            failed.append(err)
    if main:
        write_lines(results_table(report["results"]))  # its cells are escaped
        if not failed:
            write_line(f"results: {output}")
        flush_out()
    if failed:
        text = "; ".join(escape(err) for err in failed)
        raise OSError(f"{text}; the results are printed above" + "".join(f" and {k}" for k in kept))
