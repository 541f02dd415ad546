"""``hf-pma sweep``: the plan, numbers equal to separately merged and evaluated models, the CLI."""

from __future__ import annotations

import json
import os

import pytest

from hf_pma.analysis.sweep import lower_is_better, plan_sweep, run_sweep, sweep_table
from hf_pma.core.strategies import merge_coefficients
from hf_pma.evaluation.evaluator import evaluate_models, read_eval_record
from hf_pma.merging.engine import merge_checkpoints
from hf_pma.merging.sources import resolve_sources
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.output import markdown_rows
from tests.helpers.snapshot_runs import INTERVAL, noise_deviation, write_run


def _texts() -> list[str]:
    text = sample_text(12_000)
    return [text[i : i + 3000] for i in range(0, 12_000, 3000)]


def test_plan_sweep_selects_every_kth_snapshot_from_the_newest():
    combos, skipped = plan_sweep(7, windows=[1, 3, 4], every=[1, 2, 3], strategies=["sma", "ema"], alpha=0.5)
    by = {(c.strategy, c.window, c.every): c for c in combos}
    assert by[("sma", 3, 1)].indices == (4, 5, 6)
    assert by[("sma", 3, 2)].indices == (2, 4, 6)
    assert by[("ema", 3, 3)].indices == (0, 3, 6)
    assert by[("ema", 4, 2)].indices == (0, 2, 4, 6)
    assert by[("ema", 3, 3)].weights == tuple(merge_coefficients(3, "ema", 0.5))
    assert by[("sma", 1, 3)].indices == (6,) and by[("sma", 1, 3)].weights == (1.0,)
    # 4 snapshots every 3rd need 10: skipped, for both strategies, with the reason.
    assert {(s["strategy"], s["window"], s["every"]) for s in skipped} == {("sma", 4, 3), ("ema", 4, 3)}
    assert "needs 10 snapshots, the run has 7" in skipped[0]["reason"]
    # N = 1 is the same model whatever the stride and strategy: one key.
    assert len({c.key() for c in combos if c.window == 1}) == 1
    assert len({c.key() for c in combos}) == len(combos) - 5
    with pytest.raises(ValueError, match="unknown merge strategy 'median'"):
        plan_sweep(7, strategies=["median"])
    with pytest.raises(ValueError, match="window must be a positive integer, got 0"):
        plan_sweep(7, windows=[0, 3])
    assert (
        lower_is_better("lm/loss")
        and lower_is_better("lm/bits_per_byte")
        and not lower_is_better("pma_cloze/acc")
    )


def test_plan_sweep_windows_in_tokens():
    tokens = [1000 * (i + 1) for i in range(7)]
    combos, skipped = plan_sweep(
        7, windows=[3], every=[1, 2], strategies=["sma"], window_tokens=[3000, 4001], tokens=tokens
    )
    by = {c.label: c for c in combos}
    assert set(by) == {
        "sma N=3 k=1",
        "sma N=3 k=2",
        "sma T=3000 k=1",
        "sma T=4001 k=1",
        "sma T=3000 k=2",
        "sma T=4001 k=2",
    }
    assert by["sma T=3000 k=1"].indices == (4, 5, 6) and by["sma T=3000 k=1"].key() == by["sma N=3 k=1"].key()
    assert by["sma T=4001 k=1"].indices == (2, 3, 4, 5, 6) and by["sma T=4001 k=1"].window == 5
    assert by["sma T=3000 k=2"].indices == (4, 6) and by["sma T=4001 k=2"].indices == (2, 4, 6)
    assert not skipped
    # Only windows in tokens; they need every snapshot's tokens.
    combos, _ = plan_sweep(7, windows=[], every=[1], strategies=["wma"], window_tokens=[2000], tokens=tokens)
    assert [c.label for c in combos] == ["wma T=2000 k=1"] and combos[0].window_tokens == 2000
    with pytest.raises(ValueError, match="need the token count of every snapshot"):
        plan_sweep(7, windows=[], window_tokens=[2000])
    with pytest.raises(ValueError, match="give at least one window value"):
        plan_sweep(7, windows=[], window_tokens=[])


def test_sweep_numbers_equal_separately_merged_and_evaluated_models(tmp_path, tiny_tokenizer):
    run, _ = write_run(tmp_path / "run", 5, noise_deviation(0.03), tokenizer=tiny_tokenizer)
    texts = _texts()
    report = run_sweep(
        run,
        windows=[1, 2, 3],
        every=[1, 2],
        strategies=["sma", "ema"],
        alpha=0.4,
        texts=texts,
        block_size=64,
        batch_size=4,
        progress=False,
    )
    combos = report["combinations"]
    assert len(combos) == 12 and not report["skipped"]
    # Distinct merges: N=1 (= the baseline, never re-evaluated), N=2 and N=3 for k=1,2 and both strategies.
    assert report["evaluations"] == 1 + 8
    assert all(c["duplicate_of"] == "last snapshot" for c in combos if c["window"] == 1)
    sources = resolve_sources([run])
    checked = [c for c in combos if c["window"] > 1 and c["strategy"] == "ema" or c["label"] == "sma N=3 k=2"]
    folders, labels = [str(sources[-1].path)], ["last"]
    for c in checked:
        picked = [s for s in sources if s.name in c["snapshots"]]
        out = merge_checkpoints(
            picked, tmp_path / c["label"].replace(" ", "_"), strategy=c["strategy"], alpha=0.4, progress=False
        )
        assert json.loads((out / "pma_merge.json").read_text())["weights"] == pytest.approx(
            c["weights"], rel=1e-12
        )
        folders.append(str(out))
        labels.append(c["label"])
    separate = evaluate_models(
        folders, labels=labels, tokenizer=run, texts=texts, block_size=64, batch_size=4, progress=False
    )
    assert separate["results"]["last"]["lm"] == pytest.approx(report["baseline"]["results"]["lm"], rel=1e-6)
    for c in checked:
        assert c["results"]["lm"] == pytest.approx(separate["results"][c["label"]]["lm"], rel=1e-6), c[
            "label"
        ]
    assert report["metric"] == "lm/loss" and report["higher_is_better"] is False
    best = min(combos, key=lambda c: c["value"])
    assert report["best"] == best["label"] and best["delta"] == pytest.approx(
        best["value"] - report["baseline"]["value"]
    )
    # The table says whether the best merge beats the last snapshot (a "best" alone would suggest it does).
    beats = best["value"] < report["baseline"]["value"]
    assert report["best_beats_last"] is beats
    footer = sweep_table(report).splitlines()[-1]
    assert (f"best merge: {best['label']}" if beats else f"the best merge, {best['label']}, does not") in footer
    assert ("does not beat it: keep the last snapshot" in footer) is (not beats)
    # Where no merge beats the last snapshot, the last snapshot is the row marked best, and no
    # merge row is: no "keep the last snapshot" beside a merge marked "best".
    table = sweep_table({**report, "best_beats_last": False})
    marked = [row for row in markdown_rows(table) if row[0].startswith("* ")]
    assert marked == [row for row in markdown_rows(table) if row[0] == "* last snapshot"] and len(marked) == 1
    assert marked[0][-1] == "best" and "best: the last snapshot" in table.splitlines()[-1]
    assert next(r for r in markdown_rows(table) if r[0] == best["label"])[-1].startswith("best merge")


def test_sweep_errors_are_clear(tmp_path, tiny_tokenizer):
    run, _ = write_run(tmp_path / "run", 3, noise_deviation(), tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="no combination fits the run's 3 snapshot"):
        run_sweep(run, windows=[4], every=[1], texts=["x = 1\n" * 50], progress=False)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        run_sweep(run, windows=[2], every=[1], progress=False)
    with pytest.raises(ValueError, match="metric 'lm/accuracy' is not among the results: lm/loss"):
        run_sweep(
            run,
            windows=[2],
            every=[1],
            texts=["x = 1\n" * 50],
            metric="lm/accuracy",
            block_size=32,
            progress=False,
        )


def test_sweep_cli_with_tasks_writes_table_json_heatmap_and_best(tmp_path, tiny_tokenizer):
    from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks_from_split

    run, _ = write_run(tmp_path / "run", 4, noise_deviation(0.03), tokenizer=tiny_tokenizer)
    docs = _texts()
    make_tasks_from_split(
        docs[:2],
        docs[2:],
        tmp_path / "tasks",
        options=TaskOptions(num_items=12, min_line_chars=8),
        kinds=["next_line"],
    )
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[2:]))
    best_dir = tmp_path / "best"
    out = run_cli(
        "sweep",
        run,
        "--window",
        "1,3",
        "--every",
        "1,2",
        "--strategy",
        "sma,wma",
        "--eval-file",
        tmp_path / "heldout.jsonl",
        "--tasks",
        "pma_next_line",
        "--include-path",
        tmp_path / "tasks",
        "--metric",
        "pma_next_line/acc",
        "--block-size",
        "64",
        "--batch-size",
        "4",
        "-o",
        tmp_path / "sweep.json",
        "--best",
        best_dir,
        "-q",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["metric"] == "pma_next_line/acc" and report["higher_is_better"] is True
    # N=3 every 2nd needs 5 snapshots; N=1 is the last snapshot: 2 merges evaluated besides it.
    assert {(s["strategy"], s["window"], s["every"]) for s in report["skipped"]} == {
        ("sma", 3, 2),
        ("wma", 3, 2),
    }
    assert report["evaluations"] == 3
    assert (tmp_path / "sweep.png").stat().st_size > 5_000
    rows = markdown_rows(out.stdout)
    assert rows[0][:3] == ["merge", "snapshots", "pma_next_line/acc"]
    assert [row[0] for row in rows if row[0].startswith("* ")] in ([f"* {report['best']}"], ["* last snapshot"])
    assert "higher is better" in out.stdout
    # The skipped combinations are printed with why, not only logged.
    assert "skipped 2: sma N=3 k=2 (needs 5 snapshots, the run has 4); wma N=3 k=2 (needs 5" in out.stdout
    # The best merge on disk: its record says how it was chosen, and evaluated on its own it
    # gives the sweep's numbers.
    best = next(c for c in report["combinations"] if c["label"] == report["best"])
    merge_record = json.loads((best_dir / "pma_merge.json").read_text())
    assert [s["name"] for s in merge_record["sources"]] == best["snapshots"]
    assert (
        merge_record["sweep"]["every"] == best["every"]
        and merge_record["interval_tokens"] == INTERVAL * best["every"]
    )
    assert read_eval_record(best_dir)["results"]["PMA merge"] == best["results"]
    again = evaluate_models(
        [best_dir],
        labels=["best"],
        tokenizer=run,
        texts=docs[2:],
        tasks="pma_next_line",
        include_path=tmp_path / "tasks",
        block_size=64,
        batch_size=4,
        progress=False,
    )
    assert again["results"]["best"]["pma_next_line"]["acc"] == best["results"]["pma_next_line"]["acc"]
    assert again["results"]["best"]["lm"]["loss"] == pytest.approx(best["results"]["lm"]["loss"], rel=1e-6)


def test_sweep_cli_rejects_bad_input_before_evaluating(tmp_path, tiny_tokenizer):
    run, _ = write_run(tmp_path / "run", 2, noise_deviation(), tokenizer=tiny_tokenizer)
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "x").write_text("taken")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(2000))
    out = str(tmp_path / "s.json")
    done = run_cli("sweep", run, "--eval-file", heldout, "--best", tmp_path / "best", "-o", out)
    assert done.returncode == 2 and "best is not empty" in done.stderr and not os.path.exists(out)
    done = run_cli("sweep", run, "-o", out)
    assert done.returncode == 2 and "give --eval-file and/or --tasks" in done.stderr
    done = run_cli("sweep", run, "--eval-file", heldout, "--metric", "loss", "-o", out)
    assert done.returncode == 2 and "must look like TASK/METRIC" in done.stderr
    done = run_cli("sweep", run, "--eval-file", heldout, "-o", tmp_path / "no" / "s.json")
    assert done.returncode == 2 and "the folder of --output" in done.stderr
    # argparse refuses these (its exit code 2, the usage line).
    done = run_cli("sweep", run, "--window", "0,3", "--eval-file", heldout)
    assert done.returncode == 2 and "--window" in done.stderr
    done = run_cli("sweep", run, "--strategy", "sma,median", "--eval-file", heldout)
    assert done.returncode == 2 and "unknown strategy 'median'" in done.stderr


def test_a_sweep_that_nothing_fits_is_one_line_and_what_it_skips_is_counted(tmp_path, tiny_tokenizer):
    """A run with one snapshot fits no combination: one error line, not one INFO line per skipped
    combination first; a sweep that skips some says how many in one line (-v lists each)."""
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(2000))
    one, _ = write_run(tmp_path / "one", 1, noise_deviation(), tokenizer=tiny_tokenizer)
    done = run_cli("sweep", one, "--eval-file", heldout, "--window", "3,6", "-o", tmp_path / "s.json")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "no combination fits the run's 1 snapshot(s)" in done.stderr
    three, _ = write_run(tmp_path / "three", 3, noise_deviation(), tokenizer=tiny_tokenizer)
    done = run_cli("sweep", three, "--eval-file", heldout, "--window", "2,6", "--every", "1", "-o", tmp_path / "t.json")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "skipping" in line]
    assert len(said) == 1 and "skipping 3 combination(s) that do not fit the run's 3 snapshot(s)" in said[0], said


def test_auto_beside_the_strategy_it_stands_for_plans_each_merge_once():
    """``--strategy auto,sma`` with a window given, or ``auto,wma`` beside the automatic window that
    chose WMA, name one merge twice: it is planned once, under the name of the weights it uses."""
    combos, _ = plan_sweep(12, windows=["auto", 3], every=[1, 2], strategies=["auto", "sma", "wma"], auto_count=4, auto_strategy="wma")
    labels = [c.label for c in combos]
    assert len(labels) == len(set(labels)), labels
    keys = [(c.strategy, c.window, c.every, c.auto) for c in combos]
    assert sorted(keys, key=str) == sorted(
        [("wma", 4, 1, True), ("sma", 4, 1, True), ("sma", 3, 1, False), ("sma", 3, 2, False), ("wma", 3, 1, False), ("wma", 3, 2, False)], key=str
    )


@pytest.mark.parametrize("last", [0, -2, True, 2.5, "3", "all"])
def test_a_window_that_is_no_count_is_refused_in_one_line(last):
    """The one path every window is taken by refuses a ``last`` that is not "auto" or a positive
    count (``last=0`` took every source, ``-2`` dropped the oldest two, ``True`` took one)."""
    from hf_pma.merging.windows import apply_window

    with pytest.raises(ValueError, match="^last must be 'auto' or a positive number of snapshots"):
        apply_window(list(range(5)), last=last)
