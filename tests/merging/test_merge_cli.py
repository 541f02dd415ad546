"""``hf-pma merge`` end to end (in process, ``tests.helpers.cli.run_cli``; the console script
itself: tests/test_run_folder_trust.py and tests/merging/test_merge_crash.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_pma.core.strategies import merge_coefficients
from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder


def test_cli_merge_end_to_end(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    for i in range(4):
        save_model_folder(run / f"checkpoint-{10 * (i + 1)}", make_tiny_model(seed=i), tiny_tokenizer)
        (run / f"checkpoint-{10 * (i + 1)}" / "trainer_state.json").write_text(
            json.dumps({"global_step": 10 * (i + 1)})
        )
    result = run_cli(
        "merge",
        run,
        "-o",
        tmp_path / "merged",
        "--strategy",
        "ema",
        "--alpha",
        "0.5",
        "--last",
        "3",
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "30KB",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path / "merged"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    states = [make_tiny_model(seed=i).state_dict() for i in (1, 2, 3)]
    weights = merge_coefficients(3, "ema", alpha=0.5)
    for name, tensor in model.state_dict().items():
        expected = sum(w * s[name].double() for w, s in zip(weights, states))
        torch.testing.assert_close(tensor.double(), expected, rtol=2**-7, atol=1e-6)
    record = json.loads((out / "pma_merge.json").read_text())
    assert [s["step"] for s in record["sources"]] == [20, 30, 40] and record["alpha"] == 0.5
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()


def test_cli_merge_explicit_weights_and_errors(tmp_path):
    a = save_model_folder(tmp_path / "a", make_tiny_model(seed=0))
    b = save_model_folder(tmp_path / "b", make_tiny_model(seed=1))
    ok = run_cli("merge", a, b, "-o", tmp_path / "m", "--weights", "3,1", "-q")
    assert ok.returncode == 0, ok.stderr
    merged = load_file(tmp_path / "m" / "model.safetensors")
    sa, sb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    torch.testing.assert_close(
        merged["model.norm.weight"], 0.75 * sa["model.norm.weight"] + 0.25 * sb["model.norm.weight"]
    )

    again = run_cli("merge", a, b, "-o", tmp_path / "m", "-q")
    assert again.returncode == 2 and "is not empty" in again.stderr and "Traceback" not in again.stderr
    missing = run_cli("merge", a, tmp_path / "missing", "-o", tmp_path / "m2")
    assert missing.returncode == 2 and "missing does not exist" in missing.stderr
    too_few = run_cli("merge", a, b, "-o", tmp_path / "m3", "--last", "5")
    assert too_few.returncode == 2 and "found 2 sources" in too_few.stderr and "fewer than --last 5: pass --last 2" in too_few.stderr
    bad_weights = run_cli("merge", a, b, "-o", tmp_path / "m4", "--weights", "1,-1")
    assert bad_weights.returncode == 2 and "negative" in bad_weights.stderr
    assert not any((tmp_path / n).exists() for n in ("m2", "m3", "m4"))
    help_text = run_cli("merge", "--help")
    assert "--strategy" in help_text.stdout and "1-sqrt-decay" in help_text.stdout


def test_a_run_is_merged_over_its_automatic_window_and_whole_only_when_asked(tmp_path):
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    run, _ = write_run(tmp_path / "run", 10, noise_deviation())  # its loss still falls: too early
    auto = run_cli("merge", run, "-o", tmp_path / "auto", "-q")
    assert auto.returncode == 0, auto.stderr
    assert "auto window: the last snapshot alone" in auto.stdout and "too early" in auto.stdout
    record = json.loads((tmp_path / "auto" / "pma_merge.json").read_text())
    assert record["num_sources"] == 1 and record["window"]["auto"]["rule"] == "too-early"
    whole = run_cli("merge", run, "-o", tmp_path / "all", "--last", "all", "-q")
    assert whole.returncode == 0, whole.stderr
    assert "merging all 10 sources" in whole.stderr and "--last auto" in whole.stderr
    assert "whole run" not in whole.stderr  # a run keeps some of its snapshots: "all" is all it keeps
    assert json.loads((tmp_path / "all" / "pma_merge.json").read_text())["window"].get("auto") is None
    windowed = run_cli("merge", run, "-o", tmp_path / "end", "--last", "2", "-q")
    assert windowed.returncode == 0 and "merging all" not in windowed.stderr, windowed.stderr
    assert "auto window" not in windowed.stdout
    listed = run_cli("merge", *sorted((run / "pma").glob("snapshot-*")), "-o", tmp_path / "listed", "-q")
    assert listed.returncode == 0 and "merging all" not in listed.stderr, listed.stderr
    assert json.loads((tmp_path / "listed" / "pma_merge.json").read_text())["num_sources"] == 10
    bad = run_cli("merge", run, "-o", tmp_path / "bad", "--last", "some")
    assert bad.returncode == 2 and "'auto' or a positive number" in bad.stderr


def test_a_settled_run_merges_the_window_its_records_choose_and_the_card_says_why(tmp_path):
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    flat = [4.0 + 0.03 * ((-1) ** i) + 0.01 * (i % 3) for i in range(12)]  # settled: noise, no trend
    run, _ = write_run(tmp_path / "run", 12, noise_deviation(), losses=flat)
    done = run_cli("merge", run, "-o", tmp_path / "m")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "m" / "pma_merge.json").read_text())
    count = record["window"]["auto"]["count"]
    assert 1 < count < 12 and record["num_sources"] == count  # within a quarter of the tokens trained
    assert [s["tokens"] for s in record["sources"]] == [(i + 1) * 1000 for i in range(12 - count, 12)]
    assert f"auto window: the newest {count} snapshots" in done.stdout
    card = run_cli("card", tmp_path / "m")
    assert card.returncode == 0, card.stderr
    assert "chosen automatically from the run's records" in (tmp_path / "m" / "README.md").read_text()
