"""``hf-pma merge`` end to end, through the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_pma.core.strategies import merge_weights
from tests.testing_utils import make_tiny_model, save_model_folder


def _hf_pma(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    exe = os.path.join(os.path.dirname(sys.executable), "hf-pma")
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_cli_merge_end_to_end(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    for i in range(4):
        save_model_folder(run / f"checkpoint-{10 * (i + 1)}", make_tiny_model(seed=i), tiny_tokenizer)
        (run / f"checkpoint-{10 * (i + 1)}" / "trainer_state.json").write_text(json.dumps({"global_step": 10 * (i + 1)}))
    result = _hf_pma("merge", run, "-o", tmp_path / "merged", "--strategy", "ema", "--alpha", "0.5", "--last", "3",
                     "--dtype", "bfloat16", "--max-shard-size", "30KB", "--quiet")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "merged"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    states = [make_tiny_model(seed=i).state_dict() for i in (1, 2, 3)]
    weights = merge_weights(3, "ema", alpha=0.5)
    for name, tensor in model.state_dict().items():
        expected = sum(w * s[name].double() for w, s in zip(weights, states))
        torch.testing.assert_close(tensor.double(), expected, rtol=2**-7, atol=1e-6)
    record = json.loads((out / "pma_merge.json").read_text())
    assert [s["step"] for s in record["sources"]] == [20, 30, 40] and record["alpha"] == 0.5
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()


def test_cli_merge_explicit_weights_and_errors(tmp_path):
    a = save_model_folder(tmp_path / "a", make_tiny_model(seed=0))
    b = save_model_folder(tmp_path / "b", make_tiny_model(seed=1))
    ok = _hf_pma("merge", a, b, "-o", tmp_path / "m", "--weights", "3,1", "-q")
    assert ok.returncode == 0, ok.stderr
    merged = load_file(tmp_path / "m" / "model.safetensors")
    sa, sb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    torch.testing.assert_close(merged["model.norm.weight"], 0.75 * sa["model.norm.weight"] + 0.25 * sb["model.norm.weight"])

    again = _hf_pma("merge", a, b, "-o", tmp_path / "m", "-q")
    assert again.returncode == 2 and "is not empty" in again.stderr and "Traceback" not in again.stderr
    missing = _hf_pma("merge", a, tmp_path / "missing", "-o", tmp_path / "m2")
    assert missing.returncode == 2 and "missing does not exist" in missing.stderr
    too_few = _hf_pma("merge", a, b, "-o", tmp_path / "m3", "--last", "5")
    assert too_few.returncode == 2 and "last 5 sources but found only 2" in too_few.stderr
    bad_weights = _hf_pma("merge", a, b, "-o", tmp_path / "m4", "--weights", "1,-1")
    assert bad_weights.returncode == 2 and "negative" in bad_weights.stderr
    assert not any((tmp_path / n).exists() for n in ("m2", "m3", "m4"))
    help_text = _hf_pma("merge", "--help")
    assert "--strategy" in help_text.stdout and "1-sqrt-decay" in help_text.stdout


def test_a_whole_run_without_a_window_is_merged_with_a_warning(tmp_path):
    from tests.snapshot_runs import noise_deviation, write_run

    run, _ = write_run(tmp_path / "run", 4, noise_deviation())
    whole = _hf_pma("merge", run, "-o", tmp_path / "all", "-q")
    assert whole.returncode == 0, whole.stderr
    assert "merging all 4 sources" in whole.stderr and "--last N" in whole.stderr
    windowed = _hf_pma("merge", run, "-o", tmp_path / "end", "--last", "2", "-q")
    assert windowed.returncode == 0 and "merging all" not in windowed.stderr, windowed.stderr
    listed = _hf_pma("merge", *sorted((run / "pma").glob("snapshot-*")), "-o", tmp_path / "listed", "-q")
    assert listed.returncode == 0 and "merging all" not in listed.stderr, listed.stderr
