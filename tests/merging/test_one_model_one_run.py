"""Sources must be one model and one run: configurations compared before the first tensor, run
folders merged one at a time, casts checked against the output dtype's range, a change of the
snapshot interval V said (output, record, card), and the tokenizer taken from the sources (or the
one named), never from a folder above them, and named in the results."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from hf_pma.core.manifest import MERGE_RECORD_NAME, PMA_SUBDIR, SnapshotRecord, write_manifest
from hf_pma.evaluation.model_checks import resolve_model
from hf_pma.merging.engine import merge_checkpoints
from hf_pma.merging.sources import config_differences
from hf_pma.publishing.card import build_model_card
from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.snapshot_runs import INTERVAL, noise_deviation, write_run

# Same tensor names and shapes as the default tiny Llama (4 heads of 8, 2 key-value heads), and
# yet another model: 8 heads of 4 (4 key-value heads), or another RoPE base.
OTHER_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}
OTHER_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


def _record(folder: Path) -> dict:
    return json.loads((folder / MERGE_RECORD_NAME).read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Model folders: ``a`` and ``a2`` (one model, two seeds), ``heads`` and ``rope`` (other
    models with the same tensor shapes), ``a_v4`` (``a``'s model with its RoPE written as
    transformers 4 writes it)."""
    root = tmp_path_factory.mktemp("models")
    out = {
        "a": save_model_folder(root / "a", make_tiny_model(seed=0)),
        "a2": save_model_folder(root / "a2", make_tiny_model(seed=1)),
        "heads": save_model_folder(root / "heads", make_tiny_model(seed=2, **OTHER_HEADS)),
        "rope": save_model_folder(root / "rope", make_tiny_model(seed=3, **OTHER_ROPE)),
    }
    v4 = save_model_folder(root / "a_v4", make_tiny_model(seed=4))
    config = json.loads((v4 / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config.pop("head_dim")  # transformers 4 left it out: hidden_size / num_attention_heads
    (v4 / "config.json").write_text(json.dumps(config))
    out["a_v4"] = v4
    for name in ("heads", "rope"):
        shapes = {k: v.shape for k, v in load_file(out[name] / "model.safetensors").items()}
        assert shapes == {k: v.shape for k, v in load_file(out["a"] / "model.safetensors").items()}
    return out


# ---------------------------------------------------------------- one model


def test_two_models_with_matching_shapes_are_refused_in_one_line(models, tmp_path):
    done = run_cli("merge", models["heads"], models["a"], "-o", tmp_path / "m")
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("hf-pma merge: error: ")
    assert str(models["heads"]) in line and str(models["a"]) in line
    assert "num_attention_heads 8 vs 4" in line and "head_dim" in line and "--allow-different-configs" in line
    assert not (tmp_path / "m").exists()

    with pytest.raises(ValueError, match=r"rope_theta 500000\.0 vs 10000\.0"):
        merge_checkpoints([models["rope"], models["a"]], tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()
    # One model written by two transformers versions (rope_theta at the top, no head_dim) is one model.
    merge_checkpoints([models["a_v4"], models["a2"], models["a"]], tmp_path / "ok", progress=False)
    assert _record(tmp_path / "ok")["config_differences"] is None
    # Llama 3's RoPE as transformers 4 and 5 write it is one RoPE; an adapter's scaling is compared too.
    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    v4 = {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {**rope, "type": "llama3"}}
    v5 = {"model_type": "llama", "rope_parameters": {**rope, "rope_theta": 5e5}}
    assert config_differences(v4, v5) == []
    assert config_differences(v4, {**v5, "rope_parameters": {**rope, "factor": 4.0, "rope_theta": 5e5}}) != []
    lora = {"peft_type": "LORA", "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    other = {**lora, "lora_alpha": 32, "target_modules": ["v_proj", "q_proj"]}
    assert config_differences(lora, other, adapter=True) == [("lora_alpha", 16, 32)]


def test_a_deliberate_soup_passes_with_the_flag_and_a_warning(models, tmp_path):
    done = run_cli(
        "merge", models["rope"], models["a"], "-o", tmp_path / "m", "--allow-different-configs", "-q"
    )
    assert done.returncode == 0, done.stderr
    assert "different models" in done.stderr and "rope_theta" in done.stderr
    differences = _record(tmp_path / "m")["config_differences"]
    assert differences and all(d.startswith("rope: ") for d in differences)


# ---------------------------------------------------------------- one run


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    first, _ = write_run(root / "run1", 3, noise_deviation(seed=1))
    second, _ = write_run(root / "run2", 3, noise_deviation(seed=2))
    return first, second


def test_two_run_folders_are_not_interleaved(two_runs, tmp_path):
    first, second = two_runs
    for window in (["--last", "2"], ["--window-tokens", "2000"], []):
        done = run_cli("merge", first, second, *window, "-o", tmp_path / "m")
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert (
            f"{first} is a run folder" in line and str(second) in line and "name each snapshot folder" in line
        )
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("def f(x):\n    return x\n" * 10)
    sweep = ("sweep", first, second, "--eval-file", heldout, "-o", tmp_path / "s.json", "--no-plot")
    for window in (["--last", "2"], []):  # a sweep's windows are drawn the same way: one run
        done = run_cli(*sweep, *window)
        assert done.returncode == 2 and f"{first} is a run folder" in done.stderr, done.stderr
    assert not (tmp_path / "s.json").exists()
    snapshot = second / PMA_SUBDIR / f"snapshot-{3 * INTERVAL}"
    done = run_cli("merge", first, snapshot, "-o", tmp_path / "m")
    assert done.returncode == 2 and f"given with {snapshot}" in done.stderr
    assert not (tmp_path / "m").exists()
    # Named one by one, snapshots of two runs merge.
    named = [first / PMA_SUBDIR / f"snapshot-{3 * INTERVAL}", snapshot]
    done = run_cli("merge", *named, "-o", tmp_path / "m", "-q")
    assert done.returncode == 0, done.stderr
    assert [s["name"] for s in _record(tmp_path / "m")["sources"]] == [p.name for p in named]


# ---------------------------------------------------------------- casts in range


@pytest.fixture(scope="module")
def large_values(tmp_path_factory) -> list[Path]:
    """Two snapshots whose ``lm_head``-tied embedding holds 100,000 and -70,000: finite in float32,
    beyond float16's 65504."""
    root = tmp_path_factory.mktemp("large")
    folders = []
    for seed in (0, 1):
        model = make_tiny_model(seed=seed)
        with torch.no_grad():
            weight = model.model.embed_tokens.weight
            weight[3, 5], weight[7, 1] = 1.0e5, -7.0e4
        folders.append(save_model_folder(root / f"s{seed}", model))
    return folders


def test_a_float16_cast_beyond_its_range_is_refused_or_clipped(large_values, tmp_path):
    done = run_cli("merge", *large_values, "--dtype", "float16", "-o", tmp_path / "m")
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "'model.embed_tokens.weight'" in line and "100000" in line and "float16" in line
    assert "--clip-to-dtype" in line
    assert not (tmp_path / "m").exists() and not list(tmp_path.iterdir())

    done = run_cli(
        "merge", *large_values, "--dtype", "float16", "--clip-to-dtype", "-o", tmp_path / "m", "-q"
    )
    assert done.returncode == 0, done.stderr
    assert "clipped 2 merged value(s) in 1 tensor(s)" in done.stderr
    weight = load_file(tmp_path / "m" / "model.safetensors")["model.embed_tokens.weight"]
    assert np.isfinite(weight).all() and weight[3, 5] == 65504 and weight[7, 1] == -65504
    assert _record(tmp_path / "m")["clipped"] == {
        "dtype": "float16",
        "values": 2,
        "tensors": {"model.embed_tokens.weight": 2},
    }
    # bfloat16 holds them: no clipping, no refusal.
    merge_checkpoints(large_values, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert _record(tmp_path / "bf16")["clipped"] is None


# ---------------------------------------------------------------- a change of V


def _resumed_run(root: Path) -> Path:
    """A run whose snapshots were taken every 1,000 tokens, then (resumed with another
    interval_tokens) every 2,000: the records carry each snapshot's V."""
    pma = root / PMA_SUBDIR
    records = []
    for tokens, interval in ((1000, 1000), (2000, 1000), (4000, 2000), (6000, 2000)):
        record = SnapshotRecord(
            path=f"snapshot-{tokens}", tokens=tokens, step=tokens // 100, extra={"interval_tokens": interval}
        )
        save_model_folder(pma / record.path, make_tiny_model(seed=tokens), extra=record.to_dict())
        records.append(record)
    write_manifest(pma, records, interval_tokens=2000)
    return root


def test_a_merge_across_a_change_of_v_says_so(tmp_path):
    run = _resumed_run(tmp_path / "run")
    done = run_cli("merge", run, "--last", "all", "-o", tmp_path / "m", "-q")
    assert done.returncode == 0, done.stderr
    assert "the snapshot interval V changed within the merged sources: 1,000 then 2,000 tokens" in done.stderr
    record = _record(tmp_path / "m")
    assert record["intervals_tokens"] == [1000, 2000] and record["intervals_from"] == "recorded"
    card = str(build_model_card(tmp_path / "m"))
    assert (
        "| interval between snapshots (V) | changed within the merge: 1,000 (1k) tokens, then 2,000 (2k) tokens |"
        in card
    )
    # Within one V: one interval, no warning.
    done = run_cli("merge", run, "--last", "2", "-o", tmp_path / "m2", "-q")
    assert done.returncode == 0 and "interval" not in done.stderr
    assert _record(tmp_path / "m2")["intervals_tokens"] == [2000]


# ---------------------------------------------------------------- the tokenizer


def test_the_merge_takes_the_runs_tokenizer_and_names_it(tmp_path, tiny_tokenizer):
    run, _ = write_run(tmp_path / "run", 2, noise_deviation(), tokenizer=tiny_tokenizer)
    done = run_cli("merge", run, "-o", tmp_path / "m", "-q")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert _record(tmp_path / "m")["tokenizer"] == "../run"
    # A tokenizer the user names instead.
    own = tmp_path / "own"
    tiny_tokenizer.save_pretrained(own)
    done = run_cli("merge", run, "--tokenizer", own, "-o", tmp_path / "m2", "-q")
    assert done.returncode == 0 and _record(tmp_path / "m2")["tokenizer"] == "../own"
    done = run_cli("merge", run, "--tokenizer", run / PMA_SUBDIR, "-o", tmp_path / "x")
    assert done.returncode == 2 and "holds no tokenizer" in done.stderr and not (tmp_path / "x").exists()
    # OUTPUT_DIR/pma named (as without-trainer.md does): the tokenizer of the run folder above it,
    # by the rule hf-pma eval loads by, so that the merge evaluates as it is.
    done = run_cli("merge", run / PMA_SUBDIR, "--last", "2", "-o", tmp_path / "m3", "-q")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m3" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert resolve_model(tmp_path / "m3")[1] == str(tmp_path / "m3")
    # ...but a tokenizer above a folder of snapshots that is no run's pma/ is not taken.
    loose = tmp_path / "loose"
    loose.mkdir()
    (run / PMA_SUBDIR).rename(loose / "snaps")
    tiny_tokenizer.save_pretrained(loose)
    done = run_cli("merge", loose / "snaps", "--last", "2", "-o", tmp_path / "m4", "-q")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "m4" / "tokenizer.json").exists()


def test_eval_never_takes_a_tokenizer_from_a_folder_above(tmp_path, tiny_tokenizer):
    shared = tmp_path / "shared"
    model = save_model_folder(shared / "merged", make_tiny_model(seed=0))
    tiny_tokenizer.save_pretrained(shared)  # someone else's tokenizer.json beside the merge
    with pytest.raises(FileNotFoundError, match="no tokenizer in model folder"):
        resolve_model(model)
    # A snapshot of a run takes the tokenizer of the run folder that holds its pma/ folder.
    run, _ = write_run(tmp_path / "run", 1, noise_deviation(), tokenizer=tiny_tokenizer)
    snapshot = run / PMA_SUBDIR / f"snapshot-{INTERVAL}"
    assert resolve_model(snapshot) == (str(snapshot), str(run.absolute()))
    from hf_pma.evaluation.evaluator import evaluate_models

    report = evaluate_models(
        [snapshot], texts=["def f(x):\n    return x + 1\n" * 4], block_size=16, progress=False
    )
    assert list(report["tokenizers"].values()) == [str(run.absolute())]
