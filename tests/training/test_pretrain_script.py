"""scripts/pretrain.py end to end, through the real script: one process with a push to a local
Hub stand-in, and two processes under ``accelerate launch`` (gloo on CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml
from huggingface_hub import ModelCard

from hf_pma.evaluation.corpus import documents_fingerprint
from tests.helpers.cli import run_cli
from tests.helpers.hub_server import HubServer
from tests.helpers.pretrain_runs import SCRIPT, SHORT, script_env
from tests.helpers.repo import load_pretrain_script


@pytest.fixture()
def hub():
    with HubServer() as server:
        yield server


def test_default_run_shortened_with_card_plot_and_push(tmp_path, hub):
    out = tmp_path / "run"
    token = next(iter(hub.tokens))
    env = script_env(tmp_path, HF_ENDPOINT=hub.url)
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *SHORT, "--output_dir", str(out), "--max_eval_chars", "700", "--push_to_hub",
         "--hub_model_id", "tester/tiny-pma", "--hub_token", token],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    merged = out / "pma" / "merged"

    # the token given by --hub_token reached no file: not the records, not the pickled TrainingArguments
    leaks = [p for p in out.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert leaks == [] and token not in result.stdout + result.stderr
    saved_args = torch.load(out / "final" / "training_args.bin", weights_only=False)  # a file this test created
    assert saved_args.hub_token is None and saved_args.output_dir == str(out)

    # the summary names every output one way (here relative to the working folder) and prints both tables
    assert "merged model         : run/pma/merged" in result.stdout and str(tmp_path) not in result.stdout
    assert "PMA merge" in result.stdout and "share of the annealing gain" in result.stdout
    # the generated tasks fit the 64-token context: lm-eval truncates nothing
    assert "exceeds model's maximum length" not in result.stderr
    assert json.loads((out / "tasks" / "tasks_info.json").read_text())["max_item_tokens"] == 64
    manifest = json.loads((out / "pma" / "manifest.json").read_text())
    assert manifest["snapshots"] and all(s["phase"] == "stable" for s in manifest["snapshots"])
    record = json.loads((merged / "pma_merge.json").read_text())
    assert record["num_sources"] == 4
    assert [s["tokens"] for s in record["sources"]] == [s["tokens"] for s in manifest["snapshots"]][-4:]

    # training record, evaluation record, plot and card
    training = json.loads((merged / "pma_training.json").read_text())
    assert training["pma_evals"] and training["datasets"] == ["local:python-stdlib"]
    assert training["command"].startswith("accelerate launch scripts/pretrain.py --max_steps 24")
    assert training["command"].endswith("--hub_token ***")
    record = json.loads((merged / "pma_eval.json").read_text())
    evaluation = record["results"]
    assert set(evaluation) == {"last snapshot", "PMA merge", "annealed"}
    # the matched comparison: all three at the same tokens, paired over the same 4 documents
    comparison = record["comparison"]
    assert comparison["documents"] == 4 and comparison["tokens"] == training["total_tokens"] == 24 * 4 * 64
    assert comparison["anneal"] == {"steps": 6, "tokens": 6 * 4 * 64, "decay_type": "linear"}
    for label in ("PMA merge", "annealed"):
        row = comparison["models"][label]
        assert row["paired_stderr"] > 0
        assert row["loss_diff"] == pytest.approx(row["loss"] - comparison["models"]["last snapshot"]["loss"])
    # one held-out set: tasks/heldout.jsonl holds the texts the run scored (700 characters of each
    # document), the record names them by their fingerprint, and `hf-pma eval` on the file gives
    # the run's number and keeps its comparison under --record
    heldout = [json.loads(line)["text"] for line in (out / "tasks" / "heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == 4 and max(map(len, heldout)) == 700
    assert record["eval_dataset"] == "heldout.jsonl"
    assert record["eval_documents"] == documents_fingerprint(heldout)
    again = run_cli("eval", merged, "--eval-file", out / "tasks" / "heldout.jsonl", "--record", merged, "-q", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    rerun = json.loads((merged / "pma_eval.json").read_text())
    assert rerun["comparison"] == comparison and rerun["eval_documents"] == record["eval_documents"]
    assert abs(rerun["results"]["merged"]["lm"]["loss"] - evaluation["PMA merge"]["lm"]["loss"]) < 1e-4
    annealed_state = json.loads((out / "annealed" / "config.json").read_text())
    assert annealed_state["vocab_size"] == 512 and not (out / "checkpoint-18").exists()  # the fork's checkpoint is gone
    assert {"lm", "pma_next_line", "pma_cloze"} <= set(evaluation["PMA merge"])
    assert 0 < evaluation["PMA merge"]["lm"]["bits_per_byte"] < 10
    png = (merged / "pma_training.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    card_text = (merged / "README.md").read_text()
    assert str(tmp_path) not in card_text and token not in card_text
    assert "pma_training.png" in card_text and "snapshot-" in card_text
    assert "share of the annealing gain" in card_text and "(all at 6,144 tokens)" in card_text

    # the merged model went to the branch pma-merged of the repo, with the card and its results
    pushed = hub.files("tester/tiny-pma", "pma-merged")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "pma_merge.json", "README.md"):
        assert pushed[name] == (merged / name).read_bytes(), name
    card = ModelCard(pushed["README.md"].decode())
    assert card.data.eval_results and card.data.library_name == "transformers"
    assert {r.metric_type for r in card.data.eval_results} >= {"loss", "bits_per_byte", "acc"}
    assert "pma" in card.data.tags
    # without --push_live_model the Trainer pushes nothing of its own to main
    assert "model.safetensors" not in hub.files("tester/tiny-pma", "main")


def test_flags_change_the_embedded_default_and_a_config_file_replaces_it(tmp_path, capsys, monkeypatch):
    pretrain = load_pretrain_script(monkeypatch)
    embedded = yaml.safe_load(pretrain.DEFAULT_CONFIG.read_text())
    model, data, comparison, args = pretrain.parse_arguments([])
    assert (args.output_dir, args.max_steps, args.learning_rate) == (
        embedded["output_dir"], embedded["max_steps"], embedded["learning_rate"]
    )
    assert (model.config_overrides, comparison.anneal_steps) == (embedded["config_overrides"], embedded["anneal_steps"])

    # flags alone: the embedded default with those flags changed, nothing else
    mine = str(tmp_path / "mine")
    model, data, comparison, args = pretrain.parse_arguments(["--output_dir", mine, "--max_steps", "600"])
    assert (args.output_dir, args.max_steps) == (mine, 600)
    assert args.learning_rate == embedded["learning_rate"] and args.pma_interval_tokens == embedded["pma_interval_tokens"]
    assert str(args.lr_scheduler_type.value) == embedded["lr_scheduler_type"] == "constant_with_warmup"
    assert comparison.anneal_steps == embedded["anneal_steps"] and data.block_size == embedded["block_size"]
    assert model.vocab_size == embedded["vocab_size"]

    # a config file first replaces the embedded default; flags after it change the file's values
    own = tmp_path / "own.yaml"
    own.write_text("output_dir: x\nmax_steps: 7\nlearning_rate: 0.002\n")
    model, data, comparison, args = pretrain.parse_arguments([str(own), "--learning_rate", "0.01"])
    assert (args.output_dir, args.max_steps, args.learning_rate) == ("x", 7, 0.01)
    assert args.pma_interval_tokens is None and comparison.anneal_steps == 0 and model.config_overrides is None

    # --help says how flags and config files combine, and shows the embedded default's values
    with pytest.raises(SystemExit) as exit_info:
        pretrain.parse_arguments(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the embedded default with these flags changed" in text and "that file instead of the embedded default" in text
    assert f"default: {embedded['output_dir']}" in text

    # an annealed fork needs a constant-LR run to fork from
    with pytest.raises(ValueError, match="anneal_steps needs a constant-LR run"):
        pretrain.parse_arguments(["--lr_scheduler_type", "cosine"])
    with pytest.raises(ValueError, match=r"anneal_steps \(1000\) must be shorter"):
        pretrain.parse_arguments(["--anneal_steps", "1000"])
    # --token_budget sets max_steps when the arguments are parsed (8 x 128 tokens a step): the fork is checked then
    assert pretrain.parse_arguments(["--token_budget", "1024000"])[3].max_steps == 1000
    with pytest.raises(ValueError, match=r"anneal_steps \(200\) must be shorter"):
        pretrain.parse_arguments(["--token_budget", "102400"])
    own.write_text("output_dir: x\nanneal_steps: 10\nlr_scheduler_type: constant\n")
    with pytest.raises(ValueError, match="anneal_steps needs max_steps"):
        pretrain.parse_arguments([str(own)])


def test_one_spelling_per_option(tmp_path, capsys, monkeypatch):
    """The script's fork options are --anneal_*: the library's --pma_anneal_* spelling of the same
    options is refused in one line, as a flag or in a config file, and --help does not show it."""
    pretrain = load_pretrain_script(monkeypatch)
    for argv, name in (
        (["--pma_anneal_steps", "100"], "pma_anneal_steps: this script takes --anneal_steps instead"),
        (["--pma_anneal_decay=cosine"], "pma_anneal_decay: this script takes --anneal_decay_type instead"),
        (["--pma_anneal_tokens", "4096"], "pma_anneal_tokens: this script takes --anneal_steps (in steps)"),
    ):
        with pytest.raises(ValueError, match=re.escape(name)):
            pretrain.parse_arguments(argv)
    own = tmp_path / "own.yaml"
    own.write_text("output_dir: x\npma_anneal_steps: 10\n")
    assert pretrain.main([str(own)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pretrain.py: error: pma_anneal_steps: this script takes --anneal_steps instead (one spelling per option)"]
    with pytest.raises(SystemExit):
        pretrain.parse_arguments(["--help"])
    shown = capsys.readouterr().out
    assert "--anneal_steps" in shown and "--anneal_decay_type" in shown and "--pma_anneal" not in shown
    _, _, comparison, args = pretrain.parse_arguments(["--anneal_steps", "100", "--anneal_decay_type", "cosine"])
    assert (args.pma_anneal_steps, args.pma_anneal_decay) == (100, "cosine")


def test_bad_arguments_fail_before_training(tmp_path, capsys, monkeypatch):
    # Arguments the parser refuses: the script's main() returns 2 with one line (in this process).
    pretrain = load_pretrain_script(monkeypatch)
    assert pretrain.main([*SHORT, "--output_dir", str(tmp_path / "o"), "--pma_strategy", "median"]) == 2
    assert "unknown merge strategy 'median'" in capsys.readouterr().err
    assert not (tmp_path / "o" / "pma").exists()
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("output_dir: x\nlearning_rat: 0.1\n")
    assert pretrain.main([str(bad_yaml)]) == 2
    assert "unknown argument(s) learning_rat" in capsys.readouterr().err
    # A missing token (read from a fresh process's environment) stops the real script before training.
    env = {**script_env(tmp_path), "HF_TOKEN": "", "HF_HOME": str(tmp_path / "empty_home")}
    no_token = subprocess.run(
        [sys.executable, str(SCRIPT), *SHORT, "--output_dir", str(tmp_path / "o"), "--push_to_hub", "--hub_model_id", "a/b"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert no_token.returncode != 0 and "no Hugging Face token found" in no_token.stderr
    assert not (tmp_path / "o" / "pma").exists()


@pytest.mark.shared_launch("pretrain-accelerate")  # started with the session, in the background
def test_two_processes_with_accelerate_launch(shared_launch):
    done = shared_launch.result("pretrain-accelerate")
    out = shared_launch("pretrain-accelerate") / "run2"
    # the summary is printed once, by the main process
    assert [done.output(rank).count("Done in ") for rank in (0, 1)] == [1, 0]
    training = json.loads((out / "pma" / "merged" / "pma_training.json").read_text())
    assert training["world_size"] == 2
    # PMATrainer's merged evaluation ran under DDP, beside the live evaluation
    assert training["pma_evals"] and all(e["eval_pma_loss"] > 0 for e in training["pma_evals"])
    # same global batch (2 processes x 2 = 4 blocks of 64 tokens) as the single-process run
    assert training["total_tokens"] == 24 * 4 * 64
    manifest = json.loads((out / "pma" / "manifest.json").read_text())
    assert [s["tokens"] for s in manifest["snapshots"]] == sorted({s["tokens"] for s in manifest["snapshots"]})
    assert all(s["tokens"] % 512 == 0 for s in manifest["snapshots"])
    record = json.loads((out / "pma" / "merged" / "pma_eval.json").read_text())
    assert set(record["results"]) == {"last snapshot", "PMA merge", "annealed"}
    # the annealed fork resumed under 2 processes too, and ends at the same tokens
    assert record["comparison"]["tokens"] == training["total_tokens"] and (out / "annealed" / "config.json").is_file()
    fork = json.loads((out / "annealed" / "pma_anneal.json").read_text())
    assert (fork["start_step"], fork["end_step"], fork["end_tokens"]) == (18, 24, training["total_tokens"])
    assert fork["snapshot"] == f"snapshot-{training['total_tokens']}"  # the last snapshot, at the same tokens
