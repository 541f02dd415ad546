"""The training plot: what it extracts from the records, and the PNG it writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.image import imread

from hf_pma.publishing.plot import plot_data, plot_training
from hf_pma.publishing.records import FolderRecords, load_records
from tests.helpers.pma_records import (
    MERGED_STEPS,
    SNAPSHOT_STEPS,
    TOKENS_PER_STEP,
    training_record,
    write_merged_folder,
)


@pytest.fixture()
def merged(tmp_path):
    return write_merged_folder(tmp_path)


def _image(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(path)


def test_plot_is_a_real_png_with_the_curves(merged):
    path = plot_training(merged)
    assert path == merged / "pma_training.png"
    image = _image(path)
    height, width = image.shape[:2]
    assert width >= 600 and height >= 300
    pixels = image[..., :3].reshape(-1, 3)
    assert len(np.unique((pixels * 255).astype(np.uint8), axis=0)) > 50  # lines, text, colours
    assert (pixels.min(axis=1) < 0.9).mean() > 0.02  # not a blank canvas
    assert not [p for p in merged.iterdir() if p.name.endswith(".tmp")]
    # readable by others, like the card and the JSON records beside it (not mkstemp's 0600)
    assert path.stat().st_mode & 0o777 == (merged / "pma_merge.json").stat().st_mode & 0o777 == 0o644


def test_plot_data_in_tokens(merged):
    data = plot_data(load_records(merged))
    assert data.x_is_tokens
    assert len(data.train_loss) == 200
    assert data.train_loss[0][0] == TOKENS_PER_STEP and data.train_loss[-1][0] == 200 * TOKENS_PER_STEP
    assert [x for x, _ in data.eval_live] == [s * TOKENS_PER_STEP for s in (50, 100, 150, 200)]
    assert [y for _, y in data.eval_merged] == [5.4 - s / 80 for s in (50, 100, 150, 200)]
    assert data.merged_snapshots == [s * TOKENS_PER_STEP for s in MERGED_STEPS]
    # The run's other snapshots come from its manifest.
    assert data.other_snapshots == [s * TOKENS_PER_STEP for s in SNAPSHOT_STEPS if s not in MERGED_STEPS]
    assert set(data.final_evals) == {"last snapshot", "PMA merge", "annealed"}
    assert data.final_evals["PMA merge"] == (MERGED_STEPS[-1] * TOKENS_PER_STEP, 4.0523)
    # the annealed model is placed at the end of the run, not at the merge's position
    assert data.final_evals["annealed"] == (200 * TOKENS_PER_STEP, 4.0481)
    assert data.learning_rate[-1] == (200 * TOKENS_PER_STEP, 0.003)


def test_plot_maps_steps_to_tokens_through_the_snapshots(merged, tmp_path):
    # A log without token counts: steps are placed with the snapshots' (step, tokens) pairs.
    record = training_record(tmp_path, with_tokens_in_log=False)
    record["pma_evals"] = []
    (merged / "pma_training.json").write_text(json.dumps(record))
    data = plot_data(load_records(merged))
    assert data.x_is_tokens
    xs = dict((round(x), y) for x, y in data.train_loss)
    assert round(30 * TOKENS_PER_STEP) in xs and round(200 * TOKENS_PER_STEP) in xs
    assert [x for x, _ in data.eval_live] == pytest.approx([s * TOKENS_PER_STEP for s in (50, 100, 150, 200)])


def test_plot_falls_back_to_steps(tmp_path):
    log = [{"step": s, "loss": 5.0 - s / 100} for s in range(1, 11)]
    records = FolderRecords(training={"log_history": log}, name="run")
    data = plot_data(records)
    assert not data.x_is_tokens and data.train_loss[-1] == (10, 4.9)
    path = plot_training(records, tmp_path / "steps.png")
    assert _image(path).shape[1] >= 600


def test_snapshot_lines_change_the_picture(merged, tmp_path):
    with_lines = _image(plot_training(merged, tmp_path / "a.png"))
    records = load_records(merged)
    records.merge = None
    records.manifest = None
    without = _image(plot_training(records, tmp_path / "b.png"))
    # The merged snapshots are orange (C1) lines: red high, green between red and blue.
    def orange_pixels(image):
        r, g, b = image[..., 0], image[..., 1], image[..., 2]
        return int(((r > 0.9) & (r - g > 0.15) & (g - b > 0.15)).sum())

    assert orange_pixels(with_lines) > 6 * 200  # 6 vertical lines, each hundreds of pixels tall
    assert orange_pixels(without) == 0


def test_nothing_to_plot_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_training(FolderRecords(name="empty"), tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="output_path"):
        plot_training(FolderRecords(training={"log_history": [{"step": 1, "loss": 1.0}]}))


def test_final_markers_side_by_side_distinct_and_labelled(merged):
    from hf_pma.publishing.plot import _figure

    data = plot_data(load_records(merged))
    # All three final evaluations at one position (as in the default run: the fork ends where the merge does).
    end = max(data.merged_snapshots)
    data.final_evals = {label: (end, y) for label, (_, y) in data.final_evals.items()}
    ax = _figure(data, dpi=50).axes[0]
    finals = {line.get_label(): line for line in ax.lines if line.get_label().startswith("final eval: ")}
    assert set(finals) == {"final eval: last snapshot", "final eval: PMA merge", "final eval: annealed"}
    xs = [float(line.get_xdata()[0]) for line in finals.values()]
    span = max(x for x, _ in data.train_loss) - min(x for x, _ in data.train_loss)
    # Side by side: at least 1% of the x range apart, around the position they share.
    assert min(abs(a - b) for i, a in enumerate(xs) for b in xs[i + 1 :]) > 0.01 * span
    assert min(xs) < end < max(xs) and sum(xs) / 3 == pytest.approx(end)
    assert len({line.get_marker() for line in finals.values()}) == 3
    # The markers say that they are not on the curves' text.
    assert "final evaluation, loss per token on" in ax.get_title() and "only where they read the same text" in ax.get_title()
