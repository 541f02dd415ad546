"""Tiny Llama models built from configs, a tokenizer trained locally, model folders and their
weights. Nothing here touches the network: models come from configs, the tokenizer is trained
with ``tokenizers`` on a few kilobytes of the standard library's own source."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.data import sample_text


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
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_model_folder(
    path: Path, model, tokenizer=None, max_shard_size: str | int = "5GB", extra: dict | None = None
) -> Path:
    """Save a model (and tokenizer) as a plain HF folder; ``extra`` is written as pma.json."""
    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if extra is not None:
        (path / "pma.json").write_text(json.dumps(extra))
    return path


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a model folder."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def max_weight_diff(snapshot: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the snapshot's tensors (tied duplicates are not stored)."""
    missing = set(snapshot) - set(live)
    assert not missing, f"snapshot has tensors the model lacks: {sorted(missing)}"
    return max(float((snapshot[k].float() - live[k].float()).abs().max()) for k in snapshot)
