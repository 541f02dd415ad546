"""Pre-train a causal LM with PMA: snapshots every V tokens, merged evaluation, final merge,
held-out evaluation, model card, plot, and optional push to the Hub.

With no arguments it runs the embedded default (``scripts/configs/tiny.yaml``): a small Llama
pre-trained on the Python standard library's own source with a WSD schedule, on CPU, in a few
minutes. With arguments it is the same job on your data, model and GPUs::

    accelerate launch scripts/pretrain.py                                   # the embedded default
    accelerate launch scripts/pretrain.py scripts/configs/tiny.yaml --max_steps 100
    accelerate launch --config_file scripts/configs/fsdp2.yaml scripts/pretrain.py \\
        --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT --streaming \\
        --config_name meta-llama/Llama-3.2-1B --tokenizer_name meta-llama/Llama-3.2-1B \\
        --output_dir runs/llama-1b --max_steps 20000 --bf16 --pma_interval_tokens 500000000

A YAML/JSON file as the first argument gives defaults; flags after it override them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    LlamaConfig,
    set_seed,
)
from transformers.utils import logging

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.evaluation.corpus import load_documents, split_documents
from hf_pma.evaluation.evaluator import evaluate_models, results_table, write_eval_record
from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks_from_split
from hf_pma.training.pretrain_data import pack_dataset, stdlib_documents, train_bpe_tokenizer
from hf_pma.utils.distributed import is_main_process, run_on_main_process
from hf_pma.utils.fs import atomic_write_json
from hf_pma.utils.logs import enable_logging

logger = logging.get_logger("hf_pma.pretrain")

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


@dataclasses.dataclass
class ModelArguments:
    """Which model to train."""

    model_name_or_path: str | None = dataclasses.field(
        default=None, metadata={"help": "Start from these weights (continued pre-training); else from a config."}
    )
    config_name: str | None = dataclasses.field(
        default=None, metadata={"help": "Config (Hub id or folder) of a model trained from scratch; default: a small Llama."}
    )
    config_overrides: str | None = dataclasses.field(
        default=None, metadata={"help": "Config overrides, e.g. 'hidden_size=256,num_hidden_layers=8'."}
    )
    tokenizer_name: str | None = dataclasses.field(
        default=None, metadata={"help": "Tokenizer (Hub id or folder); default: the model's, else a BPE trained on the train split."}
    )
    vocab_size: int = dataclasses.field(default=4096, metadata={"help": "Vocabulary of the tokenizer trained here."})


@dataclasses.dataclass
class DataArguments:
    """Which text to train and evaluate on."""

    dataset_name: str | None = dataclasses.field(default=None, metadata={"help": "A datasets name (Hub id or local builder)."})
    dataset_config_name: str | None = dataclasses.field(default=None, metadata={"help": "Its configuration."})
    dataset_split: str = dataclasses.field(default="train", metadata={"help": "Split to read."})
    streaming: bool = dataclasses.field(default=False, metadata={"help": "Stream the dataset instead of downloading it."})
    train_files: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Text files or folders (txt, md, py, jsonl, json, csv, parquet)."}
    )
    text_column: str = dataclasses.field(default="text", metadata={"help": "Column of the text in tables and datasets."})
    max_documents: int | None = dataclasses.field(
        default=None, metadata={"help": "Read at most this many documents (required with --streaming to hold out a split)."}
    )
    default_corpus_bytes: int = dataclasses.field(
        default=3_000_000, metadata={"help": "Bytes of standard-library source in the embedded default corpus."}
    )
    block_size: int = dataclasses.field(default=128, metadata={"help": "Tokens per training sequence (texts are packed)."})
    eval_fraction: float = dataclasses.field(default=0.05, metadata={"help": "Share of documents held out for evaluation."})
    max_eval_blocks: int = dataclasses.field(default=64, metadata={"help": "Held-out blocks in the Trainer's evaluations."})
    max_eval_texts: int = dataclasses.field(
        default=40, metadata={"help": "Held-out documents in the final loss / bits-per-byte evaluation."}
    )
    token_budget: int | None = dataclasses.field(
        default=None, metadata={"help": "Train on this many tokens (sets max_steps from the global batch)."}
    )
    make_tasks: bool = dataclasses.field(
        default=True, metadata={"help": "Generate multiple-choice tasks from the held-out documents and evaluate on them."}
    )
    task_items: int = dataclasses.field(default=150, metadata={"help": "Items per generated task."})
    eval_tasks: str | None = dataclasses.field(
        default=None, metadata={"help": "Extra lm-eval task names for the final evaluation (e.g. hellaswag,arc_easy)."}
    )
    overwrite_output_dir: bool = dataclasses.field(
        default=False,
        metadata={"help": "Delete an earlier run's snapshots and merge in output_dir first (never when resuming)."},
    )
    push_live_model: bool = dataclasses.field(
        default=False, metadata={"help": "With --push_to_hub, also let the Trainer push the live model (main branch)."}
    )


def parse_arguments(argv: list[str]) -> tuple[ModelArguments, DataArguments, PMATrainingArguments]:
    """Dataclasses from an optional leading YAML/JSON file (defaults) and command-line flags."""
    parser = HfArgumentParser((ModelArguments, DataArguments, PMATrainingArguments))
    if not argv:
        argv = [str(DEFAULT_CONFIG)]
    if argv[0].endswith((".yaml", ".yml", ".json")):
        path = Path(argv[0])
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        defaults = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
        known = {f.name for dc in parser.dataclass_types for f in dataclasses.fields(dc)}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"{path}: unknown argument(s) {', '.join(unknown)}")
        parser.set_defaults(**defaults)
        argv = argv[1:]
    return parser.parse_args_into_dataclasses(argv)


def read_documents(data: DataArguments) -> tuple[list[str], str]:
    """The corpus as a list of documents, and a name for it (for the card)."""
    if data.dataset_name:
        import datasets

        ds = datasets.load_dataset(
            data.dataset_name, data.dataset_config_name, split=data.dataset_split, streaming=data.streaming
        )
        if data.streaming and data.max_documents is None:
            raise ValueError("--streaming needs --max_documents (documents to read, train and held-out together)")
        if data.text_column not in (ds.column_names or []):
            raise ValueError(f"{data.dataset_name} has no column {data.text_column!r} (columns: {ds.column_names})")
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


def reproduce_command(argv: list[str]) -> str:
    """The launch line of this run, with local paths reduced to their names (for the card)."""
    parts = ["accelerate", "launch", "scripts/pretrain.py"]
    for arg in argv:
        parts.append(Path(arg).name if os.path.isabs(arg) else arg)
    return shlex.join(parts)


def final_evaluation(trainer: PMATrainer, tokenizer, heldout: list[str], train_docs: list[str], data: DataArguments) -> dict:
    """Last snapshot vs PMA merge vs the final (annealed, with WSD) model on held-out text and tasks."""
    out = Path(trainer.args.output_dir)
    snapshots = trainer.pma_callback.snapshots()
    # With a WSD schedule the final live model is the annealed one: the comparison PMA is about.
    schedule = str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type))
    annealed = schedule not in ("constant", "constant_with_warmup")
    final_label = "annealed" if annealed else "final model"
    models = {"last snapshot": snapshots[-1][1], "PMA merge": trainer.pma_merged_dir, final_label: out / "final"}
    tasks, include = data.eval_tasks, None
    if data.make_tasks:
        info = make_tasks_from_split(
            train_docs,
            heldout,
            out / "tasks",
            seed=trainer.args.seed,
            options=TaskOptions(num_items=data.task_items),
            overwrite=True,
        )
        tasks = ",".join([*info["tasks"], *([data.eval_tasks] if data.eval_tasks else [])])
        include = out / "tasks"
    return evaluate_models(
        [str(p) for p in models.values()],
        labels=list(models),
        texts=heldout[: data.max_eval_texts],
        eval_dataset="held-out documents",
        tasks=tasks,
        include_path=include,
        block_size=data.block_size,
        batch_size=trainer.args.per_device_eval_batch_size,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the whole job; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    model_args, data, args = parse_arguments(argv)
    # hf-pma's own progress at INFO; transformers' at WARNING (it logs every config it saves).
    logging.set_verbosity_warning()
    logging.enable_explicit_format()
    enable_logging(logging.INFO)
    set_seed(args.seed)

    if args.push_to_hub:  # a missing token or a bad repo id fails now, not after training
        from hf_pma.publishing.hub import check_repo_id, resolve_token

        check_repo_id(args.hub_model_id or Path(args.output_dir).resolve().name)
        resolve_token(args.hub_token)
    pma_dir = Path(args.output_dir) / "pma"
    if data.overwrite_output_dir and not args.resume_from_checkpoint and is_main_process() and pma_dir.exists():
        logger.warning(f"--overwrite_output_dir: deleting the earlier run's {pma_dir}")
        shutil.rmtree(pma_dir)
    docs, corpus_name = read_documents(data)
    train_docs, heldout = split_documents(docs, eval_fraction=data.eval_fraction, seed=args.seed)
    cache_dir = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hf_pma" / "tokenizers"
    tokenizer = run_on_main_process(build_tokenizer, model_args, train_docs, cache_dir)
    train_ds = pack_dataset(train_docs, tokenizer, data.block_size)
    eval_ds = pack_dataset(heldout, tokenizer, data.block_size)
    eval_ds = eval_ds.select(range(min(len(eval_ds), data.max_eval_blocks)))
    if data.token_budget:
        tokens_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * data.block_size
        args.max_steps = max(1, data.token_budget // tokens_per_step)
    model = build_model(model_args, tokenizer, data.block_size)
    logger.info(
        f"{corpus_name}: {len(train_docs)} train / {len(heldout)} held-out documents, {len(train_ds)} blocks of "
        f"{data.block_size} tokens; model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
    )

    push_merged = args.push_to_hub and args.pma_push_merged
    args.pma_push_merged = False  # pushed below, once the card holds the final evaluation
    args.push_to_hub = args.push_to_hub and data.push_live_model
    trainer = PMATrainer(
        model,
        args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
    )
    trainer.pma_command = reproduce_command(argv)
    trainer.train()
    trainer.save_model(str(Path(args.output_dir) / "final"))
    if trainer.pma_merged_dir is None:
        logger.warning("No snapshot was taken: no merge to evaluate (lengthen the run or lower pma_interval_tokens).")
        return 1

    # Every process calls the evaluation functions: they run on the main process, the others wait.
    results = final_evaluation(trainer, tokenizer, heldout, train_docs, data)
    write_eval_record(trainer.pma_merged_dir, results["results"], eval_dataset=results.get("eval_dataset"))
    if is_main_process():
        from hf_pma.publishing.card import write_model_card

        training_record = trainer.pma_merged_dir / "pma_training.json"
        record = json.loads(training_record.read_text())
        record["datasets"] = [corpus_name]
        record["base_model"] = model_args.model_name_or_path
        atomic_write_json(training_record, record)
        card = write_model_card(trainer.pma_merged_dir, repo_id=args.hub_model_id)
        if push_merged:
            url = trainer.push_merged_to_hub(repo_id=args.hub_model_id, revision=args.pma_push_revision)
            logger.info(f"Pushed the merged model: {url}")
        print("\nDone.")
        print(f"  snapshots + manifest : {trainer.pma_callback.pma_dir}")
        print(f"  merged model         : {trainer.pma_merged_dir}")
        print(f"  final (live) model   : {Path(args.output_dir) / 'final'}")
        print(f"  model card / plot    : {card} / {trainer.pma_merged_dir / 'pma_training.png'}")
        print(f"  evaluation           : {trainer.pma_merged_dir / 'pma_eval.json'}\n")
        print(results_table(results["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
