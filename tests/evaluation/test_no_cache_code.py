"""No code from a cache another user can write: ``hf-pma eval`` of a local model imports nothing
from ``HF_HOME/modules`` (where ``evaluate.load`` and ``trust_remote_code`` keep the code they
import), and works offline with a read-only ``HF_HOME`` (a read-only bind mount: permission bits
do not stop root)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.mounts import read_only

# Packages that evaluate, datasets and transformers import from HF_HOME/modules once they are
# on sys.path, and a module name an optional import might look for.
PLANTED = (
    "__init__.py",
    "evaluate_modules/__init__.py",
    "evaluate_modules/metrics/__init__.py",
    "datasets_modules/__init__.py",
    "transformers_modules/__init__.py",
    "flash_attn.py",
)


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("model")
    save_model_folder(root / "model", make_tiny_model(seed=0), tiny_tokenizer)
    (root / "heldout.txt").write_text(sample_text(1500))
    return root / "model", root / "heldout.txt"


def _plant(hf_home, marker):
    for relative in PLANTED:
        path = hf_home / "modules" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"open({str(marker)!r}, 'a').write({relative!r} + '\\n')\n")


def _eval(model, text, hf_home, output):
    return run_cli(
        "eval", model, "--eval-file", text, "--block-size", "32", "-o", output, "-q",
        env={"HF_HOME": str(hf_home), "HF_MODULES_CACHE": None, "HF_HUB_OFFLINE": "1"},
        process=True,
    )


@pytest.mark.slow
def test_eval_runs_no_code_planted_in_the_modules_cache(model_and_text, tmp_path):
    model, text = model_and_text
    hf_home, marker = tmp_path / "hf-home", tmp_path / "PLANTED-CODE-RAN"
    _plant(hf_home, marker)
    done = _eval(model, text, hf_home, tmp_path / "eval.json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists(), marker.read_text()
    assert json.loads((tmp_path / "eval.json").read_text())["results"]


@pytest.mark.slow
def test_eval_works_offline_with_a_read_only_hf_home(model_and_text, tmp_path):
    model, text = model_and_text
    hf_home = tmp_path / "hf-home"
    (hf_home / "hub").mkdir(parents=True)
    before = sorted(p.relative_to(hf_home) for p in hf_home.rglob("*"))
    with read_only(hf_home):
        done = _eval(model, text, hf_home, tmp_path / "eval.json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.relative_to(hf_home) for p in hf_home.rglob("*")) == before
    assert json.loads((tmp_path / "eval.json").read_text())["results"]


def test_metrics_lm_eval_loads_by_name_never_come_from_the_shared_modules_cache(tmp_path, monkeypatch):
    """lm-eval loads a metric it does not ship with ``evaluate.load(name)``: offline, the newest
    copy in ``HF_HOME/modules``. hf-pma runs lm-eval inside ``private_modules_cache``."""
    import sys

    import evaluate
    from evaluate import config as evaluate_config

    from hf_pma.evaluation.harness import private_modules_cache

    shared, marker = tmp_path / "modules", tmp_path / "PLANTED-METRIC-RAN"
    planted = shared / "evaluate_modules" / "metrics" / "evaluate-metric--planted" / ("0" * 64)
    planted.mkdir(parents=True)
    (planted / "planted.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.setattr(evaluate_config, "HF_MODULES_CACHE", shared)
    monkeypatch.setattr(evaluate_config, "HF_EVALUATE_OFFLINE", True)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with private_modules_cache() as folder:
        assert folder != shared
        with pytest.raises(Exception):  # noqa: B017 - evaluate's own error: the metric is not cached here
            evaluate.load("planted")
    assert not marker.exists()
    assert not folder.exists() and str(folder) not in sys.path
    assert evaluate_config.HF_MODULES_CACHE == shared
    with pytest.raises(Exception):  # noqa: B017 - the plant is real: outside the block it runs (then fails)
        evaluate.load("planted")
    assert marker.read_text() == "ran"
