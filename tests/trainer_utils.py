"""A tiny, fast language-modelling setup shared by the PMATrainer tests and launched scripts."""

from __future__ import annotations

from conftest import make_tiny_model, sample_text, train_tiny_tokenizer
from transformers import DataCollatorForLanguageModeling

BLOCK = 32


def lm_datasets(tokenizer, n_eval: int = 16):
    """Blocks of the sample text: (train, eval) lists of {"input_ids": [...]}."""
    ids = tokenizer(sample_text(), add_special_tokens=False)["input_ids"]
    blocks = [{"input_ids": ids[i : i + BLOCK]} for i in range(0, len(ids) - BLOCK, BLOCK)]
    return blocks[:-n_eval], blocks[-n_eval:]


def lm_setup(tokenizer=None, seed: int = 0):
    """(model, tokenizer, train, eval, collator) for a tiny Llama."""
    tokenizer = tokenizer or train_tiny_tokenizer()
    train, evaluation = lm_datasets(tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return make_tiny_model(seed=seed), tokenizer, train, evaluation, collator


def quiet_args(**overrides) -> dict:
    """TrainingArguments keywords for fast, silent CPU runs."""
    base = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    base.update(overrides)
    return base
