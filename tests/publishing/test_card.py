"""The model card of a merged folder: its contents, its metadata, what it must never hold."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from hf_pma.cli import main
from hf_pma.publishing.card import (
    build_model_card,
    comparison_table,
    eval_table,
    template_path,
    write_model_card,
)
from hf_pma.publishing.records import find_secrets, sanitize_text
from tests.helpers.pma_records import (
    EVAL_RECORD,
    FAKE_TOKEN,
    MERGED_STEPS,
    TOKENS_PER_STEP,
    merge_record,
    write_merged_folder,
)


@pytest.fixture()
def merged(tmp_path, tiny_tokenizer):
    return write_merged_folder(tmp_path, tiny_tokenizer)


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            rows.append(cells)
    return rows


def test_card_describes_the_merge_training_and_evaluation(merged):
    card = build_model_card(merged, repo_id="my-org/tiny-pma")
    text = card.text

    # PMA in two sentences, with the paper's reference.
    assert "Pre-trained Model Averaging" in text and "arxiv.org/abs/2505.12082" in text
    # The merge: strategy, N, V and one table row per snapshot used, oldest first.
    assert "SMA: simple moving average" in text
    assert "| snapshots merged (N) | 6 |" in text
    assert f"| interval between snapshots (V) | {20 * TOKENS_PER_STEP:,} " in text
    names = [f"snapshot-{s * TOKENS_PER_STEP}" for s in MERGED_STEPS]
    rows = [r for name in names for r in _table_rows(text, name)]
    assert [r[0] for r in rows] == names
    for row, step in zip(rows, MERGED_STEPS):
        assert row[1:] == [f"{step * TOKENS_PER_STEP:,}", str(step), "0.003", "stable", f"{5.0 - step / 100:.4f}", "0.1667"]
    # The training run.
    assert f"| tokens seen | {200 * TOKENS_PER_STEP:,} (819k) |" in text
    assert "| learning-rate schedule | warmup_stable_decay (num_decay_steps=20) |" in text
    assert "| hardware | 2 CPU cores |" in text and "| processes | 2 |" in text
    assert "| training time | 3 min 05 s |" in text
    # The evaluation: last snapshot, merge, annealed, and the difference merge - last.
    assert "| task | metric | last snapshot | PMA merge | annealed | merge − last |" in text
    assert _table_rows(text, "lm")[0] == ["lm", "loss (per token)", "4.1642", "4.0523", "4.0481", "-0.1119"]
    assert _table_rows(text, "py_syntax")[0] == ["py_syntax", "acc", "0.4125 ± 0.0211", "0.4475 ± 0.0208", "–", "+0.0350"]
    # How to load it, and how to reproduce it.
    assert "AutoModelForCausalLM.from_pretrained('my-org/tiny-pma')" in text
    assert "AutoTokenizer.from_pretrained('my-org/tiny-pma')" in text
    assert "accelerate launch scripts/pretrain.py --output_dir .../run" in text
    assert f"'pma/snapshot-{MERGED_STEPS[0] * TOKENS_PER_STEP}'," in text and "strategy='sma'" in text
    assert "## Limitations" in text
    # No plot file yet: no broken image link.
    assert "pma_training.png" not in text


def test_card_metadata_round_trips_with_the_model_index(merged):
    path = write_model_card(merged, repo_id="my-org/tiny-pma", license="apache-2.0")
    assert path == merged / "README.md"
    card = ModelCard.load(path)
    data = card.data
    assert data.library_name == "transformers"
    assert {"pma", "model-merging"} <= set(data.tags)
    assert data.license == "apache-2.0"
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M"
    # Only Hub dataset ids go to the metadata; local files stay out of it.
    assert data.datasets == ["HuggingFaceFW/fineweb-edu"]
    # The model-index holds the merge's results, not the last snapshot's.
    assert data.model_name == "tiny-pma"
    results = {(r.dataset_type, r.metric_type): r.metric_value for r in data.eval_results}
    merge_results = EVAL_RECORD["results"]["PMA merge"]
    assert results[("held-out-text", "loss")] == merge_results["lm"]["loss"]
    assert results[("held-out-text", "bits_per_byte")] == merge_results["lm"]["bits_per_byte"]
    assert results[("py_syntax", "acc")] == merge_results["py_syntax"]["acc,none"]
    assert all(r.task_type == "text-generation" for r in data.eval_results)
    # model_name is consumed by the model-index: the body must still show it.
    assert card.text.lstrip().splitlines()[2] == "# tiny-pma"
    # write_model_card drew the plot first, and the card shows it.
    assert (merged / "pma_training.png").is_file()
    assert "![" in card.text and "(pma_training.png)" in card.text
    assert "Over tokens seen: the training loss (blue)" in card.text and "the merged snapshots (orange lines)" in card.text


def test_card_never_holds_a_token_or_an_absolute_path(merged, tmp_path):
    raw = (merged / "pma_training.json").read_text()
    assert FAKE_TOKEN in raw and str(tmp_path) in raw and "/home/alice" in raw  # the trap is set
    content = str(build_model_card(merged))
    for secret in (FAKE_TOKEN, str(tmp_path), "/home/alice", "C:\\Users", "bob\\corpus"):
        assert secret not in content
    assert find_secrets(content) == []
    assert "--hub_token ***" in content
    assert ".../train.jsonl" in content and ".../corpus.txt" in content


@pytest.mark.parametrize(
    "text, expected",
    [
        ("see https://arxiv.org/abs/2505.12082 now", "see https://arxiv.org/abs/2505.12082 now"),
        ("--output_dir /scratch/u1/run-7 --x", "--output_dir .../run-7 --x"),
        ("cd ~/runs/a && ls", "cd .../a && ls"),
        ("D:\\data\\set\\f.jsonl", ".../f.jsonl"),
        ("`<output_dir>/pma/snapshot-<tokens>` and pma/merged", "`<output_dir>/pma/snapshot-<tokens>` and pma/merged"),
        ("loss / step, 1/N, lr/phase", "loss / step, 1/N, lr/phase"),
        (f"HF_TOKEN={FAKE_TOKEN} hf upload", "HF_TOKEN=*** hf upload"),
        (f"token {FAKE_TOKEN}.", "token ***."),
    ],
)
def test_sanitize_text(text, expected):
    assert sanitize_text(text) == expected
    assert find_secrets(sanitize_text(text)) == []


def test_card_degrades_without_the_optional_records(tmp_path, tiny_tokenizer):
    folder = write_merged_folder(tmp_path, tiny_tokenizer, with_eval=False, with_training=False, with_manifest=False)
    path = write_model_card(folder, plot=False)
    card = ModelCard.load(path)
    text = card.text
    assert "No evaluation record (`pma_eval.json`)" in text
    assert "no `pma_training.json`" in text
    assert card.data.eval_results is None and "model-index" not in str(card)
    assert "| snapshots merged (N) | 6 |" in text  # the merge is still fully described
    assert "## How to reproduce" in text and "accelerate launch" not in text
    # Without a repo id the snippet loads the local folder, by a relative name.
    assert "from_pretrained('./merged')" in text
    assert card.text.lstrip().splitlines()[2] == "# run-pma-sma"


def test_card_notes_ema_custom_weights_and_phases(tmp_path):
    record = merge_record("ema", phases=["stable"] * 4 + ["decay"] * 2, alpha=0.2)
    folder = write_merged_folder(tmp_path, merge=record, with_eval=False, with_training=False)
    text = build_model_card(folder).text
    assert "EMA: exponential moving average with alpha = 0.2" in text
    assert "2 of the 6 snapshots were taken outside the constant-LR (stable) phase (decay)" in text
    assert "strategy='ema'," in text and "alpha=0.2," in text
    assert "AutoTokenizer" not in text  # no tokenizer saved in this folder

    record = merge_record("custom")
    record["weights"] = [0.1, 0.1, 0.1, 0.2, 0.2, 0.3]
    for src, w in zip(record["sources"], record["weights"]):
        src["weight"] = w
    (folder / "pma_merge.json").write_text(json.dumps(record))
    text = build_model_card(folder).text
    assert "weights=[0.1, 0.1, 0.1, 0.2, 0.2, 0.3]" in text
    first, last = (f"snapshot-{s * TOKENS_PER_STEP}" for s in (MERGED_STEPS[0], MERGED_STEPS[-1]))
    assert [r[-1] for r in _table_rows(text, first) + _table_rows(text, last)] == ["0.1000", "0.3000"]


@pytest.mark.parametrize(
    ("half_life", "said"),
    [
        ({"half_life_tokens": 4096}, "EMA: exponential moving average with a half-life of 4,096 tokens"),
        (
            {"half_life_fraction": 0.05},
            "EMA: exponential moving average whose half-life is 0.05 of the tokens seen at each snapshot (horizon-free)",
        ),
    ],
)
def test_card_of_an_ema_by_half_life_names_it_and_remakes_it_by_its_weights(tmp_path, half_life, said):
    """An online EMA by half-life records no alpha: the card names its half-life, and the snippet
    that remakes it gives the recorded weights (``strategy='ema'`` alone would use alpha 0.2)."""
    record = {**merge_record("ema"), "alpha": None, **half_life}
    record["weights"] = [0.05, 0.05, 0.1, 0.2, 0.25, 0.35]
    folder = write_merged_folder(tmp_path, merge=record, with_eval=False, with_training=False)
    text = build_model_card(folder).text
    assert said in text and "alpha = –" not in text
    assert "strategy='ema'" not in text and "weights=[0.05, 0.05, 0.1, 0.2, 0.25, 0.35]" in text


def test_eval_table_orders_models_and_pairs_stderr():
    columns, rows = eval_table({"results": {"annealed": {"lm": {"loss": 1.0}}, "PMA merge": {"lm": {"loss": 2.0}}}})
    assert columns == ["PMA merge", "annealed"]  # no last snapshot: no difference column
    assert rows == [{"task": "lm", "metric": "loss (per token)", "values": ["2.0000", "1.0000"]}]


COMPARISON = {
    "reference": "last snapshot",
    "merge": "PMA merge",
    "annealed": "annealed",
    "documents": 32,
    "tokens": 1_024_000,
    "anneal": {"steps": 200, "tokens": 204_800, "decay_type": "linear"},
    "models": {
        "annealed": {"loss": 4.05, "loss_diff": -0.15, "paired_stderr": 0.01},
        "last snapshot": {"loss": 4.2},
        "PMA merge": {"loss": 4.08, "loss_diff": -0.12, "paired_stderr": 0.012},
    },
    "annealing_gain_recovered": 0.8,
}


def test_card_shows_the_matched_comparison(merged):
    record = json.loads((merged / "pma_eval.json").read_text())
    assert "The merge against the last snapshot" not in build_model_card(merged).text  # none recorded: no section
    record["comparison"] = COMPARISON
    (merged / "pma_eval.json").write_text(json.dumps(record))
    text = build_model_card(merged).text
    assert "The merge against the last snapshot and an annealed model" in text
    assert "| model (all at 1,024,000 tokens) | held-out loss per document (mean of 32 documents) |" in text
    # last snapshot first, then the merge, then the annealed model; paired SE and share of the gain
    assert _table_rows(text, "last snapshot (constant LR)") == [["last snapshot (constant LR)", "4.2000", "", ""]]
    assert _table_rows(text, "PMA merge")[-1] == ["PMA merge", "4.0800", "-0.1200 ± 0.0120 (10.0 SE)", "80%"]
    annealed = "annealed (linear decay to 0 over the last 204,800 tokens)"
    assert _table_rows(text, annealed) == [[annealed, "4.0500", "-0.1500 ± 0.0100 (15.0 SE)", "100%"]]
    assert comparison_table(None) == "" and comparison_table({"models": "?"}) == ""


def test_card_errors_name_the_problem(tmp_path, merged):
    empty = tmp_path / "not-merged"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="pma_merge.json"):
        write_model_card(empty)
    assert not (empty / "README.md").exists()

    (merged / "pma_eval.json").write_text("{not json")
    with pytest.raises(ValueError, match="pma_eval.json"):
        write_model_card(merged)
    assert not (merged / "README.md").exists()
    assert not [p for p in merged.iterdir() if p.name.endswith(".tmp")]


def test_cli_card(merged, tmp_path, capsys):
    assert main(["card", str(merged), "--repo-id", "org/name", "--no-plot"]) == 0
    assert capsys.readouterr().out.strip() == str(merged / "README.md")
    text = (merged / "README.md").read_text()
    assert "from_pretrained('org/name')" in text
    assert not (merged / "pma_training.png").exists()

    # Regenerating overwrites the card in place, now with the plot.
    assert main(["card", str(merged), "--model-name", "Tiny PMA"]) == 0
    card = ModelCard.load(merged / "README.md")
    assert card.data.model_name == "Tiny PMA" and "(pma_training.png)" in card.text

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["card", str(empty)]) == 2
    assert "pma_merge.json" in capsys.readouterr().err
    assert main(["card", str(merged), "--repo-id", "not a repo"]) == 2
    assert "invalid repo id 'not a repo'" in capsys.readouterr().err


def test_a_bad_template_is_one_line_naming_it_and_nothing_is_written(merged, tmp_path, capsys):
    """``--template`` is read the guarded way: a missing file, a folder, a FIFO (which would hang a
    plain read), text that is not UTF-8 or too large each stop in one line naming the template,
    before any byte of the card; a link to a real template is the user's and is followed."""
    import os

    from hf_pma.publishing.card import MAX_TEMPLATE_BYTES

    fifo = tmp_path / "fifo.md"
    os.mkfifo(fifo)
    (tmp_path / "latin1.md").write_bytes(b"caf\xe9 {{ card_data }}")
    (tmp_path / "big.md").write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    (tmp_path / "folder.md").mkdir()
    cases = {
        "missing.md": "does not exist",
        "folder.md": "is not a regular file (a folder)",
        "fifo.md": "is not a regular file (a FIFO)",
        "latin1.md": "is not UTF-8 text",
        "big.md": f"is larger than {MAX_TEMPLATE_BYTES:,} bytes",
    }
    for name, why in cases.items():
        assert main(["card", str(merged), "--no-plot", "--template", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-pma card: error: card template ") and why in err and "\n" not in err, err
        assert not (merged / "README.md").exists()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "card.md").write_text("# {{ model_name }} by link\n{{ card_data }}\n")
    links = tmp_path / "links"
    links.mkdir()
    (links / "card.md").symlink_to(elsewhere / "card.md")
    assert main(["card", str(merged), "--no-plot", "--template", str(links / "card.md")]) == 0
    assert "by link" in (merged / "README.md").read_text()


def test_template_is_packaged_with_hf_pma():
    path = template_path()
    assert path.name == "pma_model_card.md" and path.parent.name == "model_cards"
    assert "{{ card_data }}" in path.read_text()


def test_card_of_a_real_merge(tmp_path, tiny_tokenizer):
    """The merge engine's own pma_merge.json feeds the card (the two were written apart)."""
    from hf_pma.merging.engine import merge_checkpoints
    from tests.helpers.models import make_tiny_model, save_model_folder

    pma = tmp_path / "run" / "pma"
    snapshots = []
    for i, step in enumerate((100, 200, 300)):
        record = {"path": f"snapshot-{step * 512}", "tokens": step * 512, "step": step, "lr": 1e-3, "loss": 3.0 - i / 10, "phase": "stable"}
        snapshots.append(save_model_folder(pma / record["path"], make_tiny_model(seed=i), tiny_tokenizer, extra=record))
    out = merge_checkpoints(snapshots, pma / "merged", strategy="wma", progress=False)
    card = ModelCard.load(write_model_card(out, plot=False))
    text = card.text
    assert "WMA: weighted moving average" in text and "| snapshots merged (N) | 3 |" in text
    rows = [_table_rows(text, f"snapshot-{step * 512}")[0] for step in (100, 200, 300)]
    assert [r[2] for r in rows] == ["100", "200", "300"]
    assert [r[-1] for r in rows] == ["0.1667", "0.3333", "0.5000"]
    assert "'pma/snapshot-51200'," in text and "strategy='wma'," in text
    assert find_secrets(str(card)) == []
