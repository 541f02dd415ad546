"""Pre-training data: the embedded default corpus, a local BPE tokenizer, packing into blocks.

The default corpus is the Python standard library's own source, read from the running
interpreter: real text that every machine with Python has, so ``scripts/pretrain.py`` runs
with no network. The train / held-out split itself is :func:`hf_pma.evaluation.corpus.split_documents`.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from transformers.utils import logging

from hf_pma.utils.fs import write_folder_atomically

logger = logging.get_logger(__name__)

__all__ = ["stdlib_documents", "read_documents", "train_bpe_tokenizer", "pack_dataset", "full_batches"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def stdlib_documents(max_bytes: int = 8_000_000, min_chars: int = 500) -> list[str]:
    """Source files of the running interpreter's standard library, in a stable order.

    Test suites and vendored packages are skipped (repetitive, and they differ between
    installations); files are taken in sorted path order until ``max_bytes`` of text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in _stdlib_sources(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < min_chars:
            continue
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    if not docs:
        raise FileNotFoundError(f"no standard-library source files found under {root}")
    return docs


_SKIPPED_FOLDERS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3"})


def read_documents(
    train_files: Sequence[str] | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    dataset_split: str = "train",
    streaming: bool = False,
    text_column: str = "text",
    max_documents: int | None = None,
    default_corpus_bytes: int = 8_000_000,
) -> tuple[list[str], str]:
    """A pre-training corpus as a list of documents, and a name for it (for the card): local
    ``train_files`` (files or folders, :func:`~hf_pma.evaluation.corpus.load_documents`), else
    the ``datasets`` dataset ``dataset_name`` (streamed with ``streaming``, which needs
    ``max_documents``), else the default corpus (:func:`stdlib_documents`). ``max_documents``
    keeps the first ones. One-line ``ValueError`` for a missing column or an unbounded stream."""
    from hf_pma.evaluation.corpus import load_documents

    if train_files:
        return load_documents(list(train_files), text_column=text_column)[:max_documents], "local files"
    if not dataset_name:
        return stdlib_documents(max_bytes=default_corpus_bytes), "local:python-stdlib"
    if streaming and max_documents is None:
        raise ValueError(
            "streaming needs max_documents: the documents to read, train and held-out together"
        )
    import datasets

    from hf_pma.utils.hub_client import install_hub_client

    install_hub_client()  # datasets downloads it: bounded in bytes and time, like hf-pma's own
    ds = datasets.load_dataset(dataset_name, dataset_config_name, split=dataset_split, streaming=streaming)
    if text_column not in (ds.column_names or []):
        raise ValueError(f"{dataset_name} has no column {text_column!r} (columns: {ds.column_names})")
    rows = ds.take(max_documents) if streaming else ds
    return [row[text_column] for _, row in zip(range(max_documents or len(ds)), rows)], dataset_name


def _stdlib_sources(root: Path) -> list[Path]:
    """The ``*.py`` files under ``root`` outside the skipped folders, sorted as paths.

    The skipped folders are pruned while walking: site-packages sits inside the standard
    library's folder and can hold hundreds of thousands of files that would be listed for nothing.
    """
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_FOLDERS]
        found += [Path(folder, name) for name in files if name.endswith(".py")]
    return sorted(found)


def _corpus_digest(texts: Sequence[str], vocab_size: int) -> str:
    digest = hashlib.sha256(str(vocab_size).encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    return digest.hexdigest()[:16]


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 4096, cache_dir: str | os.PathLike[str] | None = None):
    """Train a byte-level BPE tokenizer on ``texts`` (cached by content in ``cache_dir``).

    Returns a ``PreTrainedTokenizerFast`` with ``<pad>``, ``<s>`` and ``</s>`` special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cached = None
    if cache_dir is not None:
        cached = Path(cache_dir) / f"bpe-{vocab_size}-{_corpus_digest(texts, vocab_size)}"
        if (cached / "tokenizer.json").is_file():
            logger.info(f"Using the cached tokenizer at {cached}")
            return PreTrainedTokenizerFast.from_pretrained(cached, trust_remote_code=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if cached is not None and not (cached / "tokenizer.json").is_file():  # another process may have cached it
        write_folder_atomically(cached, tokenizer.save_pretrained)
    return tokenizer


def pack_dataset(
    texts: Sequence[str], tokenizer, block_size: int, add_eos: bool = True, max_blocks: int | None = None
):
    """Tokenize ``texts``, join them with EOS and cut the stream into ``block_size`` blocks.

    Returns a ``datasets.Dataset`` with one ``input_ids`` column; the incomplete last block is
    dropped, so every block is full and needs no padding or attention mask. ``max_blocks`` keeps
    at most that many, spread evenly over the stream (an evaluation set that samples every text).
    """
    import datasets

    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 1):
        raise ValueError(f"max_blocks must be a positive number of blocks, got {max_blocks!r}")
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []

    def tokenize_and_pack(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        stream: list[int] = []
        for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            stream.extend(eos)
        n = len(stream) // block_size
        return {"input_ids": [stream[i * block_size : (i + 1) * block_size] for i in range(n)]}

    raw = datasets.Dataset.from_dict({"text": list(texts)})
    packed = raw.map(tokenize_and_pack, batched=True, batch_size=256, remove_columns=["text"])
    if len(packed) == 0:
        raise ValueError(f"the texts hold fewer tokens than one block of {block_size}")
    if max_blocks is not None and max_blocks < len(packed):
        packed = packed.select([i * len(packed) // max_blocks for i in range(max_blocks)])
    return packed


def full_batches(dataset, global_batch: int):
    """``dataset`` cut to a multiple of ``global_batch`` rows (sequences per optimizer step, all
    processes): every step then sees the same tokens, so that a snapshot every V tokens falls on
    the same steps in every epoch (and the last one on the last step, where an annealed fork ends).
    ``ValueError`` when it holds less than one global batch."""
    keep = len(dataset) - len(dataset) % global_batch
    if keep == 0:
        raise ValueError(f"the training data holds {len(dataset)} blocks, fewer than one global batch of {global_batch}")
    return dataset.select(range(keep)) if keep < len(dataset) else dataset
