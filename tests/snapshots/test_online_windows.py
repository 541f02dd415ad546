"""Token windows of the online average (:class:`hf_pma.snapshots.online.OnlineAverage`): an EMA
given by its half-life in tokens, tumbling SMA windows, WSM's decay emulation; each equals the
merge of the same snapshots with the weights it records, and survives a save and load bit for bit."""

from __future__ import annotations

import re

import pytest
import torch

from hf_pma.core.manifest import SnapshotRecord
from hf_pma.core.strategies import decay_emulation_weights, ema_weights
from hf_pma.snapshots.online import OnlineAverage


def snapshots(tokens: list[int]) -> list[tuple[SnapshotRecord, dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            SnapshotRecord(path=f"snapshot-{t}", tokens=t, step=i + 1),
            {
                "w": torch.randn(3, 5, generator=generator),
                "b": torch.randn(7, generator=generator).bfloat16(),
            },
        )
        for i, t in enumerate(tokens)
    ]


def fold(average: OnlineAverage, taken) -> OnlineAverage:
    for record, state in taken:
        average.update(state, record)
    return average


def merged(taken, weights: list[float]) -> dict[str, torch.Tensor]:
    return {
        name: sum(w * state[name].double() for w, (_, state) in zip(weights, taken)) for name in taken[0][1]
    }


def assert_close(average: OnlineAverage, expected: dict[str, torch.Tensor]) -> None:
    got = average.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.allclose(got[name].double(), tensor, atol=1e-6), name


def test_ema_by_half_life_in_tokens_does_not_depend_on_the_interval():
    # Irregular snapshot times: a snapshot's weight halves every 100 tokens after it.
    taken = snapshots([50, 100, 250, 300, 500])
    average = fold(OnlineAverage("ema", half_life_tokens=100), taken)
    t = [r.tokens for r, _ in taken]
    expected = [0.5 ** ((t[-1] - t[0]) / 100)] + [
        (1 - 0.5 ** ((t[i] - t[i - 1]) / 100)) * 0.5 ** ((t[-1] - t[i]) / 100) for i in range(1, len(t))
    ]
    assert average.weights() == pytest.approx(expected)
    assert sum(average.weights()) == pytest.approx(1.0)
    assert_close(average, merged(taken, average.weights()))
    # With equal intervals V it is the alpha EMA with alpha = 1 - 2^(-V/H).
    regular = snapshots([100, 200, 300, 400])
    assert fold(OnlineAverage("ema", half_life_tokens=200), regular).weights() == pytest.approx(
        ema_weights(4, 1 - 0.5**0.5)
    )


def test_ema_by_half_life_fraction_equals_the_offline_merge_with_the_weights_of_its_token_counts():
    from hf_pma.core.strategies import ema_half_life_updates, running_average_weights

    taken = snapshots([50, 100, 250, 300, 500, 900])
    average = fold(OnlineAverage("ema", half_life_fraction=0.2), taken)
    # The weights come from the recorded token counts alone, offline.
    offline = running_average_weights(ema_half_life_updates([r.tokens for r in average.records], half_life_fraction=0.2))
    assert average.weights() == pytest.approx(offline) and sum(offline) == pytest.approx(1.0)
    assert_close(average, merged(taken, offline))
    record = average.merge_record(None, "float32")
    assert record["half_life_fraction"] == 0.2 and record["alpha"] is None and record["half_life_tokens"] is None
    assert average.options["half_life_fraction"] == 0.2
    # Not the same as any fixed half-life in tokens: the half-life grows with the run.
    assert average.weights() != pytest.approx(fold(OnlineAverage("ema", half_life_tokens=100), taken).weights())


def test_tumbling_sma_window_averages_the_snapshots_of_the_current_window():
    taken = snapshots([64 * i for i in range(1, 7)])  # windows of 256: (0, 256], (256, 512]
    average = fold(OnlineAverage("sma", window_tokens=256), taken)
    assert average.count == 2 and average.window_start == 256
    assert [r.tokens for r in average.records] == [320, 384]
    assert_close(average, merged(taken[4:], [0.5, 0.5]))
    assert average.merge_record(64, "float32")["window_start_tokens"] == 256


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_decay_emulation_over_a_window_equals_the_offline_wsm_weights(shape):
    taken = snapshots([64, 128, 192, 256])  # one full window of 4 snapshots
    average = fold(OnlineAverage(f"{shape}-decay", window_tokens=256), taken)
    assert average.weights() == pytest.approx(decay_emulation_weights(4, shape))
    assert_close(average, merged(taken, decay_emulation_weights(4, shape)))
    # Part-way through the window: the same coefficients, normalised over the snapshots so far.
    partial = fold(OnlineAverage(f"{shape}-decay", window_tokens=256), taken[:2])
    c = decay_emulation_weights(4, shape)[:2]
    assert partial.weights() == pytest.approx([w / sum(c) for w in c])


@pytest.mark.parametrize(
    "options",
    [
        {"kind": "ema", "half_life_tokens": 100},
        {"kind": "ema", "half_life_fraction": 0.25},
        {"kind": "sma", "window_tokens": 192},
        {"kind": "cosine-decay", "window_tokens": 256},
    ],
)
def test_saved_mid_window_and_resumed_equals_uninterrupted_bit_for_bit(tmp_path, options):
    taken = snapshots([64 * i for i in range(1, 8)])
    kind = options.pop("kind")
    straight = fold(OnlineAverage(kind, **options), taken)
    first = fold(OnlineAverage(kind, **options), taken[:3])
    first.save_state(tmp_path / "state.safetensors")
    resumed = fold(OnlineAverage.load_state(tmp_path / "state.safetensors"), taken[3:])
    assert resumed.weights() == straight.weights() and resumed.count == straight.count
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_restored_average_with_other_options_is_refused(tmp_path):
    saved = fold(OnlineAverage("sma", window_tokens=128), snapshots([64]))
    saved.save_state(tmp_path / "state.safetensors")
    restored = OnlineAverage.load_state(tmp_path / "state.safetensors")
    with pytest.raises(ValueError, match="resume with the same online options") as err:
        OnlineAverage("sma").check_same_options(restored, "checkpoint-1")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "sma", "half_life_tokens": 10}, "online_half_life_tokens is for online='ema'"),
        ({"kind": "sma", "half_life_fraction": 0.05}, "online_half_life_fraction is for online='ema'"),
        ({"kind": "ema", "half_life_fraction": 0.0}, r"online_half_life_fraction must be in \(0, 1\], got 0.0"),
        ({"kind": "ema", "half_life_fraction": 1.5}, r"online_half_life_fraction must be in \(0, 1\], got 1.5"),
        ({"kind": "ema", "half_life_fraction": True}, r"online_half_life_fraction must be in \(0, 1\], got True"),
        (
            {"kind": "ema", "half_life_fraction": 0.05, "half_life_tokens": 100},
            "^online_half_life_fraction and online_half_life_tokens each set the EMA's decay: give one$",
        ),
        (
            {"kind": "ema", "half_life_fraction": 0.05, "alpha": 0.3},
            "^online_half_life_fraction and online_alpha each set the EMA's decay: give one$",
        ),
        ({"kind": "ema", "window_tokens": 10}, "an EMA has no window"),
        ({"kind": "linear-decay"}, "give online_window_tokens"),
        ({"kind": "sma", "window_tokens": 0}, "online_window_tokens must be a positive"),
    ],
)
def test_bad_window_options_are_refused_in_one_line(kwargs, message):
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError, match=message):
        OnlineAverage(kind, **kwargs)


def test_an_unsharded_runs_average_resumes_in_a_sharded_run(tmp_path):
    """The single file of one process is read by global offsets like a rank file."""
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink
    from hf_pma.snapshots.sinks import OnlineAverageSink, ResumePoint
    from tests.helpers.models import make_tiny_model

    model = make_tiny_model(seed=0)
    sink = OnlineAverageSink(tmp_path / "a", online="sma", async_write=False)
    sink.open(None)
    sink.take(model, SnapshotRecord(path="snapshot-64", tokens=64, step=1))
    sink.commit()
    (tmp_path / "checkpoint-1").mkdir()
    sink.save_checkpoint(tmp_path / "checkpoint-1")
    sharded = ShardedOnlineAverageSink(tmp_path / "b", online="sma", rank=0, world_size=1)
    sharded.open(ResumePoint(64, 1, tmp_path / "checkpoint-1"))
    sharded.warm_up(model)
    assert sharded.count == 1
    live = model.state_dict()
    restored = {s.name: tensor for s, tensor in sharded.local_average()}
    assert restored and all(torch.equal(restored[name], live[name]) for name in restored)


# -- the online options at every door, and hostile saved averages ---------------------------------


@pytest.mark.parametrize(
    ("options", "message", "argument_message"),
    [
        ({"online": ""}, "online must be one of", "pma_online must be one of"),
        ({"online": "x" * 100_000}, "online must be one of", "pma_online must be one of"),
        (
            {"online": "sma", "online_window_tokens": 2.5},
            "online_window_tokens must be a positive integer or None, got 2.5",
            "pma_online_window_tokens must be a positive integer or None, got 2.5",
        ),
        (
            {"online": "ema", "online_alpha": True},
            "online_alpha must be in (0, 1], got True",
            "pma_ema_alpha must be in (0, 1], got True",
        ),
        (
            {"online": "ema", "online_half_life_fraction": 0.05, "online_half_life_tokens": 1000},
            "online_half_life_fraction and online_half_life_tokens each set the EMA's decay: give one",
            "pma_online_half_life_fraction and pma_online_half_life_tokens each set the EMA's decay: give one",
        ),
        (
            {"online_half_life_fraction": 0.05},
            "online_half_life_tokens, online_half_life_fraction and online_window_tokens need online=",
            "pma_online_half_life_tokens, pma_online_half_life_fraction and pma_online_window_tokens need pma_online",
        ),
        (
            {"online_device": "device"},
            "online_device='device' needs online='sma', 'ema' or a decay kind",
            "pma_online_device='device' needs pma_online",
        ),
    ],
)
def test_bad_online_options_are_refused_at_every_door_in_its_own_words(
    tmp_path, options, message, argument_message
):
    """PMACallback and PMASnapshots name the option as they take it, PMATrainingArguments as
    ``pma_*`` (``online_alpha`` is ``pma_ema_alpha`` there); one line, at construction."""
    from hf_pma import PMACallback, PMASnapshots, PMATrainingArguments
    from tests.helpers.models import make_tiny_model

    doors = {
        "callback": lambda: PMACallback(interval_tokens=64, **options),
        "loop": lambda: PMASnapshots(make_tiny_model(), output_dir=tmp_path, interval_tokens=64, **options),
        "arguments": lambda: PMATrainingArguments(
            output_dir=str(tmp_path),
            report_to=[],
            **{("pma_ema_alpha" if k == "online_alpha" else f"pma_{k}"): v for k, v in options.items()},
        ),
    }
    for door, make in doors.items():
        with pytest.raises(ValueError) as err:
            make()
        text = str(err.value)
        assert text.startswith(argument_message if door == "arguments" else message), (door, text)
        assert "\n" not in text and len(text) < 300, door


def _saved_checkpoint(tmp_path):
    from hf_pma.snapshots.sinks import ONLINE_STATE_NAME

    average = fold(OnlineAverage("sma"), snapshots([64, 128, 192]))
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    average.save_state(checkpoint / ONLINE_STATE_NAME)
    return checkpoint, checkpoint / ONLINE_STATE_NAME


def _rewrite(path, tensors=None, metadata=None, state=None):
    """The saved file written again with its tensors, metadata or ``online_state`` changed."""
    import json

    from hf_pma.snapshots.writer import write_safetensors

    saved = OnlineAverage.load_state(path)
    meta = dict(saved.metadata)
    meta.update(metadata or {})
    if state:
        meta["online_state"] = json.dumps({**json.loads(meta["online_state"]), **state})
    path.unlink()
    write_safetensors(str(path), (tensors or (lambda t: t))(saved._average), metadata=meta)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensors": lambda t: {**t, "w": t["w"].bfloat16()}}, "tensor 'w' is bfloat16, not float32"),
        ({"tensors": lambda t: {**t, "w": t["w"].double()}}, "tensor 'w' is float64, not float32"),
        ({"tensors": lambda t: {**t, "b": torch.full_like(t["b"], float("nan"))}}, "tensor 'b' holds NaN"),
        ({"tensors": lambda t: {**t, "w": torch.full_like(t["w"], float("inf"))}}, "tensor 'w' holds NaN"),
        (
            {"metadata": {"count": "2"}, "state": {"update_weights": [1.0, 0.5]}},
            "'count' is 2 but 'records' holds 3",
        ),
        (
            {"state": {"update_weights": [0.25, 0.5, 1 / 3]}},
            "'update_weights' does not start a window with 1.0",
        ),
    ],
)
def test_a_hostile_saved_average_is_refused_at_resume_naming_the_file(tmp_path, change, message):
    """Never a silently wrong average: a file whose tensors or bookkeeping update() could not
    have written stops the resume with one line naming the file."""
    from hf_pma.snapshots.sinks import OnlineAverageSink, ResumePoint

    checkpoint, path = _saved_checkpoint(tmp_path)
    _rewrite(path, **change)
    sink = OnlineAverageSink(tmp_path / "pma", online="sma", async_write=False)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        sink.open(ResumePoint(192, 3, checkpoint))
    assert str(err.value).startswith(f"{path} is not an hf-pma online average") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (lambda t: {**t, "w": t["w"][:1]}, "but float32 of shape (1, 5) in the average"),
        (
            lambda t: {**t, "w": t["w"].int()},
            "tensor 'w' is float32 of shape (3, 5) in the snapshot but int32",
        ),
        (lambda t: {"x": t["w"], "b": t["b"]}, "tensor names differ from the average's: ['w', 'x']"),
    ],
)
def test_an_average_restored_from_another_model_is_refused_before_anything_is_folded(
    tmp_path, tensors, message
):
    """Other shapes (which would broadcast), dtypes or names than the model's: the first update
    stops with one line naming the file it was restored from, the average untouched."""
    checkpoint, path = _saved_checkpoint(tmp_path)
    _rewrite(path, tensors=tensors)
    restored = OnlineAverage.load_state(path)
    before = restored.state_dict()
    record, state = snapshots([256])[0]
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        restored.update(state, record)
    assert str(err.value).startswith(f"online average (restored from {path})") and "\n" not in str(err.value)
    assert restored.count == 3 and all(torch.equal(before[k], v) for k, v in restored.state_dict().items())


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"window_start": 0}, "'window_start' 0 is not the window of 'last_tokens' 192"),
        ({"window_start": 150}, "'window_start' 150 is not the window of 'last_tokens' 192"),
        ({"last_tokens": 180}, "'last_tokens' is 180 but the last record was taken at 192 tokens"),
        ({"last_tokens": None}, "'last_tokens' is missing"),
        ({"coef_sum": 0.0}, "'coef_sum' is 0.0, not 0.5 for its window"),
    ],
)
def test_a_saved_window_that_disagrees_with_itself_is_refused(tmp_path, state, message):
    """A decay window (T=128) holding the snapshots at 160 and 192 tokens: a file whose window
    start, last tokens or coefficient sum disagree would make the next update restart the window
    or weigh the next snapshot wrongly."""
    path = tmp_path / "average.safetensors"
    fold(OnlineAverage("linear-decay", window_tokens=128), snapshots([64, 128, 160, 192])).save_state(path)
    assert OnlineAverage.load_state(path).count == 2
    _rewrite(path, state=state)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        OnlineAverage.load_state(path)
    assert str(err.value).startswith(f"{path} is not an hf-pma online average") and "\n" not in str(err.value)
