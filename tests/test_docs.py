"""The documentation: the site builds offline in strict mode, every page is reachable, and what
the pages name (modules, functions, sub-commands, arguments) exists in the code.

A renamed function breaks an API page or a cross-reference (strict build), a Python snippet's
import (``test_snippet_imports_resolve``) or an option table (``test_*_tables_match``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.repo import REPO_ROOT

DOCS = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"


def _pages() -> set[str]:
    """Every Markdown page under docs/, relative to it (the hooks folder is code, not a page)."""
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts}


def _nav_pages(nav) -> set[str]:
    found: set[str] = set()
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            if isinstance(value, list):
                found |= _nav_pages(value)
            elif isinstance(value, str) and value.endswith(".md"):
                found.add(value)
    return found


def _config() -> dict:
    return yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())


def _code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    pattern = re.compile(r"^ *```(\w*)[^\n]*\n(.*?)^ *```", re.S | re.M)
    return [m.group(2) for m in pattern.finditer(text) if m.group(1) in languages]


def _dedent_block(block: str) -> str:
    lines = block.split("\n")
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return "\n".join(x[indent:] for x in lines)


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the project at ``root``, as CI runs it: without ``-q``, under
    which mkdocs 1.6 does not count warnings, so that a broken link or anchor fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_docs_build_strict(tmp_path):
    """``mkdocs build --strict`` succeeds offline: no broken link, anchor, reference or API page."""
    proc = _build(REPO_ROOT, tmp_path / "site")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    assert (tmp_path / "site" / "api" / "snapshots" / "index.html").is_file()
    html = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "usage: hf-pma merge" in html  # the CLI reference is rendered from the parsers
    assert 'href="../security/"' in (tmp_path / "site" / "changelog" / "index.html").read_text()


def test_docs_build_fails_on_a_broken_link_or_anchor(tmp_path):
    """The build of :func:`test_docs_build_strict`, on a copy of the docs with one broken link and
    one broken anchor (and CHANGELOG.md linking a page that does not exist), fails naming each."""
    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(REPO_ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    for name in ("hf_pma", "benchmarks", "scripts", "README.md"):
        (copy / name).symlink_to(REPO_ROOT / name)
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    (copy / "CHANGELOG.md").write_text(changelog + "\n- [Gone](docs/no-such-page.md)\n")
    quickstart = copy / "docs" / "quickstart.md"
    quickstart.write_text(quickstart.read_text() + "\n[a page](no-such-page.md) and [a section](merging.md#no-such-anchor)\n")
    proc = _build(copy, tmp_path / "site")
    assert proc.returncode != 0
    for broken in ("no-such-page.md', but the target", "#no-such-anchor", "changelog.md' contains a link 'no-such-page.md'"):
        assert broken in proc.stderr, proc.stderr


def test_every_page_is_in_the_nav():
    nav = _nav_pages(_config()["nav"])
    pages = _pages()
    assert pages - nav == set(), f"pages missing from the nav of mkdocs.yml: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_readme_links_every_manual_page():
    """The front page reaches the whole manual (API pages are reached through api/index.md)."""
    readme = README.read_text()
    linked = set(re.findall(r"\]\(docs/([^)#\s]+\.md)", readme))
    manual = {p for p in _pages() if not p.startswith("api/")} | {"api/index.md"}
    assert manual - linked == set(), f"README.md does not link these docs pages: {sorted(manual - linked)}"
    missing = {p for p in linked if not (DOCS / p).is_file()}
    assert missing == set(), f"README.md links pages that do not exist: {sorted(missing)}"


def test_the_home_page_lists_every_manual_page():
    """docs/index.md's table of the manual names every page of the nav (the API pages through
    api/index.md), so that a new page is not missing from the home page."""
    listed = set(re.findall(r"^\| \[[^]]+\]\(([^)#\s]+\.md)\)", (DOCS / "index.md").read_text(), re.M))
    manual = {p for p in _nav_pages(_config()["nav"]) if not p.startswith("api/")} | {"api/index.md"}
    assert manual - {"index.md"} - listed == set(), f"docs/index.md's table misses {sorted(manual - listed - {'index.md'})}"


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the details to docs/"
    assert "accelerate launch scripts/pretrain.py" in lines


def test_api_reference_covers_every_module():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), re.M))
    import hf_pma

    modules = {"hf_pma"}
    for info in pkgutil.walk_packages(hf_pma.__path__, "hf_pma."):
        if not any(part.startswith("_") for part in info.name.split(".")) and info.name != "hf_pma.model_cards":
            modules.add(info.name)
    missing = modules - documented
    assert missing == set(), f"modules without an API page (add `::: name` to docs/api/<subpackage>.md): {sorted(missing)}"


def test_cli_reference_covers_every_command():
    from hf_pma.cli import COMMANDS

    text = (DOCS / "cli.md").read_text()
    documented = set(re.findall(r"<!-- hf-pma-help ([\w-]+) -->", text))
    assert set(COMMANDS) - documented == set(), f"sub-commands missing from docs/cli.md: {sorted(set(COMMANDS) - documented)}"
    in_table = set(re.findall(r"^\| \[`hf-pma ([\w-]+)`\]", text, re.M))
    assert in_table == set(COMMANDS), f"docs/cli.md's command table: {sorted(in_table ^ set(COMMANDS))}"


def _hf_pma_imports(block: str) -> list[ast.stmt]:
    """The ``import hf_pma...`` / ``from hf_pma... import ...`` statements of a snippet (which may
    hold ``...`` placeholders and so not parse as a whole)."""
    statements, lines = [], iter(_dedent_block(block).split("\n"))
    for line in lines:
        text = line.strip()
        if re.match(r"(from hf_pma[\w.]* import |import hf_pma)", text):
            while text.count("(") > text.count(")"):
                text += " " + next(lines).strip()
            statements += ast.parse(text.split("#")[0].strip().rstrip(";")).body
    return statements


def test_snippet_imports_resolve():
    """Every ``from hf_pma... import name`` in a Python snippet of the docs or the README exists."""
    checked = 0
    for path in [README, *sorted(DOCS.rglob("*.md"))]:
        for block in _code_blocks(path.read_text(), ("python", "py")):
            for node in _hf_pma_imports(block):
                if isinstance(node, ast.ImportFrom):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), f"{path.name}: {node.module} has no {alias.name}"
                        checked += 1
                else:
                    for alias in node.names:
                        importlib.import_module(alias.name)
                        checked += 1
    assert checked > 20


def _table_names(page: Path, pattern: str) -> set[str]:
    """Names in backticks in the first cell of the table rows of ``page`` that match ``pattern``."""
    names = set()
    for line in page.read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names |= {n for n in re.findall(r"`([\w]+)`", first_cell) if re.fullmatch(pattern, n)}
    return names


def test_trainer_argument_tables_match():
    from hf_pma.training.arguments import PMATrainingArguments

    fields = {f.name for f in dataclasses.fields(PMATrainingArguments) if f.name.startswith("pma_")}
    documented = _table_names(DOCS / "trainer.md", r"pma_\w+")
    assert fields - documented == set(), f"docs/trainer.md does not document {sorted(fields - documented)}"
    assert documented - fields == set(), f"docs/trainer.md documents unknown arguments {sorted(documented - fields)}"


def test_callback_argument_table_matches():
    from hf_pma.snapshots.callback import PMACallback

    params = set(inspect.signature(PMACallback.__init__).parameters) - {"self"}
    documented = _table_names(DOCS / "callback.md", r"[a-z_]+")
    assert params - documented == set(), f"docs/callback.md does not document {sorted(params - documented)}"
    assert documented - params == set(), f"docs/callback.md documents unknown arguments {sorted(documented - params)}"


def test_no_citation_of_files_outside_the_repository():
    """Users have the repository only: nothing may point at the developers' notes."""
    pattern = re.compile(r"\bshared" + r"/[\w-]+\.md")  # split so that this file does not match
    offenders = []
    for root in ("hf_pma", "scripts", "tests", "benchmarks", "docs"):
        for path in (REPO_ROOT / root).rglob("*"):
            if path.suffix in {".py", ".md", ".yaml", ".yml", ".txt"} and path.is_file():
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line) and path != Path(__file__):
                        offenders.append(f"{path.relative_to(REPO_ROOT)}:{n}")
    for path in (README, REPO_ROOT / "CHANGELOG.md", REPO_ROOT / "mkdocs.yml"):
        offenders += [f"{path.name}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == [], f"citations of files outside the repository: {offenders}"


# Documented parameters that are not parameter names, known and left to the module's owner.
_KNOWN_ARGS_ENTRIES = {("hf_pma.analysis.sweep.SweepEvaluator", "Other arguments")}


def test_documented_parameters_exist():
    """Every name in an ``Args:`` section is a parameter of its function or class (a renamed
    parameter must be renamed in its docstring too)."""
    import griffe

    package = griffe.load("hf_pma", search_paths=[str(REPO_ROOT)], docstring_parser="google", resolve_aliases=False)

    def walk(obj):
        for member in obj.members.values():
            if not member.is_alias:
                yield member
                if member.is_module or member.is_class:
                    yield from walk(member)

    unknown = []
    for obj in walk(package):
        if not obj.docstring or not (obj.is_function or obj.is_class):
            continue
        if obj.is_function:
            params = {p.name for p in obj.parameters}
        else:
            init = obj.members.get("__init__")
            params = {p.name for p in init.parameters} if init is not None and not init.is_alias else set(obj.members)
        for section in obj.docstring.parse("google", warnings=False):
            if section.kind.value == "parameters":
                for entry in section.value:
                    if entry.name.lstrip("*") not in {p.lstrip("*") for p in params}:
                        unknown.append((obj.path, entry.name))
    unknown = [u for u in unknown if u not in _KNOWN_ARGS_ENTRIES]
    assert unknown == [], f"docstrings document parameters that do not exist: {unknown}"
