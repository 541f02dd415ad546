"""The paired comparison (hf_pma.analysis.comparison) against a hand computation, and its record
in a merged folder's pma_eval.json, shown by the card."""

from __future__ import annotations

import json
import math

import pytest

from hf_pma.analysis.comparison import (
    annealing_gain_recovered,
    document_losses,
    paired_comparison,
    paired_difference,
    write_comparison,
)
from hf_pma.publishing.card import build_model_card
from tests.helpers.pma_records import write_merged_folder


def lm(nll, tokens):
    return {"per_text": {"nll": nll, "tokens": tokens}}


# Three documents of 2, 4 and 5 tokens; a fourth with no scored token in the merge only.
LM = {
    "last snapshot": lm([8.0, 12.0, 20.0, 3.0], [2, 4, 5, 1]),  # per document 4, 3, 4 (and 3)
    "PMA merge": lm([7.0, 11.0, 19.0, 0.0], [2, 4, 5, 0]),  # 3.5, 2.75, 3.8
    "annealed": lm([6.0, 10.0, 18.0, 2.0], [2, 4, 5, 1]),  # 3, 2.5, 3.6
}


def test_paired_comparison_by_hand():
    record = paired_comparison(
        LM,
        anneal={"steps": 6, "tokens": 1536, "decay_type": "cosine"},
        tokens=6144,
        model_tokens={"annealed": 6144},
    )
    assert record["documents"] == 3  # the 4th has no scored token in the merge: left out of every model
    models = record["models"]
    assert models["last snapshot"]["loss"] == pytest.approx((4 + 3 + 4) / 3)
    assert models["PMA merge"]["loss"] == pytest.approx((3.5 + 2.75 + 3.8) / 3)
    # per token: over every document of that model
    assert models["last snapshot"]["per_token_loss"] == pytest.approx(43 / 12)
    # merge - last per document: -0.5, -0.25, -0.2: mean -0.31667, sample sd 0.15275, se = sd / sqrt(3)
    diffs = [-0.5, -0.25, -0.2]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert models["PMA merge"]["loss_diff"] == pytest.approx(mean)
    assert models["PMA merge"]["paired_stderr"] == pytest.approx(sd / math.sqrt(3))
    # annealed - last: -1, -0.5, -0.4; share of the gain: 0.31667 / 0.63333 = 0.5
    assert models["annealed"]["loss_diff"] == pytest.approx(-1.9 / 3)
    assert record["annealing_gain_recovered"] == pytest.approx(0.5)
    assert "loss_diff" not in models["last snapshot"] and models["annealed"]["tokens"] == 6144
    assert (record["reference"], record["merge"], record["annealed"], record["tokens"]) == (
        "last snapshot",
        "PMA merge",
        "annealed",
        6144,
    )
    assert record["anneal"]["decay_type"] == "cosine"


def test_gain_and_pairing_edges():
    assert annealing_gain_recovered(4.0, 3.9, 4.1) is None  # annealing did not help: no share
    assert annealing_gain_recovered(4.0, 4.2, 3.8) == pytest.approx(-1.0)  # the merge is worse than the last
    assert paired_difference([1.0], [2.0]).stderr is None
    assert paired_difference([1.0, 3.0], [2.0, 2.0]).z == 0.0
    assert math.isnan(document_losses(lm([1.0], [0]))[0])
    with pytest.raises(ValueError, match="not the same held-out documents"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="not the same documents"):
        paired_comparison({"last snapshot": lm([1.0], [1]), "PMA merge": lm([1.0, 2.0], [1, 1])})
    with pytest.raises(ValueError, match="'last snapshot' is not among"):
        paired_comparison({"PMA merge": lm([1.0], [1])})
    with pytest.raises(ValueError, match="no per-document results"):
        paired_comparison({"last snapshot": {"loss": 3.0}})
    # without an annealed model: no share, still the paired difference
    record = paired_comparison({k: LM[k] for k in ("last snapshot", "PMA merge")})
    assert record["annealed"] is None and record["annealing_gain_recovered"] is None
    assert "anneal" not in record and record["models"]["PMA merge"]["paired_stderr"] > 0


def test_the_record_lands_in_pma_eval_json_and_the_card_shows_it(tmp_path, tiny_tokenizer):
    merged = write_merged_folder(tmp_path, tiny_tokenizer)
    before = json.loads((merged / "pma_eval.json").read_text())
    record = paired_comparison(LM, anneal={"steps": 6, "tokens": 1536, "decay_type": "linear"}, tokens=6144)
    write_comparison(merged, record)
    after = json.loads((merged / "pma_eval.json").read_text())
    assert after["results"] == before["results"] and after["comparison"] == json.loads(json.dumps(record))
    text = build_model_card(merged).text
    assert "| model (all at 6,144 tokens) | held-out loss per document (mean of 3 documents) |" in text
    assert "| PMA merge | 3.3500 | -0.3167 ± 0.0928 (3.4 SE) | 50% |" in text
    with pytest.raises(ValueError, match="paired_comparison record"):
        write_comparison(merged, {"models": None})
