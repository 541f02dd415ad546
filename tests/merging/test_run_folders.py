"""Run folders as Trainer scripts leave them: ``merge``, ``sweep`` and ``inspect`` read the PMA
snapshots (else the ``checkpoint-*`` folders), never the final model at the folder's top unless
asked; folders the rule cannot settle are errors; windows in tokens or steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import Trainer

from hf_pma.cli import main
from hf_pma.core.manifest import MERGE_RECORD_NAME, manifest_snapshots
from hf_pma.merging.engine import merge_checkpoints
from hf_pma.merging.sources import resolve_sources
from hf_pma.snapshots.callback import PMACallback
from tests.helpers.data import TokenDataset, pad_collate, sample_text
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.output import text_rows
from tests.helpers.snapshot_runs import INTERVAL, noise_deviation, write_run
from tests.helpers.training import make_args

SEQ, BATCH, STEPS, SAVE_STEPS = 16, 4, 24, 8


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, tiny_tokenizer):
    """A Trainer script run the way transformers' run_clm.py leaves its folder: ``checkpoint-*``
    every SAVE_STEPS, PMA snapshots in ``pma/``, then ``trainer.save_model()`` and
    ``trainer.save_state()`` write the final model and its state at the top of output_dir."""
    root = tmp_path_factory.mktemp("trainer_run")
    run = root / "run"
    args = make_args(
        run, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_STEPS, lr_scheduler_type="constant"
    )
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=TokenDataset(n=STEPS * BATCH, min_len=SEQ, max_len=SEQ),
        data_collator=pad_collate,
        processing_class=tiny_tokenizer,
        callbacks=[PMACallback(interval_tokens=4 * SEQ * BATCH, async_write=False)],
    )
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    heldout = root / "heldout.txt"
    heldout.write_text(sample_text(3000))
    return run, heldout


def _sweep_names(run: Path, heldout: Path, out: Path, *extra: str) -> list[str]:
    argv = [
        "sweep",
        str(run),
        "--window",
        "2",
        "--every",
        "1",
        "--strategy",
        "sma",
        "--eval-file",
        str(heldout),
        "--block-size",
        "16",
        "--limit",
        "2",
        "--tokenizer",
        str(run),
        "-o",
        str(out),
        "--no-plot",
        "-q",
        *extra,
    ]
    assert main(argv) == 0
    return [s["name"] for s in json.loads(out.read_text())["snapshots"]]


def _merged_names(folder: Path) -> list[str]:
    return [s["name"] for s in json.loads((folder / MERGE_RECORD_NAME).read_text())["sources"]]


def test_trainer_run_folder_uses_the_snapshots_then_the_checkpoints(trainer_run, tmp_path, capsys):
    run, heldout = trainer_run
    assert (run / "model.safetensors").is_file() and (run / "trainer_state.json").is_file()
    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-16", "checkpoint-24", "checkpoint-8"]
    snapshots = [Path(r.path).name for r in manifest_snapshots(run / "pma")]
    assert len(snapshots) >= 4

    # merge: every snapshot of the manifest, not the final model at the top, and it says so.
    assert main(["merge", str(run), "--last", "all", "-o", str(tmp_path / "m"), "-q"]) == 0
    assert _merged_names(tmp_path / "m") == snapshots
    said = capsys.readouterr().out
    assert f"merged {len(snapshots)} source(s): {snapshots[0]} ... {snapshots[-1]}, tokens" in said

    # inspect: the snapshot table and the window are the snapshots'.
    assert main(["inspect", str(run), "--window", "3", "-q"]) == 0
    out = capsys.readouterr().out
    rows = text_rows(out)
    assert [r[0] for r in rows[1 : 1 + len(snapshots)]] == snapshots
    assert "Window: 3 snapshots (--window)" in out and out.strip().splitlines()[-1].startswith("Reading: ")
    assert not (run / "inspect.png").exists()

    # sweep: over the snapshots, and it says so; durations in tokens are a swept dimension.
    assert _sweep_names(run, heldout, tmp_path / "sweep.json", "--window-tokens", "512,1k") == snapshots
    said = capsys.readouterr().out
    assert f"sweep over {len(snapshots)} source(s): {snapshots[0]} ... {snapshots[-1]}, tokens" in said
    report = json.loads((tmp_path / "sweep.json").read_text())
    by_label = {c["label"]: c for c in report["combinations"]}
    assert set(by_label) == {"sma N=2 k=1", "sma T=512 k=1", "sma T=1000 k=1"}
    newest = report["snapshots"][-1]["tokens"]
    for label, span in (("sma T=512 k=1", 512), ("sma T=1000 k=1", 1000)):
        assert by_label[label]["tokens"] == [
            s["tokens"] for s in report["snapshots"] if s["tokens"] > newest - span
        ]

    # With --include-final, the final model comes last, named "final"; saved at the step of the
    # last snapshot, it takes that snapshot's place (the same point is not merged twice).
    assert main(["merge", str(run), "-o", str(tmp_path / "f"), "--last", "2", "--include-final", "-q"]) == 0
    assert _merged_names(tmp_path / "f") == [snapshots[-2], "final"]
    capsys.readouterr()

    # Without pma/: the checkpoint-* folders, in step order; the final model still left out.
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("pma"))
    ordered = ["checkpoint-8", "checkpoint-16", "checkpoint-24"]
    assert main(["merge", str(bare), "-o", str(tmp_path / "c"), "--last", "all", "-q"]) == 0
    assert _merged_names(tmp_path / "c") == ordered
    assert (
        "merged 3 source(s): checkpoint-8 ... checkpoint-24, tokens 512 to 1,536 (span 1,024)"
        in capsys.readouterr().out
    )
    assert main(["inspect", str(bare), "--window", "2", "-q"]) == 0
    assert [r[0] for r in text_rows(capsys.readouterr().out)[1:4]] == ordered
    assert _sweep_names(bare, heldout, tmp_path / "sweep2.json") == ordered

    # Windows on checkpoints, by steps or (the Trainer counted them) by tokens.
    assert main(["merge", str(bare), "-o", str(tmp_path / "w"), "--window-steps", "9", "-q"]) == 0
    assert _merged_names(tmp_path / "w") == ["checkpoint-16", "checkpoint-24"]
    assert json.loads((tmp_path / "w" / MERGE_RECORD_NAME).read_text())["window"] == {
        "unit": "steps",
        "first": 16,
        "last": 24,
        "span": 8,
        "requested": 9,
    }
    assert main(["merge", str(bare), "-o", str(tmp_path / "t"), "--window-tokens", "600", "-q"]) == 0
    assert _merged_names(tmp_path / "t") == ["checkpoint-16", "checkpoint-24"]


def _fake_run(root: Path, count: int = 6, final: bool = True, checkpoints: bool = False) -> Path:
    run, _ = write_run(root, count, noise_deviation())
    if final:
        save_model_folder(run, make_tiny_model(seed=7))
        (run / "trainer_state.json").write_text(
            json.dumps({"global_step": 10 * count + 5, "num_input_tokens_seen": 0})
        )
    if checkpoints:
        for step in (20, 40):
            save_model_folder(run / f"checkpoint-{step}", make_tiny_model(seed=step))
            state = {"global_step": step, "num_input_tokens_seen": step * 100}
            (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    return run


def test_ambiguous_folders_are_errors_naming_what_was_found(tmp_path):
    run = _fake_run(tmp_path / "run")
    # Two manifests.
    shutil.copy(run / "pma" / "manifest.json", run / "manifest.json")
    with pytest.raises(ValueError, match="holds two PMA manifests.*manifest.json.*pma/manifest.json"):
        resolve_sources([run])
    (run / "manifest.json").unlink()
    # A manifest with no usable snapshot beside a final model: an error, never a one-model merge.
    manifest = json.loads((run / "pma" / "manifest.json").read_text())
    (run / "pma" / "manifest.json").write_text(json.dumps({**manifest, "snapshots": []}))
    with pytest.raises(
        ValueError,
        match=r"lists no usable snapshots yet; the folder also holds a final model \(model.safetensors\)",
    ):
        resolve_sources([run])
    # include_final without a final model.
    other = _fake_run(tmp_path / "other", final=False)
    with pytest.raises(ValueError, match="has no final model at its top"):
        resolve_sources([other], include_final=True)
    # A folder of runs is not a run: the error names the runs inside.
    with pytest.raises(FileNotFoundError, match="its subfolders other, run do: name one"):
        resolve_sources([tmp_path])


def test_final_model_only_when_asked(tmp_path, caplog):
    run = _fake_run(tmp_path / "run", checkpoints=True)
    names = [s.name for s in resolve_sources([run])]
    assert names == [
        f"snapshot-{(i + 1) * INTERVAL}" for i in range(6)
    ]  # the manifest first, not checkpoint-*
    with_final = resolve_sources([run], include_final=True)
    assert (
        [s.name for s in with_final][-1] == "final"
        and with_final[-1].path == run
        and with_final[-1].step == 65
    )
    # Naming the weight file takes the model at the top alone.
    (only,) = resolve_sources([run / "model.safetensors"])
    assert only.path == run
    with pytest.raises(ValueError, match="is given twice"):
        resolve_sources([run, run / "model.safetensors"], include_final=True)
    with pytest.raises(ValueError, match="is a file"):
        resolve_sources([run / "config.json"])
    # A merge of one source says so at WARNING (shown by default).
    merge_checkpoints([run / "model.safetensors"], tmp_path / "one", progress=False)
    assert any(r.levelname == "WARNING" and "only one source" in r.getMessage() for r in caplog.records)
    # The final model's weights are merged only with include_final.
    out = merge_checkpoints([run], tmp_path / "f", last=None, include_final=True, progress=False)
    final = load_file(run / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    snaps = [load_file(s.files[0]) for s in with_final[:-1]]
    name = next(iter(final))
    expected = (sum(s[name] for s in snaps) + final[name]) / 7
    assert (merged[name] - expected).abs().max() < 1e-5


def test_window_tokens_selects_by_progress_and_is_recorded(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", final=False)
    # (newest - T, newest]: T = 3 V takes exactly 3 snapshots.
    sources = resolve_sources([run], window_tokens=3 * INTERVAL)
    assert [s.tokens for s in sources] == [4000, 5000, 6000]
    assert [s.tokens for s in resolve_sources([run], window_tokens=3 * INTERVAL + 1)] == [
        3000,
        4000,
        5000,
        6000,
    ]
    assert [s.tokens for s in resolve_sources([run], window_tokens=3 * INTERVAL, every=2)] == [4000, 6000]
    with pytest.raises(ValueError, match="give one of window_tokens and last"):
        resolve_sources([run], window_tokens=3000, last=2)
    assert main(["merge", str(run), "-o", str(tmp_path / "m"), "--window-tokens", "3k", "-q"]) == 0
    assert (
        "merged 3 source(s): snapshot-4000 ... snapshot-6000, tokens 4,000 to 6,000 (span 2,000), window of 3,000 tokens"
        in capsys.readouterr().out
    )
    record = json.loads((tmp_path / "m" / MERGE_RECORD_NAME).read_text())
    assert record["window"] == {
        "unit": "tokens",
        "first": 4000,
        "last": 6000,
        "span": 2000,
        "requested": 3000,
    }
    with pytest.raises(SystemExit):
        main(["merge", str(run), "-o", str(tmp_path / "x"), "--window-tokens", "3000", "--last", "2"])
    assert "not allowed with argument" in capsys.readouterr().err
    # Python API; checkpoints that count tokens take a window in tokens too.
    merge_checkpoints(run, tmp_path / "api", window_tokens=2 * INTERVAL, progress=False)
    assert [
        s["tokens"] for s in json.loads((tmp_path / "api" / MERGE_RECORD_NAME).read_text())["sources"]
    ] == [5000, 6000]
    bare = _fake_run(tmp_path / "ckpt", final=False, checkpoints=True)
    shutil.rmtree(bare / "pma")
    assert [s.name for s in resolve_sources([bare], window_tokens=2001)] == ["checkpoint-20", "checkpoint-40"]
    assert [s.name for s in resolve_sources([bare], window_tokens=2000)] == ["checkpoint-40"]
    # Checkpoints that did not count tokens: a window in tokens is an error naming them, in steps it works.
    (bare / "checkpoint-20" / "trainer_state.json").write_text(
        json.dumps({"global_step": 20, "num_input_tokens_seen": 0})
    )
    with pytest.raises(
        ValueError, match=r"1 have none: checkpoint-20 .*include_num_input_tokens_seen.*--window-steps"
    ):
        resolve_sources([bare], window_tokens=2001)
    assert main(["merge", str(bare), "-o", str(tmp_path / "s"), "--window-steps", "21", "-q"]) == 0
    assert (
        "merged 2 source(s): checkpoint-20 ... checkpoint-40, steps 20 to 40 (span 20), window of 21 steps"
        in capsys.readouterr().out
    )
    # The card says how the window was chosen.
    from hf_pma.publishing.card import build_model_card

    card = str(build_model_card(tmp_path / "m"))
    assert (
        "| merge window | the snapshots within the last 3,000 tokens (4,000 to 6,000 tokens, a span of 2,000) |"
        in card
    )


def test_a_window_in_tokens_with_last_auto_is_one_path_for_names_and_sources(tmp_path):
    """``last="auto"`` beside a window in tokens takes that window, whether the merge is given a
    run's name or the run's sources (one function chooses for both: merging.windows.apply_window)."""
    from hf_pma.merging.engine import _as_sources

    run = _fake_run(tmp_path / "run", final=False)
    by_name, choice = _as_sources([str(run)], "auto", window_tokens=3 * INTERVAL)
    by_sources, same = _as_sources(resolve_sources([run]), "auto", window_tokens=3 * INTERVAL)
    assert [s.tokens for s in by_name] == [s.tokens for s in by_sources] == [4000, 5000, 6000]
    assert choice is None and same is None  # the window was given: nothing chosen automatically
    with pytest.raises(ValueError, match="give one of window_tokens and last"):
        _as_sources(resolve_sources([run]), 2, window_tokens=3 * INTERVAL)


def test_a_runs_snapshot_pairs_and_its_sources_get_the_same_window(tmp_path):
    """What a training run lists (``(record, folder)`` pairs: PMATrainer, spike recovery,
    ``swapped()``) and what a merge of its folder resolves (sources) take their window by the one
    function, so the same run gives the same window, weights and reason either way; ``fewer``
    merges every snapshot of a run that has fewer than its window, without it that is an error."""
    from hf_pma.core.manifest import SnapshotRecord, read_manifest
    from hf_pma.merging.windows import apply_window
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    flat = [4.0 + (0.01 if i % 2 else -0.01) for i in range(12)]
    run, _ = write_run(tmp_path / "run", 12, noise_deviation(), losses=flat)
    records = [SnapshotRecord.from_dict(entry) for entry in read_manifest(run / "pma")["snapshots"]]
    pairs = [(record, run / "pma" / record.path) for record in records]  # as SnapshotTaker.snapshots() lists them
    by_pairs, choice = apply_window(pairs, last="auto")
    by_sources, same = apply_window(resolve_sources([run]), last="auto")
    assert [r.tokens for r, _ in by_pairs] == [s.tokens for s in by_sources]
    assert choice == same and choice.strategy == "wma" and 1 < choice.count < 12
    tokens, _ = apply_window(pairs, window_tokens=3 * 1000)
    assert [r.tokens for r, _ in tokens] == [s.tokens for s in apply_window(resolve_sources([run]), window_tokens=3000)[0]]
    assert len(apply_window(pairs, last=20, fewer=True)[0]) == 12
    with pytest.raises(ValueError, match="fewer than last=20"):
        apply_window(pairs, last=20)
