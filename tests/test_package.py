"""The package's public surface: lazy exports resolve, the CLI lists every sub-command."""

from __future__ import annotations

import importlib

import pytest

import hf_pma
from hf_pma.cli import COMMANDS, build_parser


@pytest.mark.parametrize("name", hf_pma.__all__)
def test_every_lazy_export_resolves(name):
    assert getattr(hf_pma, name) is not None


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
