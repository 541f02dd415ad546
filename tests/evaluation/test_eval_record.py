"""``--record`` adds: ``hf-pma eval ... --record DIR`` and ``write_eval_record`` merge new results
into an existing ``pma_eval.json`` (models and metrics added or updated, every other key kept)."""

from __future__ import annotations

import json

from hf_pma.analysis.comparison import paired_comparison, write_comparison
from hf_pma.evaluation.corpus import documents_fingerprint
from hf_pma.evaluation.evaluator import write_eval_record
from hf_pma.publishing.card import build_model_card
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.pma_records import EVAL_RECORD, write_merged_folder


def _lm(nll, tokens):
    return {"per_text": {"nll": nll, "tokens": tokens}}


LM = {
    "last snapshot": _lm([8.0, 12.0, 20.0], [2, 4, 5]),
    "PMA merge": _lm([7.0, 11.0, 19.0], [2, 4, 5]),
    "annealed": _lm([6.0, 10.0, 18.0], [2, 4, 5]),
}
TABLE_ROW = "| PMA merge | 3.3500 | -0.3167 ± 0.0928 (3.4 SE) | 50% |"


def _eval_into_record(merged, heldout, results):
    return run_cli(
        "eval", merged, "--labels", "PMA merge", "--eval-file", heldout, "--block-size", "32",
        "--record", merged, "-q", "--output", results,
    )  # fmt: skip


def test_the_cards_comparison_survives_an_extra_eval_record_on_the_same_documents(tmp_path, tiny_tokenizer):
    merged = write_merged_folder(tmp_path, tiny_tokenizer)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(600))
    record = json.loads((merged / "pma_eval.json").read_text())
    (merged / "pma_eval.json").write_text(json.dumps({**record, "eval_dataset": "heldout.txt"}))
    write_comparison(merged, paired_comparison(LM, tokens=6144))
    assert TABLE_ROW in build_model_card(merged).text

    done = _eval_into_record(merged, heldout, tmp_path / "results.json")
    assert done.returncode == 0, done.stderr
    record = json.loads((merged / "pma_eval.json").read_text())
    assert "comparison" in record and record["eval_dataset"] == "heldout.txt"
    new = json.loads((tmp_path / "results.json").read_text())["results"]["PMA merge"]["lm"]
    assert record["results"]["PMA merge"]["lm"] == new  # updated
    assert (
        record["results"]["PMA merge"]["py_syntax"] == EVAL_RECORD["results"]["PMA merge"]["py_syntax"]
    )  # kept
    assert record["results"]["annealed"] == EVAL_RECORD["results"]["annealed"]  # kept
    assert TABLE_ROW in build_model_card(merged).text  # the card's matched table is still there


def test_an_eval_record_on_other_documents_drops_the_comparison_and_says_so(tmp_path, tiny_tokenizer):
    """The card never shows a comparison computed on other documents next to these results."""
    merged = write_merged_folder(tmp_path, tiny_tokenizer)
    write_comparison(merged, paired_comparison(LM, tokens=6144))
    heldout = tmp_path / "other.txt"
    heldout.write_text(sample_text(600))
    done = _eval_into_record(merged, heldout, tmp_path / "results.json")
    assert done.returncode == 0, done.stderr
    assert "the earlier results and their comparison, computed on other documents, are dropped" in done.stderr
    record = json.loads((merged / "pma_eval.json").read_text())
    assert record["eval_dataset"] == "other.txt" and set(record) == {"results", "eval_dataset", "eval_documents"}
    assert set(record["results"]) == {"PMA merge"}
    card = build_model_card(merged).text
    assert TABLE_ROW not in card and "same held-out documents" not in card.lower()


def test_a_record_knows_its_documents_by_their_fingerprint_not_their_name(tmp_path, tiny_tokenizer):
    """The same documents under another name keep the comparison; other documents under the
    record's name start it afresh."""
    merged = write_merged_folder(tmp_path, tiny_tokenizer)
    texts = [sample_text(300), sample_text(200)[::-1]]
    record = json.loads((merged / "pma_eval.json").read_text())
    (merged / "pma_eval.json").write_text(
        json.dumps({**record, "eval_dataset": "2 held-out documents", "eval_documents": documents_fingerprint(texts)})
    )
    write_comparison(merged, paired_comparison(LM, tokens=6144))
    same = tmp_path / "heldout.jsonl"
    same.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    done = _eval_into_record(merged, same, tmp_path / "results.json")
    assert done.returncode == 0, done.stderr
    record = json.loads((merged / "pma_eval.json").read_text())
    assert "comparison" in record and "dropped" not in done.stderr
    assert record["eval_documents"] == documents_fingerprint(texts) and record["eval_dataset"] == "heldout.jsonl"

    same.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[::-1]))  # same name, other order
    done = _eval_into_record(merged, same, tmp_path / "results.json")
    assert done.returncode == 0, done.stderr
    assert "are dropped" in done.stderr and "comparison" not in json.loads((merged / "pma_eval.json").read_text())


def test_write_eval_record_adds_models_and_metrics(tmp_path, tiny_tokenizer):
    merged = write_merged_folder(tmp_path, tiny_tokenizer)
    write_comparison(merged, paired_comparison(LM, tokens=6144))
    write_eval_record(
        merged, {"PMA merge": {"lm": {"loss": 1.0}, "new_task": {"acc": 0.5}}, "other": {"lm": {"loss": 2.0}}}
    )
    record = json.loads((merged / "pma_eval.json").read_text())
    merge = record["results"]["PMA merge"]
    assert merge["lm"] == {**EVAL_RECORD["results"]["PMA merge"]["lm"], "loss": 1.0}
    assert merge["new_task"] == {"acc": 0.5} and record["results"]["other"] == {"lm": {"loss": 2.0}}
    assert record["eval_dataset"] == EVAL_RECORD["eval_dataset"] and "comparison" in record
    write_eval_record(merged, {"other": {"lm": {"loss": 3.0}}}, update=False)  # afresh
    assert json.loads((merged / "pma_eval.json").read_text()) == {
        "results": {"other": {"lm": {"loss": 3.0}}},
        "eval_dataset": None,
    }
