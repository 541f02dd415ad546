"""What the tests share: tiny Llama models built from configs, a locally trained tokenizer,
fast Trainer settings, and ``require_*`` markers for optional extras.

Nothing here touches the network: models come from configs, the tokenizer is trained with
``tokenizers`` on a few kilobytes of the standard library's own source.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import DataCollatorForLanguageModeling

REPO_ROOT = Path(__file__).resolve().parents[1]


def tiny_llama_config(vocab_size: int = 512, tie: bool = True, **overrides):
    """A 2-layer Llama config with a few tens of thousands of parameters."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def make_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    """A randomly initialised tiny LlamaForCausalLM (deterministic for a seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides))
    return model.to(dtype)


def sample_text(max_chars: int = 60_000) -> str:
    """Real text that every Python installation has: the source of a few stdlib modules."""
    import argparse
    import json as json_mod
    import textwrap

    parts = [inspect.getsource(m) for m in (textwrap, argparse, json_mod.decoder)]
    return "\n".join(parts)[:max_chars]


def train_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained locally, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_text().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


# Optional extras: CI installs them all and fails on any skip (see .ci/run).
require_peft = pytest.mark.skipif(_missing("peft"), reason="needs the peft extra (pip install hf-pma[peft])")
require_lm_eval = pytest.mark.skipif(_missing("lm_eval"), reason="needs the eval extra (pip install hf-pma[eval])")
require_matplotlib = pytest.mark.skipif(_missing("matplotlib"), reason="needs the plot extra (pip install hf-pma[plot])")


def save_model_folder(path: Path, model, tokenizer=None, max_shard_size: str | int = "5GB", extra: dict | None = None) -> Path:
    """Save a model (and tokenizer) as a plain HF folder; ``extra`` is written as pma.json."""
    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if extra is not None:
        (path / "pma.json").write_text(json.dumps(extra))
    return path

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


def markdown_rows(text: str) -> list[list[str]]:
    """The rows of the markdown tables in ``text`` (header rows included, rule rows left out),
    each a list of stripped cells."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            continue
        cells = [c.strip() for c in line[1:-1].split(" | ")]
        if all(c and set(c) <= set(":-") for c in cells):
            continue
        rows.append(cells)
    return rows


def hf_pma_command() -> str:
    """The ``hf-pma`` console script of the running Python."""
    import os
    import sys

    return os.path.join(os.path.dirname(sys.executable), "hf-pma")



def text_rows(text: str) -> list[list[str]]:
    """The rows of the plain-text tables in ``text`` (``hf_pma.utils.formatting.text_table``):
    each table's header and body rows, cut at the columns its dashed rule marks, cells stripped."""
    import re

    lines = text.splitlines()
    rows = []
    for k, rule in enumerate(lines):
        if k == 0 or not rule.strip() or set(rule) - {"-", " "} or "--" not in rule:
            continue
        spans = [m.span() for m in re.finditer(r"-+", rule)]
        starts = [a for a, _ in spans] + [None]
        table = [lines[k - 1]]
        for line in lines[k + 1 :]:
            if not line.strip():
                break
            table.append(line)
        for line in table:
            rows.append([line[starts[i] : starts[i + 1]].strip() if starts[i + 1] else line[starts[i] :].strip()
                         for i in range(len(spans))])
    return rows
