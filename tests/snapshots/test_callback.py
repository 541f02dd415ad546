"""PMACallback in a real single-process Trainer: snapshots, durability, failures, resume, online mode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback

from hf_pma.core.manifest import MERGE_RECORD_NAME, SnapshotRecord, included_snapshots, manifest_snapshots
from hf_pma.core.strategies import ema_weights
from hf_pma.io.guarded import read_json
from hf_pma.snapshots.callback import ONLINE_STATE_NAME, PMACallback
from hf_pma.snapshots.gather import gather_full_state_dict
from hf_pma.snapshots.online import OnlineAverage
from hf_pma.snapshots.writer import (
    SnapshotWriteError,
    prepare_snapshot,
    write_safetensors,
    write_snapshot,
)
from hf_pma.utils.fs import temporary_path
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import load_weights, make_tiny_model, max_weight_diff
from tests.helpers.training import StopAt, WeightRecorder, make_args

SEQ = 16
BATCH = 4
TPS = SEQ * BATCH  # tokens per step with fixed-length rows
DIST_DIR = Path(__file__).resolve().parents[1] / "dist"


def train(out, callbacks, dataset=None, processing_class=None, resume=None, **overrides):
    """Run a tiny Trainer; returns it."""
    torch.manual_seed(0)
    args = make_args(out, **overrides)
    trainer = Trainer(
        model=make_tiny_model(seed=0),
        args=args,
        train_dataset=dataset or TokenDataset(n=256, min_len=SEQ, max_len=SEQ),
        data_collator=pad_collate,
        processing_class=processing_class,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def manifest_list(pma_dir: Path) -> list[tuple[int, int, str]]:
    return [(r.tokens, r.step, r.phase) for r in manifest_snapshots(pma_dir)]


# --------------------------------------------------------------------------- the snapshots


def test_snapshots_are_loadable_model_folders_equal_to_the_weights_at_that_step(tmp_path, tiny_tokenizer):
    callback = PMACallback(interval_tokens=3 * TPS)
    recorder = WeightRecorder()
    train(
        tmp_path,
        [callback, recorder],
        processing_class=tiny_tokenizer,
        max_steps=14,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=4,
        logging_steps=2,
    )
    pma_dir = tmp_path / "pma"
    records = manifest_snapshots(pma_dir)
    # The first step whose token count reaches each multiple of V, never in warmup (steps 1-4).
    assert [(r.tokens, r.step) for r in records] == [(6 * TPS, 6), (9 * TPS, 9), (12 * TPS, 12)]
    assert all(r.phase == "stable" and r.lr == pytest.approx(1e-3) for r in records)
    assert manifest_list(pma_dir) == [(r.tokens, r.step, r.phase) for r, _ in callback.snapshots()]
    for record, folder in callback.snapshots():
        assert folder == pma_dir / f"snapshot-{record.tokens}"
        assert {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "pma.json",
        } <= {p.name for p in folder.iterdir()}
        written = read_json(folder / "pma.json")
        # The record, and the files the writer wrote (only those are ever deleted with the folder).
        assert written["extra"].pop("files") == sorted(p.name for p in folder.iterdir())
        assert written == record.to_dict()
        assert record.num_bytes == (folder / "model.safetensors").stat().st_size
        # The mean training loss since the previous snapshot (the first: since the start).
        assert record.loss is not None and record.extra["loss_source"] == "model"
        assert record.extra["loss_steps"] == (6 if record.step == 6 else 3)
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        live = recorder.weights[record.step]
        assert max_weight_diff(loaded.state_dict(), live) == 0.0
        assert max_weight_diff(load_weights(folder), live) == 0.0
        assert AutoTokenizer.from_pretrained(folder).get_vocab() == tiny_tokenizer.get_vocab()
    # Only complete folders and the manifest: no temporary leftovers.
    assert sorted(p.name for p in pma_dir.iterdir()) == [
        "manifest.json",
        "snapshot-384",
        "snapshot-576",
        "snapshot-768",
    ]
    manifest = read_json(pma_dir / "manifest.json")
    assert manifest["interval_tokens"] == 3 * TPS and manifest["token_count"] == "all"


def test_tokens_are_the_trainer_count_and_non_padding_is_respected(tmp_path):
    """Variable-length rows: boundaries follow the exact non-padding count, recorded exactly."""
    callback = PMACallback(interval_tokens=100, output_dir=tmp_path / "snaps")
    recorder = WeightRecorder()
    dataset = TokenDataset(n=128, min_len=4, max_len=30, seed=3)
    trainer = train(
        tmp_path / "run",
        [callback, recorder],
        dataset=dataset,
        max_steps=12,
        include_num_input_tokens_seen="non_padding",
    )
    tokens = [0] + [recorder.tokens[s] for s in range(1, 13)]
    expected = [
        (t, s) for s, (prev, t) in enumerate(zip(tokens, tokens[1:]), start=1) if t // 100 > prev // 100
    ]
    assert [(r.tokens, r.step) for r, _ in callback.snapshots()] == expected and len(expected) >= 4
    # Non-padding: counted from the attention mask. Padded batches would always count
    # 4 x (longest row) tokens, a multiple of 4.
    assert any((t - prev) % 4 for prev, t in zip(tokens, tokens[1:]))
    assert trainer.args.include_num_input_tokens_seen == "non_padding"
    for record, folder in callback.snapshots():
        assert max_weight_diff(load_weights(folder), recorder.weights[record.step]) == 0.0


def test_counting_is_turned_on_when_off(tmp_path):
    callback = PMACallback(interval_tokens=4 * TPS)
    trainer = train(tmp_path, [callback], max_steps=8, include_num_input_tokens_seen="no")
    assert trainer.args.include_num_input_tokens_seen == "all"
    assert [r.step for r, _ in callback.snapshots()] == [4, 8]


def test_automatic_interval_is_chosen_from_the_planned_schedule(tmp_path):
    callback = PMACallback(max_overhead=None)  # the choice itself, before any cost review
    train(
        tmp_path,
        [callback],
        max_steps=210,
        dataset=TokenDataset(n=840, min_len=SEQ, max_len=SEQ),
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": 20},
        warmup_steps=10,
        logging_steps=10,
    )
    # 200 steps snapshot (stable and decay, after 10 of warmup): 40 snapshots, one every 5 steps.
    assert callback.interval_tokens == 5 * TPS
    manifest = read_json(tmp_path / "pma" / "manifest.json")
    choice = manifest["interval_choice"]
    assert choice["auto"] and choice["tokens_per_step"] == TPS
    assert (choice["snapshot_steps"], choice["stable_steps"], choice["expected_snapshots"]) == (200, 181, 40)
    assert manifest["interval_tokens"] == 5 * TPS
    listed = manifest_list(tmp_path / "pma")
    assert [s for _, s, _ in listed] == list(range(15, 211, 5))  # none in warmup (steps 1-10)
    assert {p for _, s, p in listed if s > 191} == {"decay"} and {p for _, s, p in listed if s <= 191} == {
        "stable"
    }


@pytest.mark.parametrize(
    "phases, expected_steps",
    [(("decay",), [12, 14, 16]), (("warmup", "stable"), [2, 4, 6, 8, 10])],
)
def test_phase_selection(tmp_path, phases, expected_steps):
    callback = PMACallback(interval_tokens=2 * TPS, phases=phases)
    train(
        tmp_path,
        [callback],
        max_steps=16,
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": 6},
        warmup_steps=5,
    )
    assert [r.step for r, _ in callback.snapshots()] == expected_steps


def test_keep_last_sync_mode_save_dtype_and_shards(tmp_path):
    callback = PMACallback(
        interval_tokens=2 * TPS, keep_last=2, async_write=False, save_dtype="bfloat16", max_shard_size="20KB"
    )
    recorder = WeightRecorder()
    train(tmp_path, [callback, recorder], max_steps=10)
    pma_dir = tmp_path / "pma"
    assert [r.step for r, _ in callback.snapshots()] == [8, 10]
    assert sorted(p.name for p in pma_dir.iterdir()) == ["manifest.json", "snapshot-512", "snapshot-640"]
    assert len(callback.writer.written) == 5  # all five written, three deleted after newer ones
    folder = pma_dir / "snapshot-640"
    index = read_json(folder / "model.safetensors.index.json")
    assert len(set(index["weight_map"].values())) > 1  # sharded by max_shard_size
    assert read_json(folder / "config.json")["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    live = {k: v.to(torch.bfloat16) for k, v in recorder.weights[10].items()}
    assert max_weight_diff(loaded.state_dict(), live) == 0.0
    assert manifest_snapshots(pma_dir)[-1].dtype == "bfloat16"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"interval_tokens": 0}, "interval_tokens"),
        ({"interval_tokens": 1.5}, "interval_tokens"),
        ({"phases": ("annealing",)}, "phases"),
        ({"keep_last": 0}, "keep_last"),
        ({"save_dtype": "int8"}, "save_dtype"),
        ({"max_shard_size": "lots"}, "max_shard_size"),
        ({"async_write": "yes"}, "async_write"),
        ({"online": "wma"}, "online"),
        ({"online": "ema", "online_alpha": 1.5}, "online_alpha"),
        ({"online": "sma", "keep_last": 3}, "keep_last"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PMACallback(**kwargs)


def test_unwritable_output_fails_at_train_begin(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the snapshots should go")
    trainer = None
    with pytest.raises(PermissionError, match="not-a-folder"):
        trainer = train(
            tmp_path / "run", [PMACallback(interval_tokens=TPS, output_dir=blocker / "pma")], max_steps=4
        )
    assert trainer is None and blocker.read_text().startswith("a file")


def test_fresh_run_refuses_a_folder_with_snapshots_of_another_run(tmp_path):
    train(tmp_path, [PMACallback(interval_tokens=2 * TPS)], max_steps=4)
    with pytest.raises(FileExistsError, match="manifest.json"):
        train(tmp_path, [PMACallback(interval_tokens=2 * TPS)], max_steps=4)
    assert [r.step for r in manifest_snapshots(tmp_path / "pma")] == [2, 4]


def test_exclusions_and_listing(tmp_path):
    callback = PMACallback(interval_tokens=2 * TPS)
    train(tmp_path, [callback], max_steps=8)
    changed = callback.exclude_snapshots([4 * TPS], reason="loss spike")
    assert [r.step for r in changed] == [4]
    assert [r.step for r, _ in callback.snapshots()] == [2, 6, 8]
    everything = callback.snapshots(include_excluded=True)
    assert [r.step for r, _ in everything] == [2, 4, 6, 8]
    assert everything[1][0].extra["excluded"] is True and everything[1][1].is_dir()
    assert [r.step for r in included_snapshots(tmp_path / "pma")] == [2, 6, 8]
    with pytest.raises(ValueError, match="no snapshot at tokens"):
        callback.exclude_snapshots([12345])


# --------------------------------------------------------------------------- failures


class BreakOutputAt(TrainerCallback):
    """At the end of step ``step``, put a file where the next snapshot goes (its write fails). A
    snapshot folder moved away instead stops the run before the write (tests/test_lock_fallback.py)."""

    def __init__(self, callback: PMACallback, step: int):
        self.callback, self.step = callback, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.callback.wait()
            (self.callback.pma_dir / f"snapshot-{4 * TPS}").write_text("in the way")


@pytest.mark.parametrize("async_write", [True, False])
def test_writer_failure_is_raised_in_training(tmp_path, async_write):
    callback = PMACallback(interval_tokens=2 * TPS, async_write=async_write)
    recorder = WeightRecorder()  # after PMACallback: records the steps PMACallback let finish
    with pytest.raises(SnapshotWriteError, match="snapshot-256") as info:
        train(tmp_path, [BreakOutputAt(callback, 3), callback, recorder], max_steps=10)
    assert isinstance(info.value.__cause__, OSError)
    # The write of step 4 fails. Sync: raised at once (when the step's loss is logged).
    # Async: raised by the next event after the failure, at the latest by the next snapshot (6).
    assert max(recorder.tokens) in ({4} if not async_write else {4, 5})
    assert [r.step for r in manifest_snapshots(tmp_path / "pma")] == [2]


def test_crash_mid_write_leaves_a_valid_manifest_and_resume_repairs(tmp_path):
    """SIGKILL while the third snapshot's weights are half written, then resume."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(DIST_DIR / "crash_mid_write.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pma_dir = out / "pma"
    listed = manifest_snapshots(pma_dir)
    assert [(r.tokens, r.step) for r in listed] == [(3 * TPS, 3), (6 * TPS, 6)]
    for record in listed:  # everything listed is complete and readable
        with safe_open(pma_dir / record.path / "model.safetensors", framework="pt") as fh:
            assert len(list(fh.keys())) > 0
    leftovers = [p.name for p in pma_dir.iterdir() if p.name.startswith(".snapshot-576.tmp-")]
    assert len(leftovers) == 1  # the half-written one, never listed
    half = next(pma_dir.glob(".snapshot-576.tmp-*/model.safetensors"))
    with pytest.raises(Exception):  # noqa: B017 - any reader error: the file is truncated
        with safe_open(half, framework="pt") as fh:
            [fh.get_tensor(k) for k in fh.keys()]

    from tests.dist import crash_mid_write

    trainer, callback = crash_mid_write.make_trainer(out, [])
    trainer.train(resume_from_checkpoint=True)  # the last checkpoint: step 8
    assert not [p for p in pma_dir.iterdir() if p.name.startswith(".")]
    assert [r.step for r, _ in callback.snapshots()] == [3, 6, 9, 12, 15, 18]


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    "crash_step, restore_state",
    [
        (11, False),  # snapshot of step 9 written after checkpoint-8: dropped and taken again
        (9, False),  # the crash comes before any snapshot after checkpoint-8
        (11, True),  # Trainer restores the callback from trainer_state.json (auto interval)
    ],
)
def test_resume_gives_the_snapshot_list_of_an_uninterrupted_run(tmp_path, crash_step, restore_state):
    interval = None if restore_state else 3 * TPS
    common = dict(
        max_steps=16,
        save_strategy="steps",
        save_steps=4,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        restore_callback_states_from_checkpoint=restore_state,
        logging_steps=1,
    )
    # No cost budget: the automatic V is the planned one, whatever these steps cost.
    budget = {"max_overhead": None}
    straight = PMACallback(interval_tokens=interval, **budget)
    train(tmp_path / "straight", [straight], **common)
    expected = manifest_list(tmp_path / "straight" / "pma")
    assert len(expected) >= 5

    first = PMACallback(interval_tokens=interval, **budget)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "crashed", [StopAt(crash_step), first], **common)
    first.wait()  # the process would have finished (or lost) that write before dying
    pma_dir = tmp_path / "crashed" / "pma"
    before = [s for _, s, _ in manifest_list(pma_dir)]
    assert (max(before) > 8) == (crash_step == 11)

    second = PMACallback(interval_tokens=interval, **budget)
    trainer = train(
        tmp_path / "crashed", [second], resume=str(tmp_path / "crashed" / "checkpoint-8"), **common
    )
    assert manifest_list(pma_dir) == expected
    assert sorted(p.name for p in pma_dir.iterdir()) == sorted(
        p.name for p in (tmp_path / "straight" / "pma").iterdir()
    )
    live = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PMACallback))
    assert live.interval_tokens == straight.interval_tokens
    # The resumed run retraced the same weights.
    for record in manifest_snapshots(pma_dir):
        a = load_weights(pma_dir / record.path)
        b = load_weights(tmp_path / "straight" / "pma" / record.path)
        assert max_weight_diff(a, b) < 1e-6, record.path


def test_resume_lists_complete_unlisted_snapshots_and_deletes_later_ones(tmp_path):
    """A crash between renaming a snapshot into place and listing it leaves a complete folder."""
    common = dict(max_steps=8, save_strategy="steps", save_steps=4)
    callback = PMACallback(interval_tokens=2 * TPS)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, [StopAt(7), callback], **common)
    callback.wait()
    pma_dir = tmp_path / "pma"
    assert [r.step for r in manifest_snapshots(pma_dir)] == [2, 4, 6]
    # Write complete snapshot folders without listing them: one before the checkpoint, one after.
    model = make_tiny_model(seed=5)
    for tokens, step in ((3 * TPS, 3), (5 * TPS, 5)):
        state = gather_full_state_dict(model)
        write_snapshot(
            prepare_snapshot(model, state, SnapshotRecord(f"snapshot-{tokens}", tokens, step)), pma_dir
        )
    # And the temporary file of a manifest replacement that was cut short (its process is gone).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cut = temporary_path(pma_dir / "manifest.json").name.rsplit("-", 2)[0] + f"-{int(dead.stdout)}-0"
    (pma_dir / cut).write_text('{"snapshots": [')
    resumed = PMACallback(interval_tokens=2 * TPS)
    train(tmp_path, [resumed], resume=str(tmp_path / "checkpoint-4"), **common)
    assert [r.step for r in manifest_snapshots(pma_dir)] == [2, 3, 4, 6, 8]
    assert not (pma_dir / f"snapshot-{5 * TPS}").exists()
    assert not [p.name for p in pma_dir.iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- online mode


@pytest.mark.parametrize("kind", ["sma", "ema"])
def test_online_average_equals_the_average_of_the_weights(tmp_path, kind, tiny_tokenizer):
    callback = PMACallback(interval_tokens=2 * TPS, online=kind, online_alpha=0.3)
    recorder = WeightRecorder()
    train(tmp_path, [callback, recorder], processing_class=tiny_tokenizer, max_steps=10)
    steps = [2, 4, 6, 8, 10]
    weights = [1 / 5] * 5 if kind == "sma" else ema_weights(5, 0.3)
    online = callback.online_state_dict()
    for name, tensor in online.items():
        expected = sum(w * recorder.weights[s][name].double() for w, s in zip(weights, steps))
        assert torch.allclose(tensor.double(), expected, atol=1e-6), name
    assert callback.online_count == 5
    pma_dir = tmp_path / "pma"
    assert not list(pma_dir.glob("snapshot-*"))  # nothing written during training
    folder = pma_dir / f"online-{kind}"
    record = read_json(folder / MERGE_RECORD_NAME)
    assert record["strategy"] == kind and record["weights"] == pytest.approx(weights)
    assert [s["step"] for s in record["sources"]] == steps
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert max_weight_diff(online, loaded.state_dict()) < 1e-7
    assert (folder / "tokenizer.json").is_file()


def test_online_ema_by_half_life_fraction_equals_the_offline_ema_of_the_recorded_tokens(tmp_path, tiny_tokenizer):
    """A horizon-free EMA in a real Trainer: the average equals the merge of the live weights at
    each snapshot with the weights computed offline from the token counts its record holds; the
    record and the card say how it was made; a resumed run ends bit for bit where the uninterrupted one does."""
    from hf_pma.core.strategies import ema_half_life_updates, running_average_weights
    from hf_pma.publishing.card import write_model_card

    common = dict(max_steps=12, save_strategy="steps", save_steps=6, processing_class=tiny_tokenizer)
    options = dict(interval_tokens=TPS, online="ema", online_half_life_fraction=0.25)
    callback = PMACallback(**options)
    recorder = WeightRecorder()
    train(tmp_path / "a", [callback, recorder], **common)
    folder = tmp_path / "a" / "pma" / "online-ema"
    record = read_json(folder / MERGE_RECORD_NAME)
    tokens = [s["tokens"] for s in record["sources"]]
    assert tokens == [recorder.tokens[step] for step in range(1, 13)]
    weights = running_average_weights(ema_half_life_updates(tokens, half_life_fraction=0.25))
    assert record["weights"] == pytest.approx(weights) and record["half_life_fraction"] == 0.25
    assert record["alpha"] is None and record["strategy"] == "ema"
    online = callback.online_state_dict()
    for name, tensor in online.items():
        expected = sum(w * recorder.weights[step][name].double() for w, step in zip(weights, range(1, 13)))
        assert torch.allclose(tensor.double(), expected, atol=1e-6), name
    assert max_weight_diff(online, AutoModelForCausalLM.from_pretrained(folder).state_dict()) < 1e-7
    card = write_model_card(folder, plot=False).read_text()
    assert "half-life is 0.25 of the tokens seen at each snapshot (horizon-free)" in card
    assert "strategy='ema'" not in card  # the snippet gives the recorded weights: no alpha remakes them
    # Stopped after the checkpoint at step 6 and resumed: the same average, bit for bit.
    first = PMACallback(**options)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b", [StopAt(9), first], **common)
    resumed = PMACallback(**options)
    train(tmp_path / "b", [resumed], resume=str(tmp_path / "b" / "checkpoint-6"), **common)
    again = read_json(tmp_path / "b" / "pma" / "online-ema" / MERGE_RECORD_NAME)
    assert again["weights"] == record["weights"]
    b = resumed.online_state_dict()
    assert all(torch.equal(online[k], b[k]) for k in online)
    # A resume with another fraction is refused in one line.
    other = PMACallback(**{**options, "online_half_life_fraction": 0.5})
    with pytest.raises(ValueError, match="resume with the same online options"):
        train(tmp_path / "b", [other], resume=str(tmp_path / "b" / "checkpoint-6"), **common)


def test_online_average_survives_a_resume(tmp_path):
    common = dict(max_steps=12, save_strategy="steps", save_steps=6)
    straight = PMACallback(interval_tokens=2 * TPS, online="sma")
    train(tmp_path / "a", [straight], **common)
    first = PMACallback(interval_tokens=2 * TPS, online="sma")
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b", [StopAt(9), first], **common)
    assert (tmp_path / "b" / "checkpoint-6" / ONLINE_STATE_NAME).is_file()
    assert OnlineAverage.load_state(tmp_path / "b" / "checkpoint-6" / ONLINE_STATE_NAME).count == 3
    second = PMACallback(interval_tokens=2 * TPS, online="sma")
    train(tmp_path / "b", [second], resume=str(tmp_path / "b" / "checkpoint-6"), **common)
    assert second.online_count == straight.online_count == 6
    a, b = straight.online_state_dict(), second.online_state_dict()
    assert max_weight_diff(a, b) < 1e-6


# --------------------------------------------------------------------------- building blocks


def test_gathered_copy_is_detached_and_safetensors_writer_round_trips(tmp_path):
    model = make_tiny_model(seed=1)
    state = gather_full_state_dict(model, dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    # Tied weights stay one tensor, so the snapshot stores them once.
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(state["model.norm.weight"].float(), model.model.norm.weight)
    # An earlier copy is overwritten in place (no new memory), with the new values.
    again = gather_full_state_dict(model, dtype="bfloat16", buffers=state)
    assert all(again[k] is state[k] for k in state)
    assert torch.equal(again["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))
    fresh = gather_full_state_dict(model, buffers=state)  # float32 now: other dtype, new tensors
    assert fresh["model.norm.weight"] is not state["model.norm.weight"]
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7),
        "c": torch.ones(2, dtype=torch.bool),
        "e": torch.empty(0),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    with safe_open(tmp_path / "x.safetensors", framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert torch.equal(fh.get_tensor(name), tensor)
    job = prepare_snapshot(model, again, SnapshotRecord("snapshot-1", 1, 1))
    assert "lm_head.weight" not in job.state_dict and job.record.dtype == "bfloat16"
    with pytest.raises(ValueError, match="complex"):
        write_safetensors(tmp_path / "y.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})


def test_a_wait_too_short_to_show_is_no_warning(caplog, monkeypatch):
    """A write that was finishing (a wait that prints as 0.00 s) logs at DEBUG, not WARNING."""
    import logging
    import threading

    from hf_pma.snapshots import writer

    worker = writer.BackgroundWorker()
    release = threading.Event()
    monkeypatch.setattr(writer, "MIN_REPORTED_WAIT_S", 60.0)  # every real wait here is "too short"
    worker.submit(lambda: release.wait(5), "first")
    threading.Timer(0.2, release.set).start()
    with caplog.at_level(logging.DEBUG, logger="hf_pma"):
        worker.submit(lambda: None, "second")
    worker.wait()
    waits = [r for r in caplog.records if "second waited" in r.getMessage()]
    assert [r.levelname for r in waits] == ["DEBUG"]


def test_background_worker_one_task_in_flight_waits_logged_failures_raised(caplog):
    import logging
    import threading

    from hf_pma.snapshots.writer import BackgroundWorker

    worker = BackgroundWorker()
    events: list[str] = []
    release = threading.Event()

    def slow():
        events.append("slow start")
        release.wait(5)
        events.append("slow end")

    worker.submit(slow, "first")
    assert worker.busy
    threading.Timer(0.2, release.set).start()
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        worker.submit(lambda: events.append("second"), "second")  # waits for the first
    worker.wait()
    assert events == ["slow start", "slow end", "second"]
    assert any("second waited" in r.getMessage() for r in caplog.records)
    assert worker.total_wait_s > 0.1

    def fail():
        raise OSError(28, "No space left on device")

    worker.submit(fail, "snapshot-9")
    with pytest.raises(SnapshotWriteError, match="snapshot-9 failed: OSError.*No space left"):
        worker.submit(lambda: None, "snapshot-10")
    worker.wait()  # the failure is raised once, not again


@pytest.mark.parametrize(
    "attributes, says",
    [
        ({"resume_state": {"phase": "x"}}, "phase must be a dict"),
        ({"resume_state": {"interval_tokens": "abc"}}, "interval_tokens must be a positive integer"),
        ({"resume_state": {"phase": {"previous_lr": "abc"}}}, "phase.previous_lr must be a finite number"),
        (["x"], "the schedule state must be a dict"),
    ],
)
def test_a_hostile_resume_state_in_trainer_state_is_one_line(tmp_path, attributes, says):
    """The callback's state read back from a resumed checkpoint's trainer_state.json is checked
    field by field before the snapshot folder is claimed (it raised deep inside, or was taken)."""
    from transformers import TrainerControl, TrainerState

    args = make_args(tmp_path)
    state = TrainerState(
        max_steps=4,
        global_step=2,
        num_input_tokens_seen=128,
        stateful_callbacks={"PMACallback": {"args": {}, "attributes": attributes}},
    )
    model = make_tiny_model(seed=0)
    with pytest.raises(ValueError, match=f"trainer_state.json: PMACallback's resume_state: .*{says}"):
        PMACallback(interval_tokens=64).on_train_begin(args, state, TrainerControl(), model=model)
    assert not (tmp_path / "pma").exists()
