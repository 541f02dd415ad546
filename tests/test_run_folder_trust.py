"""A run folder handed over by someone else cannot be turned against its user: a manifest entry
that leads outside the run is refused by every command and by a resumed Trainer, nothing outside
is ever deleted, and a malformed manifest is one line naming the file, the entry and the field
(exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_pma.cli import main
from hf_pma.core.manifest import is_excluded, manifest_snapshots
from hf_pma.snapshots.callback import PMACallback
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.markers import require_matplotlib
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.pma_records import write_merged_folder
from tests.helpers.snapshot_runs import noise_deviation, write_run
from tests.helpers.training import TRAIN_SMALL_TPS, train_small

TPS = TRAIN_SMALL_TPS  # tokens per step of train_small


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its content."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def add_entries(pma: Path, *entries: dict, first: bool = False) -> None:
    """Add raw entries to the manifest of ``pma`` (after the others, or before with ``first``)."""
    data = json.loads((pma / "manifest.json").read_text())
    data["snapshots"] = [*entries, *data["snapshots"]] if first else [*data["snapshots"], *entries]
    (pma / "manifest.json").write_text(json.dumps(data))


def the_error(stderr: str) -> str:
    """The last line of a command's stderr: its one-line error (log lines may come before)."""
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------- commands reading a run


@pytest.fixture
def handed_over(tmp_path, tiny_tokenizer):
    """A run of 3 snapshots, and a real model outside it (``victim/model``) for entries to aim at."""
    run, _ = write_run(tmp_path / "run", 3, noise_deviation(), tokenizer=tiny_tokenizer)
    victim = save_model_folder(tmp_path / "victim" / "model", make_tiny_model(seed=7))
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(2000))
    return run, victim, heldout


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_merge_sweep_inspect_refuse_an_entry_outside_the_run(handed_over, tmp_path, capsys, how):
    run, victim, heldout = handed_over
    pma = run / "pma"
    path = {"relative": "../../victim/model", "absolute": str(victim), "symlink": "snapshot-4000"}[how]
    if how == "symlink":
        (pma / "snapshot-4000").symlink_to(victim)
    add_entries(pma, {"path": path, "tokens": 4000, "step": 40})
    before = tree(tmp_path / "victim")
    commands = {
        "merge": ["merge", str(run), "-o", str(tmp_path / "merged"), "-q"],
        "inspect": ["inspect", str(run), "--plot", "", "-q"],
        "sweep": [
            "sweep",
            str(run),
            "--eval-file",
            str(heldout),
            "-o",
            str(tmp_path / "s.json"),
            "--no-plot",
            "-q",
        ],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        error = the_error(capsys.readouterr().err)
        assert error.startswith(
            f"hf-pma {name}: error: {pma / 'manifest.json'}: snapshots[3] ({path!r}): 'path' refused"
        )
    assert not (tmp_path / "merged").exists() and not (tmp_path / "s.json").exists()
    assert tree(tmp_path / "victim") == before


def _tokens(d):
    d["snapshots"][1]["tokens"] = "abc"


MALFORMED = {
    "tokens 'abc'": (
        _tokens,
        "snapshots[1] ('snapshot-2000'): 'tokens' must be a non-negative integer, got 'abc'",
    ),
    "tokens null": (
        lambda d: d["snapshots"][1].update(tokens=None),
        "snapshots[1] ('snapshot-2000'): 'tokens' must be",
    ),
    "tokens -5": (
        lambda d: d["snapshots"][0].update(tokens=-5),
        "snapshots[0] ('snapshot-1000'): 'tokens' must be a non-negative",
    ),
    "path 5": (
        lambda d: d["snapshots"][2].update(path=5),
        "snapshots[2]: 'path' must be a non-empty relative path, got 5",
    ),
    "snapshots {}": (
        lambda d: d.update(snapshots={}),
        "'snapshots' must be a list of snapshot records, got {}",
    ),
    "entry string": (
        lambda d: d["snapshots"].__setitem__(1, "snapshot-2000"),
        "snapshots[1]: expected an object",
    ),
    "format_version 99": (
        lambda d: d.update(format_version=99),
        "was written by a newer hf-pma (format_version 99;",
    ),
    "format_version 'banana'": (
        lambda d: d.update(format_version="banana"),
        "'format_version' must be an integer",
    ),
    "excluded 'false'": (
        lambda d: d["snapshots"][2].update(excluded="false"),
        "snapshots[2] ('snapshot-3000'): 'extra.excluded' must be true or false, got 'false'",
    ),
    "steps decrease": (
        lambda d: d["snapshots"][2].update(step=5),
        "snapshots[2] ('snapshot-3000'): 'step' 5 does not increase",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_manifest_is_one_line_and_exit_2(handed_over, tmp_path, capsys, name):
    run, _, heldout = handed_over
    manifest = run / "pma" / "manifest.json"
    data = json.loads(manifest.read_text())
    mutate, expected = MALFORMED[name]
    mutate(data)
    manifest.write_text(json.dumps(data))
    for argv in (
        ["merge", str(run), "-o", str(tmp_path / "merged"), "--last", "2", "-q"],
        ["inspect", str(run), "--plot", "", "-q"],
    ):
        assert main(argv) == 2, argv
        error = the_error(capsys.readouterr().err)
        assert f"error: {manifest}" in error and expected in error, error
    assert not (tmp_path / "merged").exists()


def test_the_installed_command_exits_2_with_one_line(handed_over, tmp_path):
    run, victim, _ = handed_over
    add_entries(run / "pma", {"path": "../../victim/model", "tokens": 4000, "step": 40})
    done = run_cli("merge", run, "-o", tmp_path / "m", process=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert (
        "snapshots[3] ('../../victim/model'): 'path' refused: the path '../../victim/model' leaves"
        in done.stderr
    )


# ---------------------------------------------------------------- a resumed Trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 8-step run: snapshots at steps 2, 4, 6, 8; checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train_small(out, [PMACallback(interval_tokens=2 * TPS)])
    assert [r.step for r in manifest_snapshots(out / "pma")] == [2, 4, 6, 8]
    return out


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the trained run, and two folders outside it that nothing may delete."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    for name in ("victim_rel", "victim_abs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pma.json").write_text(json.dumps({"path": name, "tokens": 1, "step": 1}))
        (tmp_path / name / "weights.safetensors").write_text("weeks of GPU time")
    return run


def test_resume_refuses_entries_outside_the_run_and_deletes_nothing(run_copy, tmp_path):
    pma = run_copy / "pma"
    # Both after the resume point: resuming drops (and used to delete) them.
    add_entries(
        pma,
        {"path": "../../victim_rel", "tokens": 20 * TPS, "step": 20},
        {"path": str(tmp_path / "victim_abs"), "tokens": 21 * TPS, "step": 21},
    )
    manifest = (pma / "manifest.json").read_bytes()
    before = tree(tmp_path)
    with pytest.raises(
        ValueError, match=r"snapshots\[4\] \('../../victim_rel'\): 'path' refused: .* leaves"
    ) as info:
        train_small(run_copy, [PMACallback(interval_tokens=2 * TPS)], resume=str(run_copy / "checkpoint-4"))
    assert "\n" not in str(info.value)
    assert tree(tmp_path) == before and (pma / "manifest.json").read_bytes() == manifest


def test_keep_last_refuses_an_old_entry_outside_the_run(run_copy, tmp_path):
    pma = run_copy / "pma"
    add_entries(pma, {"path": str(tmp_path / "victim_abs"), "tokens": 1, "step": 1}, first=True)
    before = tree(tmp_path)
    with pytest.raises(
        ValueError, match=r"snapshots\[0\] \('.*victim_abs'\): 'path' refused: .* is absolute"
    ):
        train_small(
            run_copy, [PMACallback(interval_tokens=2 * TPS, keep_last=2)], resume=str(run_copy / "checkpoint-4")
        )
    assert tree(tmp_path) == before


def test_resume_and_keep_last_leave_folders_that_hf_pma_did_not_write(run_copy):
    """Entries inside the run that are not snapshot folders hf-pma wrote: dropped from the
    manifest when resuming or keep_last says so, but left on disk."""
    pma = run_copy / "pma"
    for name in ("notes_old", "notes_new"):
        (pma / name).mkdir()
        (pma / name / "mine.txt").write_text("keep me")
    add_entries(pma, {"path": "notes_old", "tokens": 1, "step": 1}, first=True)
    add_entries(pma, {"path": "notes_new", "tokens": 20 * TPS, "step": 20})
    train_small(run_copy, [PMACallback(interval_tokens=2 * TPS, keep_last=2)], resume=str(run_copy / "checkpoint-4"))
    # notes_new lies past the resume point and past where the run ended: set aside, excluded.
    assert [r.step for r in manifest_snapshots(pma) if not is_excluded(r)] == [6, 8]
    assert [(r.path, r.extra["set_aside_at"]) for r in manifest_snapshots(pma) if is_excluded(r)] == [("notes_new", 4 * TPS)]
    assert (pma / "notes_old" / "mine.txt").read_text() == "keep me"
    assert (pma / "notes_new" / "mine.txt").read_text() == "keep me"
    # Its own snapshots past keep_last were deleted as before.
    assert sorted(p.name for p in pma.glob("snapshot-*")) == [f"snapshot-{6 * TPS}", f"snapshot-{8 * TPS}"]


# ---------------------------------------------------------------- the card's view of the run


@require_matplotlib
def test_card_records_and_plot_leave_out_a_malformed_manifest(tmp_path):
    from hf_pma.publishing.plot import plot_training
    from hf_pma.publishing.records import load_records

    folder = write_merged_folder(tmp_path)
    manifest = folder.parent / "manifest.json"
    data = json.loads(manifest.read_text())
    data["snapshots"][3] = "snapshot-x"
    manifest.write_text(json.dumps(data))
    records = load_records(folder)
    assert records.manifest is None and records.merge["strategy"] == "sma"
    assert plot_training(folder, tmp_path / "plot.png").stat().st_size > 10_000
