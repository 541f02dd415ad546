"""hf_pma.utils.names: the one reading of a Hub id, and of a schedule's name."""

from __future__ import annotations

import pytest
import transformers

from hf_pma.utils.names import is_hub_id, parse_hub_id, scheduler_name


@pytest.mark.parametrize(
    "text, bare, expected",
    [
        ("EleutherAI/pythia-160m", False, ("EleutherAI/pythia-160m", None)),
        ("EleutherAI/pythia-160m@step1000", False, ("EleutherAI/pythia-160m", "step1000")),
        ("org/model@refs/pr/3", False, ("org/model", "refs/pr/3")),
        ("gpt2", False, None),  # a bare name only where the caller takes one
        ("gpt2", True, ("gpt2", None)),
        ("./org/model", False, None),
        ("/abs/model", False, None),
        ("~/model", True, None),
        ("a/b/c", False, None),
        ("org\\model", False, None),
        ("data/train.jsonl", True, None),  # a file, although the Hub's rule would take it
        ("notes.txt", True, None),
        ("org/model--x", False, None),  # the Hub's own rule: no -- or ..
        ("org/-model", False, None),
        ("org/model@", False, None),
        ("org/model@a@b", False, None),
        ("org/mo del", False, None),
        (None, True, None),
        (3, True, None),
    ],
)
def test_parse_hub_id(text, bare, expected):
    assert parse_hub_id(text, bare) == expected
    assert is_hub_id(text, bare) is (expected is not None and expected[1] is None)


def test_the_merge_reads_hub_ids_through_the_one_function():
    from hf_pma.merging.hub_revisions import is_hub_spec, parse_hub_spec

    assert parse_hub_spec("org/m@rev") == parse_hub_id("org/m@rev") and not is_hub_spec("org/m--x")


def test_scheduler_name_is_the_string_before_and_after_post_init(tmp_path):
    args = transformers.TrainingArguments(
        str(tmp_path), lr_scheduler_type="constant_with_warmup", report_to=[]
    )
    assert isinstance(args.lr_scheduler_type, transformers.SchedulerType)
    assert scheduler_name(args) == "constant_with_warmup"

    class Plain:
        lr_scheduler_type = "cosine"

    assert scheduler_name(Plain()) == "cosine"
