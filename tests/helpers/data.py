"""Data for the tests: real text every Python installation has, blocks of it, random token
datasets and their collation, and generated lm-eval tasks."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

BLOCK = 32


def sample_text(max_chars: int = 60_000) -> str:
    """Real text that every Python installation has: the source of a few stdlib modules."""
    import argparse
    import json as json_mod
    import textwrap

    parts = [inspect.getsource(m) for m in (textwrap, argparse, json_mod.decoder)]
    return "\n".join(parts)[:max_chars]


def write_small_tasks(folder: Path) -> Path:
    """Generated lm-eval tasks (12 items each, lines of at most 60 characters) with their held-out
    documents, from :func:`sample_text` cut into 30-line documents; returns ``folder``."""
    from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks

    lines = sample_text().splitlines()
    docs = ["\n".join(lines[i : i + 30]) for i in range(0, len(lines), 30)]
    make_tasks(docs, folder, eval_fraction=0.3, options=TaskOptions(num_items=12, max_line_chars=60))
    return Path(folder)


def lm_datasets(tokenizer, n_eval: int = 16):
    """Blocks of the sample text: (train, eval) lists of {"input_ids": [...]}."""
    ids = tokenizer(sample_text(), add_special_tokens=False)["input_ids"]
    blocks = [{"input_ids": ids[i : i + BLOCK]} for i in range(0, len(ids) - BLOCK, BLOCK)]
    return blocks[:-n_eval], blocks[-n_eval:]


# Lines that every document holds: they are in training whatever the split, so they must never
# be a choice, though they are long enough to be one.
BOILERPLATE = [
    "# Copyright (c) the authors of this shared header, all rights reserved.",
    "    raise NotImplementedError('this shared line sits in every document')",
]


def corpus(n_lines: int = 30) -> list[str]:
    """Documents of ``n_lines`` lines of :func:`sample_text`, each with the two ``BOILERPLATE``
    lines (one first, one in the middle)."""
    lines = sample_text().splitlines()
    docs = []
    for start in range(0, len(lines), n_lines):
        chunk = lines[start : start + n_lines]
        docs.append(
            "\n".join([BOILERPLATE[0], *chunk[: n_lines // 2], BOILERPLATE[1], *chunk[n_lines // 2 :]])
        )
    return docs


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences; lengths vary in ``[min_len, max_len]`` (fixed when equal)."""

    def __init__(self, n: int = 256, min_len: int = 16, max_len: int = 16, seed: int = 0, vocab: int = 512):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
        self.rows = [torch.randint(3, vocab, (int(n_tok),), generator=generator) for n_tok in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def pad_collate(features: list[dict]) -> dict:
    """Right-pad with id 0; attention mask; labels ignore the padding."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, feature in enumerate(features):
        n = len(feature["input_ids"])
        ids[row, :n] = feature["input_ids"]
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def local_model(root: Path, files: dict[str, bytes]) -> tuple[Path, Path]:
    """A model folder ``root/model`` holding ``files`` (by name), and held-out text beside it
    (``root/heldout.txt``, 2,000 characters): a local model to evaluate against a Hub's tokenizer."""
    model = root / "model"
    model.mkdir()
    for name, data in files.items():
        (model / name).write_bytes(data)
    text = root / "heldout.txt"
    text.write_text(sample_text(2000))
    return model, text
