"""PEFT: adapter-only snapshots and merges that reload with PeftModel.from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from hf_pma import PMATrainer, PMATrainingArguments
from tests.helpers.models import make_tiny_model
from tests.helpers.training import lm_setup, quiet_args


def test_lora_snapshots_merge_and_reload(tiny_tokenizer, tmp_path):
    _m, tokenizer, train, evaluation, collator = lm_setup(tiny_tokenizer)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(make_tiny_model(seed=0), config)
    args = PMATrainingArguments(
        output_dir=str(tmp_path / "out"),
        **quiet_args(max_steps=16, eval_strategy="steps", eval_steps=16, learning_rate=1e-2),
        pma_interval_tokens=256,
        pma_window=3,
    )
    trainer = PMATrainer(model, args, train_dataset=train, eval_dataset=evaluation, data_collator=collator,
                         processing_class=tokenizer)
    trainer.train()

    snapshots = trainer.pma_callback.snapshots()
    assert len(snapshots) >= 3
    for _record, folder in snapshots:
        assert (folder / "adapter_model.safetensors").is_file() and (folder / "adapter_config.json").is_file()
        assert not (folder / "model.safetensors").exists()
        keys = load_file(folder / "adapter_model.safetensors").keys()
        assert keys and all("lora_" in k for k in keys)  # adapter weights only, no base weights

    merged = trainer.pma_merged_dir
    assert (merged / "adapter_model.safetensors").is_file()
    states = [load_file(folder / "adapter_model.safetensors") for _, folder in snapshots[-3:]]
    merged_state = load_file(merged / "adapter_model.safetensors")
    for name, tensor in merged_state.items():
        torch.testing.assert_close(tensor, sum(s[name] for s in states) / 3, rtol=0, atol=1e-7)
    assert json.loads((merged / "pma_merge.json").read_text())["num_sources"] == 3

    reloaded = PeftModel.from_pretrained(make_tiny_model(seed=0), merged)
    live = dict(reloaded.named_parameters())
    for name, tensor in merged_state.items():
        live_name = name.replace(".weight", ".default.weight")
        assert torch.equal(live[live_name].detach(), tensor), name

    # merged evaluation swapped adapter weights in and out and logged both losses
    (last_eval,) = [e for e in trainer.state.log_history if "eval_pma_loss" in e]
    assert last_eval["eval_pma_loss"] != last_eval["eval_loss"]
    after = trainer.evaluate()
    assert after["eval_loss"] == pytest.approx(last_eval["eval_loss"], rel=1e-6)
    assert after["eval_pma_loss"] == pytest.approx(last_eval["eval_pma_loss"], rel=1e-6)
