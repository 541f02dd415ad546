"""Pre-train a causal LM with PMA: snapshots every V tokens, merged evaluation, final merge,
a matched annealed model, held-out evaluation, model card, plot, and optional push to the Hub.

With no arguments it runs the embedded default (``scripts/configs/tiny.yaml``): a small Llama
pre-trained on the Python standard library's source at a constant LR, on CPU, in a few minutes,
and a fork annealed over its last steps: the merge, the constant-LR model and the annealed model
are compared at the same tokens. With arguments it is the same job on your data, model and GPUs::

    accelerate launch scripts/pretrain.py                                   # the embedded default
    accelerate launch scripts/pretrain.py --output_dir runs/mine --max_steps 600   # the default, changed
    accelerate launch scripts/pretrain.py my.yaml --max_steps 100           # your config file instead
    accelerate launch --config_file scripts/configs/fsdp2.yaml scripts/pretrain.py my-run.yaml \\
        --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT --streaming \\
        --config_name meta-llama/Llama-3.2-1B --tokenizer_name meta-llama/Llama-3.2-1B \\
        --output_dir runs/llama-1b --max_steps 20000 --bf16 --pma_interval_tokens 500000000

Flags without a config file change the embedded default; a YAML/JSON file as the first argument
replaces it, and flags after it override it. The fork and the comparison are hf-pma's
(``pma_anneal_steps``, ``PMATrainer.annealing_check``), as in any Trainer script.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from dataclasses import field
from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    set_seed,
)
from transformers.utils import logging

from hf_pma import (
    EVAL_RECORD_NAME,
    PMATrainer,
    PMATrainingArguments,
    TaskOptions,
    check_decay_type,
    check_repo_id,
    command_line,
    comparison_table,
    enable_logging,
    fits_context,
    full_batches,
    hf_argument_parser,
    is_main_process,
    make_tasks_from_split,
    pack_dataset,
    parse_with_config,
    read_documents,
    redact,
    resolve_token,
    results_table,
    run_on_main_process,
    save_full_model,
    split_documents,
    train_bpe_tokenizer,
    warn_if_fewer_processes,
)

logger = logging.get_logger("hf_pma.pretrain")

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"
USAGE_NOTE = """\
Which arguments a run uses:
  no arguments                  the embedded default run (scripts/configs/tiny.yaml): the
                                defaults shown with the options above are its values
  --flag value ...              the embedded default with these flags changed (e.g. --output_dir runs/mine)
  CONFIG.yaml|json [--flag ...] that file instead of the embedded default (then the dataclasses' own
                                defaults for what it leaves out), with the flags after it changing it
"""


def _arg(default, help: str, **kw):  # noqa: A002 - the dataclass field's help text
    return field(default=default, metadata={"help": help}, **kw)


@dataclasses.dataclass
class ModelArguments:
    """Which model to train."""

    model_name_or_path: str | None = _arg(None, "Start from these weights; else from a config.")
    config_name: str | None = _arg(None, "Config (Hub id or folder); default: a small Llama.")
    config_overrides: str | None = _arg(None, "Config overrides, e.g. 'hidden_size=256,num_hidden_layers=8'.")
    tokenizer_name: str | None = _arg(None, "Tokenizer; default: the model's, else a BPE trained here.")
    vocab_size: int = _arg(4096, "Vocabulary of the tokenizer trained here.")


@dataclasses.dataclass
class DataArguments:
    """Which text to train and evaluate on."""

    dataset_name: str | None = _arg(None, "A datasets name (Hub id or local builder).")
    dataset_config_name: str | None = _arg(None, "Its configuration.")
    dataset_split: str = _arg("train", "Split to read.")
    streaming: bool = _arg(False, "Stream the dataset instead of downloading it.")
    train_files: list[str] | None = _arg(None, "Text files or folders (txt, md, py, jsonl, csv, parquet).")
    text_column: str = _arg("text", "Column of the text in tables and datasets.")
    max_documents: int | None = _arg(None, "Read at most this many documents (needed with --streaming).")
    default_corpus_bytes: int = _arg(3_000_000, "Bytes of Python stdlib source in the default corpus.")
    block_size: int = _arg(128, "Tokens per training sequence (texts are packed).")
    eval_fraction: float = _arg(0.05, "Share of documents held out for evaluation.")
    max_eval_blocks: int = _arg(64, "Held-out blocks (of the final evaluation's text) in evaluations.")
    max_eval_texts: int = _arg(40, "Held-out documents in the final loss / bits-per-byte evaluation.")
    max_eval_chars: int | None = _arg(None, "Characters of each of those documents evaluated (default: all).")
    token_budget: int | None = _arg(None, "Train on this many tokens (sets max_steps).")
    make_tasks: bool = _arg(True, "Generate multiple-choice tasks from the held-out documents.")
    task_items: int = _arg(150, "Items per generated task.")
    eval_tasks: str | None = _arg(None, "Extra lm-eval task names for the final evaluation.")
    overwrite_output_dir: bool = _arg(False, "Delete an earlier run's pma/ and annealed/ first.")
    push_live_model: bool = _arg(False, "With --push_to_hub, also let the Trainer push the live model.")


@dataclasses.dataclass
class ComparisonArguments:
    """The annealed model that the merge is compared with, at the same tokens (the library's
    ``pma_anneal_*`` options, in this script's words: ``ANNEAL_SPELLING``)."""

    anneal_steps: int = _arg(0, "Annealed fork: the last N steps again, LR decayed to 0. 0: none.")
    anneal_decay_type: str = _arg("linear", "Shape of the fork's decay: linear, cosine or 1-sqrt.")

    def __post_init__(self) -> None:
        if self.anneal_steps < 0:
            raise ValueError(f"anneal_steps must be 0 or positive, got {self.anneal_steps}")
        check_decay_type(self.anneal_decay_type, "anneal_decay_type")


ANNEAL_SPELLING = {"pma_anneal_steps": "--anneal_steps", "pma_anneal_tokens": "--anneal_steps (in steps)",
                   "pma_anneal_decay": "--anneal_decay_type"}  # fmt: skip


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help; the usage note as written."""


def parse_arguments(argv: list[str]) -> tuple:
    """The run's model, data, comparison and training arguments: the embedded default config (or a
    YAML/JSON file given as the first argument, which replaces it), changed by the flags."""
    types = (ModelArguments, DataArguments, ComparisonArguments, PMATrainingArguments)  # parsed: no abbreviations, typos named
    parser = hf_argument_parser(types, description=__doc__.split("\n\n")[0], epilog=USAGE_NOTE, formatter_class=_Formatter)
    model_args, data, comparison, args = parse_with_config(parser, argv, DEFAULT_CONFIG, spelled=ANNEAL_SPELLING)
    if data.token_budget:  # the global batch is known: processes x per device x accumulation
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        args.max_steps = max(1, data.token_budget // (batch * data.block_size))
    if comparison.anneal_steps:  # the fork is PMATrainer's (pma_anneal_steps), checked there
        if args.max_steps <= 0:
            raise ValueError("anneal_steps needs max_steps or token_budget (the fork starts before the end)")
        args.pma_anneal_steps, args.pma_anneal_decay = comparison.anneal_steps, comparison.anneal_decay_type
        args.check_annealing()
    return model_args, data, comparison, args


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
    """Pre-trained weights, or a fresh model from a config (default: a small Llama)."""
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
    else:
        config = LlamaConfig(
            hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=block_size, tie_word_embeddings=True,
        )  # fmt: skip
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return AutoModelForCausalLM.from_config(config)


def reproduce_command(argv: list[str]) -> str:
    """The launch line of this run, one line, shell-quoted, with local paths reduced to their names
    and access tokens redacted (by name and by value: ``--hub_token ***``), for the card and records."""
    args = [Path(a).name if os.path.isabs(a) else a for a in argv]
    return redact(command_line(["accelerate", "launch", "scripts/pretrain.py", *args]))


def shown(path: str | os.PathLike[str]) -> str:
    """A path as the summary prints it: relative to the working folder when inside it, else absolute."""
    path = Path(path).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def main(argv: list[str] | None = None) -> int:
    """Run the whole job; returns the exit code."""
    started, argv = time.time(), sys.argv[1:] if argv is None else argv
    # hf-pma's own progress at INFO; transformers' at WARNING (it logs every config it saves).
    logging.set_verbosity_warning()
    logging.enable_explicit_format()
    enable_logging(logging.INFO)
    warn_if_fewer_processes("scripts/pretrain.py")
    try:
        model_args, data, _comparison, args = parse_arguments(argv)
    except ValueError as err:  # bad arguments: one line, before anything is trained or written
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 2
    set_seed(args.seed)
    if args.hub_token:  # to huggingface_hub by HF_TOKEN: the Trainer pickles its arguments into checkpoints
        os.environ["HF_TOKEN"], args.hub_token = args.hub_token, None
    if args.push_to_hub:  # a missing token or a bad repo id fails now, not after training
        check_repo_id(args.hub_model_id or Path(args.output_dir).resolve().name)
        resolve_token()
    out = Path(args.output_dir)
    if data.overwrite_output_dir and not args.resume_from_checkpoint and is_main_process():
        for old in (out / "pma", out / "annealed"):
            if old.exists():
                logger.warning(f"--overwrite_output_dir: deleting the earlier run's {old}")
                shutil.rmtree(old)
    docs, corpus_name = read_documents(
        data.train_files, data.dataset_name, data.dataset_config_name, data.dataset_split, data.streaming,
        data.text_column, data.max_documents, data.default_corpus_bytes,
    )  # fmt: skip
    train_docs, heldout = split_documents(docs, eval_fraction=data.eval_fraction, seed=args.seed)
    cache_dir = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hf_pma/tokenizers"
    tokenizer = run_on_main_process(build_tokenizer, model_args, train_docs, cache_dir)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    train_ds = full_batches(pack_dataset(train_docs, tokenizer, data.block_size), global_batch)
    # The Trainer's evaluations read evenly spread blocks of the final evaluation's text: comparable.
    texts = [doc[: data.max_eval_chars] for doc in heldout[: data.max_eval_texts]]
    eval_ds = pack_dataset(texts, tokenizer, data.block_size, max_blocks=data.max_eval_blocks)
    model = build_model(model_args, tokenizer, data.block_size)
    logger.info(
        f"{corpus_name}: {len(train_docs)} train / {len(heldout)} held-out documents, {len(train_ds)} blocks of "
        f"{data.block_size} tokens; model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
    )

    push_merged = args.push_to_hub and args.pma_push_merged
    args.pma_push_merged = False  # pushed below, once the card holds the final evaluation
    args.push_to_hub = args.push_to_hub and data.push_live_model
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = PMATrainer(
        model, args, train_dataset=train_ds, eval_dataset=eval_ds, data_collator=collator, processing_class=tokenizer
    )  # fmt: skip
    trainer.pma_command = reproduce_command(argv)
    trainer.pma_record_extra = {"datasets": [corpus_name], "base_model": model_args.model_name_or_path}
    trainer.train()  # trains, merges the last snapshots, and with --anneal_steps forks the annealed model
    save_full_model(trainer, out / "final")
    if trainer.pma_merged_dir is None:
        logger.warning("No snapshot was taken: nothing to merge (lengthen the run or lower V)")
        return 1
    merged, tasks, include = trainer.pma_merged_dir, data.eval_tasks, None
    if data.make_tasks:  # sized to the model's context, so that lm-eval scores every choice whole
        info = make_tasks_from_split(
            train_docs, heldout, out / "tasks", seed=args.seed, options=TaskOptions(num_items=data.task_items),
            overwrite=True, info={"max_item_tokens": data.block_size}, fits=fits_context(tokenizer, data.block_size),
            eval_texts=texts,
        )  # fmt: skip
        names = [*info["tasks"], *([data.eval_tasks] if data.eval_tasks else [])]
        tasks, include = ",".join(names), out / "tasks"
    # The last snapshot, the merge and the annealed model on the same held-out documents: the
    # record, the paired comparison and the card (every process calls it; the main one evaluates).
    kwargs = {"tasks": tasks, "include_path": include, "block_size": data.block_size, "live": out / "final"}
    kwargs["eval_dataset"] = "heldout.jsonl" if data.make_tasks else None  # the file of the texts it scores
    results = trainer.annealing_check(texts, **kwargs)
    if is_main_process():
        if push_merged:
            url = trainer.push_merged_to_hub(repo_id=args.hub_model_id, revision=args.pma_push_revision)
            logger.info(f"Pushed the merged model: {url}")
        summary = {
            "snapshots + manifest": trainer.pma_callback.pma_dir,
            "merged model": merged,
            "final (live) model": out / "final",
            "annealed fork": trainer.pma_annealed_dir,
            "model card / plot": f"{shown(merged / 'README.md')} / {shown(merged / 'pma_training.png')}",
            "evaluation": merged / EVAL_RECORD_NAME,
        }
        print(f"\nDone in {time.time() - started:.0f} s.")
        for what, path in summary.items():
            if path is not None:
                print(f"  {what:<21}: {path if isinstance(path, str) else shown(path)}")
        print(f"\n{results_table(results['results'])}\n\n{comparison_table(results['comparison'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
