"""Where things are: the repository root, ``tests/dist/``, and :func:`load_script`, the one way
tests load a script that is no module of a package (``scripts/pretrain.py``, a benchmark, a docs
hook)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DIST_DIR = REPO_ROOT / "tests" / "dist"


def load_script(
    path: str | Path, name: str | None = None, monkeypatch: pytest.MonkeyPatch | None = None
) -> ModuleType:
    """The Python file ``path`` (relative to the repository root, or absolute) loaded as a module
    named ``name`` (the file's stem by default).

    While it runs, the module is in ``sys.modules`` (dataclasses need it there while they are
    made); it stays there for the test with ``monkeypatch`` (removed at the test's end), and is
    removed at once without.
    """
    path = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved
    return module


def load_pretrain_script(monkeypatch: pytest.MonkeyPatch | None = None) -> ModuleType:
    """scripts/pretrain.py as a module (:func:`load_script`)."""
    return load_script("scripts/pretrain.py", "pretrain_script", monkeypatch)
