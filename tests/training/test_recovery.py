"""hf_pma.training.recovery from a plain torch loop (no Trainer): loss-spike recovery through
``PMASnapshots.check_for_spike``, and PMA-init of a fresh model from the run's snapshots."""

from __future__ import annotations

import math

import pytest
import torch

from hf_pma.core.manifest import is_excluded, manifest_snapshots, read_manifest
from hf_pma.merging.engine import merge_state_dict
from hf_pma.training.loop import PMASnapshots
from hf_pma.training.recovery import LossSpikeError, SpikeDetector, SpikeRecovery, pma_init
from tests.helpers.data import TokenDataset, pad_collate
from tests.helpers.models import make_tiny_model

BATCH, SEQ, LR = 4, 16, 3e-3
SPIKE = 7  # the optimizer step whose forward sees the damaged weights


def _batches(n: int) -> list[dict]:
    data = TokenDataset(n=n * BATCH, seed=1)
    return [pad_collate([data[i * BATCH + j] for j in range(BATCH)]) for i in range(n)]


def _spiking_run(out, steps: int, recovery: SpikeRecovery, damage_at: tuple[int, ...] = (SPIKE,)):
    """A snapshot after every step; before the forward of each step in ``damage_at`` the weights
    are blown up (what a bad batch or an LR too high does), so that step's loss spikes."""
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    pma = PMASnapshots(
        model,
        optimizer=optimizer,
        output_dir=out,
        interval_tokens=BATCH * SEQ,
        phases=("warmup", "stable", "decay"),
    )
    events = []
    for step, batch in enumerate(_batches(steps), 1):
        if step in damage_at:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(40.0)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        pma.step(batch=batch)
        events.append((step, pma.check_for_spike(recovery, loss.item())))
    pma.end()
    return model, optimizer, events


def test_spike_recovery_in_a_loop(tmp_path):
    recovery = SpikeRecovery(factor=3.0, window=5, last=2)
    model, optimizer, events = _spiking_run(tmp_path, SPIKE, recovery)
    records = [record for step, record in events if record is not None]
    assert [step for step, record in events if record is not None] == [SPIKE]
    record = records[0]
    # The snapshot taken at the spike's step is excluded (kept on disk), the 2 before it merged.
    listed = manifest_snapshots(tmp_path / "pma")
    excluded = [r for r in listed if is_excluded(r)]
    assert [r.step for r in excluded] == [SPIKE] and (tmp_path / "pma" / excluded[0].path).is_dir()
    before = [r for r in listed if not is_excluded(r)][-2:]
    assert [r.step for r in before] == [SPIKE - 2, SPIKE - 1]
    assert record["snapshots"] == [r.path for r in before] and record["excluded"] == [excluded[0].tokens]
    assert record["step"] == SPIKE and record["reset_optimizer"] and optimizer.state == {}
    merged = merge_state_dict([tmp_path / "pma" / r.path for r in before])
    live = model.state_dict()
    assert all(torch.equal(live[k], merged[k]) for k in merged)
    assert read_manifest(tmp_path / "pma")["recoveries"] == recovery.recoveries == records


def test_a_run_that_keeps_spiking_stops(tmp_path):
    recovery = SpikeRecovery(factor=3.0, window=5, last=2, max_recoveries=1)
    with pytest.raises(LossSpikeError, match=r"after 1 recoveries \(max_recoveries=1\)"):
        _spiking_run(tmp_path, SPIKE + 2, recovery, damage_at=(SPIKE, SPIKE + 2))
    assert len(recovery.recoveries) == 1
    # Nothing to recover from: the spike comes before the first snapshot.
    early = SpikeRecovery(factor=3.0, window=1, last=2)
    early.detector.observe(1.0, step=0)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    pma = PMASnapshots(model, optimizer=optimizer, output_dir=tmp_path / "early", interval_tokens=10**6)
    pma.step(tokens=BATCH * SEQ, lr=LR)
    with pytest.raises(LossSpikeError, match=r"no snapshot was taken before it.*smaller interval_tokens"):
        pma.check_for_spike(early, 50.0)
    pma.end()


def test_spike_detector():
    detector = SpikeDetector(factor=3.0, window=3)
    assert not detector.observe(2.0, step=1) and not detector.observe(2.2, step=2)
    assert not detector.is_spike(100.0)  # fewer than 3 healthy losses: no median yet
    assert not detector.observe(1.8, step=3)
    assert detector.is_spike(6.1) and not detector.is_spike(5.9)
    assert detector.observe(math.nan, step=4) and detector.observe(1.0, grad_norm=math.inf, step=5)
    assert detector.last_healthy_step == 3  # spikes are not remembered
    for bad, message in (
        ({"factor": 1.0}, "factor must be greater than 1"),
        ({"window": 0}, "window must be"),
    ):
        with pytest.raises(ValueError, match=message):
            SpikeDetector(**bad)


def test_pma_init_of_a_fresh_model_from_a_loops_snapshots(tmp_path):
    _spiking_run(tmp_path, 5, SpikeRecovery(factor=3.0, window=5, last=2), damage_at=())
    listed = manifest_snapshots(tmp_path / "pma")
    fresh = make_tiny_model(seed=1)
    record = pma_init(fresh, [tmp_path / "pma"], window=3)
    assert [s["tokens"] for s in record["sources"]] == [r.tokens for r in listed[-3:]]
    merged = merge_state_dict([tmp_path / "pma" / r.path for r in listed[-3:]])
    live = fresh.state_dict()
    assert record["strategy"] == "sma" and all(torch.equal(live[k], merged[k]) for k in merged)
    wide = make_tiny_model(seed=0, hidden_size=96)
    with pytest.raises(ValueError, match=r"^pma_init \(.*tensor 'model.embed_tokens.weight' has shape"):
        pma_init(wide, [tmp_path / "pma"])


def test_bad_arguments_of_recovery_and_pma_init_leave_the_model_untouched(tmp_path):
    """Each bad argument is one ValueError line naming it, the model untouched; ``last=0`` no
    longer merges every snapshot (``[-0:]``), and one folder given as a str is one source, not a
    sequence of its characters."""
    from hf_pma.training.recovery import recover_from_spike

    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    pma = PMASnapshots(
        model,
        optimizer=optimizer,
        output_dir=tmp_path,
        interval_tokens=64,
        phases=("warmup", "stable", "decay"),
    )
    for _ in range(3):
        pma.step(tokens=64, lr=LR)
    pma.wait()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for kwargs, named in [
        ({"reset_optimizer": "no"}, "reset_optimizer"),
        ({"reset_optimizer": 1}, "reset_optimizer"),
        ({"option_prefix": 5}, "option_prefix"),
    ]:
        with pytest.raises(ValueError, match=f"^{named} must"):
            SpikeRecovery(**kwargs)
    recovery = SpikeRecovery()
    for args, kwargs, named in [
        (("x",), {}, "loss"),
        ((True,), {}, "loss"),
        ((None,), {}, "loss"),
        ((2.0, "x"), {}, "grad_norm"),
        ((2.0, True), {}, "grad_norm"),
        ((2.0,), {"model": "m"}, "model"),
    ]:
        with pytest.raises(ValueError, match=f"^{named} must"):
            pma.check_for_spike(recovery, *args, **kwargs)
    for kwargs, named in [
        ({"last": 0}, "last"),
        ({"last": -1}, "last"),
        ({"last": True}, "last"),
        ({"last": "2"}, "last"),
        ({"step": "x"}, "step"),
        ({"after_step": "x"}, "after_step"),
        ({"taker": None}, "taker"),
        ({"model": "m"}, "model"),
    ]:
        call = {"model": model, "taker": pma.taker, "step": 3, "after_step": 3, **kwargs}
        with pytest.raises(ValueError, match=f"^{named} must"):
            recover_from_spike(call.pop("model"), call.pop("taker"), **call)
    for args, named in [
        (("m", [tmp_path / "pma"]), "model"),
        ((model, None), "sources"),
        ((model, 5), "sources"),
    ]:
        with pytest.raises(ValueError, match=f"^{named} must"):
            pma_init(*args)
    first, second = sorted((tmp_path / "pma").glob("snapshot-*"))[:2]
    with pytest.raises(ValueError, match="^window_tokens selects the snapshots of one run folder"):
        pma_init(model, [first, second], window_tokens=64)  # was ignored
    with pytest.raises(ValueError, match="unknown merge strategy 'bogus'"):
        pma_init(model, [first], strategy="bogus")  # one folder was merged as sma regardless
    with pytest.raises(ValueError, match="alpha"):
        pma_init(model, [first], strategy="ema", alpha=5.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert recovery.recoveries == [] and not any(is_excluded(r) for r in manifest_snapshots(tmp_path / "pma"))
    with pytest.raises(ValueError, match="^recovery must be a SpikeRecovery"):
        pma.check_for_spike(None, 2.0)
    pma.end()
    with pytest.raises(ValueError, match=r"check_for_spike\(\) after end\(\)"):
        pma.check_for_spike(recovery, float("nan"))  # would exclude snapshots in a released folder
    fresh = make_tiny_model(seed=1)
    used = pma_init(fresh, str(tmp_path / "pma"), window=2)  # one folder as a str
    assert [s["tokens"] for s in used["sources"]] == [128, 192]
