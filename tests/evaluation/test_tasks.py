"""Corpus reading and splitting; generated tasks: no leak from training, determinism, right answers."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from hf_pma.cli import main
from hf_pma.evaluation.corpus import document_id, load_documents, split_documents
from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks
from tests.helpers.data import BOILERPLATE, corpus


def _items(folder, name):
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_order_free():
    docs = corpus()
    docs.append(docs[3])  # a copy: both copies must land on the same side
    train, heldout = split_documents(docs, eval_fraction=0.2, seed=7)
    assert (train, heldout) == split_documents(docs, eval_fraction=0.2, seed=7)
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(docs)
    assert len(heldout) == -(-len(set(docs)) * 2 // 10)  # ceil(0.2 * distinct)
    # Train keeps both copies of a document, held-out one.
    assert len(train) + len(heldout) == len(docs) - (docs[3] in heldout)
    assert train.count(docs[3]) in (0, 2) and heldout.count(docs[3]) in (0, 1)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    train2, heldout2 = split_documents(shuffled, eval_fraction=0.2, seed=7)
    assert set(heldout2) == set(heldout) and sorted(train2) == sorted(train)
    assert set(split_documents(docs, eval_fraction=0.2, seed=8)[1]) != set(heldout)


def test_split_rejects_bad_input():
    with pytest.raises(ValueError, match="eval_fraction"):
        split_documents(["a", "b"], eval_fraction=1.0)
    with pytest.raises(ValueError, match="2 distinct"):
        split_documents(["a", "a"], eval_fraction=0.5)
    with pytest.raises(ValueError, match="document 1"):
        split_documents(["a", 2], eval_fraction=0.5)


# ---------------------------------------------------------------- tasks


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    docs = corpus()
    info = make_tasks(docs, root / "a", eval_fraction=0.25, seed=11, options=TaskOptions(num_items=40))
    return docs, root, info


def test_no_choice_line_occurs_in_training_documents(generated):
    docs, root, info = generated
    train, heldout = split_documents(docs, eval_fraction=0.25, seed=11)
    train_lines = {line.strip() for doc in train for line in doc.splitlines()}
    heldout_lines = {line.strip() for doc in heldout for line in doc.splitlines() if len(line.strip()) >= 16}
    # The check matters: held-out documents share usable lines with training ones.
    assert {b.strip() for b in BOILERPLATE} <= train_lines
    assert len(heldout_lines & train_lines) > len(BOILERPLATE)
    for name, delimiter in (("pma_next_line", "\n"), ("pma_cloze", "")):
        items = _items(root / "a", name)
        assert len(items) == 40
        for item in items:
            for choice in item["choices"]:
                line = (item["context"] + delimiter + choice).split("\n")[-1].strip()
                assert line not in train_lines, (name, item["id"], line)
    assert [document_id(d) for d in heldout] == info["heldout_ids"]
    written = [json.loads(line)["text"] for line in (root / "a" / "heldout.jsonl").read_text().splitlines()]
    assert written == heldout and not set(written) & set(train)


def test_items_hold_the_true_continuation(generated):
    docs, root, _ = generated
    _, heldout = split_documents(docs, eval_fraction=0.25, seed=11)
    used = set()
    for name, delimiter in (("pma_next_line", "\n"), ("pma_cloze", "")):
        for item in _items(root / "a", name):
            lines = heldout[item["doc"]].splitlines()
            i = item["line"]
            truth = "\n".join(lines[i - 3 : i]).rstrip() if name == "pma_next_line" else "\n".join(lines[i - 3 : i])
            truth += "\n" + lines[i].rstrip()
            assert item["context"] + delimiter + item["choices"][item["label"]] == truth
            assert len(item["choices"]) == 4 == len({c.strip() for c in item["choices"]})
            assert (item["doc"], i) not in used  # one item per line over both tasks
            used.add((item["doc"], i))
    labels = [item["label"] for item in _items(root / "a", "pma_next_line")]
    assert len(set(labels)) == 4  # the answer's position varies


def test_same_seed_same_output_other_seed_other_output(generated):
    docs, root, _ = generated
    make_tasks(docs, root / "b", eval_fraction=0.25, seed=11, options=TaskOptions(num_items=40))
    make_tasks(docs, root / "c", eval_fraction=0.25, seed=12, options=TaskOptions(num_items=40))
    for name in ("pma_next_line.jsonl", "pma_cloze.jsonl", "heldout.jsonl", "tasks_info.json"):
        assert (root / "a" / name).read_bytes() == (root / "b" / name).read_bytes(), name
    for name in ("pma_next_line.yaml", "pma_cloze.yaml"):
        text_a = (root / "a" / name).read_text().replace(str(root / "a"), "DIR")
        assert text_a == (root / "b" / name).read_text().replace(str(root / "b"), "DIR")
        assert str(root / "a" / name.replace(".yaml", ".jsonl")) in (root / "a" / name).read_text()
    assert (root / "a" / "pma_next_line.jsonl").read_bytes() != (root / "c" / "pma_next_line.jsonl").read_bytes()


def test_bad_requests_leave_nothing_behind(generated, tmp_path):
    docs, root, _ = generated
    before = sorted(p.name for p in (root / "a").iterdir())
    with pytest.raises(FileExistsError, match="not empty"):
        make_tasks(docs, root / "a", seed=1)
    assert sorted(p.name for p in (root / "a").iterdir()) == before
    with pytest.raises(ValueError, match="unknown task kind"):
        make_tasks(docs, tmp_path / "x", kinds=["next_line", "riddle"])
    with pytest.raises(ValueError, match="no usable item"):
        make_tasks(docs, tmp_path / "y", options=TaskOptions(min_line_chars=190, max_line_chars=200))
    assert list(tmp_path.iterdir()) == []  # no output folder, no temporary folder


def test_make_tasks_cli(tmp_path, capsys):
    source = tmp_path / "corpus"
    source.mkdir()
    for i, doc in enumerate(corpus()):
        (source / f"doc{i:03d}.py").write_text(doc)
    (source / "blob.bin").write_bytes(b"\x00\x01binary")
    (source / ".hidden.txt").write_text("hidden")
    out = tmp_path / "tasks"
    args = ["make-tasks", str(source), "-o", str(out), "--eval-fraction", "0.3", "--num-items", "10", "--write-train"]
    assert main(args) == 0
    assert "pma_next_line: 10 items" in capsys.readouterr().out
    docs = load_documents(source)
    assert len(docs) == len(corpus())
    train = [json.loads(line)["text"] for line in (out / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line)["text"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert (train, heldout) == split_documents(docs, eval_fraction=0.3, seed=0)
    assert main(args) == 2
    assert "not empty" in capsys.readouterr().err
    assert main([*args[:2], "-o", str(tmp_path / "z"), "--kinds", "riddle"]) == 2
    assert "riddle" in capsys.readouterr().err


# ---------------------------------------------------------------- reading documents


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: os.mkfifo(p), "is not a regular file (a FIFO)"),  # a plain read would hang
        (lambda p: p.symlink_to(p.parent / "nowhere"), "is a symbolic link to nothing (a dangling link)"),
    ],
    ids=["fifo", "dangling-link"],
)
def test_a_document_source_that_is_no_file_says_what_it_is(tmp_path, make, said):
    """A source that exists but is neither a file nor a folder is refused in one line saying what
    it is (it used to be called missing, or tried as a dataset name), and never read."""
    for name in ("heldout.jsonl", "heldout"):  # the second looks like a dataset name
        source = tmp_path / name
        make(source)
        with pytest.raises(ValueError, match=re.escape(said)) as err:
            load_documents(source)
        assert name in str(err.value) and "\n" not in str(err.value)
        source.unlink()


def test_load_documents_from_files(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "b.csv").write_text('text,n\n"three, with comma",1\n')
    (tmp_path / "c.txt").write_text("four\nlines")
    (tmp_path / "d.json").write_text(json.dumps([{"body": "five"}]))
    assert load_documents([tmp_path / "a.jsonl", tmp_path / "b.csv", tmp_path / "c.txt"]) == [
        "one",
        "two",
        "three, with comma",
        "four\nlines",
    ]
    assert load_documents(tmp_path / "d.json", text_column="body") == ["five"]
    assert load_documents(tmp_path / "a.jsonl", limit=1) == ["one"]
    with pytest.raises(ValueError, match=r"d\.json.*'text'.*body"):
        load_documents(tmp_path / "d.json")
    import datasets

    datasets.Dataset.from_dict({"text": ["six", "seven"]}).to_parquet(str(tmp_path / "e.parquet"))
    assert load_documents(tmp_path / "e.parquet") == ["six", "seven"]
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"body": ["eight"]})}).save_to_disk(str(tmp_path / "saved"))
    assert load_documents(tmp_path / "saved", text_column="body", split="test") == ["eight"]
    with pytest.raises(ValueError, match="no split 'train'"):
        load_documents(tmp_path / "saved", text_column="body")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_documents(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="data/missing.jsonl"):
        load_documents("data/missing.jsonl")


def test_tasks_sized_to_a_context_fit_it(tiny_tokenizer, tmp_path):
    """With fits_context, every choice with its context is at most that many tokens (what lm-eval
    scores without truncating); without it, some items of the same corpus are longer."""
    from hf_pma.evaluation.generated_tasks import fits_context, make_tasks_from_split

    train, heldout = split_documents(corpus(), eval_fraction=0.25, seed=11)
    options = TaskOptions(num_items=30)
    limit = 48

    def lengths(folder):
        out = []
        for name, delimiter in (("pma_next_line", "\n"), ("pma_cloze", "")):
            for item in _items(folder, name):
                for choice in item["choices"]:
                    text = item["context"] + delimiter + choice
                    out.append(len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]))
        return out

    make_tasks_from_split(train, heldout, tmp_path / "free", seed=3, options=options)
    make_tasks_from_split(train, heldout, tmp_path / "sized", seed=3, options=options, fits=fits_context(tiny_tokenizer, limit))
    assert max(lengths(tmp_path / "free")) > limit
    sized = lengths(tmp_path / "sized")
    assert sized and max(sized) <= limit
    with pytest.raises(ValueError, match="max_tokens"):
        fits_context(tiny_tokenizer, 1)
