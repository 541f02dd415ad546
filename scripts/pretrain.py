"""Pre-train a causal LM with PMA: snapshots every V tokens, merged evaluation, final merge,
a matched annealed model, held-out evaluation, model card, plot, and optional push to the Hub.

With no arguments it runs the embedded default (``scripts/configs/tiny.yaml``): a small Llama
pre-trained on the Python standard library's own source at a constant learning rate, on CPU,
in a few minutes; then a fork of it annealed over its last tokens, so that the merge at T tokens
is compared with the constant-LR model and with an annealed model at the same T. With arguments
it is the same job on your data, model and GPUs::

    accelerate launch scripts/pretrain.py                                   # the embedded default
    accelerate launch scripts/pretrain.py --output_dir runs/mine --max_steps 600   # the default, changed
    accelerate launch scripts/pretrain.py my.yaml --max_steps 100           # your config file instead
    accelerate launch --config_file scripts/configs/fsdp2.yaml scripts/pretrain.py my-run.yaml \\
        --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT --streaming \\
        --config_name meta-llama/Llama-3.2-1B --tokenizer_name meta-llama/Llama-3.2-1B \\
        --output_dir runs/llama-1b --max_steps 20000 --bf16 --pma_interval_tokens 500000000

Flags without a config file change the embedded default; a YAML/JSON file as the first argument
replaces it, and flags after it override the file.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import logging as stdlib_logging
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    LlamaConfig,
    Trainer,
    TrainerCallback,
    set_seed,
)
from transformers.utils import logging

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.evaluation.corpus import load_documents, split_documents
from hf_pma.evaluation.evaluator import EVAL_RECORD_NAME, evaluate_models, results_table, write_eval_record
from hf_pma.evaluation.generated_tasks import TaskOptions, fits_context, make_tasks_from_split
from hf_pma.io.guarded import read_json
from hf_pma.training.pretrain_data import pack_dataset, stdlib_documents, train_bpe_tokenizer
from hf_pma.training.trainer import save_full_model
from hf_pma.utils.distributed import is_main_process, run_on_main_process
from hf_pma.utils.fs import atomic_write_json, remove_tree
from hf_pma.utils.logs import enable_logging
from hf_pma.utils.secrets import redact
from hf_pma.utils.text import command_line

logger = logging.get_logger("hf_pma.pretrain")

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")
USAGE_NOTE = """\
Which arguments a run uses:
  no arguments                  the embedded default run (scripts/configs/tiny.yaml): the
                                defaults shown with the options above are its values
  --flag value ...              the embedded default with these flags changed (e.g. --output_dir runs/mine)
  CONFIG.yaml|json [--flag ...] that file instead of the embedded default (then the dataclasses' own
                                defaults for what it leaves out), with the flags after it changing it
"""


@dataclasses.dataclass
class ModelArguments:
    """Which model to train."""

    model_name_or_path: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Start from these weights (continued pre-training); else from a config."},
    )
    config_name: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Config (Hub id or folder) of a model trained from scratch; default: a small Llama."
        },
    )
    config_overrides: str | None = dataclasses.field(
        default=None, metadata={"help": "Config overrides, e.g. 'hidden_size=256,num_hidden_layers=8'."}
    )
    tokenizer_name: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Tokenizer (Hub id or folder); default: the model's, else a BPE trained on the train split."
        },
    )
    vocab_size: int = dataclasses.field(
        default=4096, metadata={"help": "Vocabulary of the tokenizer trained here."}
    )


@dataclasses.dataclass
class DataArguments:
    """Which text to train and evaluate on."""

    dataset_name: str | None = dataclasses.field(
        default=None, metadata={"help": "A datasets name (Hub id or local builder)."}
    )
    dataset_config_name: str | None = dataclasses.field(default=None, metadata={"help": "Its configuration."})
    dataset_split: str = dataclasses.field(default="train", metadata={"help": "Split to read."})
    streaming: bool = dataclasses.field(
        default=False, metadata={"help": "Stream the dataset instead of downloading it."}
    )
    train_files: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Text files or folders (txt, md, py, jsonl, json, csv, parquet)."}
    )
    text_column: str = dataclasses.field(
        default="text", metadata={"help": "Column of the text in tables and datasets."}
    )
    max_documents: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Read at most this many documents (required with --streaming to hold out a split)."
        },
    )
    default_corpus_bytes: int = dataclasses.field(
        default=3_000_000,
        metadata={"help": "Bytes of standard-library source in the embedded default corpus."},
    )
    block_size: int = dataclasses.field(
        default=128, metadata={"help": "Tokens per training sequence (texts are packed)."}
    )
    eval_fraction: float = dataclasses.field(
        default=0.05, metadata={"help": "Share of documents held out for evaluation."}
    )
    max_eval_blocks: int = dataclasses.field(
        default=64,
        metadata={
            "help": "Held-out blocks in the Trainer's evaluations: spread evenly over the final evaluation's text."
        },
    )
    max_eval_texts: int = dataclasses.field(
        default=40, metadata={"help": "Held-out documents in the final loss / bits-per-byte evaluation."}
    )
    max_eval_chars: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Characters of each of those documents evaluated (its start; default: all)."},
    )
    token_budget: int | None = dataclasses.field(
        default=None, metadata={"help": "Train on this many tokens (sets max_steps from the global batch)."}
    )
    make_tasks: bool = dataclasses.field(
        default=True,
        metadata={"help": "Generate multiple-choice tasks from the held-out documents and evaluate on them."},
    )
    task_items: int = dataclasses.field(default=150, metadata={"help": "Items per generated task."})
    eval_tasks: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Extra lm-eval task names for the final evaluation (e.g. hellaswag,arc_easy)."},
    )
    overwrite_output_dir: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Delete an earlier run's snapshots and merge in output_dir first (never when resuming)."
        },
    )
    push_live_model: bool = dataclasses.field(
        default=False,
        metadata={"help": "With --push_to_hub, also let the Trainer push the live model (main branch)."},
    )


@dataclasses.dataclass
class ComparisonArguments:
    """The annealed model that the merge is compared with, at the same tokens."""

    anneal_steps: int = dataclasses.field(
        default=0,
        metadata={
            "help": "Also train an annealed fork of the constant-LR run: from its state anneal_steps before the end, "
            "decay the LR to 0 over the same steps and data, and compare it with the merge at the same tokens "
            "(needs lr_scheduler_type constant_with_warmup or constant). 0: no fork."
        },
    )
    anneal_decay_type: str = dataclasses.field(
        default="linear", metadata={"help": "Shape of the fork's decay: linear, cosine or 1-sqrt."}
    )


def build_parser() -> HfArgumentParser:
    """The command-line parser (its defaults are the dataclasses' own until a config is applied)."""
    import argparse

    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Defaults after each flag's help; the usage note as written."""

    return HfArgumentParser(
        (ModelArguments, DataArguments, ComparisonArguments, PMATrainingArguments),
        description=__doc__.split("\n\n")[0],
        epilog=USAGE_NOTE,
        formatter_class=Formatter,
    )


def read_config(path: Path, parser: HfArgumentParser) -> dict:
    """The arguments of a YAML/JSON config file, checked against the parser's argument names."""
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    values = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of argument names to values")
    known = {f.name for dc in parser.dataclass_types for f in dataclasses.fields(dc)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{path}: unknown argument(s) {', '.join(unknown)}")
    return values


def parse_arguments(
    argv: list[str],
) -> tuple[ModelArguments, DataArguments, ComparisonArguments, PMATrainingArguments]:
    """The run's dataclasses: the embedded default config (or a YAML/JSON file given as the first
    argument, which replaces it), changed by the command-line flags."""
    parser = build_parser()
    config = DEFAULT_CONFIG
    if argv and argv[0].endswith(CONFIG_SUFFIXES) and not argv[0].startswith("-"):
        config, argv = Path(argv[0]), argv[1:]
    parser.set_defaults(**read_config(config, parser))
    model_args, data, comparison, args = parser.parse_args_into_dataclasses(argv)
    check_comparison(comparison, args, data.token_budget)
    return model_args, data, comparison, args


def check_comparison(
    comparison: ComparisonArguments, args: PMATrainingArguments, token_budget: int | None = None
) -> None:
    """``ValueError`` naming the argument when the annealed fork cannot be made (``token_budget``:
    max_steps is set from it later)."""
    if comparison.anneal_steps < 0:
        raise ValueError(f"anneal_steps must be 0 or positive, got {comparison.anneal_steps}")
    if comparison.anneal_decay_type not in ("linear", "cosine", "1-sqrt"):
        raise ValueError(
            f"anneal_decay_type must be linear, cosine or 1-sqrt, got {comparison.anneal_decay_type!r}"
        )
    if not comparison.anneal_steps:
        return
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if schedule not in CONSTANT_SCHEDULES:
        raise ValueError(
            f"anneal_steps needs a constant-LR run to fork from (lr_scheduler_type constant_with_warmup), "
            f"got lr_scheduler_type {schedule}; or pass --anneal_steps 0"
        )
    if args.max_steps <= 0 and not token_budget:
        raise ValueError(
            "anneal_steps needs max_steps (or token_budget): the fork starts anneal_steps before the end"
        )
    if args.max_steps > 0 and comparison.anneal_steps >= args.max_steps - args.get_warmup_steps(
        args.max_steps
    ):
        raise ValueError(
            f"anneal_steps ({comparison.anneal_steps}) must be shorter than the constant-LR part of the run "
            f"(max_steps {args.max_steps} minus the warmup)"
        )


class SaveAtStep(TrainerCallback):
    """Saves a Trainer checkpoint (weights, optimizer, scheduler, data position) at one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback event
        if state.global_step == self.step:
            control.should_save = True
        return control


def train_annealed_fork(
    model_args: ModelArguments,
    comparison: ComparisonArguments,
    args: PMATrainingArguments,
    tokenizer,
    train_ds,
    block_size: int,
    checkpoint: Path,
) -> Path:
    """From the constant-LR run's checkpoint, the same data with the LR decayed to 0 over
    ``anneal_steps``: a WSD run that ends at the constant-LR run's last token. Returns its folder."""
    out = Path(args.output_dir) / "annealed"
    fork_args = dataclasses.replace(
        args,
        output_dir=str(out),
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={
            "num_decay_steps": comparison.anneal_steps,
            "decay_type": comparison.anneal_decay_type,
            "min_lr_ratio": 0.0,
        },
        eval_strategy="no",
        save_strategy="no",
        push_to_hub=False,
        resume_from_checkpoint=None,
    )
    model = build_model(model_args, tokenizer, block_size)
    trainer = Trainer(
        model,
        fork_args,
        train_dataset=train_ds,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
    )
    logger.info(
        f"Annealed fork: from step {args.max_steps - comparison.anneal_steps}, {comparison.anneal_decay_type} decay "
        f"to 0 over {comparison.anneal_steps} steps"
    )
    with tied_keys_not_missing(model):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    save_full_model(trainer, out)  # FSDP with sharded checkpoints too
    return out


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
        try:
            missing = ast.literal_eval(message[len(self.PREFIX) :].rstrip("."))
        except (ValueError, SyntaxError):
            return True
        return not (missing and set(missing) <= self.tied)


@contextlib.contextmanager
def tied_keys_not_missing(model):
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


def launcher_processes() -> int | None:
    """``--num_processes`` of the ``accelerate launch`` that started this process (Linux: read from
    the parent's command line), or ``None`` when not started so or not known."""
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "launch" not in parent[:4] or not any(Path(arg).name == "accelerate" for arg in parent[:3]):
        return None
    for i, arg in enumerate(parent):
        value = arg.partition("=")[2] if arg.startswith("--num_processes=") else None
        if arg == "--num_processes" and i + 1 < len(parent):
            value = parent[i + 1]
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def warn_if_fewer_processes(asked: int | None, world_size: int) -> None:
    """A warning when ``accelerate launch --num_processes N`` (N > 1) started one process: on CPU,
    ``--cpu`` alone does not make several processes."""
    if asked is not None and asked > 1 and world_size == 1:
        logger.warning(
            f"accelerate launch was asked for {asked} processes but this run has 1 (WORLD_SIZE is not set): on "
            f"CPU, start them with: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {asked} "
            f"scripts/pretrain.py (or torchrun --nproc_per_node {asked} scripts/pretrain.py)"
        )


def read_documents(data: DataArguments) -> tuple[list[str], str]:
    """The corpus as a list of documents, and a name for it (for the card)."""
    if data.dataset_name:
        import datasets

        ds = datasets.load_dataset(
            data.dataset_name, data.dataset_config_name, split=data.dataset_split, streaming=data.streaming
        )
        if data.streaming and data.max_documents is None:
            raise ValueError(
                "--streaming needs --max_documents (documents to read, train and held-out together)"
            )
        if data.text_column not in (ds.column_names or []):
            raise ValueError(
                f"{data.dataset_name} has no column {data.text_column!r} (columns: {ds.column_names})"
            )
        rows = ds.take(data.max_documents) if data.streaming else ds
        docs = [row[data.text_column] for _, row in zip(range(data.max_documents or len(ds)), rows)]
        return docs, data.dataset_name
    if data.train_files:
        docs = load_documents(data.train_files, text_column=data.text_column)
        return docs[: data.max_documents], "local files"
    return stdlib_documents(max_bytes=data.default_corpus_bytes), "local:python-stdlib"


def build_tokenizer(model_args: ModelArguments, train_docs: list[str], cache_dir: Path):
    """The tokenizer named by the arguments, else a byte-level BPE trained on the train split."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name:
        tokenizer = AutoTokenizer.from_pretrained(name)
    else:
        tokenizer = train_bpe_tokenizer(train_docs, vocab_size=model_args.vocab_size, cache_dir=cache_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(model_args: ModelArguments, tokenizer, block_size: int):
    """Pre-trained weights, or a fresh model from a config (default: a ~1.4M-parameter Llama)."""
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
    else:
        config = LlamaConfig(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=block_size,
            tie_word_embeddings=True,
        )
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return AutoModelForCausalLM.from_config(config)


def full_batches(train_ds, args: PMATrainingArguments):
    """The training blocks, cut to a multiple of the global batch: every optimizer step then sees
    the same tokens, so a snapshot every V tokens falls on the same steps in every epoch (and the
    last one on the last step, where the annealed fork ends)."""
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    keep = len(train_ds) - len(train_ds) % global_batch
    if keep == 0:
        raise ValueError(
            f"the training data holds {len(train_ds)} blocks, fewer than one global batch of {global_batch}"
        )
    return train_ds.select(range(keep)) if keep < len(train_ds) else train_ds


def reproduce_command(argv: list[str]) -> str:
    """The launch line of this run, with local paths reduced to their names and access tokens
    redacted (by name and by value: ``--hub_token ***``), for the card and the records."""
    parts = ["accelerate", "launch", "scripts/pretrain.py"]
    for arg in argv:
        parts.append(Path(arg).name if os.path.isabs(arg) else arg)
    return redact(command_line(parts))  # shell-quoted, one line (a control character as $'...')


def move_token_to_environment(args: PMATrainingArguments) -> None:
    """Pass ``--hub_token`` on by the ``HF_TOKEN`` environment variable of this process and clear
    it from ``args``: the Trainer pickles its arguments into ``training_args.bin`` with every
    checkpoint and model it saves, and ``huggingface_hub`` reads ``HF_TOKEN`` for every request."""
    if args.hub_token:
        os.environ["HF_TOKEN"] = args.hub_token
        args.hub_token = None


def final_eval_texts(heldout: list[str], data: DataArguments) -> list[str]:
    """The held-out text of the final evaluation (and, packed, of the Trainer's evaluations)."""
    return [doc[: data.max_eval_chars] for doc in heldout[: data.max_eval_texts]]


def evenly_spaced(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(total)`` (all of them when ``count >= total``)."""
    if count >= total:
        return list(range(total))
    return [i * total // count for i in range(count)]


def final_evaluation(
    trainer: PMATrainer,
    heldout: list[str],
    train_docs: list[str],
    data: DataArguments,
    tokenizer,
    annealed: Path | None,
) -> dict:
    """Last snapshot vs PMA merge vs the annealed model on held-out text and tasks.

    With a fork, ``annealed`` is its folder (at the same tokens as the last snapshot); without
    one, a run with a decaying schedule contributes its final model (annealed, later tokens)."""
    out = Path(trainer.args.output_dir)
    record, last = trainer.pma_callback.snapshots()[-1]
    models = {"last snapshot": last, "PMA merge": trainer.pma_merged_dir}
    if annealed is not None and record.step != trainer.state.global_step:
        # The fork ends at the run's last step: compare with the live model there, at the same tokens.
        logger.warning(
            f"the last snapshot is at step {record.step}, not at the end of the run (step {trainer.state.global_step}): "
            "comparing with the final live model instead (make max_steps x tokens per step a multiple of "
            "pma_interval_tokens to compare with a snapshot)"
        )
        models = {"live model at the end": out / "final", "PMA merge": trainer.pma_merged_dir}
    schedule = str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type))
    if annealed is not None:
        models["annealed"] = annealed
    elif schedule not in CONSTANT_SCHEDULES:
        models["annealed"] = out / "final"  # with WSD the final live model is the annealed one
    tasks, include = data.eval_tasks, None
    if data.make_tasks:
        # Sized to the model's context, so that lm-eval scores every choice without truncating it.
        info = make_tasks_from_split(
            train_docs,
            heldout,
            out / "tasks",
            seed=trainer.args.seed,
            options=TaskOptions(num_items=data.task_items),
            overwrite=True,
            info={"max_item_tokens": data.block_size},
            fits=fits_context(tokenizer, data.block_size),
        )
        tasks = ",".join([*info["tasks"], *([data.eval_tasks] if data.eval_tasks else [])])
        include = out / "tasks"
    texts = final_eval_texts(heldout, data)
    return evaluate_models(
        [str(p) for p in models.values()],
        labels=list(models),
        texts=texts,
        eval_dataset=f"{len(texts)} held-out documents",
        tasks=tasks,
        include_path=include,
        block_size=data.block_size,
        batch_size=trainer.args.per_device_eval_batch_size,
    )


def _document_losses(lm: dict) -> list[float]:
    per_text = lm["per_text"]
    return [nll / tokens for nll, tokens in zip(per_text["nll"], per_text["tokens"]) if tokens]


def paired_comparison(
    lm: dict[str, dict],
    reference: str = "last snapshot",
    merge: str = "PMA merge",
    annealed: str = "annealed",
) -> dict:
    """Each model's mean held-out loss over the same documents, its mean per-document difference
    from ``reference`` with the paired standard error, and the share of the annealing gain that
    the merge recovers: (reference - merge) / (reference - annealed)."""
    base = _document_losses(lm[reference])
    models = {reference: {"loss": statistics.fmean(base)}}
    for label in lm:
        if label == reference:
            continue
        losses = _document_losses(lm[label])
        diffs = [a - b for a, b in zip(losses, base)]
        stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
        models[label] = {
            "loss": statistics.fmean(losses),
            "loss_diff": statistics.fmean(diffs),
            "paired_stderr": stderr,
        }
    record = {
        "reference": reference,
        "merge": merge,
        "annealed": annealed if annealed in lm else None,
        "documents": len(base),
        "models": models,
        "annealing_gain_recovered": None,
    }
    if annealed in lm and merge in lm and models[annealed]["loss_diff"] < 0:
        record["annealing_gain_recovered"] = models[merge]["loss_diff"] / models[annealed]["loss_diff"]
    return record


def write_comparison(merged_dir: Path, comparison: dict) -> None:
    """Add the comparison to the merged folder's evaluation record (pma_eval.json), for the card."""
    path = merged_dir / EVAL_RECORD_NAME
    record = read_json(path)
    record["comparison"] = comparison
    atomic_write_json(path, record)


def shown(path: str | os.PathLike[str]) -> str:
    """A path as the summary prints it: relative to the working folder when inside it, else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    """Run the whole job; returns the exit code."""
    started = time.time()
    argv = sys.argv[1:] if argv is None else argv
    # hf-pma's own progress at INFO; transformers' at WARNING (it logs every config it saves).
    logging.set_verbosity_warning()
    logging.enable_explicit_format()
    enable_logging(logging.INFO)
    warn_if_fewer_processes(launcher_processes(), int(os.environ.get("WORLD_SIZE", "1")))
    try:
        model_args, data, comparison, args = parse_arguments(argv)
    except ValueError as err:  # bad arguments: one line, before anything is trained or written
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 2
    set_seed(args.seed)

    move_token_to_environment(args)
    if args.push_to_hub:  # a missing token or a bad repo id fails now, not after training
        from hf_pma.publishing.hub import check_repo_id, resolve_token

        check_repo_id(args.hub_model_id or Path(args.output_dir).resolve().name)
        resolve_token()
    out = Path(args.output_dir)
    if data.overwrite_output_dir and not args.resume_from_checkpoint and is_main_process():
        for old in (out / "pma", out / "annealed"):
            if old.exists():
                logger.warning(f"--overwrite_output_dir: deleting the earlier run's {old}")
                shutil.rmtree(old)
    docs, corpus_name = read_documents(data)
    train_docs, heldout = split_documents(docs, eval_fraction=data.eval_fraction, seed=args.seed)
    cache_dir = (
        Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hf_pma" / "tokenizers"
    )
    tokenizer = run_on_main_process(build_tokenizer, model_args, train_docs, cache_dir)
    train_ds = full_batches(pack_dataset(train_docs, tokenizer, data.block_size), args)
    # The Trainer's evaluations read the final evaluation's text, so that their curves and the
    # final evaluation (the plot's markers) are comparable: evenly spread blocks of it.
    eval_ds = pack_dataset(final_eval_texts(heldout, data), tokenizer, data.block_size)
    eval_ds = eval_ds.select(evenly_spaced(len(eval_ds), data.max_eval_blocks))
    if data.token_budget:
        tokens_per_step = (
            args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * args.world_size
            * data.block_size
        )
        args.max_steps = max(1, data.token_budget // tokens_per_step)
        check_comparison(comparison, args)
    model = build_model(model_args, tokenizer, data.block_size)
    logger.info(
        f"{corpus_name}: {len(train_docs)} train / {len(heldout)} held-out documents, {len(train_ds)} blocks of "
        f"{data.block_size} tokens; model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
    )

    push_merged = args.push_to_hub and args.pma_push_merged
    args.pma_push_merged = False  # pushed below, once the card holds the final evaluation
    args.push_to_hub = args.push_to_hub and data.push_live_model
    fork_step = args.max_steps - comparison.anneal_steps if comparison.anneal_steps else None
    trainer = PMATrainer(
        model,
        args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        callbacks=[SaveAtStep(fork_step)] if fork_step else None,
    )
    trainer.pma_command = reproduce_command(argv)
    trainer.train()
    save_full_model(trainer, out / "final")
    if trainer.pma_merged_dir is None:
        logger.warning(
            "No snapshot was taken: no merge to evaluate (lengthen the run or lower pma_interval_tokens)."
        )
        return 1
    annealed = None
    if fork_step:
        checkpoint = out / f"checkpoint-{fork_step}"
        annealed = train_annealed_fork(
            model_args, comparison, args, tokenizer, train_ds, data.block_size, checkpoint
        )
        if is_main_process():
            remove_tree(checkpoint)  # only the fork needed it

    # Every process calls the evaluation functions: they run on the main process, the others wait.
    results = final_evaluation(trainer, heldout, train_docs, data, tokenizer, annealed)
    write_eval_record(trainer.pma_merged_dir, results["results"], eval_dataset=results.get("eval_dataset"))
    if is_main_process():
        from hf_pma.publishing.card import comparison_table, write_model_card

        paired = paired_comparison(results["lm"], reference=next(iter(results["lm"])))
        tokens_per_step = (
            args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * args.world_size
            * data.block_size
        )
        paired["tokens"] = trainer.state.num_input_tokens_seen or args.max_steps * tokens_per_step
        if annealed is not None:
            paired["anneal"] = {
                "steps": comparison.anneal_steps,
                "tokens": comparison.anneal_steps * tokens_per_step,
                "decay_type": comparison.anneal_decay_type,
            }
        write_comparison(trainer.pma_merged_dir, paired)
        training_record = trainer.pma_merged_dir / "pma_training.json"
        record = json.loads(training_record.read_text())
        record["datasets"] = [corpus_name]
        record["base_model"] = model_args.model_name_or_path
        atomic_write_json(training_record, record)
        card = write_model_card(trainer.pma_merged_dir, repo_id=args.hub_model_id)
        if push_merged:
            url = trainer.push_merged_to_hub(repo_id=args.hub_model_id, revision=args.pma_push_revision)
            logger.info(f"Pushed the merged model: {url}")
        merged = trainer.pma_merged_dir
        print(f"\nDone in {time.time() - started:.0f} s.")
        print(f"  snapshots + manifest : {shown(trainer.pma_callback.pma_dir)}")
        print(f"  merged model         : {shown(merged)}")
        print(f"  final (live) model   : {shown(out / 'final')}")
        if annealed is not None:
            print(f"  annealed fork        : {shown(annealed)}")
        print(f"  model card / plot    : {shown(card)} / {shown(merged / 'pma_training.png')}")
        print(f"  evaluation           : {shown(merged / EVAL_RECORD_NAME)}\n")
        print(results_table(results["results"]))
        print()
        print(comparison_table(paired))
    return 0


if __name__ == "__main__":
    sys.exit(main())
