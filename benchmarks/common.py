"""What the benchmarks share: a Llama built from a few sizes, its parameter count, random token
data, and seeded copies of a model (snapshots that differ as real ones do).

The scripts of this folder import it as ``common`` (Python puts a script's own folder first on
``sys.path``). Nothing heavy is imported at the top: ``bench_merge.py``'s merge worker must stay
torch-free and ``gpu_check.py`` stops before importing transformers when there is no GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def llama_config(
    *,
    hidden: int,
    layers: int,
    vocab: int,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    max_positions: int = 2048,
    tie: bool = True,
    **extra: Any,
):
    """A ``LlamaConfig``: ``intermediate`` defaults to 4 x ``hidden``, ``heads`` to one per 64
    dimensions, ``kv_heads`` to ``heads``; ``extra`` goes to the config as is (token ids...)."""
    from transformers import LlamaConfig

    heads = heads or max(1, hidden // 64)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        **extra,
    )


def llama(*, seed: int = 0, meta: bool = False, **sizes: Any):
    """A randomly initialised ``LlamaForCausalLM`` of :func:`llama_config` ``(**sizes)``, the same
    for a seed (on the meta device with ``meta``: for a caller that shards it first)."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(**sizes)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


def llama_parameter_count(
    hidden: int,
    layers: int,
    intermediate: int,
    vocab: int,
    heads: int,
    kv_heads: int | None = None,
    tie: bool = True,
) -> int:
    """Parameters of a ``LlamaForCausalLM`` (no biases, RMSNorm weights, tied head by default)."""
    kv = (kv_heads or heads) * (hidden // heads)
    attention = 2 * hidden * hidden + 2 * hidden * kv
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tie else 2)
    return embeddings + layers * per_layer + hidden


class Tokens:
    """``n`` random sequences of ``seq`` token ids below ``vocab`` (the same for a seed), as a
    map-style dataset whose items are ``{"input_ids", "labels"}`` (the labels are the ids)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def perturbed_copies(model, folders: list[Path], scale: float = 1e-3, seed: int = 1000, **save: Any) -> int:
    """Save ``model`` into each folder of ``folders`` (``save_pretrained(**save)``), the ``k``-th
    with its weights moved by ``scale`` x a normal draw seeded ``seed + k``: snapshots that differ
    as real ones do, made cheaply. A folder that already holds a ``config.json`` is kept; each
    new one appears whole (saved beside it, then renamed). Returns the bytes of the model's
    weights."""
    import os
    import shutil

    import torch

    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, folder in enumerate(folders):
        if (Path(folder) / "config.json").is_file():
            continue
        generator = torch.Generator().manual_seed(seed + k)
        with torch.no_grad():
            for name, param in model.state_dict().items():
                param.copy_(base[name]).add_(torch.randn(param.shape, generator=generator), alpha=scale)
        partial = Path(folder).with_name(Path(folder).name + ".tmp")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, **save)
        os.replace(partial, folder)
    return sum(v.numel() * v.element_size() for v in base.values())
