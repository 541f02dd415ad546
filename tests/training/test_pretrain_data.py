"""The embedded default corpus: which standard-library files it reads, and in which order."""

from __future__ import annotations

from pathlib import Path

from hf_pma.training.pretrain_data import _stdlib_sources, stdlib_documents


def _tree(root: Path, files: list[str]) -> None:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * 200)


def test_sources_skip_tests_and_installed_packages_and_sort_as_paths(tmp_path):
    _tree(
        tmp_path,
        [
            "a-b/c.py", "a/b.py", "a/test/t.py", "a/tests/t.py", "idlelib/x.py", "site-packages/pkg/m.py",
            "dist-packages/m.py", "lib2to3/m.py", "z.py", "notes.txt", "a/deeper/site-packages/m.py",
        ],
    )
    (tmp_path / "folder.py").mkdir()  # a folder named like a source file is not one
    found = [p.relative_to(tmp_path).as_posix() for p in _stdlib_sources(tmp_path)]
    # sorted as paths (part by part): "a/b.py" before "a-b/c.py", unlike a plain string sort
    assert found == ["a/b.py", "a-b/c.py", "z.py"]


def test_default_corpus_is_stable_and_within_its_budget():
    docs = stdlib_documents(max_bytes=200_000)
    assert docs == stdlib_documents(max_bytes=200_000)
    assert all(len(d) >= 500 for d in docs)
    # the budget is reached by the last file taken, not before it
    assert sum(len(d.encode()) for d in docs[:-1]) < 200_000 <= sum(len(d.encode()) for d in docs)
