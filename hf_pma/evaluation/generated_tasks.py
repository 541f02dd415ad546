"""Multiple-choice benchmarks generated from a held-out corpus, for small pre-training runs.

Standard benchmarks sit at chance for a small model early in pre-training; these do not, and
they measure what pre-training teaches: continuing a document. Two kinds, both lm-eval
``multiple_choice`` tasks written as YAML + JSONL (run them with ``hf-pma eval --include-path``
or ``lm_eval --include_path``, offline):

* ``next_line``: a few lines of a held-out document; pick its true next line among lines drawn
  from other held-out documents (of similar length).
* ``cloze``: the same context plus the start of a line with one word removed; pick the word
  (each choice is the word followed by the rest of the line, so both sides count), among words
  drawn from other held-out documents.

No answer can leak from training: items come from the held-out part of
:func:`hf_pma.evaluation.corpus.split_documents`, and every line a choice makes (the true one and the
distractors) is checked against every line of the training documents; an item with any choice
line seen in training is dropped. Output is identical for the same documents and seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from hf_pma.core.outputs import check_overwrite_target, record_own_files
from hf_pma.evaluation.corpus import check_texts, document_id, documents_fingerprint, split_documents
from hf_pma.evaluation.task_options import TASK_KINDS, TaskOptions
from hf_pma.utils.fs import atomic_write_json, check_output_folder, write_folder_atomically
from hf_pma.utils.logs import get_logger
from hf_pma.utils.version import __version__

logger = get_logger(__name__)

__all__ = [
    "TASK_KINDS",
    "TASKS_INFO_NAME",
    "HELDOUT_NAME",
    "TRAIN_NAME",
    "TaskOptions",
    "next_line_items",
    "cloze_items",
    "choice_lines",
    "find_leaks",
    "task_yaml",
    "check_task_settings",
    "make_tasks",
    "make_tasks_from_split",
    "fits_context",
]

# Between context and choice: a choice is a whole next line, or the rest of the current line.
TARGET_DELIMITERS = {"next_line": "\n", "cloze": ""}
TASKS_INFO_NAME = "tasks_info.json"
HELDOUT_NAME = "heldout.jsonl"
TRAIN_NAME = "train.jsonl"

_WORD_RE = re.compile(r"\w{3,}")
_PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


# ---------------------------------------------------------------- lines and leaks


def _usable(line: str, options: TaskOptions) -> bool:
    return options.min_line_chars <= len(line.strip()) <= options.max_line_chars


def _lines_seen_in(candidates: set[str], documents: Iterable[str]) -> set[str]:
    """The candidates (stripped lines) that occur as a line of some document. Streams the documents:
    memory is O(candidates), whatever the size of the training corpus."""
    seen: set[str] = set()
    for doc in documents:
        for line in doc.splitlines():
            stripped = line.strip()
            if stripped in candidates:
                seen.add(stripped)
    return seen


def choice_lines(item: dict[str, Any], target_delimiter: str) -> list[str]:
    """Every text line that the choices of ``item`` make, stripped: the lines of
    ``context + delimiter + choice`` that the choice touches, for each choice."""
    lines = []
    for choice in item["choices"]:
        full = item["context"] + target_delimiter + choice
        start = len(item["context"]) + len(target_delimiter)
        line_start = full.rfind("\n", 0, start) + 1
        lines.extend(line.strip() for line in full[line_start:].split("\n") if line.strip())
    return lines


def find_leaks(
    items: Sequence[dict[str, Any]], train_documents: Iterable[str], target_delimiter: str
) -> list[tuple[int, str]]:
    """``(item index, line)`` for every choice line of ``items`` that is a line of a training
    document (an empty list means no leak)."""
    per_item = [choice_lines(item, target_delimiter) for item in items]
    seen = _lines_seen_in({line for lines in per_item for line in lines}, train_documents)
    return [(i, line) for i, lines in enumerate(per_item) for line in lines if line in seen]


# ---------------------------------------------------------------- item generation


def _pick_distractors(
    rng: random.Random, pool: Sequence[tuple[int, str]], gold: str, doc: int, count: int, key: Any
) -> list[str] | None:
    """``count`` distinct texts from ``pool`` entries of other documents, closest in length to
    ``gold`` among a random sample; ``None`` if the sample has too few."""
    sample = [pool[rng.randrange(len(pool))] for _ in range(8 * count + 8)]
    chosen: dict[str, int] = {}
    for order, (other_doc, text) in enumerate(sample):
        if other_doc != doc and key(text) != key(gold) and key(text) not in {key(t) for t in chosen}:
            chosen[text] = order
    if len(chosen) < count:
        return None
    ranked = sorted(chosen, key=lambda text: (abs(len(text) - len(gold)), chosen[text]))
    return ranked[:count]


def _with_gold(rng: random.Random, gold: str, distractors: list[str]) -> tuple[list[str], int]:
    label = rng.randrange(len(distractors) + 1)
    return distractors[:label] + [gold] + distractors[label:], label


def fits_context(tokenizer: Any, max_tokens: int) -> Callable[[str], bool]:
    """A ``fits`` test for the item generators: the text is at most ``max_tokens`` tokens long
    (no special tokens), so that a model with that context scores it without truncation."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")

    def fits(text: str) -> bool:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_tokens

    return fits


def _item_fits(fits: Callable[[str], bool] | None, context: str, choices: Sequence[str], kind: str) -> bool:
    return fits is None or all(fits(context + TARGET_DELIMITERS[kind] + choice) for choice in choices)


def next_line_items(
    heldout: Sequence[str],
    seen_in_train: set[str],
    options: TaskOptions,
    rng: random.Random,
    fits: Callable[[str], bool] | None = None,
) -> list[dict[str, Any]]:
    """Next-line items from ``heldout`` documents. ``seen_in_train`` holds the stripped lines
    that training documents contain: such lines are never used as a choice. With ``fits``, an
    item is kept only when ``fits(context + delimiter + choice)`` for every choice (see
    :func:`fits_context`)."""
    doc_lines = [doc.splitlines() for doc in heldout]

    def answer(line: str) -> bool:
        return _usable(line, options) and line.strip() not in seen_in_train

    pool = list(
        dict.fromkeys(
            (j, line.rstrip()) for j, lines in enumerate(doc_lines) for line in lines if answer(line)
        )
    )
    k = options.context_lines
    positions = [
        (j, i)
        for j, lines in enumerate(doc_lines)
        for i in range(k, len(lines))
        if answer(lines[i]) and lines[i - 1].strip()
    ]
    rng.shuffle(positions)
    items, done = [], set()
    for j, i in positions:
        if len(items) == options.num_items:
            break
        lines = doc_lines[j]
        context, gold = "\n".join(lines[i - k : i]).rstrip(), lines[i].rstrip()
        if (context, gold) in done:
            continue
        distractors = _pick_distractors(rng, pool, gold, j, options.num_choices - 1, key=str.strip)
        if distractors is None:
            continue
        choices, label = _with_gold(rng, gold, distractors)
        if not _item_fits(fits, context, choices, "next_line"):
            continue
        done.add((context, gold))
        items.append(
            {
                "id": f"next_line-{len(items)}",
                "doc": j,
                "line": i,
                "context": context,
                "choices": choices,
                "label": label,
            }
        )
    return items


def cloze_items(
    heldout: Sequence[str],
    seen_in_train: set[str],
    options: TaskOptions,
    rng: random.Random,
    train_documents: Iterable[str] = (),
    exclude: set[tuple[int, int]] = frozenset(),
    fits: Callable[[str], bool] | None = None,
) -> list[dict[str, Any]]:
    """Cloze items from ``heldout`` documents: context + the start of a line; each choice is a
    word + the rest of that line. Lines in ``seen_in_train`` are never used; the lines that
    distractor words make are checked against ``train_documents`` and items with one seen there
    are dropped. ``exclude`` holds ``(doc, line)`` positions not to use (those of next-line items:
    the same text split at two places trips lm-eval's logits cache, see :mod:`hf_pma.evaluation.harness`).
    ``fits`` as in :func:`next_line_items`."""
    doc_lines = [doc.splitlines() for doc in heldout]
    k = options.context_lines
    words = list(
        dict.fromkeys(
            (j, m.group(0))
            for j, lines in enumerate(doc_lines)
            for line in lines
            for m in _WORD_RE.finditer(line)
        )
    )
    positions = [
        (j, i)
        for j, lines in enumerate(doc_lines)
        for i in range(k, len(lines))
        if (j, i) not in exclude
        and _usable(lines[i], options)
        and lines[i].strip() not in seen_in_train
        and _WORD_RE.search(lines[i])
    ]
    rng.shuffle(positions)
    # Over-generate: some items fall out below when a distractor's line turns out to be in train.
    wanted = options.num_items + options.num_items // 2 + 8
    items, done = [], set()
    for j, i in positions:
        if len(items) == wanted or not words:
            break
        line = doc_lines[j][i].rstrip()
        matches = list(_WORD_RE.finditer(line))
        match = matches[rng.randrange(len(matches))]
        head, gold, rest = line[: match.start()], match.group(0), line[match.end() :]
        context = "\n".join(doc_lines[j][i - k : i]) + "\n" + head
        if not context.strip() or (context, gold) in done:
            continue
        distractors = _pick_distractors(rng, words, gold, j, options.num_choices - 1, key=lambda w: w)
        if distractors is None:
            continue
        choices, label = _with_gold(rng, gold + rest, [w + rest for w in distractors])
        if not _item_fits(fits, context, choices, "cloze"):
            continue
        done.add((context, gold))
        items.append({"doc": j, "line": i, "context": context, "choices": choices, "label": label})
    leaking = {index for index, _ in find_leaks(items, train_documents, TARGET_DELIMITERS["cloze"])}
    kept = [item for index, item in enumerate(items) if index not in leaking][: options.num_items]
    return [{"id": f"cloze-{n}", **item} for n, item in enumerate(kept)]


# ---------------------------------------------------------------- files


def task_yaml(task_name: str, data_file: Path, kind: str, tag: str | None = None) -> dict[str, Any]:
    """The lm-eval task config of a generated task (``data_file`` must be absolute: lm-eval
    resolves relative data files against the working directory, not the YAML)."""
    config: dict[str, Any] = {
        "task": task_name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": TARGET_DELIMITERS[kind],
        "num_fewshot": 0,
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0, "generator": f"hf-pma {__version__}", "kind": kind},
    }
    if tag:
        config["tag"] = [tag]
    return config


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def check_task_settings(kinds: Sequence[str], prefix: str, options: TaskOptions) -> None:
    """``ValueError`` naming the first bad setting (checked before any document is read)."""
    options.validate()
    unknown = [k for k in kinds if k not in TASK_KINDS]
    if unknown or not kinds:
        raise ValueError(
            f"unknown task kind(s) {list(unknown or kinds)}; choose from {', '.join(TASK_KINDS)}"
        )
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix {prefix!r} must be letters, digits and underscores, starting with a letter")


def _write_tasks(
    train: Sequence[str],
    heldout: Sequence[str],
    output_dir: Path,
    seed: int,
    kinds: Sequence[str],
    options: TaskOptions,
    prefix: str,
    write_train: bool,
    overwrite: bool,
    info: dict[str, Any],
    fits: Callable[[str], bool] | None = None,
    eval_texts: Sequence[str] | None = None,
) -> dict[str, Any]:
    check_task_settings(kinds, prefix, options)
    if not heldout:
        raise ValueError("no held-out documents to make tasks from")
    eval_texts = list(heldout if eval_texts is None else eval_texts)
    check_texts(eval_texts)
    check_output_folder(output_dir, overwrite)
    if overwrite:  # only an earlier task folder: never a checkpoint, a snapshot or the user's folder
        check_overwrite_target(output_dir, (TASKS_INFO_NAME,), "tasks")

    candidates = {line.strip() for doc in heldout for line in doc.splitlines() if _usable(line, options)}
    seen_in_train = _lines_seen_in(candidates, train)
    logger.info(
        f"{len(candidates)} distinct usable lines in {len(heldout)} held-out documents; "
        f"{len(seen_in_train)} of them also occur in the {len(train)} training documents and are never a choice"
    )
    generated, used = {}, set()
    for kind in sorted(kinds, key=TASK_KINDS.index):  # next_line first: cloze avoids its lines
        rng = random.Random(f"hf-pma/{kind}/{seed}")
        if kind == "next_line":
            items = next_line_items(heldout, seen_in_train, options, rng, fits=fits)
            used = {(item["doc"], item["line"]) for item in items}
        else:
            items = cloze_items(heldout, seen_in_train, options, rng, train, exclude=used, fits=fits)
        leaks = find_leaks(items, train, TARGET_DELIMITERS[kind])
        if leaks:  # the generators exclude these; this is the independent check
            raise RuntimeError(
                f"{kind}: {len(leaks)} choice line(s) occur in the training documents, e.g. {leaks[0][1]!r}"
            )
        if not items:
            raise ValueError(
                f"{kind}: the held-out documents give no usable item (lines of {options.min_line_chars} to "
                f"{options.max_line_chars} characters, not in training, with {options.context_lines} lines before "
                f"them and {options.num_choices - 1} distractors from other documents); lower min_line_chars or "
                "raise eval_fraction"
            )
        if len(items) < options.num_items:
            logger.warning(f"{kind}: only {len(items)} items (asked for {options.num_items})")
        generated[kind] = items

    tasks = {
        f"{prefix}_{kind}": {"kind": kind, "items": len(items), "num_choices": options.num_choices}
        for kind, items in generated.items()
    }
    record = {
        "hf_pma_version": __version__,
        **info,
        "seed": seed,
        "num_train_documents": len(train),
        "num_heldout_documents": len(heldout),
        "options": dataclasses.asdict(options),
        "tasks": tasks,
        "tag": f"{prefix}_tasks",
        "heldout_ids": [document_id(doc) for doc in heldout],
        # What heldout.jsonl holds: the texts a run scores (a part of each document), which
        # `hf-pma eval --eval-file` scores again; its fingerprint is the one its records carry.
        "heldout_file": {"documents": len(eval_texts), "fingerprint": documents_fingerprint(eval_texts)},
    }

    def write(tmp: Path) -> None:
        for kind, items in generated.items():
            name = f"{prefix}_{kind}"
            _write_jsonl(tmp / f"{name}.jsonl", items)
            config = task_yaml(name, output_dir / f"{name}.jsonl", kind, tag=f"{prefix}_tasks")
            (tmp / f"{name}.yaml").write_text(
                yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8"
            )
        _write_jsonl(tmp / HELDOUT_NAME, ({"text": doc} for doc in eval_texts))
        if write_train:
            _write_jsonl(tmp / TRAIN_NAME, ({"text": doc} for doc in train))
        atomic_write_json(tmp / TASKS_INFO_NAME, record_own_files(tmp, record, TASKS_INFO_NAME))

    # Claimed exclusively while written; what --overwrite replaces is checked again at the replace.
    write_folder_atomically(
        output_dir, write, overwrite=overwrite,
        check_replaced=lambda folder: check_overwrite_target(folder, (TASKS_INFO_NAME,), "tasks"),
    )
    summary = ", ".join(f"{name} ({task['items']} items)" for name, task in tasks.items())
    logger.info(f"Wrote {summary} to {output_dir}")
    return record


def make_tasks_from_split(
    train: Sequence[str],
    heldout: Sequence[str],
    output_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    kinds: Sequence[str] = TASK_KINDS,
    options: TaskOptions | None = None,
    prefix: str = "pma",
    write_train: bool = False,
    overwrite: bool = False,
    info: dict[str, Any] | None = None,
    fits: Callable[[str], bool] | None = None,
    eval_texts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write tasks generated from ``heldout`` (checked against ``train``) into ``output_dir``.

    Writes ``<prefix>_<kind>.yaml`` + ``.jsonl`` per kind (tagged ``<prefix>_tasks``, so
    ``--tasks <prefix>_tasks`` runs them all), ``heldout.jsonl`` (``eval_texts``, default the
    held-out documents, ``{"text": ...}`` per line: the data for ``hf-pma eval --eval-file``; a
    run passes the texts it scores, so that the file reproduces its numbers), ``train.jsonl`` with
    ``write_train``, and ``tasks_info.json`` (returned; ``info`` is added to it). The folder
    appears complete or not at all. Raises ``ValueError`` when a kind yields no item, and
    ``FileExistsError`` for a non-empty ``output_dir`` without ``overwrite``. ``fits`` keeps only
    items whose every choice, with its context, passes it: ``fits_context(tokenizer, context
    length)`` sizes the tasks for a model, so that lm-eval never truncates them. Under several
    processes this runs on the main process only (see :mod:`hf_pma.utils.distributed`).
    """
    from hf_pma.utils.distributed import run_on_main_process

    return run_on_main_process(
        _write_tasks,
        train,
        heldout,
        Path(output_dir).absolute(),
        seed,
        kinds,
        options or TaskOptions(),
        prefix,
        write_train,
        overwrite,
        info or {},
        fits,
        eval_texts,
    )


def make_tasks(
    documents: Sequence[str],
    output_dir: str | os.PathLike[str],
    *,
    eval_fraction: float = 0.1,
    seed: int = 0,
    kinds: Sequence[str] = TASK_KINDS,
    options: TaskOptions | None = None,
    prefix: str = "pma",
    write_train: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Split ``documents`` with :func:`~hf_pma.evaluation.corpus.split_documents` (``eval_fraction``,
    ``seed``) and write tasks from the held-out part; see :func:`make_tasks_from_split`.

    Train on the same split (``split_documents(documents, eval_fraction, seed)[0]``, or the
    ``train.jsonl`` that ``write_train`` writes), so that no task answer is trained on.
    """
    train, heldout = split_documents(documents, eval_fraction=eval_fraction, seed=seed)
    return make_tasks_from_split(
        train,
        heldout,
        output_dir,
        seed=seed,
        kinds=kinds,
        options=options,
        prefix=prefix,
        write_train=write_train,
        overwrite=overwrite,
        info={"eval_fraction": eval_fraction, "num_documents": len(documents)},
    )
