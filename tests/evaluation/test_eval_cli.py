"""``hf-pma eval``: side-by-side table and JSON for two models, clear errors, and a 2-process launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_pma.cli import main
from hf_pma.core.manifest import write_manifest
from hf_pma.evaluation.evaluator import evaluate_language_modeling, load_model_for_eval
from tests.helpers.data import sample_text, write_small_tasks
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.output import markdown_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    """A run folder: a snapshot without a tokenizer (it is found in the run folder), a merged
    folder with one; and generated tasks with their held-out documents."""
    root = tmp_path_factory.mktemp("evalcli")
    run = root / "run"
    tiny_tokenizer.save_pretrained(run)
    snapshot = save_model_folder(run / "pma" / "snapshot-100", make_tiny_model(seed=0, initializer_range=0.3))
    merged = save_model_folder(
        run / "pma" / "merged", make_tiny_model(seed=1, initializer_range=0.3), tiny_tokenizer
    )
    tasks = write_small_tasks(root / "tasks")
    return {"root": root, "run": run, "snapshot": snapshot, "merged": merged, "tasks": tasks}


def test_two_models_side_by_side(setup, capsys):
    out = setup["root"] / "results.json"
    args = [
        "eval",
        str(setup["snapshot"]),
        str(setup["merged"]),
        "--tasks",
        "pma_tasks",
        "--include-path",
        str(setup["tasks"]),
        "--eval-file",
        str(setup["tasks"] / "heldout.jsonl"),
        "--limit",
        "6",
        "--batch-size",
        "4",
        "--output",
        str(out),
        "--record",
        str(setup["merged"]),
        "-q",
    ]
    assert main(args) == 0
    table = markdown_rows(capsys.readouterr().out)
    assert table[0] == ["metric", "snapshot-100", "merged"]
    rows = {row[0]: row[1:] for row in table[1:]}
    assert set(rows) == {
        "lm/loss (per token)",
        "lm/perplexity",
        "lm/bits_per_byte",
        "pma_next_line/acc",
        "pma_next_line/acc_norm",
        "pma_cloze/acc",
        "pma_cloze/acc_norm",
    }

    report = json.loads(out.read_text())
    assert list(report["results"]) == ["snapshot-100", "merged"]
    assert report["eval_dataset"] == "heldout.jsonl"
    texts = [
        json.loads(line)["text"] for line in (setup["tasks"] / "heldout.jsonl").read_text().splitlines()
    ][:6]
    for label, folder in (("snapshot-100", setup["snapshot"]), ("merged", setup["merged"])):
        model = AutoModelForCausalLM.from_pretrained(folder)
        direct = evaluate_language_modeling(
            model, AutoTokenizer.from_pretrained(setup["run"]), texts, progress=False
        )
        lm = report["results"][label]["lm"]
        assert lm["perplexity"] == pytest.approx(direct["perplexity"], rel=1e-5)
        assert report["lm"][label]["tokens"] == direct["tokens"]
        column = 0 if label == "snapshot-100" else 1
        assert rows["lm/perplexity"][column] == _cell(lm["perplexity"])
        acc = report["results"][label]["pma_next_line"]["acc"]
        assert report["lm_eval"][label]["results"]["pma_next_line"]["acc,none"] == acc
        assert report["lm_eval"][label]["n-samples"]["pma_next_line"]["effective"] == 6
    assert report["results"]["snapshot-100"]["lm"] != report["results"]["merged"]["lm"]

    record = json.loads((setup["merged"] / "pma_eval.json").read_text())
    assert record == {"results": report["results"], "eval_dataset": "heldout.jsonl", "eval_documents": report["eval_documents"]}
    assert report["eval_documents"].startswith("sha256:")


def test_results_go_to_the_current_folder_by_default_and_a_run_stands_for_its_newest_snapshots(
    tmp_path, tiny_tokenizer, capsys, monkeypatch
):
    from tests.helpers.snapshot_runs import noise_deviation, write_run

    run, _ = write_run(tmp_path / "run", 3, noise_deviation(), tokenizer=tiny_tokenizer)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(2000))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert (
        main(["eval", str(run), "--last", "2", "--eval-file", str(heldout), "--block-size", "32", "-q"]) == 0
    )
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "results: eval_results.json"
    report = json.loads((here / "eval_results.json").read_text())
    assert list(report["results"]) == ["snapshot-2000", "snapshot-3000"]
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written into the run
    # Without --last, --every or --revisions, --last is refused (nothing to select among).
    assert (
        main(["eval", str(run / "pma" / "snapshot-1000"), "--last", "2", "--eval-file", str(heldout), "-q"])
        == 2
    )
    assert "--last and --every select among a run folder's snapshots" in capsys.readouterr().err


def _cell(value: float) -> str:
    return f"{value:,.1f}" if value >= 1000 else f"{value:.4f}"


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty-folder", "not readable: no config.json and no weights"),
        ("tokenizer-mismatch", "does not match model"),
        (
            "run-folder",
            "is a run folder (a PMA manifest (pma/manifest.json)) without a final model at its top: --last N",
        ),
        ("unknown-task", "'pma_next_lin' (close matches: pma_next_line"),
        ("nothing", "nothing to evaluate"),
    ],
)
def test_errors_are_clear_and_write_nothing(setup, tmp_path, capsys, case, message):
    model, extra = str(setup["merged"]), ["--eval-file", str(setup["tasks"] / "heldout.jsonl")]
    if case == "empty-folder":
        (tmp_path / "empty").mkdir()
        model = str(tmp_path / "empty")
    elif case == "tokenizer-mismatch":
        model = str(save_model_folder(tmp_path / "small-vocab", make_tiny_model(vocab_size=256)))
        extra += ["--tokenizer", str(setup["run"])]
    elif case == "run-folder":
        (tmp_path / "run" / "pma").mkdir(parents=True)
        write_manifest(tmp_path / "run" / "pma", [])
        model = str(tmp_path / "run")
    elif case == "unknown-task":
        extra = ["--tasks", "pma_next_lin", "--include-path", str(setup["tasks"])]
    elif case == "nothing":
        extra = []
    out = tmp_path / "out.json"
    # The good model comes first: the bad one must be caught before anything is evaluated.
    assert main(["eval", str(setup["snapshot"]), model, *extra, "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if case in ("empty-folder", "tokenizer-mismatch", "run-folder"):
        assert Path(model).name in err
    assert not out.exists()


def test_load_model_for_eval_with_a_tokenizer_object(setup, tiny_tokenizer, tmp_path):
    # The snapshot folder holds no tokenizer: a given tokenizer object is used as it is.
    model, tok = load_model_for_eval(setup["snapshot"], tokenizer=tiny_tokenizer, device="cpu")
    assert tok is tiny_tokenizer and not model.training
    small = save_model_folder(tmp_path / "small-vocab", make_tiny_model(vocab_size=256))
    with pytest.raises(ValueError, match="512 tokens but the model's embedding has 256 rows"):
        load_model_for_eval(small, tokenizer=tiny_tokenizer)


@pytest.mark.distributed
@pytest.mark.shared_launch("world2")  # the `eval` scenario of tests/dist/scenarios.py
def test_two_process_launch_evaluates_once(shared_launch):
    done, out = shared_launch.result("world2", "eval"), shared_launch("world2", "eval")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["forwards"] > 0 and ranks[1]["forwards"] == 0  # ran once, on the main process
    assert ranks[0]["results"] == ranks[1]["results"]  # and every rank got the result
    assert set(ranks[0]["results"]) == {"lm", "pma_next_line"}
    assert [r["error"] for r in ranks] == ["bad input seen by rank 0"] * 2
    assert ranks[0]["local"]["loss"] == ranks[0]["results"]["lm"]["loss"] and "local" not in ranks[1]
    # the CLI table is printed once, by the main process
    assert [done.output(rank).count("lm/perplexity") for rank in (0, 1)] == [1, 0]
    cli = json.loads((out / "cli.json").read_text())
    assert set(cli["results"]["model"]) == {"lm", "pma_cloze"}


def test_a_sharded_folder_is_evaluated_as_its_consolidated_model(setup, capsys):
    """An online average or snapshot of an FSDP / ZeRO-3 run (one file per rank) is evaluated as
    the model it holds: the same numbers as its consolidated folder."""
    from hf_pma.merging.consolidate import consolidate_snapshot
    from tests.helpers.sharded_files import LAYOUTS, write_sharded

    state = AutoModelForCausalLM.from_pretrained(setup["merged"]).state_dict()
    sharded = write_sharded(
        setup["run"] / "pma" / "online-sma", state, LAYOUTS["boxes-2x2"], config_from=setup["merged"]
    )
    full = consolidate_snapshot(sharded, setup["root"] / "online-sma-full", progress=False)
    args = ["--eval-file", str(setup["tasks"] / "heldout.jsonl"), "--limit", "6", "--batch-size", "4", "-q"]
    out = ["--tokenizer", str(setup["run"]), "--output"]
    assert main(["eval", str(sharded), *out, str(setup["root"] / "sharded.json"), *args]) == 0
    from_shards = markdown_rows(capsys.readouterr().out)
    assert main(["eval", str(full), *out, str(setup["root"] / "full.json"), *args]) == 0
    consolidated = markdown_rows(capsys.readouterr().out)
    assert [row[1:] for row in from_shards[1:]] == [row[1:] for row in consolidated[1:]] != []
