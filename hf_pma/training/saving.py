"""Saving a whole model from a Trainer under any sharding."""

from __future__ import annotations

from pathlib import Path

from transformers import Trainer

__all__ = ["save_full_model"]


def save_full_model(trainer: Trainer, output_dir: str | Path) -> None:
    """``trainer.save_model(output_dir)`` that writes a folder ``from_pretrained`` loads under
    any sharding. Call it on every process.

    Under FSDP with ``fsdp_state_dict_type: SHARDED_STATE_DICT`` (what FSDP2 configs use, so
    that checkpoints stay sharded), ``Trainer.save_model`` writes no weights at all; here the
    state-dict type is FULL_STATE_DICT for the duration of the call (the full weights are
    gathered to the main process, which writes them), then back to what it was. DDP, ZeRO-3
    and a single process save as ``save_model`` does.
    """
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not trainer.is_fsdp_enabled or plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        trainer.save_model(str(output_dir))
        return
    previous = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        trainer.save_model(str(output_dir))
    finally:
        plugin.state_dict_type = previous
