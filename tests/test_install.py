"""A regular (non-editable) install: the wheel holds the package, the card templates and the
``hf-pma`` entry point, and an installed copy finds its templates without the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.pma_records import write_merged_folder
from tests.helpers.repo import REPO_ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build a wheel from a copy of the sources (the checkout stays clean) and install it with
    ``pip install --target``; returns (wheel, target folder)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("hf_pma", "model_cards"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.cfg", "README.md", "LICENSE"):
        if (REPO_ROOT / name).is_file():
            shutil.copy(REPO_ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(root / "dist")], cwd=src, check=True, timeout=300)
    (wheel,) = (root / "dist").glob("hf_pma-*.whl")
    target = root / "target"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    return wheel, target


def _env(target: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(target)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_wheel_holds_templates_and_entry_point(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hf_pma/model_cards/pma_model_card.md" in names
    assert "hf_pma/model_cards/__init__.py" in names
    assert {"hf_pma/publishing/card.py", "hf_pma/publishing/hub.py", "hf_pma/publishing/plot.py", "hf_pma/cli.py"} <= names
    assert "hf-pma = hf_pma.cli:main" in entry_points
    # The version pyproject.toml reads from hf_pma/utils/version.py (statically: nothing imported).
    from hf_pma.utils.version import __version__

    assert wheel.name.startswith(f"hf_pma-{__version__}-"), wheel.name


def test_installed_copy_imports_and_renders_a_card(installed, tmp_path):
    _, target = installed
    probe = (
        "import hf_pma, hf_pma.publishing.card as card; "
        "print(hf_pma.__file__); print(card.template_path())"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_env(target), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    module_file, template = out.stdout.split()
    # Imported from the installed copy, template from its package data: not from the checkout.
    assert Path(module_file).is_relative_to(target)
    assert Path(template) == target / "hf_pma" / "model_cards" / "pma_model_card.md"

    script = target / "bin" / "hf-pma"
    assert script.is_file()
    version = subprocess.run([str(script), "--version"], cwd=tmp_path, env=_env(target), capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("hf-pma "), version.stderr
    from hf_pma.utils.version import __version__

    assert version.stdout.split() == ["hf-pma", __version__]

    folder = write_merged_folder(tmp_path)
    card = subprocess.run(
        [str(script), "card", str(folder), "--repo-id", "org/installed", "--no-plot"],
        cwd=tmp_path,
        env=_env(target),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert card.returncode == 0, card.stderr
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n") and "model-index" in text and "from_pretrained('org/installed')" in text
