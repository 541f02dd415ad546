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
    removed at once without. The script's folder is first on ``sys.path`` while it runs, as when
    Python runs it (``benchmarks/gpu_check.py`` imports ``common`` beside it).
    """
    path = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get(name)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)  # put back at the test's end
    else:
        sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        if monkeypatch is None:
            if saved is None:
                del sys.modules[name]
            else:
                sys.modules[name] = saved
    return module


def load_pretrain_script(monkeypatch: pytest.MonkeyPatch | None = None) -> ModuleType:
    """scripts/pretrain.py as a module (:func:`load_script`)."""
    return load_script("scripts/pretrain.py", "pretrain_script", monkeypatch)
