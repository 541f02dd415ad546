"""The package's public surface: lazy exports resolve, the CLI lists every sub-command."""

from __future__ import annotations

import ast
import importlib
import warnings

import pytest

import hf_pma
from hf_pma.cli import COMMANDS, build_parser


@pytest.mark.parametrize("name", hf_pma.__all__)
def test_every_lazy_export_resolves(name):
    assert getattr(hf_pma, name) is not None


def _type_checking_imports() -> dict[str, str]:
    """Name -> module of the ``if TYPE_CHECKING:`` imports of ``hf_pma/__init__.py``."""
    tree = ast.parse(open(hf_pma.__file__).read())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    assert len(blocks) == 1, "hf_pma/__init__.py needs one `if TYPE_CHECKING:` block of imports"
    found: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.name not in found, f"{alias.name} is imported twice"
            found[alias.asname or alias.name] = node.module
    return found


def test_type_checkers_see_what_the_lazy_table_exports():
    """The ``TYPE_CHECKING`` imports (what IDEs and type checkers read), the lazy table and
    ``__all__`` name the same things, each from the same module, the module that defines it."""
    seen = _type_checking_imports()
    assert seen == hf_pma._LAZY
    assert sorted(hf_pma.__all__) == sorted(["__version__", *hf_pma._LAZY])
    for name, module in hf_pma._LAZY.items():
        value = getattr(importlib.import_module(module), name)
        defined_in = getattr(value, "__module__", module) if callable(value) else module
        assert defined_in == module, f"hf_pma.{name} comes from {module} but is defined in {defined_in}"


def test_dir_lists_every_export():
    assert set(hf_pma.__all__) <= set(dir(hf_pma))


def test_exports_a_user_needs():
    for name in (
        "EvalOptions",
        "TaskOptions",
        "make_tasks_from_split",
        "save_full_model",
        "merge_coefficients",
    ):
        assert name in hf_pma.__all__


def test_merge_weights_is_the_deprecated_name_of_merge_coefficients():
    assert hf_pma.merge_coefficients(3, "wma") == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hf_pma.merge_weights(3, "wma") == hf_pma.merge_coefficients(3, "wma")
    assert [w.category for w in caught] == [FutureWarning]
    assert "merge_coefficients" in str(caught[0].message)


def test_scripts_import_the_public_names_only():
    """scripts/pretrain.py is the example users copy: it imports from ``hf_pma`` itself, not from
    the package's modules (which may move)."""
    from tests.helpers.repo import REPO_ROOT

    tree = ast.parse((REPO_ROOT / "scripts" / "pretrain.py").read_text())
    internal = sorted(
        {
            n.module
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("hf_pma.")
        }
    )
    assert internal == [], f"scripts/pretrain.py imports from {internal}: export what it needs from hf_pma"


# The examples users copy stay short: what more they need belongs in the library.
SCRIPT_LINES = {"pretrain.py": 300, "pretrain_no_trainer.py": 75}


def test_the_example_scripts_stay_short():
    from tests.helpers.repo import REPO_ROOT

    for name, most in SCRIPT_LINES.items():
        lines = len((REPO_ROOT / "scripts" / name).read_text().splitlines())
        assert lines <= most, f"scripts/{name} has {lines} lines (at most {most}): move what it needs into hf_pma"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_pma.nope  # noqa: B018


def test_cli_registers_every_command_module():
    parser = build_parser()
    for command, module in COMMANDS.items():
        assert callable(importlib.import_module(f"hf_pma.commands.{module}").add_parser)
        args = parser.parse_args([command, *_minimal_args(command)])
        assert callable(args.func)


def _minimal_args(command: str) -> list[str]:
    return {
        "merge": ["a", "-o", "out"],
        "eval": ["model"],
        "make-tasks": ["data", "-o", "out"],
        "card": ["folder"],
        "push": ["folder", "--repo-id", "org/name"],
        "sweep": ["run"],
        "inspect": ["run"],
        "consolidate": ["snapshot", "-o", "out"],
        "compare": ["run1", "run2", "--eval-file", "heldout.txt"],
    }[command]


def test_version_is_the_changelogs_top_heading():
    # "## 0.2.0 (unreleased)" -> "0.2.0.dev0"; once released ("## 0.2.0") the version is "0.2.0".
    from packaging.version import Version

    from tests.helpers.repo import REPO_ROOT

    heading = next(
        line for line in (REPO_ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")
    )
    number, _, rest = heading[3:].partition(" ")
    expected = Version(f"{number}.dev0") if "unreleased" in rest else Version(number)
    assert Version(hf_pma.__version__) == expected, (hf_pma.__version__, heading)
