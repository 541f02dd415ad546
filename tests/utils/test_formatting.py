"""The one number format and the one markdown table (pinned: every command prints through them)."""

from __future__ import annotations

import pytest

from hf_pma.utils.formatting import format_metric, format_number, markdown_table
from tests.helpers.output import markdown_rows


@pytest.mark.parametrize(
    "value, spec, expected",
    [
        (0.31204, None, "0.3120"),
        (12.3456789, None, "12.3457"),
        (999.99994, None, "999.9999"),
        (1234.56, None, "1,234.6"),
        (-1234.56, None, "-1,234.6"),
        (3, None, "3.0000"),
        (None, None, "-"),
        (float("nan"), None, "nan"),
        (float("inf"), ".3f", "inf"),
        (-0.0123, "+.4f", "-0.0123"),
        (0.02, "+.4f", "+0.0200"),
        (3000, ",", "3,000"),
        (0.000123456, ".3g", "0.000123"),
        ("stable", None, "stable"),
        (True, None, "True"),
    ],
)
def test_format_number(value, spec, expected):
    assert format_number(value, spec) == expected


def test_format_metric_with_and_without_stderr():
    assert format_metric(0.3125, 0.01404) == "0.3125 ± 0.0140"
    assert format_metric(0.3125) == "0.3125"
    assert format_metric(None, 0.1) == "-"
    assert format_metric(None, missing="–") == "–"


def test_markdown_table_pads_aligns_and_escapes():
    table = markdown_table(["metric", "a"], [["lm/loss", "4.1234"], ["x|y", "-"]])
    assert table.splitlines() == [
        "| metric  |      a |",
        "| :------ | -----: |",
        "| lm/loss | 4.1234 |",
        "| x\\|y    |      - |",
    ]
    assert markdown_rows(table) == [["metric", "a"], ["lm/loss", "4.1234"], ["x\\|y", "-"]]
    assert markdown_table(["a", "b"], [["1", "2"]], align="rl").splitlines()[1] == "| --: | :-- |"
    with pytest.raises(ValueError, match="2 cells"):
        markdown_table(["a", "b", "c"], [["1", "2"]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [["1", "2"]], align="lc")


def test_eval_and_sweep_print_a_metric_the_same_way():
    from hf_pma.analysis.sweep import BASELINE_LABEL, sweep_table
    from hf_pma.evaluation.evaluator import results_table

    value = 1234.5678
    results = {"lm": {"perplexity": 5.0, "loss": value}}
    eval_cell = markdown_rows(results_table({"m": results}))[2][1]
    report = {
        "metric": "lm/loss", "higher_is_better": False, "best": "sma N=2 k=1",
        "baseline": {"snapshot": "snapshot-2", "results": results, "value": value},
        "combinations": [{"label": "sma N=2 k=1", "snapshots": ["snapshot-1", "snapshot-2"], "results": results,
                          "delta": 0.0, "duplicate_of": None}],
    }
    rows = markdown_rows(sweep_table(report))
    assert rows[0][:3] == ["merge", "snapshots", "lm/loss"] and rows[1][0] == BASELINE_LABEL
    assert eval_cell == rows[1][2] == rows[2][2] == "1,234.6"
    assert rows[2][0] == "* sma N=2 k=1" and rows[2][3] == "+0.0000"


@pytest.mark.parametrize(
    "num_bytes, expected",
    [(512, "512 B"), (1536, "1.5 KiB"), (336_512, "328.6 KiB"), (2 * 2**30, "2.0 GiB"), (3 * 2**40, "3.0 TiB"), (None, "-")],
)
def test_format_bytes(num_bytes, expected):
    from hf_pma.utils.formatting import format_bytes

    assert format_bytes(num_bytes) == expected


def test_the_held_out_loss_says_it_is_per_token():
    from hf_pma.evaluation.evaluator import results_table
    from hf_pma.utils.formatting import metric_label

    assert metric_label("lm", "loss") == "loss (per token)"
    assert metric_label("lm", "perplexity") == "perplexity" and metric_label("t", "loss") == "loss"
    rows = markdown_rows(results_table({"m": {"lm": {"loss": 3.9, "perplexity": 49.4}}}))
    assert [row[0] for row in rows] == ["metric", "lm/loss (per token)", "lm/perplexity"]
