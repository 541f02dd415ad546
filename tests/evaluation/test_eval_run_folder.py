"""``hf-pma eval RUN``: a run folder alone is its final model; without one, one line says what
to give instead, before any model is loaded."""

from __future__ import annotations

import argparse

import pytest

from hf_pma.commands.eval import _hub_models
from tests.helpers.models import make_tiny_model, save_model_folder


def _args(*models: str, last: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(models=list(models), last=last, every=None, revisions=None, cache_dir=None)


@pytest.fixture
def run_folder(tmp_path):
    """A Trainer run folder: two checkpoints, no final model (yet)."""
    run = tmp_path / "run"
    model = make_tiny_model(seed=0)
    for step in (10, 20):
        save_model_folder(run / f"checkpoint-{step}", model)
    return run


def test_a_run_folder_without_a_final_model_says_what_to_give(run_folder):
    with pytest.raises(ValueError) as error:
        _hub_models(_args(str(run_folder)))
    message = str(error.value)
    assert message.startswith(
        f"{run_folder} is a run folder (2 checkpoint-* folder(s) (checkpoint-10 ... checkpoint-20))"
    )
    assert "without a final model at its top: --last N evaluates its newest N snapshots" in message
    assert "\n" not in message


def test_a_run_folder_is_its_final_model_and_with_last_its_newest_snapshots(run_folder):
    save_model_folder(run_folder, make_tiny_model(seed=1))  # trainer.save_model(output_dir)
    assert _hub_models(_args(str(run_folder))) == ([str(run_folder)], None)
    models, labels = _hub_models(_args(str(run_folder), last=1))
    assert models == [str(run_folder / "checkpoint-20")] and labels is None
