"""``hf-pma make-tasks``: multiple-choice lm-eval tasks from the held-out part of a corpus."""

from __future__ import annotations

import argparse

from hf_pma.commands import add_output_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hf-pma make-tasks``."""
    from hf_pma.evaluation.task_options import TASK_KINDS, TaskOptions

    defaults = TaskOptions()
    p = subparsers.add_parser(
        "make-tasks",
        help="generate small-run benchmarks (next line, cloze) from held-out documents",
        description=(
            "Split the documents of INPUTs into train / held-out (deterministic for --seed, the same split as "
            "hf_pma.evaluation.corpus.split_documents), generate lm-eval multiple-choice tasks from the held-out documents "
            "only (no choice line occurs in a training document), and write them as YAML + JSONL into OUTPUT, "
            "with heldout.jsonl (for `hf-pma eval --eval-file`) and tasks_info.json. Run them with "
            "`hf-pma eval MODEL --include-path OUTPUT --tasks <prefix>_tasks`."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text file (one document), .jsonl/.json/.csv/.parquet (one per row), folder of text files, or a "
        "dataset name[:config]",
    )
    p.add_argument("--text-column", default="text", help="column of the text in tables (default: %(default)s)")
    p.add_argument("--split", default="train", help="split of a dataset INPUT (default: %(default)s)")
    p.add_argument(
        "--eval-fraction", type=float, default=0.1, help="share of documents held out (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split and the items (default: %(default)s)")
    p.add_argument(
        "--kinds",
        default=",".join(TASK_KINDS),
        help="comma-separated task kinds (default: %(default)s)",
    )
    p.add_argument("--num-items", type=int, default=defaults.num_items, help="items per task")
    p.add_argument("--num-choices", type=int, default=defaults.num_choices, help="choices per item")
    p.add_argument("--context-lines", type=int, default=defaults.context_lines, help="lines of context")
    p.add_argument("--min-line-chars", type=int, default=defaults.min_line_chars, help="shortest answer line")
    p.add_argument("--max-line-chars", type=int, default=defaults.max_line_chars, help="longest answer line")
    p.add_argument("--prefix", default="pma", help="task name prefix: <prefix>_next_line, ... (default: %(default)s)")
    p.add_argument(
        "--write-train", action="store_true", help="also write the training documents as train.jsonl"
    )
    add_output_arguments(p, quiet="no info logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-pma make-tasks``."""
    import logging

    from hf_pma.core.outputs import check_overwrite_target
    from hf_pma.evaluation.corpus import load_documents
    from hf_pma.evaluation.generated_tasks import (
        TASKS_INFO_NAME,
        TaskOptions,
        check_task_settings,
        make_tasks,
    )
    from hf_pma.utils.fs import check_output_folder
    from hf_pma.utils.logs import set_transformers_verbosity

    if args.quiet:
        set_transformers_verbosity(logging.WARNING)  # without importing transformers
    same_names = ("num_items", "num_choices", "context_lines", "min_line_chars", "max_line_chars")
    options = TaskOptions(**{k: getattr(args, k) for k in same_names})
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    check_task_settings(kinds, args.prefix, options)
    if not 0.0 < args.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be between 0 and 1 (exclusive), got {args.eval_fraction}")
    check_output_folder(args.output, args.overwrite)
    if args.overwrite:  # before the documents are read
        check_overwrite_target(args.output, (TASKS_INFO_NAME,), "tasks")
    documents = load_documents(args.inputs, text_column=args.text_column, split=args.split)
    info = make_tasks(
        documents,
        args.output,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        kinds=kinds,
        options=options,
        prefix=args.prefix,
        write_train=args.write_train,
        overwrite=args.overwrite,
    )
    from hf_pma.utils.text import command_line, write_line

    for name, task in info["tasks"].items():
        write_line(f"{name}: {task['items']} items ({task['kind']})")
    write_line(
        f"{info['num_heldout_documents']} held-out / {info['num_train_documents']} training documents; "
        f"run: hf-pma eval MODEL {command_line(['--include-path', args.output, '--tasks', info['tag']])}"
    )
    return 0
