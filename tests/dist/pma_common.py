"""Helpers shared by the PMACallback tests and the scripts they launch (tests/dist/*.py).

Real components only: a real dataset of token ids, the Trainer's own collation path, and a
callback that keeps a copy of the model's weights after every optimizer step so that tests
can compare snapshots with the weights the model really had.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

from tests.testing_utils import (
    make_tiny_model,  # noqa: F401  (re-exported for the scripts)
    quiet_args,
)


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


def make_args(output_dir: str | Path, **overrides) -> TrainingArguments:
    """Small, quiet CPU training arguments (``tests.testing_utils.quiet_args``); ``overrides`` win."""
    kwargs = quiet_args(max_steps=12, learning_rate=1e-3)
    kwargs.pop("per_device_eval_batch_size")
    kwargs.pop("data_seed")
    kwargs.update(overrides)
    return TrainingArguments(output_dir=str(output_dir), **kwargs)


class WeightRecorder(TrainerCallback):
    """Keeps, on the main process, the weights and token count after every optimizer step.

    Add it *after* PMACallback: both see the same weights at ``on_step_end``.
    """

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.tokens: dict[int, int] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.tokens[state.global_step] = int(state.num_input_tokens_seen)
        if state.is_world_process_zero:
            self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


class StopAt(TrainerCallback):
    """Raises at the end of optimizer step ``step``: a crash in the middle of training.

    Add it *before* PMACallback, which then never sees that step.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"simulated crash at step {self.step}")


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
