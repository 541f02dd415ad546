"""The numbers that README.md and docs/quickstart.md quote about the default run are those of
``scripts/configs/tiny.yaml``: model size, vocabulary, V, schedule, steps, LR, batch; and N, the
window its merge chose automatically, that of the default run's merge record committed in
``benchmarks/results/default_run/pma_merge.json``. The README is read on GitHub, so it is checked
here rather than generated at build time."""

from __future__ import annotations

import inspect
import json
import math
import re
import statistics

import pytest
import yaml

from hf_pma.core.window_choice import MAX_SHARE, TREND_LIMIT, TREND_STRATEGY
from tests.helpers.repo import REPO_ROOT, load_pretrain_script, load_script

CONFIG = yaml.safe_load((REPO_ROOT / "scripts" / "configs" / "tiny.yaml").read_text())
# The default run's merge, as the run recorded it (its window is chosen automatically).
MERGE = json.loads((REPO_ROOT / "benchmarks" / "results" / "default_run" / "pma_merge.json").read_text())
WINDOW = MERGE["num_sources"]
PAGES = ("README.md", "docs/quickstart.md")
# Pages whose commands and paths name the default run's folders (runs/pma-tiny/...).
RUN_PAGES = (
    "README.md",
    "docs/quickstart.md",
    "docs/evaluation.md",
    "docs/analysis.md",
    "docs/merging.md",
    "docs/publishing.md",
)
CONSTANT = CONFIG["lr_scheduler_type"] in ("constant", "constant_with_warmup")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


class _Vocabulary:
    """What the script's build_model reads of a tokenizer: its length and special token ids."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return CONFIG["vocab_size"]


def _parameters_in_millions(monkeypatch) -> str:
    script = load_pretrain_script(monkeypatch)
    model_args = script.ModelArguments(
        config_overrides=CONFIG["config_overrides"], vocab_size=CONFIG["vocab_size"]
    )
    model = script.build_model(model_args, _Vocabulary(), CONFIG["block_size"])
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}"


def _overrides() -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in CONFIG["config_overrides"].split(","))}


TOKENS_PER_STEP = CONFIG["per_device_train_batch_size"] * CONFIG["block_size"]
TOTAL_TOKENS = CONFIG["max_steps"] * TOKENS_PER_STEP

# (what, pattern, what every match must read, per group); each must match somewhere in PAGES.
CHECKS = [
    ("V", r"snapshot every ([\d,]+) tokens", [CONFIG["pma_interval_tokens"]]),
    (
        "V in steps",
        r"snapshot every [\d,]+ tokens \((\d+) steps",
        [CONFIG["pma_interval_tokens"] // TOKENS_PER_STEP],
    ),
    ("N", r"(?:merges|merge of|SMA of) the last (\d+)", [WINDOW]),
    ("steps and batch", r"for ([\d,]+) steps of ([\d,]+) tokens", [CONFIG["max_steps"], TOKENS_PER_STEP]),
    ("warmup", r"(\d+) warmup steps", [CONFIG["warmup_steps"]]),
    ("tokens in all", r"same ([\d,]+) tokens", [TOTAL_TOKENS]),
    ("anneal", r"annealed over its last (\d+) steps", [CONFIG["anneal_steps"]]),
    ("anneal (steps)", r"decayed linearly to 0 over (\d+) steps", [CONFIG["anneal_steps"]]),
    ("keep_last", r"the newest (\d+) kept", [CONFIG["pma_keep_last"]]),
    ("vocabulary", r"BPE tokenizer \(([\d,]+) tokens\)", [CONFIG["vocab_size"]]),
    ("block size", r"(\d+)-token blocks", [CONFIG["block_size"]]),
    ("tokens of the run", r"(?:same|at) ([\d,]+) tokens", [TOTAL_TOKENS]),
    ("last step", r"step ([\d,]+)\)", [CONFIG["max_steps"]]),
    (
        "merge span",
        r"steps (\d+)(?:-| to )([\d,]+)",
        [
            CONFIG["max_steps"]
            - (WINDOW - 1) * CONFIG["pma_interval_tokens"] // TOKENS_PER_STEP,
            CONFIG["max_steps"],
        ],
    ),
    ("fork", r"at step (\d+)", [CONFIG["max_steps"] - CONFIG["anneal_steps"]]),
    ("anneal tokens", r"over the last ([\d,]+) tokens", [CONFIG["anneal_steps"] * TOKENS_PER_STEP]),
    (
        "layers and width",
        r"(\d+)-layer Llama \(hidden size (\d+)",
        [_overrides()["num_hidden_layers"], _overrides()["hidden_size"]],
    ),
]


def _text() -> dict[str, str]:
    return {page: " ".join((REPO_ROOT / page).read_text().split()) for page in PAGES}  # line breaks as spaces


@pytest.mark.parametrize("what, pattern, expected", CHECKS, ids=[c[0] for c in CHECKS])
def test_numbers_quoted_about_the_default_run_match_tiny_yaml(what, pattern, expected):
    found = [(page, m.groups()) for page, text in _text().items() for m in re.finditer(pattern, text)]
    assert found, f"{what}: no {pattern!r} in {PAGES}: update this check with the docs"
    wrong = [(page, groups) for page, groups in found if [_int(g) for g in groups] != expected]
    assert not wrong, f"{what}: {wrong} in the docs, {expected} in scripts/configs/tiny.yaml"


def test_model_size_and_learning_rate_match_tiny_yaml(monkeypatch):
    millions = _parameters_in_millions(monkeypatch)
    texts = _text()
    sizes = [
        (page, m.group(1))
        for page, text in texts.items()
        for m in re.finditer(r"(\d+\.\d+)M[- ]parameter", text)
    ]
    assert {page for page, _ in sizes} == set(PAGES)  # every page says the size
    assert all(size == millions for _, size in sizes), (sizes, millions)
    rates = [
        (page, m.group(1))
        for page, text in texts.items()
        for m in re.finditer(r"constant (?:LR )?(\d+(?:\.\d+)?e-\d+)", text)
    ]
    assert rates and all(float(rate) == CONFIG["learning_rate"] for _, rate in rates), rates


def test_schedule_matches_tiny_yaml():
    for page, text in _text().items():
        intro = text[text.index("pre-trains a") :][:400]  # the sentence that describes the default run
        assert ("constant learning rate" in intro) == CONSTANT, (page, intro)
        for name in re.findall(r"`(constant_with_warmup|constant|warmup_stable_decay|linear|cosine)`", intro):
            assert name == CONFIG["lr_scheduler_type"], (page, name)
        if CONSTANT:
            assert "warmup-stable-decay schedule" not in text, page


def _benchmark_tables_hook():
    return load_script("docs/hooks/benchmark_tables.py")


def test_gpu_numbers_quoted_in_the_docs_are_those_of_the_committed_gpu_check():
    """docs quote the GPU check's blocked times in prose; the tables themselves are rendered from
    benchmarks/results/gpu_check/ by a docs hook."""
    import json

    results = json.loads((REPO_ROOT / "benchmarks" / "results" / "gpu_check" / "results.json").read_text())
    costs, interval_ms = results["train"]["pma"]["costs"], results["train"]["interval_ms"]
    first, steady = round(costs["blocked_first_ms"]), round(costs["blocked_steady_ms"])
    share = round(100 * costs["blocked_steady_ms"] / interval_ms)
    choosing = " ".join((REPO_ROOT / "docs" / "choosing-v.md").read_text().split())
    assert (
        f"blocked training for {first} ms at its first snapshot and {steady} ms at each later one" in choosing
    )
    assert (
        f"a snapshot every {interval_ms / 1000:.1f} s looked like a third of the training time; it was {share}%"
        in choosing
    )
    benchmarks = " ".join((REPO_ROOT / "docs" / "benchmarks.md").read_text().split())
    assert (
        f"{steady} ms per snapshot of a 110M-parameter model, {share}% of the {interval_ms / 1000:.1f} s"
        in benchmarks
    )
    assert results["train"]["parameters"] // 10**6 == 109  # "110M": 109.5M


def test_the_docs_hook_renders_the_committed_result_tables():
    hook = _benchmark_tables_hook()
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    markers = hook.MARKER.findall(page)
    assert "gpu_check/results.md" in markers and "gpu_check/interval30/results.md" in markers
    table = hook.results_tables("gpu_check/results.md")
    assert table.startswith("| check") and "| bf16 step time, PMACallback" in table
    rendered = hook.on_page_markdown(page)
    assert "<!-- hf-pma-table" not in rendered and table in rendered
    for bad in ("gpu_check/missing.md", "../../README.md"):
        with pytest.raises(ValueError, match="no such file under benchmarks/results/"):
            hook.results_tables(bad)


def test_the_default_runs_paths_in_the_docs_exist_in_it():
    """``runs/pma-tiny/pma/snapshot-N`` names the default run's last snapshot (the run ends at
    max_steps x tokens per step, on a multiple of V); every output folder is the configured one."""
    assert TOTAL_TOKENS % CONFIG["pma_interval_tokens"] == 0
    found = []
    for page in RUN_PAGES:
        text = (REPO_ROOT / page).read_text()
        found += [(page, int(n)) for n in re.findall(r"runs/pma-tiny/pma/snapshot-(\d+)", text)]
        assert "runs/tiny" not in text and "snapshot-1048576" not in text, page
        assert all(name == CONFIG["output_dir"] for name in re.findall(r"\b(runs/pma-[\w-]+)", text)), page
    assert found and all(n == TOTAL_TOKENS for _, n in found), found


def test_the_evaluation_page_says_how_much_of_each_held_out_file_the_default_run_scores():
    text = " ".join((REPO_ROOT / "docs" / "evaluation.md").read_text().split())
    quoted = re.findall(r"score the first ([\d,]+) characters of each held-out file", text)
    assert quoted == [f"{CONFIG['max_eval_chars']:,}"], quoted


def _comparison_rows(text: str) -> dict[str, tuple[str, ...]]:
    """label -> (per-document loss, difference, SE, share) of a page's comparison table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        label = cells[0].split(" (")[0]
        if (
            label in ("last snapshot", "PMA merge", "annealed")
            and len(cells) >= 4
            and re.fullmatch(r"\d\.\d{4}", cells[1])
        ):
            diff = re.match(r"(-?\d\.\d{4}) ± (\d\.\d{4})", cells[2].replace("*", ""))
            rows[label] = (cells[1], *(diff.groups() if diff else ("", "")), cells[3].strip("*"))
    return rows


def test_the_quoted_default_run_tables_agree_with_each_other():
    """README and quickstart quote one run: the same table; its ratios are those of its numbers."""
    readme, quickstart = (_comparison_rows((REPO_ROOT / page).read_text()) for page in PAGES)
    assert set(readme) == {"last snapshot", "PMA merge", "annealed"} and readme == quickstart
    per_token = re.search(r"lm/loss \(per token\)[\s|]+(\d\.\d{4})", (REPO_ROOT / PAGES[1]).read_text()).group(1)
    assert f"{per_token} for the last snapshot" in _text()[PAGES[0]]
    merge, annealed = float(readme["PMA merge"][1]), float(readme["annealed"][1])
    low, high = (abs(merge) - 5e-5) / (abs(annealed) + 5e-5), (abs(merge) + 5e-5) / (abs(annealed) - 5e-5)
    share = int(readme["PMA merge"][3].rstrip("%")) / 100
    assert round(low, 2) <= share <= round(high, 2), (share, low, high)
    for label in ("PMA merge", "annealed"):
        text = _text()[PAGES[0]]
        ratio = abs(float(readme[label][1])) / float(readme[label][2])
        assert f"({ratio:.1f} SE)" in text, (label, ratio)


def test_the_quoted_comparison_table_has_the_format_the_code_prints():
    """The quickstart's comparison table has the header and row labels that ``comparison_table``
    prints for the default run (32 held-out documents, the annealed fork over its last steps)."""
    from hf_pma.analysis.comparison import paired_comparison
    from hf_pma.publishing.card import comparison_table

    def lm(offset: float) -> dict:
        return {"per_text": {"nll": [4.0 - offset + 0.01 * i for i in range(32)], "tokens": [1] * 32}}

    anneal = {
        "steps": CONFIG["anneal_steps"],
        "tokens": CONFIG["anneal_steps"] * TOKENS_PER_STEP,
        "decay_type": "linear",
    }
    models = {"last snapshot": lm(0.0), "PMA merge": lm(0.1), "annealed": lm(0.09)}
    printed = comparison_table(paired_comparison(models, anneal=anneal, tokens=TOTAL_TOKENS)).splitlines()
    quoted = [line for line in (REPO_ROOT / PAGES[1]).read_text().splitlines() if line.startswith("| ")]
    quoted = quoted[quoted.index(next(q for q in quoted if q.startswith("| model (all at"))) :][:4]
    assert quoted[0] == printed[0]
    assert [q.split(" | ")[0] for q in quoted[1:]] == [p.split(" | ")[0] for p in printed[2:]]


def test_the_sweep_prediction_summary_quotes_the_benchmarks_results():
    """Each tau / MAE pair of docs/benchmarks.md's summary is the one the benchmark printed for that
    window, ranking (sweep or ladder) and model (merge or last)."""
    results = (REPO_ROOT / "benchmarks" / "results" / "sweep_prediction" / "tables.md").read_text()
    against = re.compile(
        r"Against annealed \(\d+ runs\): merge Kendall's tau ([+-][\d.]+)(?: \([^)]*\))?, mean absolute error ([\d.]+); "
        r"last Kendall's tau ([+-][\d.]+)(?: \([^)]*\))?, mean absolute error ([\d.]+)"
    )
    printed = [m.groups() for m in against.finditer(results)]
    # In the order the benchmark prints them: sweep and ladder with the runs' own window (the automatic
    # one, or a fixed N), then per --also-last N.
    own = re.search(r"the automatic merge window|merge of the last (\d+)", results)
    assert own is not None
    windows = [own.group(1) or "auto"] + re.findall(r"^## The same runs, merging the last (\d+) snapshots", results, re.M)
    assert len(printed) == 2 * len(windows)
    by_window = {w: (printed[2 * i], printed[2 * i + 1]) for i, w in enumerate(windows)}
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (?:last )?(\d+|auto) [^|]*\|" + r" ([+-][\d.]+) / ([\d.]+) \|" * 4, page, re.M)
    assert {r[0] for r in rows} == set(by_window), rows
    for window, *cells in rows:
        sweep, ladder = by_window[window]
        assert tuple(cells) == (*sweep[:2], *sweep[2:], *ladder[:2], *ladder[2:]), window


def test_the_callback_pages_worked_example_of_the_automatic_v_is_what_the_planner_chooses():
    """callback.md's example (100B tokens, 4M-token steps, WSD 1,000 + 20,000 + 4,000 steps) is
    what the automatic V gives, through the planner the callback uses (the schedule probed step
    by step), for the default phases and for ``phases=["stable"]``."""
    import torch
    from transformers import get_wsd_schedule

    from hf_pma.core.schedule import choose_interval, plan_run
    from hf_pma.snapshots.callback import PMACallback
    from hf_pma.snapshots.lr_probe import planned_lrs

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = get_wsd_schedule(optimizer, num_warmup_steps=1000, num_stable_steps=20000, num_decay_steps=4000)
    lrs, stride = planned_lrs(schedule, 25000)
    default_phases = inspect.signature(PMACallback.__init__).parameters["phases"].default
    text = " ".join((REPO_ROOT / "docs" / "callback.md").read_text().split())
    assert "100B tokens in 4M-token steps (25,000 steps)" in text
    for phases, words in ((default_phases, "With the default phases (stable and decay), "), (["stable"], 'With `phases=["stable"]`, ')):
        plan = plan_run(25000, phases, lrs, 1e-3, stride, warmup_steps=1000)
        choice = choose_interval(4_000_000, 25000, plan.selected_steps())
        steps = choice.interval_tokens // 4_000_000
        said = f"{words}{plan.selected_steps():,} steps snapshot"
        assert said in text, said
        v = f"auto V = {choice.interval_tokens / 1e9:g}B tokens ("
        assert v in text[text.index(said) :][:200] and f"every {steps} steps" in text[text.index(said) :][:250]
        if phases is default_phases:  # the last 10 snapshots of the default choice
            assert f"the last 10 snapshots span {10 * choice.interval_tokens / 1e9:g}B tokens" in text


DROPS_SNAPSHOTS = r"\bsnapshots\b[^;]*\bare (dropped|deleted)\b|\b(drops?|deletes?) (the |its )?(later )?snapshots"


def test_no_page_says_a_resume_drops_snapshots():
    """A resume sets later snapshots aside (kept on disk and in the manifest, excluded from merges,
    until the run passes them): no sentence of the manual says it drops or deletes them."""
    wrong = []
    for page in sorted((REPO_ROOT / "docs").rglob("*.md")):
        text = " ".join(page.read_text().split())
        for sentence in re.split(r"(?<=[.;:])\s", text):
            if re.search(r"\bresum", sentence) and re.search(DROPS_SNAPSHOTS, sentence, re.I):
                wrong.append(f"{page.name}: {sentence[:120]}")
    assert wrong == [], wrong


def test_the_default_runs_time_and_the_suites_size_are_each_said_one_way():
    """How long the default run took is the measured "**M min S s** end to end" (the same in the
    README and the quickstart), and no page, nor the config, gives it another way ("about N
    minutes"); the suite's test count and time are said in the README's Tests section only."""
    config = REPO_ROOT / "scripts" / "configs" / "tiny.yaml"
    places = [REPO_ROOT / "README.md", config, *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    measured, other, counts = set(), [], []
    for path in places:
        text = " ".join(path.read_text().split())
        measured |= set(re.findall(r"\*\*(\d+ min \d+ s)\*\* end to end", text))
        for sentence in re.split(r"(?<=[.;])\s", text):
            if re.search(r"default run|test suite|the suite|tiny\.yaml|Llama on 3 MB", sentence):
                other += [f"{path.name}: {m}" for m in re.findall(r"(?:about|~) ?\d+ min(?:utes?)?\b", sentence)]
        counts += [f"{path.name}: {m}" for m in re.findall(r"\b[\d,]{3,} tests\b", text)]
    assert len(measured) == 1, f"the default run's time is given as {sorted(measured)}"
    assert other == [], f"times given another way: {other}"
    assert [c.split(":")[0] for c in counts] == ["README.md"], counts


def test_the_window_choice_page_quotes_the_benchmarks_results():
    """Every number of docs/choosing-window.md's summary of the evidence is the committed
    benchmark's (results.json, the compare reports), and its example of a checked window is a
    reason ``hf-pma compare`` wrote there."""
    results = REPO_ROOT / "benchmarks" / "results" / "window_choice"
    summary = json.loads((results / "results.json").read_text())
    s, rows = summary["summary"], summary["rows"]
    page = (REPO_ROOT / "docs" / "choosing-window.md").read_text()
    text = " ".join(page.split("<!-- window-choice-summary", 1)[1].split("\n## ", 1)[0].split())

    def shares(window, lr, steps=1000):
        return " and ".join(
            f"{100 * r['gain_share']:.0f}%" for r in rows if (r["window"], r["lr"], r["steps"]) == (window, lr, steps)
        )

    auto, rule, eight, last = s["auto"], s["rule"], s["8"], s["last"]
    short = [r for r in rows if r["window"] == "auto" and r["gain_counts"] and r["gain_share"] < 0.9]

    def pct(value):
        return f"{100 * value:.0f}%"

    expected = [
        f"in {auto['runs_worse_than_last_beyond_1se']} of {auto['runs']} runs (the rule alone: "
        f"{rule['runs_worse_than_last_beyond_1se']}; N=8: {eight['runs_worse_than_last_beyond_1se']})",
        f"At least 90% in {auto['runs_recovering_90pct']} of the {auto['runs_where_annealing_gains_3se']} runs",
        f"at least 80% in {auto['runs_recovering_80pct']} (the rule alone: {rule['runs_recovering_90pct']} and "
        f"{rule['runs_recovering_80pct']}; N=8: {eight['runs_recovering_90pct']} and {eight['runs_recovering_80pct']}, "
        f"the worst at {pct(eight['min_gain_share_where_annealing_gains_3se'])}",
        f"The lowest share is {pct(auto['min_gain_share_where_annealing_gains_3se'])} (the rule alone: "
        f"{pct(rule['min_gain_share_where_annealing_gains_3se'])})",
        f"The {['no', 'one', 'two', 'three', 'four', 'five', 'six', 'seven'][len(short)]} short of 90%",
        f"1,000-step runs at 1.2e-2 ({shares('auto', '0.012')})",
        f"6,000-step run at 1.2e-2 ({shares('auto', '0.012', 6000)})",
        f"Tau = 1 in {auto['separated_groups_tau_1']} of the {auto['separated_groups']} groups",
        f"(in {auto['groups_tau_1']} of {auto['groups']} groups in all; N=8 and the last snapshot: "
        f"{eight['separated_groups_tau_1']} of {eight['separated_groups']})",
        f"{auto['mae']:.4f} nats for the checked window, {rule['mae']:.4f} for the rule alone, {eight['mae']:.4f} "
        f"for N=8 and {last['mae']:.4f} for the last snapshot",
    ]
    for phrase in expected:
        assert phrase in text, phrase
    # "not met" where a goal is missed, "met" where it is met.
    assert ("**The annealing gain**: not met" in text) == (auto["min_gain_share_where_annealing_gains_3se"] < 0.9)
    assert ("**The error against the annealed loss**: not met" in text) == (auto["mae"] > last["mae"] / 8)
    assert last["mae"] / auto["mae"] < 8 and "about a seventh" in text and round(last["mae"] / auto["mae"]) == 7
    assert auto["separated_groups_tau_1"] == auto["separated_groups"] and "**The ranking**: met" in text
    assert auto["runs_worse_than_last_beyond_1se"] == 0 and "**Never worse than the last snapshot**: met" in text
    shares_3000 = sorted(r["gain_share"] for r in short if r["steps"] == 3000)
    assert f"({pct(shares_3000[0])} to {pct(shares_3000[-1])})" in text
    # The rule before, on the same runs and documents.
    before = json.loads((results / "before" / "results.json").read_text())
    b_auto, b_rule = before["summary"]["auto"], before["summary"]["rule"]

    def at_90(summary_rows, window):
        return sum(r["gain_share"] >= 0.9 for r in summary_rows if r["window"] == window and r["gain_counts"])

    assert [r["run"] for r in before["rows"]] == [r["run"] for r in rows]  # the same runs
    for phrase in (
        f"from {pct(b_auto['min_gain_share_where_annealing_gains_3se'])} to {pct(auto['min_gain_share_where_annealing_gains_3se'])} "
        f"for the checked window and from {pct(b_rule['min_gain_share_where_annealing_gains_3se'])} to "
        f"{pct(rule['min_gain_share_where_annealing_gains_3se'])} for the rule alone",
        f"went from {at_90(before['rows'], 'auto')} to {at_90(rows, 'auto')} (checked) and from "
        f"{at_90(before['rows'], 'rule')} to {at_90(rows, 'rule')} (the rule alone)",
        f"from {b_rule['runs_worse_than_last_beyond_1se']} to {rule['runs_worse_than_last_beyond_1se']} for the rule alone",
        f"from {b_auto['mae']:.4f} to {auto['mae']:.4f} (the rule alone: {b_rule['mae']:.4f} to {rule['mae']:.4f})",
    ):
        assert phrase in text, phrase
    # The example of a checked window is one that compare wrote (without the flag it names).
    example = page.split("(checked_choice_example) -->", 1)[1].split("```text\n", 1)[1].split("\n", 1)[0].strip()
    written = [
        entry["merge"]["window_origin"].removesuffix(" (--last auto)").removesuffix(" (compare's held-out check)")
        for steps in (300, 1000, 3000, 6000)
        for entry in json.loads((results / f"compare-{steps}-auto.json").read_text())["runs"]
    ]
    assert example in written


def _pct(value):
    return f"{100 * value:.0f}%"


def _words(count):
    return ["no", "one", "two", "three", "four", "five", "six", "seven", "eight"][count]


def test_the_window_page_quotes_the_ceiling_and_the_unseen_runs():
    """The best merge in hindsight (window_ceiling.py) and the runs the benchmark never saw
    (window_choice.py on other seeds): every number docs/choosing-window.md gives of them is the
    committed results', and so is the one run the check's wider candidates changed."""
    results = REPO_ROOT / "benchmarks" / "results" / "window_choice"
    page = (REPO_ROOT / "docs" / "choosing-window.md").read_text()
    ceiling_text = " ".join(page.split("<!-- window-ceiling-summary", 1)[1].split("**Runs the benchmark never saw", 1)[0].split())
    unseen_text = " ".join(page.split("<!-- window-unseen-summary", 1)[1].split("\n## ", 1)[0].split())

    rows = json.loads((results / "ceiling.json").read_text())["rows"]
    counted = [r for r in rows if r["gain_counts"]]
    short = [r for r in counted if r["best"]["gain_share"] < 0.9]
    assert {r["run"].split("-")[1] for r in short} == {"lr0.012"}
    assert all(int(r["run"].split("-")[0][1:]) >= 1000 for r in short)
    assert {r["run"] for r in short} == {r["run"] for r in counted if "lr0.012" in r["run"] and not r["run"].startswith("n300-")}
    shares = sorted(r["best"]["gain_share"] for r in short)
    last_mae = sum(abs(r["last"] - r["annealed"]) for r in rows) / len(rows)
    least = sum(r["least_error"] for r in rows) / len(rows)

    def spans(steps):
        values = sorted(r["best"]["share_of_run"] for r in rows if int(r["run"].split("-")[0][1:]) in steps)
        return f"{_pct(values[0])} to {_pct(values[-1])}"

    for phrase in (
        f"In {len(short)} of the {len(counted)} runs where annealing gains at least 3 SE",
        f"every run of 1,000 steps or more at 1.2e-2 ({_pct(shares[0])} to {_pct(shares[-1])}), in "
        f"{sum(x < 0.85 for x in shares)} less than 85%",
        f"nor the rule alone's 85% in those {sum(x < 0.85 for x in shares)}",
        f"The best merge is WMA in {sum(r['best']['strategy'] == 'wma' for r in rows)} of the {len(rows)} runs",
        f"reaches is {least:.4f} (1/{last_mae / least:.1f} of the last snapshot's)",
        f"span {spans({1000})} of the run at 1,000 steps and {spans({3000, 6000})} at 3,000 and 6,000 steps",
    ):
        assert phrase in ceiling_text, phrase

    unseen = json.loads((results / "unseen" / "results.json").read_text())["summary"]
    auto, rule, eight, last = unseen["auto"], unseen["rule"], unseen["8"], unseen["last"]
    unseen_rows = json.loads((results / "unseen" / "ceiling.json").read_text())["rows"]
    unseen_short = sorted(r["best"]["gain_share"] for r in unseen_rows if r["gain_counts"] and r["best"]["gain_share"] < 0.9)
    assert all("lr0.012" in r["run"] for r in unseen_rows if r["gain_counts"] and r["best"]["gain_share"] < 0.9)
    for phrase in (
        f"none worse than its last snapshot beyond one SE (the rule alone: {_words(rule['runs_worse_than_last_beyond_1se']).replace('no', 'none')}; "
        f"N=8: {_words(eight['runs_worse_than_last_beyond_1se']).replace('no', 'none')})",
        f"at least 90% of the annealing gain in {auto['runs_recovering_90pct']} of {auto['runs_where_annealing_gains_3se']}, the lowest "
        f"{_pct(auto['min_gain_share_where_annealing_gains_3se'])} (the rule alone: {rule['runs_recovering_90pct']} of "
        f"{rule['runs_where_annealing_gains_3se']}, the lowest {_pct(rule['min_gain_share_where_annealing_gains_3se'])})",
        f"falls short of 90% in {len(unseen_short)} of them ({_pct(unseen_short[0])} to {_pct(unseen_short[-1])}, all at 1.2e-2)",
        f"tau = 1 in {auto['separated_groups_tau_1']} of the {auto['separated_groups']} separated groups",
        f"{auto['mae']:.4f} (1/{last['mae'] / auto['mae']:.1f} of the last snapshot's; the rule alone: {rule['mae']:.4f}, "
        f"1/{last['mae'] / rule['mae']:.1f})",
    ):
        assert phrase in unseen_text, phrase
    assert auto["runs_worse_than_last_beyond_1se"] == 0 and auto["runs"] == 8 and "Eight more runs" in page

    # How the constants were chosen: window_tuning.py's evaluation on the tuning documents.
    tuning = json.loads((results / "tuning.json").read_text())
    tuning_text = " ".join(page.split("<!-- window-tuning-summary", 1)[1].split("The report documents were looked at", 1)[0].split())
    run = next(r for r in tuning["runs"] if r["run"] == "n1000-lr0.006-s0")

    def doc_mean(values):
        return statistics.fmean(v for v in values if not math.isnan(v))

    def share(key):
        last = doc_mean(run["merges"]["sma:1"])
        return (doc_mean(run["merges"][key]) - last) / (doc_mean(run["annealed"]) - last)

    wma = [share(f"wma:{k}") for k in range(5, 13)]
    grid = tuning["grid"]
    best = max(g["min_share"] for g in grid if g["strategy"] == "wma")
    at_best = [g for g in grid if g["strategy"] == "wma" and _pct(g["min_share"]) == _pct(best)]
    check = tuning["check"]
    for phrase in (
        f"SMA falls from {_pct(share('sma:5'))} at 5 snapshots to {_pct(share('sma:11'))} at 11, WMA stays within "
        f"{_pct(min(wma))} to {_pct(max(wma))} from 5 to 12",
        f"the highest lowest share of the annealing gain on those documents ({_pct(best)}, no run worse",
        f"came with caps of {_pct(min(g['cap'] for g in at_best))} to {_pct(max(g['cap'] for g in at_best))} and limits of "
        f"{min(g['limit'] for g in at_best):g} to {max(g['limit'] for g in at_best):g} (with SMA at best "
        f"{_pct(max(g['min_share'] for g in grid if g['strategy'] == 'sma'))})",
        f"with the wider candidates its lowest share is {_pct(check['wider']['min_share'])}, with the halvings alone "
        f"{_pct(check['halvings']['min_share'])}; the wider candidates change the window of "
        f"{_words(len(check['changed_by_wider']))} run, the 6,000-step run at 1.2e-2",
    ):
        assert phrase in tuning_text, phrase
    assert all(g["worse"] == 0 for g in at_best) and check["changed_by_wider"] == ["n6000-lr0.012-s0"]
    assert (MAX_SHARE, TREND_LIMIT, TREND_STRATEGY) in {(g["cap"], g["limit"], g["strategy"]) for g in at_best}

    # The one window the wider candidates changed, against the check with halvings only.
    now = json.loads((results / "results.json").read_text())["rows"]
    before = json.loads((results / "halvings-only" / "results.json").read_text())["rows"]
    changed = [(b, a) for b, a in zip(before, now) if b["window"] == "auto" and b["n"] != a["n"]]
    assert [b["run"] for b, _ in changed] == ["n6000-lr0.012-s0"]
    (b, a), = changed
    text = " ".join(page.split())
    assert (
        f"took {a['n']} snapshots instead of {b['n']}, {_pct(a['gain_share'])} of its gain instead of {_pct(b['gain_share'])}"
        in text
    )


def test_the_window_checks_cost_is_the_committed_measurement():
    """choosing-window.md's wall times of compare with and without the check are the medians of
    benchmarks/results/window_check_cost/results.md."""
    results = (REPO_ROOT / "benchmarks" / "results" / "window_check_cost" / "results.md").read_text()
    medians = dict(re.findall(r"^\| (checked \(default\)|--no-window-check) \| ([\d.]+) \|", results, re.M))
    page = " ".join((REPO_ROOT / "docs" / "choosing-window.md").read_text().split())
    checked, unchecked = medians["checked (default)"], medians["--no-window-check"]
    assert f"a median of {checked} s with the check and {unchecked} s without" in page
    halvings = dict(re.findall(r"^\| (checked, halvings only|unchecked) \| ([\d.]+) \|", results, re.M))
    assert f"with the halvings alone it took {halvings['checked, halvings only']} s against {halvings['unchecked']} s" in page


def _record_rows(record: dict) -> dict[str, tuple[str, ...]]:
    """label -> (per-document loss, difference, SE, share) as a page prints a committed pma_eval.json's comparison."""
    comparison = record["comparison"]
    rows = {}
    for label, row in comparison["models"].items():
        if label == comparison["reference"]:
            rows[label] = (f"{row['loss']:.4f}", "", "", "")
            continue
        share = comparison["annealing_gain_recovered"] if label == comparison["merge"] else 1.0
        rows[label] = (f"{row['loss']:.4f}", f"{row['loss_diff']:.4f}", f"{row['paired_stderr']:.4f}", f"{share:.0%}")
    return rows


def test_the_quoted_default_runs_are_their_committed_records():
    """The README's and the quickstart's table are the committed record of the README's command
    (benchmarks/results/default_run/pma_eval.json), and the quickstart's AVX2 table that of the
    same command with AVX2 kernels (its avx2/ folder); their windows are the records' windows.
    tests/test_default_run_record.py checks the records against the command itself."""
    records = REPO_ROOT / "benchmarks" / "results" / "default_run"
    main = json.loads((records / "pma_eval.json").read_text())
    avx2 = json.loads((records / "avx2" / "pma_eval.json").read_text())
    assert _comparison_rows((REPO_ROOT / "README.md").read_text()) == _record_rows(main)
    quickstart = (REPO_ROOT / "docs" / "quickstart.md").read_text()
    table = [line.replace("AVX2: ", "", 1) for line in quickstart.splitlines() if line.startswith("| AVX2: ")]
    assert _comparison_rows("\n".join(table)) == _record_rows(avx2)
    avx2_window = json.loads((records / "avx2" / "pma_merge.json").read_text())["num_sources"]
    text = " ".join(quickstart.split())
    assert f"chose a window of {avx2_window} snapshots" in text and f"takes a window of {avx2_window}" in _text()["README.md"]
    per_token = main["results"]["last snapshot"]["lm"]["loss"]
    assert f"{per_token:.4f} for the last snapshot" in _text()["README.md"]
