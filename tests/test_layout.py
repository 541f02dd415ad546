"""The package's layout: subpackages import downward only, no module imports in a cycle, and no
module points at files outside the repository. The tests' layout: every multi-process launch goes
through ``tests.helpers.launcher.launch``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.repo import REPO_ROOT

PACKAGE = REPO_ROOT / "hf_pma"
# Bottom to top: a subpackage may import its own modules and those of the subpackages below it.
LAYERS = [
    "utils",
    "io",
    "core",
    "merging",
    "snapshots",
    "evaluation",
    "publishing",
    "analysis",
    "training",
    "commands",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every hf_pma module that ``path`` imports, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from hf_pma.x import y``: y may be a module of its own.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t == "hf_pma" or t.startswith("hf_pma."))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_subpackages_import_downward_only():
    modules = _modules()
    assert {_layer(m) for m in modules} - {None} == set(LAYERS), "a subpackage is missing from LAYERS"
    upward = []
    for module, path in modules.items():
        layer = _layer(module)
        if layer is None:  # hf_pma/__init__ (lazy exports) and cli.py sit on top
            continue
        for target in _imports(path, modules):
            target_layer = _layer(target)
            if target_layer is None or LAYERS.index(target_layer) > LAYERS.index(layer):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_no_module_below_the_front_door_imports_the_package_root():
    # ``hf_pma/__init__.py`` names training and publishing (its lazy exports): a subpackage module
    # importing ``hf_pma`` itself (``from hf_pma import __version__``) would run back up to them.
    # Only the front door and the command line sit above it.
    modules = _modules()
    offenders = [
        module
        for module, path in modules.items()
        if module not in ("hf_pma", "hf_pma.cli") and "hf_pma" in _imports(path, modules)
    ]
    assert not offenders, f"modules that import the package root hf_pma: {offenders}"


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {
        m: {t for t in _imports(p, modules) if t in modules and t != m and t != "hf_pma"}
        for m, p in modules.items()
    }
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_points_outside_the_repository():
    offenders = [
        str(path.relative_to(REPO_ROOT))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "shared/" in path.read_text()
    ]
    assert not offenders, f"modules that cite shared/ (developer notes users do not have): {offenders}"


# Layers that sit side by side on the IO layer: neither imports the other (the snapshot writers
# and the merge share the safetensors reader/writer and the sharded layout of hf_pma.io).
SIBLINGS = [("snapshots", "merging")]


def test_snapshots_and_merging_share_only_the_io_layer():
    modules = _modules()
    crossing = []
    for module, path in modules.items():
        layer = _layer(module)
        for a, b in SIBLINGS:
            if layer not in (a, b):
                continue
            other = b if layer == a else a
            crossing += [f"{module} imports {t}" for t in _imports(path, modules) if _layer(t) == other]
    assert not crossing, "imports between sibling layers (move what both need to hf_pma.io):\n" + "\n".join(
        crossing
    )


# What starting ranks by hand looks like: a launcher module or its port / process-count flags.
LAUNCH_STRINGS = {
    "torch.distributed.run",
    "torchrun",
    "accelerate.commands.launch",
    "--master-port",
    "--master_port",
    "--main_process_port",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--nproc_per_node",
    "--nproc-per-node",
    "--num_processes",
}


def _test_nodes(allowed: set[Path]):
    """(``path:line``, node) for every AST node of the test modules but the ``allowed`` ones."""
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        if path not in allowed:
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                yield f"{path.relative_to(REPO_ROOT)}:{getattr(node, 'lineno', '?')}", node


def test_tests_launch_processes_through_the_one_launcher():
    """No test module chooses a port or builds a torchrun / accelerate command of its own:
    ``tests.helpers.launcher.launch`` holds the port safely, keeps per-rank logs and reports the
    first failing rank's traceback."""
    tests = REPO_ROOT / "tests"
    # The launcher; the Hub stand-in (serves on port 0); this rule's own list.
    allowed = {
        tests / "helpers" / "launcher.py",
        tests / "helpers" / "hub_server.py",
        Path(__file__).resolve(),
    }
    offenders = []
    for where, node in _test_nodes(allowed):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and re.search(
            r"(^|_)ports?(_|$)", node.name.lower()
        ):
            offenders.append(f"{where} defines {node.name}()")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in LAUNCH_STRINGS:
            offenders.append(f"{where} builds a launch command ({node.value!r})")
        elif isinstance(node, ast.Attribute) and node.attr == "bind":
            offenders.append(f"{where} binds a socket")
    assert not offenders, "launch multi-process tests with tests.helpers.launcher.launch:\n" + "\n".join(
        offenders
    )


# What running the hf-pma command by hand looks like: its console script or its module.
CLI_STRINGS = {"hf-pma", "hf_pma.cli"}


def test_tests_run_the_command_through_the_one_helper():
    """No test module starts ``hf-pma`` (or ``python -m hf_pma.cli``) itself:
    ``tests.helpers.cli.run_cli`` runs it in this process (putting back what the command
    changes: logging, environment, current folder, threads) or, with ``process=True``, as a
    process of its own."""
    tests = REPO_ROOT / "tests"
    allowed = {
        tests / "helpers" / "cli.py",  # the helper
        tests / "test_cli.py",  # fresh interpreters that report what importing the command loads
        tests / "test_install.py",  # the console script of a freshly built wheel
        tests / "merging" / "test_exclusive_outputs.py",  # two merges racing each other (Popen)
        tests / "test_one_writer.py",  # eval --record processes racing each other and a merge (Popen)
        Path(__file__).resolve(),
    }
    offenders = []
    for where, node in _test_nodes(allowed):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CLI_STRINGS:
            offenders.append(f"{where} builds an hf-pma command ({node.value!r})")
        elif isinstance(node, ast.Name) and node.id == "hf_pma_command":
            offenders.append(f"{where} starts the console script itself")
    assert not offenders, "run hf-pma with tests.helpers.cli.run_cli:\n" + "\n".join(offenders)


# What opening a file looks like. Files under a folder a user gave (a run, a source, a snapshot,
# a folder to push) are opened through hf_pma.io.guarded only: confined after links, regular
# files only, bounded.
READ_CALLS = {"open", "read_text", "read_bytes", "safe_open", "load", "copy", "copy2", "copyfile", "copytree"}
# Modules that open files another way, and why that is safe.
OPENS_ALLOWED = {
    "hf_pma/io/guarded.py": "the one way in",
    "hf_pma/io/safetensors.py": "SafetensorsWriter creates its output file inside a temporary folder hf-pma made",
    "hf_pma/utils/fs.py": "the one way out: fsyncs and claims of files and folders hf-pma creates",
    "hf_pma/utils/read_files.py": "the way out's bounded look (no link, regular file) at a manifest's top level",
    "hf_pma/evaluation/generated_tasks.py": "writes the task files it generates into its own folder",
    "hf_pma/utils/distributed.py": "a probe file the ranks write into a folder they share",
    "hf_pma/training/arguments.py": "the user's own training-arguments file named on the command line",
    "hf_pma/training/pretrain_data.py": "the user's own text corpus named on the command line",
    "hf_pma/evaluation/corpus.py": "the user's own held-out text named on the command line (--eval-file)",
    "hf_pma/merging/hub_revisions.py": "creates the Hub cache files it downloads (O_NOFOLLOW) and their pointers",
    "hf_pma/snapshots/sinks.py": "creates (O_EXCL, O_NOFOLLOW) and removes a probe that checks the folder is writable",
    "hf_pma/utils/text.py": "opens /dev/null onto a standard stream that is closed, or whose reader is gone",
}


def _opens(node: ast.AST) -> str | None:
    """What ``node`` opens a file with, if it is such a call: ``open(``, ``os.open(``,
    ``.read_text(``, ``.read_bytes(``, ``json.load(``, ``safe_open(``, ``shutil.copy*(``."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Name) and func.id in ("open", "safe_open"):
        return f"{func.id}("
    if not isinstance(func, ast.Attribute) or func.attr not in READ_CALLS:
        return None
    owner = func.value.id if isinstance(func.value, ast.Name) else None
    if func.attr in ("read_text", "read_bytes", "safe_open"):
        return f".{func.attr}("
    if func.attr == "open" and owner in ("os", "io"):
        return f"{owner}.open("
    if func.attr == "load" and owner == "json":
        return "json.load("
    if func.attr.startswith("copy") and owner == "shutil":
        return f"shutil.{func.attr}("
    return None


def test_files_are_opened_through_the_one_way_in():
    """No module but the allowed ones opens a file itself (see :data:`OPENS_ALLOWED`)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(REPO_ROOT))
        if where in OPENS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=where)):
            what = _opens(node)
            if what is not None:
                offenders.append(f"{where}:{node.lineno} calls {what}")
    assert not offenders, "open files from a user's folder through hf_pma.io.guarded:\n" + "\n".join(
        offenders
    )


def _module_table() -> dict[str, list[str]]:
    """The table "Where each module is tested" of docs/development.md: module -> its test files."""
    from tests.helpers.output import markdown_rows

    text = (REPO_ROOT / "docs" / "development.md").read_text()
    section = text.split("## Where each module is tested", 1)[1].split("\n## ", 1)[0]
    return {
        row[0].strip("`"): [cell.strip().strip("`") for cell in row[1].split(",")]
        for row in markdown_rows(section)
        if len(row) == 2 and row[0] not in ("module", "test file")
    }


def test_every_module_is_listed_with_its_tests():
    """docs/development.md says where each module of hf_pma is tested: every module with code (a
    package's ``__init__`` only when it holds more than a docstring) has a row, every row is a
    module, every test file named exists, and every test file of the suite appears in a row."""
    table = _module_table()
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        if path.name == "__init__.py" and len(body) <= 1:
            continue
        modules.add(path.relative_to(REPO_ROOT).as_posix())
    listed = {name for name in table if name.startswith("hf_pma/")}
    assert sorted(modules - listed) == [], "modules missing from docs/development.md's table"
    assert sorted(listed - modules) == [], "rows of docs/development.md's table that name no module"
    named = {test for tests in table.values() for test in tests if test.endswith(".py")}
    named |= {name for name in table if not name.startswith("hf_pma/")}  # the tests of the whole
    tests = REPO_ROOT / "tests"
    assert sorted(t for t in named if not (tests / t).is_file()) == [], "test files that do not exist"
    everywhere = {p.relative_to(tests).as_posix() for p in tests.rglob("test_*.py")}
    assert sorted(everywhere - named) == [], "test files in no row of docs/development.md's table"


def test_what_tests_share_lives_in_the_helpers_package():
    """No module under tests/ imports from a test module (``test_*.py``): what tests share lives
    in ``tests/helpers/`` (or in the ``tests/dist/`` script the test launches)."""
    offenders = []
    for where, node in _test_nodes(set()):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
            if node.module.rsplit(".", 1)[-1].startswith("test_"):
                offenders.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Import):
            offenders += [
                f"{where} imports {a.name}"
                for a in node.names
                if a.name.rsplit(".", 1)[-1].startswith("test_")
            ]
    assert not offenders, "move what tests share into tests/helpers/:\n" + "\n".join(offenders)
