"""Held-out LM metrics against hand computations; lm-eval accuracy against direct scoring; records."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_pma.evaluation.evaluator import (
    evaluate_language_modeling,
    plan_windows,
    read_eval_record,
    results_table,
    write_eval_record,
)
from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks
from hf_pma.evaluation.harness import flatten_lm_eval_results, load_task_manager, run_lm_eval
from hf_pma.evaluation.metrics import load_metric, metric_path
from hf_pma.evaluation.metrics.totals import language_model_totals
from tests.helpers.data import sample_text
from tests.helpers.models import make_tiny_model
from tests.helpers.output import markdown_rows

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé bytes: naïve café — ✓ 日本語",  # multi-byte UTF-8: bytes != characters
    "x",
]


@pytest.fixture(scope="module")
def peaked_model():
    """A tiny Llama with large weights, so that its predictions are far from uniform and a
    misaligned target or a padding leak changes the numbers visibly."""
    return make_tiny_model(seed=3, initializer_range=0.5).eval()


def _prefixed(tokenizer, text):
    return [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]


def _full_context_nll(model, ids):
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return -sum(float(logprobs[j, ids[j + 1]]) for j in range(len(ids) - 1))


def test_short_texts_equal_hand_computation(peaked_model, tiny_tokenizer):
    result = evaluate_language_modeling(peaked_model, tiny_tokenizer, TEXTS, batch_size=2, progress=False)
    sequences = [_prefixed(tiny_tokenizer, t) for t in TEXTS]
    assert max(len(s) for s in sequences) <= 128  # one window each: full context
    total_nll = sum(_full_context_nll(peaked_model, s) for s in sequences)
    tokens = sum(len(s) - 1 for s in sequences)
    num_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    assert num_bytes > sum(len(t) for t in TEXTS)
    assert result["tokens"] == tokens
    assert result["bytes"] == num_bytes
    assert result["loss"] == pytest.approx(total_nll / tokens, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(total_nll / tokens), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(total_nll / math.log(2) / num_bytes, rel=1e-5)
    assert result["texts"] == 3
    # per text, in order: what paired comparisons of two models use
    per_text = result["per_text"]
    assert per_text["tokens"] == [len(s) - 1 for s in sequences]
    assert per_text["nll"] == pytest.approx([_full_context_nll(peaked_model, s) for s in sequences], rel=1e-5)


def test_strided_windows_equal_per_token_reference(peaked_model, tiny_tokenizer):
    """Texts longer than the window: each token's log-probability, computed alone with exactly
    the context the documented window rule gives it, sums to the batched result."""
    block, stride = 16, 5
    texts = [sample_text()[:400], sample_text()[1000:1150]]
    total_nll, tokens = 0.0, 0
    for text in texts:
        ids = _prefixed(tiny_tokenizer, text)
        ends = [min(block, len(ids))]
        while ends[-1] < len(ids):
            ends.append(min(ends[-1] + stride, len(ids)))
        previous = 1
        for end in ends:
            start = max(0, end - block)
            for target in range(previous, end):
                with torch.no_grad():
                    logits = peaked_model(torch.tensor([ids[start:target]])).logits[0, -1].double()
                total_nll -= float(logits.log_softmax(-1)[ids[target]])
                tokens += 1
            previous = end
    assert len(ids) > 3 * block
    for batch_size in (1, 3):
        result = evaluate_language_modeling(
            peaked_model, tiny_tokenizer, texts, block_size=block, stride=stride, batch_size=batch_size, progress=False
        )
        assert result["tokens"] == tokens == sum(len(_prefixed(tiny_tokenizer, t)) - 1 for t in texts)
        assert result["loss"] == pytest.approx(total_nll / tokens, rel=1e-5)
        assert (result["block_size"], result["stride"]) == (block, stride)


@pytest.mark.parametrize("block", [2, 3, 8, 17])
def test_plan_windows_scores_every_token_once(block):
    for stride in range(1, block):
        for n in range(0, 3 * block + 2):
            counts = [0] * n
            for start, end, n_scored in plan_windows(n, block, stride):
                assert 0 <= start < end <= n and end - start <= block
                first = end - n_scored
                assert start <= first - 1, "a scored token needs the token before it in the window"
                for target in range(first, end):
                    counts[target] += 1
            assert counts[1:] == [1] * (n - 1) and (n == 0 or counts[0] == 0)


def test_bad_arguments_are_named(peaked_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="stride"):
        evaluate_language_modeling(peaked_model, tiny_tokenizer, TEXTS, block_size=8, stride=8)
    with pytest.raises(ValueError, match="every text is empty"):
        evaluate_language_modeling(peaked_model, tiny_tokenizer, ["", ""])
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        evaluate_language_modeling(peaked_model, tiny_tokenizer, ["a", 3])


def test_training_mode_is_restored(tiny_tokenizer):
    model = make_tiny_model(seed=1).train()
    evaluate_language_modeling(model, tiny_tokenizer, TEXTS[:1], progress=False)
    assert model.training


def test_shipped_metric_module_loads_offline():
    # conftest sets HF_HUB_OFFLINE=1: a Hub lookup would fail here.
    assert metric_path("bits_per_byte").is_file()
    metric = load_metric("bits_per_byte")
    metric.add_batch(nll=[2.0, 4.0], tokens=[1, 3], bytes=[3, 5])
    out = metric.compute()
    assert out["loss"] == pytest.approx(6.0 / 4)
    assert out["bits_per_byte"] == pytest.approx(6.0 / math.log(2) / 8)
    assert out["perplexity"] == pytest.approx(math.exp(1.5))
    with pytest.raises(ValueError, match="unknown hf-pma metric"):
        metric_path("accuracy")
    # Built from the installed package, not a copy imported from HF_HOME/modules.
    assert type(metric).__module__ == "hf_pma.evaluation.metrics.bits_per_byte"


def test_language_model_totals():
    out = language_model_totals([2.0, 4.0], [1, 3], [3, 5])
    assert out == {
        "loss": 1.5,
        "perplexity": pytest.approx(math.exp(1.5)),
        "bits_per_byte": pytest.approx(6.0 / math.log(2) / 8),
        "tokens": 4,
        "bytes": 8,
    }
    assert language_model_totals([1e6], [1], [1])["perplexity"] == math.inf
    with pytest.raises(ValueError, match="no scored tokens or bytes"):
        language_model_totals([1.0], [0], [3])


# ---------------------------------------------------------------- lm-eval


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    docs = []
    for chunk in range(0, len(sample_text().splitlines()), 40):
        docs.append("\n".join(sample_text().splitlines()[chunk : chunk + 40]))
    out = tmp_path_factory.mktemp("tasks") / "tasks"
    make_tasks(docs, out, eval_fraction=0.3, seed=0, options=TaskOptions(num_items=25, max_line_chars=60))
    return out


def _hflm_loglikelihood(model, tokenizer, context, continuation, max_length=128):
    """What lm-eval's HFLM computes for one request, written out: trailing spaces of the context
    move to the continuation; the whole string is encoded and split after the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    cont_ids = whole[len(context_ids) :]
    inputs = (context_ids + cont_ids)[-(max_length + 1) :][:-1]
    with torch.no_grad():
        logprobs = model(torch.tensor([inputs])).logits[0].double().log_softmax(-1)
    picked = logprobs[len(inputs) - len(cont_ids) :]
    return float(sum(picked[i, tok] for i, tok in enumerate(cont_ids)))


def test_lm_eval_acc_equals_direct_accuracy(peaked_model, tiny_tokenizer, task_dir):
    results = run_lm_eval(
        peaked_model, tiny_tokenizer, "pma_next_line,pma_cloze", include_path=task_dir, log_samples=True, batch_size=4
    )
    flat = flatten_lm_eval_results(results)
    for task, delimiter in (("pma_next_line", "\n"), ("pma_cloze", "")):
        items = [json.loads(line) for line in (task_dir / f"{task}.jsonl").read_text().splitlines()]
        correct, samples = [], {s["doc_id"]: s for s in results["samples"][task]}
        for doc_id, item in enumerate(items):
            lls = [_hflm_loglikelihood(peaked_model, tiny_tokenizer, item["context"], delimiter + c) for c in item["choices"]]
            # Per item and per choice, lm-eval's log-likelihood is the model's.
            assert [r[0] for r in samples[doc_id]["filtered_resps"]] == pytest.approx(lls, abs=1e-3)
            correct.append(max(range(len(lls)), key=lls.__getitem__) == item["label"])
        direct = sum(correct) / len(correct)
        assert results["results"][task]["acc,none"] == pytest.approx(direct)
        assert flat[task]["acc"] == pytest.approx(direct)
        assert flat[task]["acc_stderr"] == pytest.approx(results["results"][task]["acc_stderr,none"])
        assert 0 < len(items) <= 25

    # The generated tasks never split one text at two places (next-line and cloze items use
    # different lines), so lm-eval's own logits cache, used by a plain `lm_eval` run, scores them right.
    cached = run_lm_eval(
        peaked_model,
        tiny_tokenizer,
        "pma_next_line,pma_cloze",
        include_path=task_dir,
        logits_cache=True,
        log_samples=True,
        batch_size=4,
    )
    for task in ("pma_next_line", "pma_cloze"):
        lls = {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in results["samples"][task]}
        for sample in cached["samples"][task]:
            assert [r[0] for r in sample["filtered_resps"]] == pytest.approx(lls[sample["doc_id"]], abs=1e-3)


def test_flatten_keeps_filters_and_missing_stderr():
    raw = {
        "results": {
            "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01},
            "wikitext": {"word_perplexity,none": 30.5, "word_perplexity_stderr,none": "N/A", "sample_len": 62},
        }
    }
    assert flatten_lm_eval_results(raw) == {
        "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01},
        "wikitext": {"word_perplexity": 30.5, "word_perplexity_stderr": None},
    }


def test_local_tasks_resolve_without_indexing_builtin_tasks(task_dir):
    names, manager = load_task_manager("pma_tasks", include_path=task_dir)
    assert names == ["pma_tasks"]
    assert set(manager.all_tasks) == {"pma_next_line", "pma_cloze", "pma_tasks"}
    with pytest.raises(FileNotFoundError, match="missing-folder"):
        load_task_manager("pma_cloze", include_path=task_dir / "missing-folder")


# ---------------------------------------------------------------- records and tables


def test_eval_record_round_trip_update_and_card(tmp_path):
    from hf_pma.publishing.card import eval_table

    merged = {"lm": {"loss": 3.0, "perplexity": 20.09, "bits_per_byte": 1.1}, "pma_next_line": {"acc": 0.5, "acc_stderr": 0.1}}
    last = {"lm": {"loss": 3.2, "perplexity": 24.5, "bits_per_byte": 1.2}, "pma_next_line": {"acc": 0.4, "acc_stderr": 0.1}}
    write_eval_record(tmp_path, {"PMA merge": merged}, eval_dataset="heldout.jsonl")
    write_eval_record(tmp_path, {"last snapshot": last})
    record = read_eval_record(tmp_path)
    assert record == {"results": {"PMA merge": merged, "last snapshot": last}, "eval_dataset": "heldout.jsonl"}
    write_eval_record(tmp_path, {"last snapshot": merged}, update=False)
    assert read_eval_record(tmp_path)["results"] == {"last snapshot": merged}
    with pytest.raises(ValueError, match=r"\['x'\]\['lm'\]\['loss'\]"):
        write_eval_record(tmp_path, {"x": {"lm": {"loss": "low"}}})
    assert read_eval_record(tmp_path)["results"] == {"last snapshot": merged}  # untouched by the failure

    # The card (issue 6) reads the record: one row per task/metric, stderr paired.
    write_eval_record(tmp_path, {"PMA merge": merged, "last snapshot": last}, update=False)
    columns, rows = eval_table(read_eval_record(tmp_path))
    assert columns[:2] == ["last snapshot", "PMA merge"]
    acc = next(r for r in rows if r["task"] == "pma_next_line" and r["metric"] == "acc")
    assert acc["values"][:2] == ["0.4000 ± 0.1000", "0.5000 ± 0.1000"]


def test_results_table_rows_are_metrics_columns_are_models():
    table = results_table(
        {
            "snapshot-100": {"lm": {"perplexity": 12.3456}, "t": {"acc": 0.25, "acc_stderr": 0.05}},
            "merged": {"lm": {"perplexity": 11.0}, "t": {"acc": 0.5, "acc_stderr": None}},
        }
    )
    assert markdown_rows(table) == [
        ["metric", "snapshot-100", "merged"],
        ["lm/perplexity", "12.3456", "11.0000"],
        ["t/acc", "0.2500 ± 0.0500", "0.5000"],
    ]
    assert table.splitlines()[1].startswith("| :---")  # a markdown table: labels left, numbers right


def test_lm_eval_runs_no_subprocess_and_leaves_lm_eval_as_it_was(peaked_model, tiny_tokenizer, task_dir, monkeypatch):
    """lm-eval's machine report (git describe, torch's collect_env: pip, nvidia-smi, ...) is skipped
    while hf-pma evaluates, and put back afterwards for the user's own lm-eval runs."""
    import subprocess

    import lm_eval.evaluator

    originals = (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash)
    started = []
    popen_init = subprocess.Popen.__init__

    def spy(self, args, *rest, **kwargs):
        started.append(args)
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", spy)
    results = run_lm_eval(peaked_model, tiny_tokenizer, "pma_cloze", include_path=task_dir, limit=2, batch_size=4)
    assert started == []
    assert "pretty_env_info" not in results and results["results"]["pma_cloze"]["acc,none"] is not None
    assert (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash) == originals
    # the spy sees processes: lm-eval's own report starts some when called outside hf-pma
    storage = {}
    lm_eval.evaluator.add_env_info(storage)
    assert started and "pretty_env_info" in storage
