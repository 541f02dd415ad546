"""The streaming merge engine: arithmetic, output folder, source kinds, ordering, bad input."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_pma.core.manifest import SnapshotRecord, write_manifest
from hf_pma.core.strategies import STRATEGIES, merge_coefficients
from hf_pma.io.safetensors import CheckpointFormatError
from hf_pma.merging.engine import MergeError, merge_checkpoints, merge_state_dict
from hf_pma.utils.parsing import parse_size
from tests.helpers.models import make_tiny_model, save_model_folder


def _model_states(n, dtype=torch.float32):
    return [make_tiny_model(seed=i, dtype=dtype).state_dict() for i in range(n)]


def _reference(states, weights):
    """The merge computed directly in float64."""
    return {k: sum(w * s[k].double() for w, s in zip(weights, states)) for k in states[0]}


@pytest.fixture(scope="module")
def fp32_sharded_run(tmp_path_factory, ):
    """Four tiny Llama snapshots saved as sharded fp32 safetensors, with snapshot records."""
    root = tmp_path_factory.mktemp("fp32")
    folders = []
    for i in range(4):
        model = make_tiny_model(seed=i)
        folders.append(
            save_model_folder(root / f"snap{i}", model, max_shard_size="20KB", extra={"path": f"snap{i}", "tokens": 1000 * (i + 1), "step": i + 1})
        )
    assert (folders[0] / "model.safetensors.index.json").is_file()
    return folders


def _merged_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    return state


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "auto"])
def test_every_strategy_equals_direct_computation_fp32_sharded(fp32_sharded_run, tmp_path, strategy):
    out = merge_checkpoints(fp32_sharded_run, tmp_path / "merged", strategy=strategy, alpha=0.3, progress=False)
    weights = merge_coefficients(4, strategy, alpha=0.3)
    reference = _reference(_model_states(4), weights)
    merged = _merged_state(out)
    assert set(merged) == set(reference) - {"lm_head.weight"}  # tied: stored once, as in the sources
    for name, tensor in merged.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor.double(), reference[name], rtol=0, atol=2e-7)
    record = json.loads((out / "pma_merge.json").read_text())
    assert record["strategy"] == strategy
    assert record["weights"] == pytest.approx(weights)
    assert [s["tokens"] for s in record["sources"]] == [1000, 2000, 3000, 4000]


def test_explicit_weights_and_float64_accumulation(fp32_sharded_run, tmp_path):
    out = merge_checkpoints(
        fp32_sharded_run, tmp_path / "m", weights=[1, 2, 3, 4], accumulate_dtype=torch.float64, progress=False
    )
    reference = _reference(_model_states(4), [0.1, 0.2, 0.3, 0.4])
    for name, tensor in _merged_state(out).items():
        # accumulated in float64: the only error left is the final rounding to float32 (at most
        # one ulp; exact midpoints are common here since the inputs are float32 and w = k/10)
        torch.testing.assert_close(tensor, reference[name].float(), rtol=2.0**-23, atol=1e-12)
    assert json.loads((out / "pma_merge.json").read_text())["strategy"] == "custom"


def test_bf16_inputs_stay_bf16_and_round_correctly(tmp_path):
    folders = [save_model_folder(tmp_path / f"b{i}", make_tiny_model(seed=i, dtype=torch.bfloat16)) for i in range(3)]
    out = merge_checkpoints(folders, tmp_path / "m", strategy="ema", progress=False)
    states, weights = _model_states(3, torch.bfloat16), merge_coefficients(3, "ema")
    reference = _reference(states, weights)
    for name, tensor in _merged_state(out).items():
        assert tensor.dtype == torch.bfloat16
        expected = reference[name].to(torch.bfloat16)
        # fp32 accumulation then one rounding: within one bf16 ulp of the exact result, plus the
        # fp32 accumulation error where terms cancel; almost always bit-equal
        diff = (tensor.double() - expected.double()).abs()
        ulp = expected.double().abs() * 2.0**-7
        fp32_error = sum(w * s[name].double().abs() for w, s in zip(weights, states)) * 2.0**-21
        assert bool((diff <= ulp + fp32_error).all()), name
        assert (diff == 0).float().mean() > 0.98
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_output_dtype_conversion_updates_config(fp32_sharded_run, tmp_path):
    out = merge_checkpoints(fp32_sharded_run, tmp_path / "m", dtype="bfloat16", progress=False)
    assert all(t.dtype == torch.bfloat16 for t in _merged_state(out).values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "pma_merge.json").read_text())["dtype"] == "bfloat16"


def test_output_is_a_loadable_sharded_model_with_tied_weights_and_tokenizer(fp32_sharded_run, tmp_path, tiny_tokenizer):
    newest = fp32_sharded_run[-1]
    tiny_tokenizer.save_pretrained(newest)
    try:
        out = merge_checkpoints(fp32_sharded_run, tmp_path / "m", max_shard_size="40KB", progress=False)
    finally:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            (newest / name).unlink(missing_ok=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert all((out / s).stat().st_size <= 40_000 + 4096 or len([k for k, v in index["weight_map"].items() if v == s]) == 1 for s in shards)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reference = _reference(_model_states(4), [0.25] * 4)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor.double(), reference[name], rtol=0, atol=2e-7)
    assert not list(tmp_path.glob(".m.tmp-*"))


def test_tiny_chunks_give_identical_bytes(fp32_sharded_run, tmp_path):
    """Chunked accumulation (the path huge tensors take) must not change a single bit."""
    a = merge_checkpoints(fp32_sharded_run, tmp_path / "a", progress=False)
    b = merge_checkpoints(fp32_sharded_run, tmp_path / "b", progress=False, chunk_bytes=100)
    sa, sb = _merged_state(a), _merged_state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_merge_state_dict_equals_the_written_merge(fp32_sharded_run, tmp_path):
    out = merge_checkpoints(fp32_sharded_run, tmp_path / "m", strategy="wma", progress=False)
    in_memory = merge_state_dict(fp32_sharded_run, strategy="wma")
    on_disk = _merged_state(out)
    assert set(in_memory) == set(on_disk)
    assert all(torch.equal(in_memory[k], on_disk[k]) and in_memory[k].shape == on_disk[k].shape for k in on_disk)


def test_sources_are_ordered_by_tokens_and_last_n(fp32_sharded_run, tmp_path):
    shuffled = [fp32_sharded_run[i] for i in (2, 0, 3, 1)]
    out = merge_checkpoints(shuffled, tmp_path / "m", strategy="wma", last=3, progress=False)
    record = json.loads((out / "pma_merge.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["snap1", "snap2", "snap3"]
    reference = _reference(_model_states(4)[1:], merge_coefficients(3, "wma"))
    for name, tensor in _merged_state(out).items():
        torch.testing.assert_close(tensor.double(), reference[name], rtol=0, atol=2e-7)
    assert all(not os.path.isabs(s["path"]) for s in record["sources"])


def test_run_folder_with_manifest_skips_excluded_snapshots(tmp_path):
    pma = tmp_path / "run" / "pma"
    records = []
    for i in range(3):
        folder = save_model_folder(pma / f"snapshot-{100 * (i + 1)}", make_tiny_model(seed=i))
        records.append(SnapshotRecord(path=folder.name, tokens=100 * (i + 1), step=i + 1, lr=1e-3, phase="stable"))
    records[1].extra["excluded"] = True  # e.g. taken during a loss spike
    write_manifest(pma, records, interval_tokens=100)
    out = merge_checkpoints([tmp_path / "run"], tmp_path / "m", progress=False)
    record = json.loads((out / "pma_merge.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["snapshot-100", "snapshot-300"]
    assert record["interval_tokens"] == 100 and record["sources"][0]["phase"] == "stable"
    states = _model_states(3)
    reference = _reference([states[0], states[2]], [0.5, 0.5])
    for name, tensor in _merged_state(out).items():
        torch.testing.assert_close(tensor.double(), reference[name], rtol=0, atol=2e-7)


def test_trainer_checkpoint_folders_ordered_by_step(tmp_path):
    run = tmp_path / "out"
    for step, seed in ((20, 1), (100, 3), (9, 0)):
        folder = save_model_folder(run / f"checkpoint-{step}", make_tiny_model(seed=seed))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "num_input_tokens_seen": 0}))
        torch.save({"exp_avg": torch.zeros(1)}, folder / "optimizer.pt")
    out = merge_checkpoints([run], tmp_path / "m", progress=False)
    record = json.loads((out / "pma_merge.json").read_text())
    assert [s["step"] for s in record["sources"]] == [9, 20, 100]
    assert [s["tokens"] for s in record["sources"]] == [None, None, None]
    assert not (out / "optimizer.pt").exists()


def test_pytorch_bin_sources_are_read_safely(tmp_path):
    folders = []
    for i in range(2):
        model = make_tiny_model(seed=i)
        folder = save_model_folder(tmp_path / f"bin{i}", model)
        state = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin")
        folders.append(folder)
    out = merge_checkpoints(folders, tmp_path / "m", progress=False)
    reference = _reference(_model_states(2), [0.5, 0.5])
    for name, tensor in _merged_state(out).items():
        torch.testing.assert_close(tensor.double(), reference[name], rtol=0, atol=2e-7)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (folders[1] / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(CheckpointFormatError, match="bin1/pytorch_model.bin"):
        merge_checkpoints(folders, tmp_path / "m2", progress=False)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "m2").exists()


# ---------------------------------------------------------------- synthetic folders for bad input


def _raw_folder(path: Path, tensors: dict[str, torch.Tensor], tokens: int | None = None) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if tokens is not None:
        (path / "pma.json").write_text(json.dumps({"path": path.name, "tokens": tokens, "step": tokens}))
    return path


def _two(tmp_path, a: dict, b: dict) -> list[Path]:
    return [_raw_folder(tmp_path / "a", a), _raw_folder(tmp_path / "b", b)]


def _assert_fails_cleanly(sources, out: Path, exc, match):
    with pytest.raises(exc, match=match):
        merge_checkpoints(sources, out, progress=False)
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*"))


def test_integer_tensors_copied_when_equal_and_refused_when_not(tmp_path):
    counter = torch.arange(5)
    good = _two(tmp_path / "g", {"w": torch.ones(3), "count": counter, "mask": torch.tensor([True, False])},
                {"w": torch.zeros(3), "count": counter.clone(), "mask": torch.tensor([True, False])})
    merged = load_file(merge_checkpoints(good, tmp_path / "ok", progress=False) / "model.safetensors")
    assert torch.equal(merged["count"], counter) and merged["count"].dtype == torch.int64
    assert torch.equal(merged["mask"], torch.tensor([True, False]))
    assert torch.equal(merged["w"], torch.full((3,), 0.5))
    bad = _two(tmp_path / "x", {"w": torch.ones(3), "count": counter}, {"w": torch.ones(3), "count": counter + 1})
    _assert_fails_cleanly(bad, tmp_path / "bad", MergeError, r"integer/bool tensor 'count' differs between .*a and .*b")


def test_non_finite_values_name_source_and_tensor(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(4), "v": torch.ones(2)}, {"w": torch.tensor([1.0, float("nan"), 1, 1]), "v": torch.ones(2)})
    _assert_fails_cleanly(srcs, tmp_path / "out", MergeError, r"tensor 'w' in .*/b holds non-finite")


def test_different_names_shapes_dtypes(tmp_path):
    cases = {
        "names": ({"w": torch.ones(2), "v": torch.ones(2)}, {"w": torch.ones(2), "u": torch.ones(2)}, r"different tensor names: .*/b lacks 1 tensor.*v"),
        "shape": ({"w": torch.ones(2)}, {"w": torch.ones(3)}, r"tensor 'w' has shape \[3\] in .*/b but \[2\]"),
        "dtype": ({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float16)}, r"tensor 'w' is F16 in .*/b"),
    }
    for key, (a, b, match) in cases.items():
        _assert_fails_cleanly(_two(tmp_path / key, a, b), tmp_path / f"out-{key}", MergeError, match)


def test_truncated_and_corrupt_safetensors(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(1000)}, {"w": torch.ones(1000)})
    data = (srcs[1] / "model.safetensors").read_bytes()
    (srcs[1] / "model.safetensors").write_bytes(data[:-100])
    _assert_fails_cleanly(srcs, tmp_path / "out", CheckpointFormatError, r"b/model.safetensors .*tensor 'w' ends at byte .*\(truncated\)")
    (srcs[1] / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    _assert_fails_cleanly(srcs, tmp_path / "out", CheckpointFormatError, r"b/model.safetensors .*header")
    (srcs[1] / "model.safetensors").write_bytes(b"abc")
    _assert_fails_cleanly(srcs, tmp_path / "out", CheckpointFormatError, r"b/model.safetensors .*3 bytes")


def test_missing_sources_and_files(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(2)}, {"w": torch.ones(2)})
    _assert_fails_cleanly([srcs[0], tmp_path / "nope"], tmp_path / "out", FileNotFoundError, r"source .*nope does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_fails_cleanly([srcs[0], empty], tmp_path / "out", FileNotFoundError, r"empty holds no model weights, snapshots or checkpoints: give ")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"w": torch.ones(2)}, sharded / "model-00001-of-00002.safetensors")
    _assert_fails_cleanly([srcs[0], sharded], tmp_path / "out", CheckpointFormatError, r"lists shard\(s\) that do not exist: model-00002")
    (srcs[1] / "config.json").unlink()
    _assert_fails_cleanly(srcs, tmp_path / "out", FileNotFoundError, r"b has no config.json")


def test_fewer_sources_than_last(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(2)}, {"w": torch.ones(2)})
    _assert_fails_cleanly_last = pytest.raises(ValueError, match=r"found 2 sources .*, fewer than last=3")
    with _assert_fails_cleanly_last:
        merge_checkpoints(srcs, tmp_path / "out", last=3, progress=False)
    assert not (tmp_path / "out").exists()


def test_non_empty_output_needs_overwrite_and_overwrite_replaces(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="out is not empty"):
        merge_checkpoints(srcs, out, progress=False)
    assert (out / "keep.txt").read_text() == "user data"
    # overwrite replaces only a folder hf-pma wrote: not this one
    with pytest.raises(FileExistsError, match=r"^overwrite refuses to replace .*: hf-pma did not write it"):
        merge_checkpoints(srcs, out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "user data"
    out = tmp_path / "merged"
    merge_checkpoints(srcs, out, weights=[1, 0], progress=False)
    merge_checkpoints(srcs, out, overwrite=True, progress=False)
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.full((2,), 0.5))
    # a failed merge with overwrite keeps the previous output intact
    bad = _raw_folder(tmp_path / "c", {"w": torch.ones(3)})
    with pytest.raises(MergeError):
        merge_checkpoints([srcs[0], bad], out, overwrite=True, progress=False)
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.full((2,), 0.5))


def test_output_inside_or_over_a_source_is_refused(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="overlaps source"):
        merge_checkpoints(srcs, srcs[0], overwrite=True, progress=False)
    with pytest.raises(ValueError, match="overlaps source"):
        merge_checkpoints(srcs, tmp_path, overwrite=True, progress=False)
    assert (srcs[0] / "model.safetensors").is_file()


def test_same_source_twice_and_bad_arguments(tmp_path):
    srcs = _two(tmp_path, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="given twice"):
        merge_checkpoints([srcs[0], srcs[0]], tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        merge_checkpoints(srcs, tmp_path / "o", dtype="int8", progress=False)
    with pytest.raises(ValueError, match="max_shard_size .five gigs. cannot be parsed"):
        merge_checkpoints(srcs, tmp_path / "o", max_shard_size="five gigs", progress=False)
    with pytest.raises(ValueError, match="accumulate_dtype"):
        merge_checkpoints(srcs, tmp_path / "o", accumulate_dtype=torch.float16, progress=False)
    assert not (tmp_path / "o").exists()


def test_parse_size():
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500 MB") == 500_000_000
    assert parse_size(1234) == 1234


def test_peft_adapter_folders_merge_to_an_adapter(tmp_path):
    folders = []
    for i in range(2):
        folder = tmp_path / f"ad{i}"
        folder.mkdir()
        save_file({"base_model.model.lora_A.weight": torch.full((2, 4), float(i))}, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
        folders.append(folder)
    out = merge_checkpoints(folders, tmp_path / "m", progress=False)
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    assert torch.equal(load_file(out / "adapter_model.safetensors")["base_model.model.lora_A.weight"], torch.full((2, 4), 0.5))


def test_merge_options_are_keywords(tmp_path):
    """After the sources (and the output folder), every option of the merge functions is named:
    ``merge_checkpoints(srcs, out, "wma")`` would silently read as another option."""
    import inspect

    from hf_pma.merging.engine import merge_state_dict

    for fn, positional in ((merge_checkpoints, ["sources", "output_dir"]), (merge_state_dict, ["sources"])):
        params = inspect.signature(fn).parameters.values()
        assert [p.name for p in params if p.kind is not p.KEYWORD_ONLY] == positional
    with pytest.raises(TypeError, match="positional"):
        merge_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "m", "wma")
    assert not (tmp_path / "m").exists()


def test_the_automatic_window_merges_with_its_own_weights_and_a_given_window_with_sma(tmp_path):
    """``strategy="auto"`` (every merge's default): the weights the automatic window chose with it
    (WMA for a window the trend test chose), SMA for a window given; a strategy named wins."""
    from hf_pma.core.strategies import wma_weights
    from hf_pma.merging.sources import resolve_sources
    from hf_pma.merging.windows import apply_window
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    flat = [4.0 + (0.01 if i % 2 else -0.01) for i in range(12)]  # a settled loss: the trend test takes a window
    run, states = write_run(tmp_path / "run", 12, noise_deviation(), losses=flat)
    chosen, choice = apply_window(resolve_sources([run]), last="auto")
    assert choice.strategy == "wma" and choice.count > 1
    merged = merge_checkpoints(run, tmp_path / "auto", last="auto", progress=False)
    record = json.loads((merged / "pma_merge.json").read_text())
    assert record["strategy"] == "wma"
    assert record["weights"] == pytest.approx(wma_weights(choice.count))
    reference = _reference(states[-choice.count :], wma_weights(choice.count))
    for name, tensor in _merged_state(merged).items():
        torch.testing.assert_close(tensor.double(), reference[name], rtol=0, atol=2e-7)
    from hf_pma.publishing.card import write_model_card

    card = write_model_card(merged, plot=False).read_text()
    assert "| strategy | WMA: weighted moving average" in card and "chosen with the automatic window" in card
    given = merge_checkpoints(run, tmp_path / "given", last=4, progress=False)
    assert json.loads((given / "pma_merge.json").read_text())["strategy"] == "sma"
    named = merge_checkpoints(run, tmp_path / "named", last="auto", strategy="sma", progress=False)
    record = json.loads((named / "pma_merge.json").read_text())
    assert record["weights"] == pytest.approx([1 / choice.count] * choice.count)
    # The line and the record say the weights used: the strategy named, not the rule's own.
    assert record["strategy"] == record["window"]["auto"]["strategy"] == "sma" and record["window"]["auto"]["strategy_named"]
    from hf_pma.core.window_choice import merge_strategy

    assert merge_strategy("sma", choice)[1].describe().startswith(f"auto window: the newest {choice.count} snapshots, SMA (as asked): ")
    # Naming the rule's own weights is still a name: said as asked, and no card says the rule chose them.
    named_wma = merge_checkpoints(run, tmp_path / "named-wma", last="auto", strategy="wma", progress=False)
    assert json.loads((named_wma / "pma_merge.json").read_text())["window"]["auto"]["strategy_named"]
    assert "chosen with the automatic window" not in write_model_card(named_wma, plot=False).read_text()
    # One snapshot is itself, whatever the strategy named: the record says SMA.
    one = merge_checkpoints(run, tmp_path / "one", last=1, strategy="ema", progress=False)
    assert json.loads((one / "pma_merge.json").read_text())["strategy"] == "sma"
