"""The manual runs: every Python snippet and shell command block of README.md and docs/ is
executed, page by page and in order, in a temporary working folder that holds what users have
there (:func:`doc_folder`): a short real default run of ``scripts/pretrain.py``
(``runs/pma-tiny``), a user's Trainer checkpoints (``out/``) and a folder of text files.

A block that cannot run here is marked so in the Markdown source, visibly, right before it::

    <!-- not run: needs the Hub -->
    <!-- not run: a fragment of your own script; given: model, args, ds -->

and is checked instead: a Python block compiles and uses no name that neither it, an earlier
block of its page, the builtins nor the marker's ``given:`` list defines; each ``hf-pma`` command
of a shell block is parsed by the real parser (``hf_pma.cli.build_parser``), each
``scripts/pretrain.py`` command's flags are options of the script, each ``pip install`` names
extras that exist. Training runs are parse-checked only (the suite's time budget).

The blocks are found by `Sybil <https://sybil.readthedocs.io>`_ (its Markdown lexers: fenced
blocks with their language, line numbers, the document's shared namespace), a maintained
documentation-testing tool that, unlike pytest-markdown-docs or pytest-examples, hands each
block to an evaluator of our own: shell blocks run through ``tests.helpers.cli.run_cli`` in
this process (no process start per command), and the "not run" marker and the shared run folder
are ours.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import glob
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser

from hf_pma import cli
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.repo import REPO_ROOT

# How the pages spell the command: the parser's program name, or ``-m`` and the CLI's module.
PROG, CLI_MODULE = cli.build_parser().prog, cli.__name__
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->", re.S)
RUN_LANGUAGES = ("python", "bash")

@pytest.fixture(scope="module")
def doc_folder(tmp_path_factory) -> Path:
    """What the pages' commands read, made once and the way users make it: ``runs/pma-tiny`` by a
    real run of ``scripts/pretrain.py`` with the default's names
    (:func:`tests.helpers.pretrain_runs.docs_default_run`: snapshots, merge, ``final/``,
    ``annealed/``, ``tasks/``, and nothing the script does not write), ``out/checkpoint-*`` by a
    user's plain ``Trainer`` script (a checkpoint every 10 steps), ``data/`` (a folder of text
    files) and ``heldout.jsonl`` (the run's held-out file, copied as a user would)."""
    from transformers import Trainer, TrainingArguments

    from tests.helpers.pretrain_runs import docs_default_run
    from tests.helpers.training import lm_setup, quiet_args

    root = tmp_path_factory.mktemp("docs-run")
    run = docs_default_run(root)
    shutil.copy(run / "tasks" / "heldout.jsonl", root / "heldout.jsonl")
    model, tokenizer, train, _, collator = lm_setup()
    arguments = quiet_args(max_steps=50, save_strategy="steps", save_steps=10, learning_rate=1e-3)
    user_trainer = Trainer(
        model, TrainingArguments(output_dir=str(root / "out"), **arguments), train_dataset=train,
        data_collator=collator, processing_class=tokenizer,
    )  # fmt: skip
    user_trainer.train()
    data = root / "data"
    data.mkdir()
    lines = sample_text(30_000).splitlines()
    for n in range(0, len(lines), 40):
        (data / f"doc{n // 40:03d}.txt").write_text("\n".join(lines[n : n + 40]))
    return root


def _marker(example) -> str | None:
    """The reason of the ``<!-- not run: ... -->`` marker right before ``example``, if any."""
    before = example.document.text[: example.start].rstrip()
    comment = before[before.rfind("<!--") :] if before.endswith("-->") else ""
    found = NOT_RUN.fullmatch(comment)
    return found.group(1) if found else None


def _given(reason: str) -> set[str]:
    found = re.search(r"given:\s*([\w ,]+)", reason)
    return {name.strip() for name in found.group(1).split(",")} if found else set()


def _names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names a snippet defines, names it reads), loosely: every scope at once."""
    defined, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return defined, read


def _check_python(source: str, where: str, known: set[str]) -> set[str]:
    """Compile ``source`` and check that every name it reads is defined (by it, ``known`` or the
    builtins); returns the names it defines."""
    tree = ast.parse(source, where)
    compile(tree, where, "exec")
    defined, read = _names(tree)
    undefined = read - defined - known - set(dir(builtins))
    assert not undefined, f"{where}: names used but never defined: {sorted(undefined)}"
    return defined


def _commands(source: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``&&`` split."""
    commands = []
    for line in source.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1 :]
    return commands


def _pretrain_options() -> set[str]:
    """The flags of scripts/pretrain.py: the fields of its argument dataclasses (``--name``, and
    ``--no_name`` for a boolean)."""
    import dataclasses

    from tests.helpers.repo import load_pretrain_script

    script = load_pretrain_script()
    classes = [v for v in vars(script).values() if isinstance(v, type) and dataclasses.is_dataclass(v)]
    fields = [f for cls in classes for f in dataclasses.fields(cls)]
    return {"--help"} | {f"--{f.name}" for f in fields} | {f"--no_{f.name}" for f in fields}


def _extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _parse_check(words: list[str], where: str) -> None:
    """A command that is not run: its options parsed by the real parser where there is one."""
    env = 0
    while env < len(words) and re.fullmatch(r"\w+=\S*", words[env]):
        env += 1
    words = words[env:]
    if not words:
        return
    if words[0] == PROG or CLI_MODULE in words:
        args = words[1:] if words[0] == PROG else words[words.index(CLI_MODULE) + 1 :]
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                cli.build_parser().parse_args(args)
            except SystemExit as exit:
                assert exit.code == 0, f"{where}: `hf-pma {shlex.join(args)}`: {err.getvalue().strip()}"
    elif "scripts/pretrain.py" in words:
        args = words[words.index("scripts/pretrain.py") + 1 :]
        if "--config_file" in words:
            assert (REPO_ROOT / words[words.index("--config_file") + 1]).is_file(), f"{where}: {words}"
        options = _pretrain_options()
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in options]
        assert not unknown, f"{where}: scripts/pretrain.py has no option {unknown}"
        if args and not args[0].startswith("-") and args[0].endswith((".yaml", ".json")) and "/" in args[0]:
            assert (REPO_ROOT / args[0]).is_file(), f"{where}: no config file {args[0]}"
    elif words[:2] == ["pip", "install"]:
        for spec in words[2:]:
            extras = re.search(r"\[([\w,-]+)\]", spec)
            if extras:
                missing = set(extras.group(1).split(",")) - _extras()
                assert not missing, f"{where}: pyproject.toml has no extra {sorted(missing)}"
    elif words[0] == "python" and words[1:2] and words[1].endswith(".py"):
        assert (REPO_ROOT / words[1]).is_file(), f"{where}: no {words[1]}"


def _run_shell(words: list[str], where: str) -> str:
    env = {}
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[0] == PROG, (
        f"{where}: `{shlex.join(words)}` cannot run in the suite: mark the block `<!-- not run: why -->`"
    )
    args = [a for w in words[1:] for a in (sorted(glob.glob(w)) or [w] if "*" in w else [w])]
    done = run_cli(*args, env=env or None)
    assert done.returncode == 0, f"{where}: `{shlex.join(words)}` failed:\n{done.stderr[-3000:]}"
    return done.stdout


class _Page:
    """Evaluates one page's blocks in order, in one namespace."""

    def __init__(self, produced: tuple[str, dict, Path] | None = None) -> None:
        self.produced = produced  # (a block's source, its namespace, its run folder): run once, by a fixture
        self.namespace: dict = {"__name__": "__docs__"}
        self.known: set[str] = set()
        self.ran: list[str] = []
        self.printed: dict[str, str] = {}  # what each command run printed, by its text
        self.checked: list[str] = []

    def __call__(self, example) -> None:
        language = example.region.lexemes["arguments"]
        where = f"{example.path.rsplit('/', 1)[-1]}:{example.line}"
        source = str(example.parsed)
        source = "\n".join(
            line[min((len(x) - len(x.lstrip()) for x in source.splitlines() if x.strip()), default=0) :]
            for line in source.splitlines()
        )
        reason = _marker(example)
        if language == "python":
            self.known |= _check_python(
                source, where, self.known | set(self.namespace) | _given(reason or "")
            )
            if reason is None and self.produced is not None and self.produced[0] == str(example.parsed):
                self.namespace.update(self.produced[1])
                shutil.copytree(self.produced[2], "run")
            elif reason is None:
                exec(compile(source, where, "exec"), self.namespace)
        else:
            for words in _commands(source):
                if reason is None:
                    self.printed[shlex.join(words)] = _run_shell(words, where)
                else:
                    _parse_check(words, where)
        (self.checked if reason else self.ran).append(where)


SYBIL = Sybil(parsers=[CodeBlockParser(language) for language in RUN_LANGUAGES])
ALL_PAGES = sorted(
    p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").rglob("*.md") if "hooks" not in p.parts
)
PAGES = [
    page
    for page in [
        "README.md",
        *sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").rglob("*.md")),
    ]
    if list(SYBIL.parse(REPO_ROOT / page))
]


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs(page, doc_folder, tmp_path, monkeypatch, request):
    """Every block of ``page``, in order, in a copy of :func:`doc_folder` (the callback page's
    training example is run once, by :func:`callback_run`)."""
    document = SYBIL.parse(REPO_ROOT / page)
    examples = list(document)
    shutil.copytree(doc_folder, tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    produced = None
    if page == "docs/callback.md":
        namespace, run = request.getfixturevalue("callback_run")
        produced = (str(examples[0].parsed), namespace, run)
    evaluate = _Page(produced)
    for example in examples:
        evaluate(example)
    for example in OUTPUTS.parse(REPO_ROOT / page):
        command = _output_of(example)
        if command is not None:  # a command's output shown: the page's run of that command printed it
            assert command in evaluate.printed, f"{page}:{example.line}: no command `{command}` ran before"
            shown = str(example.parsed).strip()
            assert shown in evaluate.printed[command], (
                f"{page}:{example.line}: shows\n{shown}\nprinted:\n{evaluate.printed[command]}"
            )


# --- Output shown on a page is real (and checked) or said to be an example ----------------------

OUTPUTS = Sybil(parsers=[CodeBlockParser("text"), CodeBlockParser("console")])
OUTPUT_OF = re.compile(r"<!--\s*output of:\s*(.*?)\s*-->", re.S)
EXAMPLE = re.compile(r"\b(for example|e\.g\.|for instance)", re.I)
LAYOUT = re.compile(r"(<output_dir>|run/|snapshot-<|<!--)")


def _output_of(example) -> str | None:
    """The command of the ``<!-- output of: CMD -->`` marker right before ``example``, if any."""
    before = example.document.text[: example.start].rstrip()
    found = OUTPUT_OF.fullmatch(before[before.rfind("<!--") :]) if before.endswith("-->") else None
    return found.group(1) if found else None


def _output_blocks() -> list[tuple[str, object]]:
    return [(page, e) for page in ["README.md", *ALL_PAGES] for e in OUTPUTS.parse(REPO_ROOT / page)]


def test_output_shown_is_checked_or_an_example():
    """A ``text`` block that shows what something printed is either checked (``<!-- output of:
    CMD -->``: the page runs CMD and the test compares; ``<!-- quoted: ... -->`` names the test that
    checks it), or the sentence before it says "for example"; file layouts (paths) are neither.
    Output blocks are fenced ``text`` (a test of this file finds unlabelled fences)."""
    unlabelled = []
    for page in ["README.md", *ALL_PAGES]:
        inside = False
        for n, line in enumerate((REPO_ROOT / page).read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                if not inside and line.strip() == "```":
                    unlabelled.append(f"{page}:{n}")
                inside = not inside
    wrong = []
    for page, example in _output_blocks():
        before = example.document.text[: example.start].rstrip()
        first = str(example.parsed).lstrip().split("\n", 1)[0]
        if (
            LAYOUT.match(first)
            or _output_of(example) is not None
            or re.search(r"<!--\s*quoted:[^>]*-->\Z", before)
        ):
            continue
        if not EXAMPLE.search(before.rsplit("\n\n", 1)[-1]):  # the paragraph before it
            wrong.append(f"{page}:{example.line}")
    assert not wrong, f"output blocks neither checked nor said to be an example: {wrong}"
    assert not unlabelled, f"fenced blocks without a language: {unlabelled}"


PLAIN_RULE = re.compile(r"^-{3,}(  +-{3,})+$", re.M)  # text_table's rule under its header


def test_example_outputs_are_shown_as_the_commands_print_them():
    """hf-pma prints its tables as markdown (``markdown_table``: eval, sweep, compare, the card), but
    for ``hf-pma inspect``'s listing and diagnostics (``text_table``), and sizes in binary units
    (``format_bytes``: KiB, MiB, GiB): an output block shows a plain table only after a paragraph
    about ``inspect``, and no size in MB or GB."""
    wrong = []
    for page, example in _output_blocks():
        shown, before = str(example.parsed), example.document.text[: example.start]
        paragraph = before.rstrip().rsplit("\n\n", 1)[-1]
        if PLAIN_RULE.search(shown) and "inspect" not in paragraph and "geometry" not in paragraph:
            wrong.append(f"{page}:{example.line}: a plain table where the command prints markdown")
        if re.search(r"\d (MB|GB|KB)\b", shown):
            wrong.append(f"{page}:{example.line}: MB/GB where the command prints MiB/GiB")
    assert wrong == [], wrong


OUTPUT_FLAGS = {"-o", "--output", "--best", "--plot", "--output-dir"}


def test_pages_name_their_own_outputs():
    """A user runs the pages one after the other in one folder: no two pages (nor two commands of
    one page, unless the second says ``--overwrite``) write an output of the same name (an
    ``hf-pma`` output option, or a script's ``output_dir="..."``), run blocks and others alike."""
    writers: dict[str, list[tuple[str, int, bool]]] = {}
    for page in ["README.md", *ALL_PAGES]:
        for example in SYBIL.parse(REPO_ROOT / page):
            source = str(example.parsed)
            names = [(m, False) for m in re.findall(r'output_dir="([^"]+)"', source)]
            if example.region.lexemes["arguments"] == "bash":
                for words in _commands(source):
                    names += [(words[i + 1].rstrip("/"), "--overwrite" in words)
                              for i, w in enumerate(words[:-1]) if w in OUTPUT_FLAGS]  # fmt: skip
            for name, overwrite in names:
                writers.setdefault(name, []).append((page, example.line, overwrite))
    reused = {
        name: where
        for name, where in writers.items()
        if len({page for page, _, _ in where}) > 1 or sum(not overwrite for _, _, overwrite in where) > 1
    }
    assert reused == {}, f"outputs written by more than one command: {reused}"


# --- The records format.md shows are those the callback example writes -------------------------

VARYING = {"time", "created", "loss", "step_loss", "hf_pma_version"}  # differ from run to run


def _same_shape(shown, real, where: str) -> None:
    """``shown`` (a page's JSON example) has exactly the keys of ``real`` and its values, except
    those of ``VARYING`` keys; a list of records shown in part matches records of ``real``."""
    if isinstance(shown, dict):
        assert isinstance(real, dict) and set(shown) == set(real), (
            f"{where}: keys {sorted(shown)} vs {sorted(real)}"
        )
        for key, value in shown.items():
            if key not in VARYING:
                _same_shape(value, real[key], f"{where}.{key}")
    elif isinstance(shown, list) and shown and isinstance(shown[0], dict):
        by_name = {item.get("name"): item for item in real}
        for item in shown:
            _same_shape(item, by_name[item.get("name")], f"{where}[{item.get('name')}]")
    else:
        assert shown == real, f"{where}: the page shows {shown!r}, the example run wrote {real!r}"


@pytest.fixture(scope="module")
def callback_run(tmp_path_factory) -> tuple[dict, Path]:
    """The callback page's example run (its first Python block, as written), then the merge of its
    last 5 snapshots that format.md shows: (its namespace, its ``run`` folder)."""
    import os

    from hf_pma import merge_checkpoints

    block = next(
        e
        for e in SYBIL.parse(REPO_ROOT / "docs" / "callback.md")
        if e.region.lexemes["arguments"] == "python"
    )
    here, work = os.getcwd(), tmp_path_factory.mktemp("callback-example")
    os.chdir(work)
    try:
        namespace: dict = {"__name__": "__docs__"}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(str(block.parsed), "callback.md", "exec"), namespace)
    finally:
        os.chdir(here)
    merge_checkpoints([work / "run" / "pma"], work / "run" / "pma" / "merged", last=5)
    return namespace, work / "run"  # (its merged/ is format.md's merge example)


def _json_blocks(page: str) -> list[dict]:
    import json

    blocks = [str(e.parsed) for e in Sybil(parsers=[CodeBlockParser("json")]).parse(REPO_ROOT / page)]
    return [json.loads(b.replace("[ ...records, oldest first... ]", "[]")) for b in blocks]


def test_the_callback_example_prints_the_v_its_page_says(callback_run):
    namespace, _ = callback_run
    v = namespace["callback"].interval_tokens
    per_step = namespace["args"].per_device_train_batch_size * namespace["Tokens"]().ids.shape[1]
    text = (REPO_ROOT / "docs" / "callback.md").read_text()
    assert f"# the V it chose: {v:,} tokens = {v / per_step:g} steps of {per_step} here" in text


def test_the_records_format_md_shows_are_those_the_callback_example_writes(callback_run):
    import json

    _, run = callback_run
    manifest, record, merge = _json_blocks("docs/format.md")
    real = json.loads((run / "pma" / "manifest.json").read_text())
    assert manifest.pop("snapshots") == []
    _same_shape(manifest, {k: v for k, v in real.items() if k != "snapshots"}, "manifest")
    _same_shape(record, real["snapshots"][-1], "snapshot record")
    in_folder = json.loads((run / "pma" / record["path"] / "pma.json").read_text())
    assert (
        in_folder["extra"].pop("files") and in_folder == real["snapshots"][-1]
    )  # the same record, + its files
    _same_shape(merge, json.loads((run / "pma" / "merged" / "pma_merge.json").read_text()), "pma_merge.json")


PYTHIA = ["step0", *(f"step{2**i}" for i in range(10)), *(f"step{1000 * i}" for i in range(1, 144))]


def test_the_revision_patterns_of_the_pythia_page_select_what_it_says():
    from hf_pma.merging.hub_revisions import revision_matcher

    assert len(PYTHIA) == 154 and PYTHIA[:4] == ["step0", "step1", "step2", "step4"]
    text = (REPO_ROOT / "docs" / "recipes" / "pythia.md").read_text()
    regex = re.search(r"--revisions '(/\^step[^']+/)'", text).group(1)
    matcher, is_regex = revision_matcher(regex)
    assert is_regex and [r for r in PYTHIA if matcher.search(r)] == [
        f"step{1000 * i}" for i in range(130, 144)
    ]
    glob_matcher, _ = revision_matcher("step1[34]*")
    assert "--revisions 'step1[34]*' --last 8" in text and "last 8 (136000 ... 143000)" in text
    selected = [r for r in PYTHIA if glob_matcher.fullmatch(r)]
    assert [f"step{1000 * i}" for i in range(136, 144)] == sorted(selected, key=lambda r: int(r[4:]))[-8:]
