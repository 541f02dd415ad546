"""PMATrainer: merged evaluation, merge at end, PMA-init, loss-spike recovery, argument checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

from hf_pma import PMATrainer, PMATrainingArguments
from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
from hf_pma.training.trainer import LossSpikeError
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.training import lm_setup, quiet_args


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    return lm_setup(tiny_tokenizer)


def _trainer(setup, tmp_path, model=None, callbacks=None, **overrides):
    _model, tokenizer, train, evaluation, collator = setup
    args = PMATrainingArguments(output_dir=str(tmp_path / "out"), **quiet_args(**overrides))
    return PMATrainer(
        model if model is not None else make_tiny_model(seed=0),
        args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def test_merged_eval_sits_beside_live_eval_and_equals_independent_evaluation(setup, tmp_path):
    trainer = _trainer(
        setup, tmp_path, max_steps=24, eval_strategy="steps", eval_steps=12, pma_interval_tokens=256, pma_window=4
    )
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 2
    assert all("eval_pma_loss" in e for e in evals)  # the same log line as eval_loss
    assert evals[-1]["eval_pma_num_snapshots"] == 4
    assert evals[-1]["eval_pma_loss"] != evals[-1]["eval_loss"]

    # The merged folder written at the end holds the same 4 snapshots as the last evaluation.
    merged = trainer.pma_merged_dir
    record = json.loads((merged / "pma_merge.json").read_text())
    manifest = json.loads((tmp_path / "out" / "pma" / "manifest.json").read_text())
    assert [s["tokens"] for s in record["sources"]] == [s["tokens"] for s in manifest["snapshots"]][-4:]
    assert (merged / "tokenizer.json").is_file() and (merged / "README.md").is_file()
    training = json.loads((merged / "pma_training.json").read_text())
    assert training["pma_evals"] and training["total_tokens"] == trainer.state.num_input_tokens_seen
    assert training["seed"] == trainer.args.seed and training["learning_rate"] == trainer.args.learning_rate

    # Evaluate the merged folder with a plain Trainer: the same loss as eval_pma_loss.
    _model, tokenizer, _train, evaluation, collator = setup
    plain = Trainer(
        AutoModelForCausalLM.from_pretrained(merged),
        TrainingArguments(output_dir=str(tmp_path / "plain"), **quiet_args()),
        eval_dataset=evaluation,
        data_collator=collator,
    )
    independent = plain.evaluate()["eval_loss"]
    assert independent == pytest.approx(evals[-1]["eval_pma_loss"], rel=1e-6)
    # and the live weights came back after the merged evaluation
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)


def test_pma_window_tokens_merges_the_last_tokens_in_eval_at_the_end_and_for_init(setup, tmp_path):
    trainer = _trainer(
        setup, tmp_path, max_steps=16, eval_strategy="steps", eval_steps=16, pma_interval_tokens=256,
        pma_window_tokens=3 * 256 + 1,
    )
    trainer.train()
    manifest = json.loads((tmp_path / "out" / "pma" / "manifest.json").read_text())["snapshots"]
    newest = manifest[-1]["tokens"]
    inside = [s["tokens"] for s in manifest if s["tokens"] > newest - (3 * 256 + 1)]
    assert len(manifest) > len(inside) >= 3
    evals = [e for e in trainer.state.log_history if "eval_pma_loss" in e]
    assert evals[-1]["eval_pma_num_snapshots"] == len(inside)
    record = json.loads((trainer.pma_merged_dir / "pma_merge.json").read_text())
    assert [s["tokens"] for s in record["sources"]] == inside
    assert record["window"]["unit"] == "tokens" and record["window"]["requested"] == 3 * 256 + 1
    assert json.loads((trainer.pma_merged_dir / "pma_training.json").read_text())["pma_window_tokens"] == 3 * 256 + 1
    # PMA-init from the run folder takes the same window.
    capture = _CaptureAtStart()
    init = _trainer(setup, tmp_path / "init", callbacks=[capture], max_steps=1, pma_merge_at_end=False,
                    pma_init_from=[str(tmp_path / "out")], pma_window_tokens=3 * 256 + 1)
    init.train()
    assert [s["tokens"] for s in init.pma_init_record["sources"]] == inside


def test_no_snapshot_yet_means_no_merged_metrics(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, pma_interval_tokens=10**9)
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert evals and not any("eval_pma_loss" in e for e in evals)
    assert trainer.pma_merged_dir is None


class _CaptureAtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_pma_init_starts_from_the_merge(setup, tmp_path):
    folders = [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=10 + i)) for i in range(3)]
    capture = _CaptureAtStart()
    trainer = _trainer(
        setup, tmp_path, callbacks=[capture], max_steps=1, pma_init_from=[str(f) for f in folders], pma_merge_at_end=False
    )
    trainer.train()
    expected = merge_state_dict(folders)
    for name, tensor in expected.items():
        assert torch.equal(capture.state[name], tensor), name
    assert torch.equal(capture.state["lm_head.weight"], expected["model.embed_tokens.weight"])  # tied
    record = json.loads((tmp_path / "out" / "pma" / "pma_init.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["s0", "s1", "s2"]


def test_pma_init_from_a_merged_folder_and_shape_mismatch(setup, tmp_path):
    folders = [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(2)]
    merged = merge_checkpoints(folders, tmp_path / "merged", progress=False)
    trainer = _trainer(setup, tmp_path, max_steps=1, pma_init_from=[str(merged)])
    expected = merge_state_dict([merged])
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in expected.items())
    wide = save_model_folder(tmp_path / "wide", make_tiny_model(seed=0, hidden_size=64, intermediate_size=64))
    with pytest.raises(ValueError, match=r"pma_init_from .*wide.*tensor 'model.embed_tokens.weight' has shape \[512, 64\]"):
        _trainer(setup, tmp_path, max_steps=1, pma_init_from=[str(wide)])


class _LearningRateSpike(TrainerCallback):
    """Multiplies the learning rate by ``factor`` for steps [start, stop): a deliberate divergence."""

    def __init__(self, start: int, stop: int, factor: float) -> None:
        self.start, self.stop, self.factor = start, stop, factor

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.start <= state.global_step < self.stop:
            for group in optimizer.param_groups:
                group["lr"] = args.learning_rate * self.factor


def _final_loss(trainer, n=5):
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return sum(losses[-n:]) / n


def _spike_run(setup, tmp_path, recovery: bool, stop: int = 33, max_recoveries: int = 5):
    return _trainer(
        setup,
        tmp_path,
        callbacks=[_LearningRateSpike(30, stop, 300.0)],
        max_steps=60,
        pma_interval_tokens=512,
        pma_phases=["warmup", "stable", "decay"],
        pma_spike_recovery=recovery,
        pma_max_recoveries=max_recoveries,
        pma_merge_at_end=False,
        logging_nan_inf_filter=False,
    )


def test_spike_recovery_returns_to_the_trajectory(setup, tmp_path):
    with_recovery = _spike_run(setup, tmp_path / "on", recovery=True)
    with_recovery.train()
    without = _spike_run(setup, tmp_path / "off", recovery=False)
    without.train()

    events = [e for e in with_recovery.state.log_history if "pma_recovery" in e]
    assert events and events[0]["pma_recovery_step"] >= 30
    assert with_recovery.pma_recoveries[0]["snapshots"]
    pre_spike = [e["loss"] for e in with_recovery.state.log_history if "loss" in e and e["step"] in range(26, 31)]
    pre_spike_loss = sum(pre_spike) / len(pre_spike)
    assert _final_loss(with_recovery) < _final_loss(without)
    assert _final_loss(with_recovery) < pre_spike_loss * 1.1
    # snapshots taken during the spike are excluded from merges, never deleted silently
    manifest = json.loads((tmp_path / "on" / "out" / "pma" / "manifest.json").read_text())
    assert manifest["recoveries"] and manifest["recoveries"][0]["step"] == events[0]["pma_recovery_step"]
    spike_steps = {r["step"] for r in manifest["snapshots"] if r.get("excluded")}
    assert all(step > 29 for step in spike_steps)


def test_a_run_that_keeps_diverging_stops_with_a_clear_error(setup, tmp_path):
    trainer = _spike_run(setup, tmp_path, recovery=True, stop=10**6, max_recoveries=2)
    with pytest.raises(LossSpikeError, match=r"after 2 recoveries \(pma_max_recoveries=2\)"):
        trainer.train()
    assert len(trainer.pma_recoveries) == 2


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"pma_window": 0}, "pma_window must be 'auto' or a positive number of snapshots"),
        ({"pma_window": "ten"}, "pma_window must be 'auto' or a positive number of snapshots, got 'ten'"),
        ({"pma_window_tokens": 0}, "pma_window_tokens must be a positive integer"),
        ({"pma_strategy": "median"}, "unknown merge strategy 'median'"),
        ({"pma_ema_alpha": 1.5, "pma_strategy": "ema"}, "alpha"),
        ({"pma_keep_last": 3, "pma_window": 10}, r"pma_keep_last \(3\) is smaller than pma_window \(10\)"),
        ({"pma_phases": ["stable", "cooldown"]}, "cooldown"),
        ({"pma_spike_factor": 0.5}, "pma_spike_factor must be greater than 1"),
        ({"pma_init_from": ["./no/such/folder"]}, r"pma_init_from: ./no/such/folder does not exist"),
        ({"pma_save_dtype": "int8"}, "pma_save_dtype"),
        ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "pma_eval=True is not supported with DeepSpeed ZeRO-3"),
        (  # the online average too: its swap into ZeRO-3 partitions is tested outside a Trainer only
            {"deepspeed": {"zero_optimization": {"stage": 3}}, "pma_online": "sma"},
            "pma_eval=True is not supported with DeepSpeed ZeRO-3",
        ),
        ({"pma_online": "wma"}, r"^pma_online must be one of \("),
        ({"pma_online": "online_x"}, r"^pma_online must be one of .* got 'online_x'$"),
        ({"pma_online": "sma", "pma_online_half_life_tokens": 100}, "^pma_online_half_life_tokens is for pma_online='ema'"),
        ({"pma_online": "1-sqrt-decay"}, "give pma_online_window_tokens$"),
        ({"pma_online_window_tokens": 100}, "^pma_online_half_life_tokens, pma_online_half_life_fraction and pma_online_window_tokens need pma_online$"),
        ({"pma_online": "sma", "pma_online_device": "cuda"}, "^pma_online_device must be one of"),
        ({"pma_online": "sma", "pma_keep_last": 20}, "^pma_keep_last has no effect with pma_online"),
        ({"pma_online": "sma", "pma_spike_recovery": True}, "^pma_spike_recovery restores a merge of the snapshots"),
    ],
)
def test_arguments_are_checked_when_given(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        PMATrainingArguments(output_dir=str(tmp_path), **overrides)
    assert "\n" not in str(err.value)


def test_arguments_parse_from_command_line_and_yaml(tmp_path):
    parser = HfArgumentParser(PMATrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--pma_window", "6", "--pma_strategy", "ema", "--pma_ema_alpha", "0.1",
         "--pma_phases", "stable", "--pma_spike_recovery", "--pma_interval_tokens", "4096"]
    )
    assert (args.pma_window, args.pma_strategy, args.pma_ema_alpha) == (6, "ema", 0.1)
    assert args.pma_phases == ["stable"] and args.pma_spike_recovery and args.pma_interval_tokens == 4096
    config = tmp_path / "args.yaml"
    config.write_text(f"output_dir: {tmp_path}\npma_window: 3\npma_keep_last: 5\npma_init_from: [{tmp_path}]\n")
    (from_yaml,) = parser.parse_yaml_file(str(config))
    assert from_yaml.pma_window == 3 and from_yaml.pma_keep_last == 5 and from_yaml.pma_init_from == [str(tmp_path)]
    with pytest.raises(ValueError, match="pma_window"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--pma_window", "0"])


@pytest.mark.parametrize(
    ("callback", "overrides", "message"),
    [
        ({}, {"pma_online": "sma"}, "pma_online='sma' but the PMACallback passed in callbacks"),
        ({"online": "ema"}, {"pma_online": "sma"}, "has online='ema': set the online average in one place$"),
        (
            {"online": "ema"},
            {"pma_online": "ema", "pma_ema_alpha": 0.5},
            "pma_ema_alpha=0.5 but .* has online_alpha=0.2",
        ),
        (
            {"online": "sma"},
            {"pma_online": "sma", "pma_online_device": "device"},
            "pma_online_device='device' but .* has online_device='cpu'",
        ),
    ],
)
def test_pma_online_arguments_that_a_given_callback_would_override_are_refused(
    tmp_path, callback, overrides, message
):
    """A PMACallback in ``callbacks`` is used instead of one built from the arguments: pma_online*
    options it does not share would be ignored without a word."""
    from hf_pma import PMACallback

    args = PMATrainingArguments(output_dir=str(tmp_path), report_to=[], **overrides)
    with pytest.raises(ValueError, match=message) as err:
        PMATrainer(make_tiny_model(), args, callbacks=[PMACallback(**callback)])
    assert "\n" not in str(err.value)
    # The same options on both sides, or left at their defaults in the arguments: accepted.
    agreeing = PMACallback(**{"online": "sma", **callback, "online_device": "cpu"})
    same = PMATrainingArguments(output_dir=str(tmp_path), report_to=[], pma_online=agreeing.online)
    assert PMATrainer(make_tiny_model(), same, callbacks=[agreeing]).pma_callback is agreeing


def test_plain_training_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="PMATrainingArguments"):
        PMATrainer(make_tiny_model(), TrainingArguments(output_dir=str(tmp_path)))


def test_merge_losses_are_finite(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, max_steps=8, eval_strategy="steps", eval_steps=8, pma_interval_tokens=128, pma_window=3)
    trainer.train()
    (last_eval,) = [e for e in trainer.state.log_history if "eval_pma_loss" in e]
    assert math.isfinite(last_eval["eval_pma_loss"])


def test_push_to_hub_sends_the_merge_to_its_branch_beside_the_trainers_push(tmp_path):
    import os
    import subprocess
    import sys

    from huggingface_hub import ModelCard

    from tests.helpers.hub_server import HubServer
    from tests.helpers.repo import REPO_ROOT

    with HubServer() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": next(iter(hub.tokens)), "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "0"}
        out = tmp_path / "out"
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / "tests" / "dist" / "push_trainer.py"), str(out), "tester/pma-run"],
            capture_output=True, text=True, env=env, timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        merged = out / "pma" / "merged"
        on_branch = hub.files("tester/pma-run", "pma-merged")
        for name in ("model.safetensors", "pma_merge.json", "README.md", "tokenizer.json"):
            assert on_branch[name] == (merged / name).read_bytes(), name
        card = ModelCard(on_branch["README.md"].decode())
        assert "pma" in card.data.tags and "tester/pma-run" in card.text
        on_main = hub.files("tester/pma-run", "main")
        assert "model.safetensors" in on_main and on_main["model.safetensors"] != on_branch["model.safetensors"]


def test_zero3_from_accelerate_launch_is_refused_for_merged_eval(tmp_path, monkeypatch):
    # What `accelerate launch` with a ZeRO-3 config puts in the environment.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ValueError, match="partitioned placeholders.*set pma_eval=False"):
        PMATrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    from hf_pma.training.arguments import deepspeed_zero_stage

    assert deepspeed_zero_stage(None) == 2 and deepspeed_zero_stage(str(config)) == 2
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    assert deepspeed_zero_stage(None) is None
