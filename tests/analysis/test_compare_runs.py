"""``hf-pma compare``: runs at matched tokens (last, merge, annealed), ranks, Kendall's tau, MAE,
the power-law fit, the explanation of a merge worse than its last snapshot, and every bad input
as one line before any evaluation."""

from __future__ import annotations

import json
import math
import zlib

import pytest
import torch

from hf_pma.analysis.compare_runs import (
    fit_power_law,
    kendall_tau,
    matched_tokens,
    mean_absolute_error,
    parse_x_values,
    plan_comparison,
    rank_runs,
)
from hf_pma.core.manifest import ANNEAL_RECORD_NAME
from hf_pma.evaluation.evaluator import evaluate_models
from hf_pma.merging.engine import merge_checkpoints
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.models import make_tiny_model, save_model_folder, train_tiny_tokenizer
from tests.helpers.snapshot_runs import float_params, noise_deviation, write_run

COUNT = 5  # snapshots per run, every 1000 tokens: 1000 ... 5000


def _texts() -> list[str]:
    text = sample_text(8000)
    return [text[i : i + 2000] for i in range(0, 8000, 2000)]


def _drifting(scale: float):
    """Snapshots far from the final weights early on, closer later: a merge over all of them
    reaches back over weights from before training settled (worse than the last snapshot)."""

    def deviation(i: int, name: str, base: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"drift/{i}/{name}".encode()))
        return scale * (COUNT - 1 - i) * torch.randn(base.shape, generator=g)

    return deviation


def _annealed(run, scale: float, end_tokens: int = COUNT * 1000) -> None:
    """``run/annealed/``: the runs' base weights plus noise of ``scale``, with its record."""
    model = make_tiny_model(seed=0)
    # Seeded by the run's place below its fixture's folder ("compare/a"), not its tmp path, which
    # changes from one pytest session to the next (and with it every value the tests compare).
    place = f"{run.parent.name.rstrip('0123456789')}/{run.name}"
    g = torch.Generator().manual_seed(zlib.crc32(place.encode()))
    with torch.no_grad():
        for p in float_params(model).values():
            p.add_(scale * torch.randn(p.shape, generator=g))
    save_model_folder(run / "annealed", model)
    record = {"start_tokens": end_tokens - 2000, "end_tokens": end_tokens, "decay_type": "linear"}
    (run / "annealed" / ANNEAL_RECORD_NAME).write_text(json.dumps(record))


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory, tiny_tokenizer):
    """Three runs (5 snapshots each, every 1000 tokens), each with an annealed model at 5000 tokens;
    run ``c`` drifts (its merge over all 5 snapshots is worse than its last snapshot)."""
    root = tmp_path_factory.mktemp("compare")
    runs = []
    for name, deviation, anneal in (
        ("a", noise_deviation(0.05, seed=1), 0.01),
        ("b", noise_deviation(0.15, seed=2), 0.05),
        ("c", _drifting(0.5), 0.1),
    ):
        run, _ = write_run(root / name, COUNT, deviation, tokenizer=tiny_tokenizer)
        _annealed(run, anneal)
        runs.append(run)
    eval_file = root / "heldout.jsonl"
    eval_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
    return root, runs, eval_file


@pytest.fixture(scope="module")
def compared(three_runs):
    """``hf-pma compare a b c --eval-file ... -o compare.json --fit params --x ...`` (run once)."""
    root, runs, eval_file = three_runs
    out = root / "compare.json"
    result = run_cli(
        "compare",
        *runs,
        "--eval-file",
        eval_file,
        "--block-size",
        "64",
        "-o",
        out,
        "--fit",
        "params",
        "--x",
        "a=1e6,b=3e6,c=1e7",
        "--last",
        str(COUNT),  # every snapshot: the mechanics (the automatic default: its own test)
        "-q",
    )
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text()), out


# ---------------------------------------------------------------- pure parts


def test_kendall_tau_and_mean_absolute_error_against_hand_computed_values():
    annealed = [2.9, 2.1, 1.2]
    # Same order as annealed: every pair concordant.
    assert kendall_tau([3.0, 2.0, 1.0], annealed)["tau"] == pytest.approx(1.0)
    # last: pairs (0,1) discordant, (0,2) and (1,2) concordant: (2 - 1) / 3.
    assert kendall_tau([2.0, 3.0, 1.0], annealed)["tau"] == pytest.approx(1 / 3)
    assert kendall_tau([1.0, 2.0, 3.0], annealed)["tau"] == pytest.approx(-1.0)
    assert kendall_tau([1.0], [2.0])["tau"] is None
    assert mean_absolute_error([3.0, 2.0, 1.0], annealed) == pytest.approx((0.1 + 0.1 + 0.2) / 3)
    assert mean_absolute_error([], []) is None
    assert rank_runs({"x": 2.0, "y": 1.0, "z": None, "w": 3.0}) == ["y", "x", "w"]
    assert rank_runs({"x": 0.2, "y": 0.4}, higher_is_better=True) == ["y", "x"]


def test_fit_recovers_a_known_power_law():
    xs = [1e5, 3e5, 1e6, 3e6, 1e7, 3e7]
    ys = [2.0 + 50.0 * x**-0.3 for x in xs]
    fit = fit_power_law(xs, ys)
    assert fit["E"] == pytest.approx(2.0, rel=1e-4)
    assert fit["A"] == pytest.approx(50.0, rel=1e-3)
    assert fit["alpha"] == pytest.approx(0.3, rel=1e-4)
    assert fit["points"] == 6 and fit["rmse"] < 1e-6
    # Too few distinct x, or a value that is not finite: one line, no exception.
    assert "(A and alpha: 3 distinct x values), got 2" in fit_power_law([1.0, 1.0, 2.0], [3.0, 3.0, 2.0])["error"]
    assert "not all finite" in fit_power_law([1.0, 2.0, 3.0], [1.0, math.nan, 2.0])["error"]


def test_matched_tokens_and_x_values():
    assert matched_tokens({"a": [1000, 2000, 3000], "b": [2000, 3000, 4000]}) == 3000
    assert matched_tokens({"a": [1000, 2000, 3000], "b": [2000, 3000]}, at_tokens=2000) == 2000
    # In library words (the command shows the parameter as --at-tokens).
    with pytest.raises(ValueError, match="^at_tokens 1,000: no snapshot at that token count in b: nearest 2,000"):
        matched_tokens({"a": [1000, 2000], "b": [2000, 3000]}, at_tokens=1000)
    with pytest.raises(ValueError, match="no token count at which every run has a snapshot"):
        matched_tokens({"a": [1000, 2000], "b": [1500, 2500]})
    assert parse_x_values("r1=1e6, r2=3000") == {"r1": 1e6, "r2": 3000.0}
    with pytest.raises(ValueError, match="^x_values 'r1=big': expected RUN=VALUE"):
        parse_x_values("r1=big")


# ---------------------------------------------------------------- three runs


def test_compare_three_runs(three_runs, compared):
    root, runs, eval_file = three_runs
    result, report, out = compared
    assert report["at_tokens"] == COUNT * 1000 and report["metric"] == "lm/loss"
    by = {e["name"]: e for e in report["runs"]}
    assert list(by) == ["a", "b", "c"]
    assert by["a"]["merge"]["window"] == COUNT and by["a"]["merge"]["window_origin"] == f"last={COUNT} (--last)"
    assert by["a"]["last"]["snapshot"] == "snapshot-5000"

    # The numbers equal the same models merged to disk and evaluated on their own.
    merged = merge_checkpoints(
        [runs[1] / "pma" / f"snapshot-{1000 * (i + 1)}" for i in range(COUNT)], root / "merged-b"
    )
    texts = [json.loads(line)["text"] for line in eval_file.read_text().splitlines()]
    separate = evaluate_models(
        [runs[1] / "pma" / "snapshot-5000", merged, runs[1] / "annealed"],
        tokenizer=runs[1],
        texts=texts,
        block_size=64,
        progress=False,
    )["results"]
    values = [r["lm"]["loss"] for r in separate.values()]
    assert [by["b"][k]["value"] for k in ("last", "merge", "annealed")] == pytest.approx(values, abs=1e-5)

    # Rankings, Kendall's tau and MAE, counted by hand from the report's own values.
    names = ["a", "b", "c"]
    vals = {k: [by[n][k]["value"] for n in names] for k in ("last", "merge", "annealed")}
    for kind in ("last", "merge", "annealed"):
        assert report["rankings"][kind] == sorted(names, key=lambda n: by[n][kind]["value"])

    def tau(x, y):
        pairs = [(i, j) for i in range(3) for j in range(i + 1, 3)]
        s = sum(math.copysign(1, (x[i] - x[j]) * (y[i] - y[j])) for i, j in pairs)
        return s / len(pairs)

    for kind in ("merge", "last"):
        found = report["agreement"][kind]
        assert found["kendall"]["tau"] == pytest.approx(tau(vals[kind], vals["annealed"]))
        assert found["mae"] == pytest.approx(
            sum(abs(a - b) for a, b in zip(vals[kind], vals["annealed"])) / 3
        )
    # The paired comparison of each run (hf_pma.analysis.comparison): the merge's mean per-document
    # difference from the last snapshot, with its standard error, and the share of the annealing gain.
    for n in names:
        record, paired = by[n]["comparison"], by[n]["merge"]["paired"]
        models = record["models"]
        assert record["documents"] == paired["documents"] == 4 and record["tokens"] == COUNT * 1000
        assert paired["diff"] == pytest.approx(models["PMA merge"]["loss"] - models["last snapshot"]["loss"])
        assert paired["stderr"] > 0 and by[n]["annealed"]["paired"]["stderr"] > 0
        assert models["last snapshot"]["per_token_loss"] == pytest.approx(by[n]["last"]["value"])
        assert by[n]["annealing_gain_recovered"] == record["annealing_gain_recovered"]

    # Run c's merge reaches back over weights far from its last: worse, explained, with a smaller window tried.
    worse = by["c"]["merge_worse"]
    assert by["a"]["merge_worse"] is None and worse is not None
    # the window's share said as the automatic window says it: from its oldest snapshot to its newest
    assert "reaches back 4,000 tokens, 80% of the 5,000 tokens at which the runs are matched" in worse["explanation"]
    assert "training loss was 4.000 at its oldest snapshot" in worse["explanation"]
    assert [t["label"] for t in worse["smaller_windows"]] == ["sma N=2 k=1"]
    assert worse["pick"]["label"] in ("last snapshot", "sma N=2 k=1")
    assert "hf-pma sweep" in worse["sweep_command"] and "--window 2,5" in worse["sweep_command"]

    # The fit across runs (x given per run) and its plot.
    assert report["fit"]["x"] == "params" and {"E", "A", "alpha"} <= set(report["fit"]["merge"])
    assert [e["x"] for e in report["runs"]] == [1e6, 3e6, 1e7]
    assert out.with_suffix(".png").stat().st_size > 1000
    # The printed table: one row per run, the agreement line, the explanation.
    assert "| a " in result.stdout and "Against annealed (3 runs): merge Kendall's tau" in result.stdout
    # 3 runs: tau's caveat; 3 distinct x: the fit of A and alpha only, said so.
    assert "Caveat: over 3 runs even tau = 1 has p = 0.33" in result.stdout
    assert report["fit"]["merge"]["fixed"] == ["E"] and "E fixed at 0: 3 distinct x are too few" in result.stdout
    assert "c: the merge is worse than the last snapshot" in result.stdout


def test_task_results_reach_the_printed_table(compared):
    """``compare --tasks``: each model's task metrics are printed, not only written to the JSON
    (the report of the real comparison, with a task's results as lm-eval's flat form gives them)."""
    import copy

    from hf_pma.analysis.compare_runs import compare_table

    _, report, _ = compared
    assert "py_syntax" not in compare_table(report)  # no tasks: the table as before
    with_tasks = copy.deepcopy(report)
    with_tasks["tasks"] = ["py_syntax"]
    for n, e in enumerate(with_tasks["runs"]):
        for k, kind in enumerate(("last", "merge", "annealed")):
            e[kind]["results"]["py_syntax"] = {"acc": 0.25 + 0.1 * n + 0.01 * k, "acc_stderr": 0.05}
    printed = compare_table(with_tasks)
    row = next(line for line in printed.splitlines() if line.startswith("| py_syntax/"))
    assert "0.4500 ± 0.0500" in row and row.count("±") == 9  # run c's last; 3 runs x 3 models
    header = next(line for line in printed.splitlines() if line.startswith("| metric"))
    assert "a last" in header and "c annealed" in header


def test_compare_annealed_at_other_tokens_is_left_out_and_last_window(three_runs):
    """At 3000 tokens no annealed model ends there: left out, said, no agreement; --last 2 merges 2."""
    root, runs, eval_file = three_runs
    at, plans = plan_comparison(runs, at_tokens=3000, last=2)
    assert at == 3000 and [p.last.name for p in plans] == ["snapshot-3000"] * 3
    assert all(p.annealed is None and "ends at 5,000 tokens, not at 3,000" in p.annealed_note for p in plans)
    assert [s.name for s in plans[0].merge_sources] == ["snapshot-2000", "snapshot-3000"]
    at, plans = plan_comparison(runs, window_tokens=2000)
    assert [s.name for s in plans[0].merge_sources] == ["snapshot-4000", "snapshot-5000"]
    assert plans[0].annealed is not None


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing evaluated


@pytest.fixture(scope="module")
def odd_runs(three_runs, tiny_tokenizer):
    root, runs, _ = three_runs
    offset, _ = write_run(root / "offset", 3, noise_deviation(0.05), tokenizer=tiny_tokenizer, interval=1300)
    other_tok, _ = write_run(
        root / "other-tok", 3, noise_deviation(0.05), tokenizer=train_tiny_tokenizer(400)
    )
    return {"offset": offset, "other-tok": other_tok, "model": runs[0] / "annealed"}


@pytest.mark.parametrize(
    "case, message",
    [
        ("one run", "compare needs at least two runs, got 1"),
        ("no common tokens", "no token count at which every run has a snapshot"),
        ("no snapshot there", "--at-tokens 2,500: no snapshot at that token count in a: nearest 2,000"),
        ("different tokenizers", "runs a and other-tok have different tokenizers"),
        ("no snapshots", "run annealed holds no snapshots"),
        ("no eval file", "nothing to evaluate: give --eval-file and/or --tasks"),
        ("missing eval file", "document source"),
        ("fit without distinct x", "--fit params needs at least 3 runs with distinct x values, got 1"),
        ("x of an unknown run", "--x names zz, which is not one of the runs"),
        ("last too long", "--last 7: run a has only 5 snapshot(s)"),
        ("run twice", "is given twice"),
        ("group key not recorded", "--group 'seed': run a records no 'seed' (in its pma/merged/pma_training.json"),
        ("bad bootstrap", "--bootstrap must be a non-negative integer, got -1"),
        ("bad bootstrap seed", "--bootstrap-seed must be a non-negative integer, got -3"),
    ],
)
def test_bad_input_is_one_line_before_any_evaluation(three_runs, odd_runs, case, message):
    root, (a, b, c), eval_file = three_runs
    out = root / f"bad-{case.replace(' ', '-')}.json"
    args = {
        "one run": [a],
        "no common tokens": [a, odd_runs["offset"]],
        "no snapshot there": [a, b, "--at-tokens", "2500"],
        "different tokenizers": [a, odd_runs["other-tok"]],
        "no snapshots": [a, odd_runs["model"]],
        "no eval file": [a, b, "--no-eval", None],
        "missing eval file": [a, b, "--eval-file", root / "missing.txt"],
        "fit without distinct x": [a, b, c, "--fit", "params"],
        "x of an unknown run": [a, b, c, "--fit", "params", "--x", "a=1,b=2,zz=3"],
        "last too long": [a, b, "--last", "7"],
        "run twice": [a, a],
        "group key not recorded": [a, b, "--group", "seed"],
        "bad bootstrap": [a, b, "--bootstrap", "-1"],
        "bad bootstrap seed": [a, b, "--bootstrap-seed", "-3"],
    }[case]
    if "--no-eval" in args:
        args = args[:2]
    elif "--eval-file" not in args:
        args = [*args, "--eval-file", eval_file]
    result = run_cli("compare", *args, "-o", out)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("hf-pma compare: error: ") and result.stderr.count("\n") == 1, (
        result.stderr
    )
    assert message in result.stderr
    assert not out.exists() and "Held-out LM" not in result.stderr


# ---------------------------------------------------------------- under accelerate launch


@pytest.mark.distributed
@pytest.mark.shared_launch("world2")  # the `compare` scenario of tests/dist/scenarios.py
def test_compare_under_accelerate_launch_evaluates_on_the_main_process_only(shared_launch):
    out = shared_launch("world2", "compare")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["code"] for r in ranks] == [0, 0] and ranks[0]["world_size"] == 2
    # 3 runs x (last, merge, annealed) and the window check's 3 candidates each: all on rank 0.
    assert ranks[0]["evaluations"] >= 9 + 6 and ranks[1]["evaluations"] == 0
    assert "Against annealed (3 runs)" in ranks[0]["stdout"] and ranks[1]["stdout"] == ""
    assert "Automatic windows checked on 5 of the 20 held-out documents" in ranks[0]["stdout"]
    report = json.loads((out / "compare.json").read_text())
    assert [e["name"] for e in report["runs"]] == ["a", "b", "c"] and report["at_tokens"] == 5000
    assert all(e["annealed"]["value"] is not None for e in report["runs"])
    assert all(e["merge"]["window_choice"]["checked"]["documents"] == 5 for e in report["runs"])
    assert all(len(e["last"]["per_text"]["nll"]) == 15 for e in report["runs"])


def test_a_window_given_in_python_is_described_with_its_parameter():
    """compare_runs(last=..., window_tokens=...) called from Python: the merge's window_origin
    names the parameter (``last=3 (--last)``), not only the flag of ``hf-pma compare``."""
    from pathlib import Path

    from hf_pma.analysis.compare_runs import _plan_window
    from hf_pma.merging.checkpoint_source import CheckpointSource

    sources = [CheckpointSource(Path(f"s{i}"), "", [], tokens=1000 * i) for i in range(1, 6)]
    *_, origin, _choice = _plan_window(sources, "sma", 0.2, 3, None, None, "a")
    assert origin == "last=3 (--last)"
    *_, origin, _choice = _plan_window(sources, "sma", 0.2, None, 2000, None, "a")
    assert origin == "window_tokens=2,000 (--window-tokens)"


# ---------------------------------------------------------------- groups, ties, tau's interval and caveat


def _record_settings(run, **settings) -> None:
    """The run's training record, with the settings PMATrainer writes there (``seed``, ``learning_rate``)."""
    merged = run / "pma" / "merged"
    merged.mkdir(parents=True)
    (merged / "pma_training.json").write_text(json.dumps({"log_history": [], **settings}))


@pytest.fixture(scope="module")
def grouped(three_runs, tiny_tokenizer, tmp_path_factory):
    """Five runs in two seeds: a, b (seed 1), c, d and twin (seed 2); twin is a copy of a (the
    same snapshots and annealed model), so a and twin tie in every ranking. Compared with
    ``--group seed --bootstrap 200``, with ``--fit params`` over 4 distinct x."""
    import shutil

    root = tmp_path_factory.mktemp("grouped")
    _, (a, b, _c), eval_file = three_runs
    runs = {"a": root / "a", "b": root / "b"}
    shutil.copytree(a, runs["a"])
    shutil.copytree(b, runs["b"])
    shutil.copytree(a, root / "twin")
    runs["twin"] = root / "twin"
    for name, seed in (("c", 3), ("d", 4)):
        runs[name], _ = write_run(root / name, COUNT, noise_deviation(0.1, seed=seed), tokenizer=tiny_tokenizer)
        _annealed(runs[name], 0.02 * seed)
    for name, seed in (("a", 1), ("b", 1), ("c", 2), ("d", 2), ("twin", 2)):
        _record_settings(runs[name], seed=seed, learning_rate=3e-3)
    out = root / "compare.json"
    order = [runs[n] for n in ("a", "b", "c", "d", "twin")]
    result = run_cli(
        "compare", *order, "--eval-file", eval_file, "--block-size", "64", "-o", out, "--group", "seed",
        "--bootstrap", "200", "--bootstrap-seed", "5", "--fit", "params", "--x", "a=1e6,b=3e6,c=1e7,d=3e7,twin=1e8",
        "--last", str(COUNT),
        "--no-plot", "-q",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())


def test_compare_ranks_within_groups_with_shared_ranks_for_ties(grouped):
    result, report = grouped
    by = {e["name"]: e for e in report["runs"]}
    groups = {g["label"]: g for g in report["groups"]}
    assert list(groups) == ["seed=1", "seed=2"]
    assert groups["seed=1"]["runs"] == ["a", "b"] and groups["seed=2"]["runs"] == ["c", "d", "twin"]
    assert by["c"]["group"] == {"label": "seed=2", "values": {"seed": 2}}
    for group in groups.values():
        for kind in ("last", "merge", "annealed"):
            # Ranked by the group's own values, 1 = the lowest loss.
            values = {n: by[n][kind]["value"] for n in group["runs"]}
            assert group["ranks"][kind] == {n: 1 + sum(v < values[n] for v in values.values()) for n in values}
    # a and twin hold the same weights: equal values, one shared rank, one tier, printed "a = twin".
    for kind in ("last", "merge", "annealed"):
        assert by["a"][kind]["value"] == by["twin"][kind]["value"]
        assert report["ranks"][kind]["a"] == report["ranks"][kind]["twin"]
        assert any(set(tier) == {"a", "twin"} for tier in report["tiers"][kind])
    lines = result.stdout.splitlines()
    overall = [line for line in lines if line.startswith("  Ranking by last:")][-1]
    assert "a = twin" in overall and "a > twin" not in overall and "twin > a" not in overall
    # The groups' sections, each with its agreement; a tau over 2 runs says what it cannot show.
    start = lines.index("Group seed=1 (2 runs):")
    section = lines[start : lines.index("Group seed=2 (3 runs):")]
    assert any("Against annealed (2 runs)" in line for line in section)
    assert any("over 2 runs tau is +1 or -1 by construction" in line for line in section)
    assert groups["seed=1"]["agreement"]["merge"]["kendall"]["caveat"].startswith("over 2 runs")
    assert "| rank last / merge / annealed (in group) |" in lines[0].replace("  ", " ")


def test_compare_tau_has_the_bootstrap_interval_of_its_runs_documents(grouped):
    from scipy.stats import kendalltau

    from hf_pma.analysis.rank_stats import bootstrap_kendall_tau

    _, report = grouped
    by = {e["name"]: e for e in report["runs"]}
    group = next(g for g in report["groups"] if g["label"] == "seed=2")
    assert group["agreement"]["runs"] == ["c", "d", "twin"]
    assert report["agreement"]["runs"] == ["a", "b", "c", "d", "twin"]
    for agreement in (group["agreement"], report["agreement"]):
        names = agreement["runs"]
        for kind in ("merge", "last"):
            kendall = agreement[kind]["kendall"]
            pred, ann = [by[n][kind]["value"] for n in names], [by[n]["annealed"]["value"] for n in names]
            assert kendall["tau"] == pytest.approx(kendalltau(pred, ann, variant="b").statistic)
            # The interval is the bootstrap of exactly these runs' per-document losses, with the seed given.
            expected = bootstrap_kendall_tau(
                [(by[n][kind]["per_text"]["nll"], by[n][kind]["per_text"]["tokens"]) for n in names],
                [(by[n]["annealed"]["per_text"]["nll"], by[n]["annealed"]["per_text"]["tokens"]) for n in names],
                resamples=200,
                seed=5,
            )
            assert kendall["interval"] == expected and expected["documents"] == 4 and expected["defined"] > 100
            assert expected["low"] <= expected["high"]
            # The per-document losses give back the value compared (loss per token over all documents).
            per_text = by[names[0]][kind]["per_text"]
            assert sum(per_text["nll"]) / sum(per_text["tokens"]) == pytest.approx(by[names[0]][kind]["value"])
    # Over all five runs merge and last have intervals of their own (so the check above tells them apart).
    intervals = [report["agreement"][k]["kendall"]["interval"] for k in ("merge", "last")]
    assert (intervals[0]["low"], intervals[0]["high"]) != (intervals[1]["low"], intervals[1]["high"])
    assert report["bootstrap"] == {"resamples": 200, "seed": 5}


def test_compare_fit_over_four_distinct_x_fits_three_parameters(grouped):
    result, report = grouped
    for kind in ("last", "merge", "annealed"):
        fit = report["fit"][kind]
        assert fit["distinct_x"] == 5 and fit["parameters"] == 3 and fit["fixed"] == []
        for flag in fit["flags"]:  # each flag printed under its fit
            assert f"FLAG: {flag}" in result.stdout


def test_recorded_settings_come_from_the_training_record_then_the_model_config(tmp_path):
    """What --group reads: the training record's scalars win over the model config's; a record
    that is not an object, or one reached through a link out of the run, is one line naming it."""
    from hf_pma.analysis.run_settings import group_runs, recorded_settings
    from hf_pma.merging.sources import resolve_sources

    run, _ = write_run(tmp_path / "run", 2, noise_deviation(0.05))
    last = resolve_sources([run])[-1]
    settings = recorded_settings(run, last)
    assert settings["model_type"] and settings["hidden_size"] > 0 and "seed" not in settings
    _record_settings(run, seed=7, hidden_size=-1, log=[1, 2])
    settings = recorded_settings(run, last)
    assert settings["seed"] == 7 and settings["hidden_size"] == -1 and "log" not in settings  # scalars only
    groups = group_runs({"a": {"seed": 1, "lr": 0.1}, "b": {"seed": 2, "lr": 0.1}, "c": {"seed": 1, "lr": 0.2}}, ["seed"])
    assert [(g["label"], g["runs"]) for g in groups] == [("seed=1", ["a", "c"]), ("seed=2", ["b"])]
    with pytest.raises(ValueError, match="^group 'lr': run b records no 'lr'"):
        group_runs({"a": {"lr": 0.1}, "b": {}}, ["lr"])
    record = run / "pma" / "merged" / "pma_training.json"
    record.write_text("[1, 2]")
    with pytest.raises(ValueError, match="pma_training.json: expected a JSON object"):
        recorded_settings(run, last)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"seed": 3}))
    record.unlink()
    record.symlink_to(outside)
    with pytest.raises(ValueError) as err:
        recorded_settings(run, last)
    assert "pma_training.json" in str(err.value) and "\n" not in str(err.value)


def test_without_a_window_each_run_gets_the_automatic_one_with_its_reason(three_runs):
    """No --last, no --window-tokens and no window recorded: each run's merge is the automatic
    window chosen from its own records (here the loss still falls: the last snapshot alone)."""
    from hf_pma.analysis.compare_runs import plan_comparison

    _, runs, _ = three_runs
    _, plans = plan_comparison(runs)
    for plan in plans:
        assert plan.window_choice is not None and plan.merge_indices == [COUNT - 1]
        assert plan.window_origin.startswith("auto window: the last snapshot alone") and "(the default)" in plan.window_origin
    _, plans = plan_comparison(runs, last="auto")
    assert all("(--last auto)" in plan.window_origin for plan in plans)
    with pytest.raises(ValueError, match="^last must be 'auto' or a positive number of snapshots"):
        plan_comparison(runs, last="ten")


@pytest.fixture(scope="module")
def checked_runs(tmp_path_factory, tiny_tokenizer):
    """Two runs whose recorded losses are flat (the rule takes the newest 2: the cap) and 20
    held-out documents: ``noisy`` (independent noise per snapshot: averaging helps) and ``drift``
    (the older snapshot far off: the merge of 2 is worse than the last snapshot)."""
    root = tmp_path_factory.mktemp("window-check")
    runs = []
    for name, deviation in (("noisy", noise_deviation(0.15, seed=3)), ("drift", _drifting(0.5))):
        run, _ = write_run(root / name, COUNT, deviation, tokenizer=tiny_tokenizer, losses=[4.0] * COUNT)
        runs.append(run)
    text = sample_text(16_000)
    documents = [text[i : i + 800] for i in range(0, 16_000, 800)]
    assert len(documents) == 20
    eval_file = root / "heldout.jsonl"
    eval_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    return root, runs, eval_file, documents


def test_the_automatic_window_is_checked_on_selection_documents_never_reported(checked_runs):
    """With 20 held-out documents, every 4th (5) checks each automatic window, its smaller
    candidates and the wider ones within half the run; the results are on the other 15 only: the
    drifting run's window of 2 is overruled by the last snapshot, the noisy run's by a wider one
    (independent noise: the more snapshots, the less of it)."""
    root, runs, eval_file, documents = checked_runs
    out = root / "checked.json"
    args = ["compare", *runs, "--eval-file", eval_file, "--block-size", "64", "--bootstrap", "0", "-q"]
    result = run_cli(*args, "-o", out)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["window_check"] == {"selection_documents": 5, "report_documents": 15, "every": 4, "skipped": None}
    assert "Automatic windows checked on 5 of the 20 held-out documents" in result.stdout
    noisy, drift = report["runs"]
    checked = noisy["merge"]["window_choice"]["checked"]
    assert (checked["rule"], checked["rule_count"]) == ("cap", 2)
    # 1.5 x 2 = 3 (tokens 3,000 to 5,000: 40% of the run) is tried; 2 x 2 would span 60%: it is not
    assert set(checked["against_last"]) == {"3", "2"}
    assert checked["against_last"]["3"] < checked["against_last"]["2"] < 0
    assert noisy["merge"]["window"] == 3 and noisy["merge"]["window_choice"]["rule"] == "held-out"
    assert noisy["merge"]["window_choice"]["reason"].startswith("tokens 3,000 to 5,000 (40% of the run): the best on 5")
    assert drift["merge"]["window"] == 1 and drift["merge"]["window_choice"]["rule"] == "held-out"
    assert drift["merge"]["window_choice"]["checked"]["against_last"]["2"] > 0
    assert "the last snapshot does best" in drift["merge"]["window_origin"]
    # what chose each window is named: the check where it overruled the rule, the rule where it stood
    assert drift["merge"]["window_origin"].endswith("(compare's held-out check)")
    assert noisy["merge"]["window_origin"].endswith("(compare's held-out check)")
    # Each automatic window is said in one line, with why.
    assert "\ndrift: auto window: the last snapshot alone: " in result.stdout
    assert "\nnoisy: auto window: the newest 3 snapshots, WMA (" in result.stdout
    # Every reported number is on the 15 report documents: the last snapshot's loss is its loss there.
    report_docs = [d for i, d in enumerate(documents) if i % 4 != 3]
    for entry, run in zip(report["runs"], runs):
        assert len(entry["last"]["per_text"]["nll"]) == 15
        direct = evaluate_models(
            [run / "pma" / entry["last"]["snapshot"]], texts=report_docs, block_size=64, progress=False
        )
        assert entry["last"]["value"] == pytest.approx(direct["results"][entry["last"]["snapshot"]]["lm"]["loss"])

    unchecked = root / "unchecked.json"
    result = run_cli(*args, "--no-window-check", "-o", unchecked)
    assert result.returncode == 0, result.stderr
    report = json.loads(unchecked.read_text())
    assert report["window_check"] is None and "Automatic windows" not in result.stdout
    assert [e["merge"]["window"] for e in report["runs"]] == [2, 2]
    assert all(len(e["last"]["per_text"]["nll"]) == 20 for e in report["runs"])


def test_too_few_documents_leave_the_window_unchecked_and_say_so(checked_runs):
    root, runs, eval_file, _ = checked_runs
    few = root / "few.jsonl"
    few.write_text("".join(eval_file.read_text().splitlines(keepends=True)[:12]))
    out = root / "few.json"
    result = run_cli("compare", *runs, "--eval-file", few, "--block-size", "64", "--bootstrap", "0", "-q", "-o", out)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["window_check"]["skipped"].startswith("12 held-out document(s)")
    assert "Automatic windows unchecked: 12 held-out document(s)" in result.stdout
    assert [e["merge"]["window"] for e in report["runs"]] == [2, 2]


def test_selection_documents_without_text_leave_the_window_unchecked(checked_runs):
    """Every 4th held-out document empty: no selection split, said so, every document reports."""
    from hf_pma.analysis.compare_runs import compare_runs, compare_table, plan_comparison

    _, runs, _, documents = checked_runs
    at_tokens, plans = plan_comparison(runs)
    empty = ["" if i % 4 == 3 else d for i, d in enumerate(documents)]
    report = compare_runs(at_tokens, plans, empty, block_size=64, bootstrap=0)
    assert report["window_check"]["skipped"] == "every selection document (every 4th) is empty"
    assert "Automatic windows unchecked: every selection document (every 4th) is empty." in compare_table(report)
    assert [e["merge"]["window"] for e in report["runs"]] == [2, 2]
    assert report["window_check"]["report_documents"] == 20  # every document reports (the empty ones have no loss)


def test_too_few_selection_documents_with_text_leave_the_window_unchecked(checked_runs):
    """20 held-out documents whose selection documents hold text in only 1 of 5 (the others
    empty): a check on 1 document is too noisy to overrule the rule (fewer than
    MIN_SELECTION_DOCUMENTS), so none is made, said so, and every document reports."""
    from hf_pma.analysis.compare_runs import compare_runs, compare_table, plan_comparison

    _, runs, _, documents = checked_runs
    at_tokens, plans = plan_comparison(runs)
    sparse = ["" if i in (3, 7, 11, 15) else d for i, d in enumerate(documents)]
    report = compare_runs(at_tokens, plans, sparse, block_size=64, bootstrap=0)
    skipped = "only 1 of the 5 selection documents (every 4th) with text; a check needs at least 5"
    assert report["window_check"]["skipped"] == skipped
    assert f"Automatic windows unchecked: {skipped}." in compare_table(report)
    assert [e["merge"]["window"] for e in report["runs"]] == [2, 2]
    assert all(e["merge"]["window_choice"]["checked"] is None for e in report["runs"])
    # Every document with text reports.
    assert all(len(e["last"]["per_text"]["nll"]) == 16 for e in report["runs"])


def test_report_documents_without_text_leave_the_window_unchecked(checked_runs):
    """Only the selection documents (every 4th) hold text: a split would leave nothing to report
    on (an error after every candidate was evaluated), so none is made, said so, and every
    document reports."""
    from hf_pma.analysis.compare_runs import compare_runs, compare_table, plan_comparison

    _, runs, _, documents = checked_runs
    at_tokens, plans = plan_comparison(runs)
    selection_only = [d if i % 4 == 3 else "" for i, d in enumerate(documents)]
    report = compare_runs(at_tokens, plans, selection_only, block_size=64, bootstrap=0)
    skipped = "every report document (all but every 4th) is empty"
    assert report["window_check"]["skipped"] == skipped
    assert f"Automatic windows unchecked: {skipped}." in compare_table(report)
    assert [e["merge"]["window"] for e in report["runs"]] == [2, 2]


def test_a_held_out_text_that_is_no_string_is_one_line_before_any_model(checked_runs, monkeypatch):
    """From Python, a document that is not a string is refused in one line naming it, before any
    model is loaded (the selection split reads every document's text first)."""
    from hf_pma.analysis import sweep
    from hf_pma.analysis.compare_runs import compare_runs, plan_comparison

    _, runs, _, documents = checked_runs
    at_tokens, plans = plan_comparison(runs)
    monkeypatch.setattr(sweep, "SweepEvaluator", None)  # any model work fails otherwise
    texts = [*documents[:3], None, *documents[4:]]
    with pytest.raises(TypeError, match=r"^texts\[3\] is a NoneType, not a string$"):
        compare_runs(at_tokens, plans, texts, block_size=64, bootstrap=0)
