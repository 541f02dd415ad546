"""Sources are read as one version: a file rewritten in place, a file replaced or a folder swapped
under its name while a command reads it is refused in one line (exit status 2), and nothing is
published (hf_pma.io.guarded.one_version, used by every reader).

The merges that meet a change run as real processes (tests/dist/merge_pause.py: paused after
their first output bytes, the sources already open and partly read), changed meanwhile by this
process, then let go."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hf_pma.io.guarded import (
    OneVersion,
    SourceChangedError,
    check_one_version,
    one_version,
    read_bytes,
    read_json,
)
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.paused_merge import child_env, paused_merge, resume
from tests.helpers.repo import REPO_ROOT

PAUSE_AT = REPO_ROOT / "tests" / "dist" / "pause_at.py"


def rewrite_in_place(path: Path) -> None:
    """Overwrite the second half of ``path`` with other bytes: same file, same size, new content."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        old = fh.read()
        fh.seek(size // 2)
        fh.write(bytes(b ^ 0x5A for b in old))
    assert path.stat().st_size == size


def swap_folder(folder: Path, replacement: Path) -> None:
    """What a user's ``mv new folder`` does mid-merge: the folder renamed away, another put under its name."""
    folder.rename(folder.with_name(folder.name + ".old"))
    replacement.rename(folder)


def _error_line(stderr: str) -> str:
    """The command's whole stderr, which must be one error line (no traceback, nothing else)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and len(lines[0]) < 400, stderr
    return lines[0]


@pytest.fixture()
def sources(tmp_path):
    return [save_model_folder(tmp_path / f"s{i}", make_tiny_model(seed=i)) for i in range(2)]


def merge_changed_midway(tmp_path: Path, sources: list[Path], change) -> tuple[int, str]:
    """Run ``hf-pma merge`` in a child paused after its first output bytes, ``change()`` the
    sources meanwhile, let it go on; its exit code and stderr."""
    with paused_merge(*sources, "-o", tmp_path / "merged", "-q", "--workers", "1") as child:
        return _changed_then_resumed(child, change)


def _changed_then_resumed(child: subprocess.Popen, change: Callable[[], None]) -> tuple[int, str]:
    """With ``child`` paused mid-read: ``change()`` its sources, let it go on, and its exit code and stderr."""
    change()
    return resume(child), child.stderr.read()


def _nothing_published(tmp_path: Path) -> None:
    assert not (tmp_path / "merged").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary, no claim


def test_a_source_rewritten_in_place_mid_merge_is_refused_and_nothing_published(tmp_path, sources):
    weights = sources[0] / "model.safetensors"
    code, stderr = merge_changed_midway(tmp_path, sources, lambda: rewrite_in_place(weights))
    line = _error_line(stderr)
    assert code == 2, stderr
    assert (
        f"{weights} was rewritten while this command read it; run it again once nothing writes there" in line
    )
    _nothing_published(tmp_path)


def test_a_source_folder_swapped_mid_merge_is_refused_and_nothing_published(tmp_path, sources):
    other = save_model_folder(tmp_path / "other", make_tiny_model(seed=7))
    code, stderr = merge_changed_midway(tmp_path, sources, lambda: swap_folder(sources[-1], other))
    line = _error_line(stderr)
    assert code == 2, stderr
    # Its config.json, copied last, is the new folder's: named at once (or the folder, at the check).
    assert f"{sources[-1]}" in line and "while this command read it; run it again" in line, line
    _nothing_published(tmp_path)


def test_an_older_source_folder_swapped_mid_merge_is_refused(tmp_path, sources):
    other = save_model_folder(tmp_path / "other", make_tiny_model(seed=7))
    code, stderr = merge_changed_midway(tmp_path, sources, lambda: swap_folder(sources[0], other))
    assert code == 2, stderr
    assert _error_line(stderr).endswith(
        f"{sources[0]} was replaced by another folder while this command read it; run it again once nothing "
        "writes there"
    )
    _nothing_published(tmp_path)


def test_an_unchanged_merge_and_a_source_touched_by_nobody_pass(tmp_path, sources):
    code, stderr = merge_changed_midway(tmp_path, sources, lambda: None)
    assert code == 0, stderr
    assert (tmp_path / "merged" / "model.safetensors").is_file()


# ---------------------------------------------------------------- every other reader


def command_changed_midway(stage: str, argv: list, change, env: dict | None = None) -> tuple[int, str]:
    """Run ``hf-pma ARGV`` in a child paused before the first call of ``stage``
    (tests/dist/pause_at.py), ``change()`` meanwhile, let it go on; its exit code and stderr."""
    child = subprocess.Popen(
        [sys.executable, str(PAUSE_AT), stage, *map(str, argv), "-q"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in {**child_env(), **(env or {})}.items() if v is not None},
    )
    try:
        seen = []
        for line in child.stderr:
            seen.append(line)
            if line.startswith("PAUSED "):
                break
        else:
            pytest.fail(f"never paused at {stage}; exit {child.wait()}: {''.join(seen)}")
        return _changed_then_resumed(child, change)
    finally:
        if child.poll() is None:
            child.kill()


def test_eval_of_a_model_rewritten_between_its_checks_and_its_load_is_refused(tmp_path, tiny_tokenizer):
    model = save_model_folder(tmp_path / "model", make_tiny_model(seed=1), tiny_tokenizer)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    results = tmp_path / "results.json"
    weights = model / "model.safetensors"
    code, stderr = command_changed_midway(
        "transformers:AutoModelForCausalLM.from_pretrained",  # the folder checked, its weights not yet loaded
        ["eval", model, "--eval-file", heldout, "--block-size", "32", "-o", results],
        lambda: rewrite_in_place(weights),
    )
    assert code == 2, stderr
    assert f"{weights} was rewritten while this command read it" in _error_line(stderr)
    assert not results.exists()


def test_consolidate_of_a_snapshot_rewritten_midway_publishes_nothing(tmp_path):
    from tests.helpers.sharded_files import LAYOUTS, write_sharded

    model = make_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "full")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    snapshot = write_sharded(tmp_path / "dcp", state, LAYOUTS["rows-2"], config_from=tmp_path / "full")
    rank_file = sorted(snapshot.glob("*.safetensors"))[0]
    out = tmp_path / "out"
    code, stderr = command_changed_midway(
        "hf_pma.merging.consolidate:write_shard_index",  # every shard written, nothing published
        ["consolidate", snapshot, "-o", out],
        lambda: rewrite_in_place(rank_file),
    )
    assert code == 2, stderr
    assert f"{rank_file} was rewritten while this command read it" in _error_line(stderr)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_push_of_a_folder_rewritten_after_its_checks_uploads_nothing(tmp_path, monkeypatch, tiny_tokenizer):
    from tests.helpers.hub_server import online_cli_env, online_hub
    from tests.helpers.pma_records import write_merged_folder

    token = "hf_test_token_for_the_local_hub_0000"
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    weights = next(merged.glob("*.safetensors"))
    with online_hub(monkeypatch, tmp_path, (token,)) as hub:
        code, stderr = command_changed_midway(
            "hf_pma.publishing.hub:resolve_token",  # the folder checked, no file opened to upload yet
            ["push", merged, "--repo-id", "org/model"],
            lambda: rewrite_in_place(weights),
            env=online_cli_env(hub, token, str(tmp_path / "hf-home")),
        )
        assert code == 2, stderr
        assert f"{weights} was rewritten while this command read it" in _error_line(stderr)
        assert "org/model" not in hub.repos and hub.requests == []  # not one request


def test_push_of_a_file_rewritten_after_it_was_opened_for_upload_commits_nothing(
    tmp_path, monkeypatch, tiny_tokenizer
):
    from tests.helpers.hub_server import online_cli_env, online_hub
    from tests.helpers.pma_records import write_merged_folder

    token = "hf_test_token_for_the_local_hub_0000"
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    weights = next(merged.glob("*.safetensors"))
    with online_hub(monkeypatch, tmp_path, (token,)) as hub:
        code, stderr = command_changed_midway(
            "huggingface_hub.hf_api:HfApi.create_repo",  # every file open for the upload, nothing sent
            ["push", merged, "--repo-id", "org/model"],
            lambda: rewrite_in_place(weights),
            env=online_cli_env(hub, token, str(tmp_path / "hf-home")),
        )
        assert code == 2, stderr
        assert f"{weights} was rewritten while this command read it" in _error_line(stderr)
        assert hub.uploads() == [] and hub.repos["org/model"].commits == []  # no file sent, no commit


def test_merges_inside_one_block_share_one_version(sources):
    """What a sweep does: every merge it evaluates reads the version the first one read."""
    from hf_pma.merging.engine import merge_state_dict

    weights = sources[0] / "model.safetensors"
    first = merge_state_dict(sources)
    rewrite_in_place(weights)
    assert merge_state_dict(sources).keys() == first.keys()  # a merge on its own: the new version, whole
    with one_version():
        merge_state_dict(sources)
        rewrite_in_place(weights)
        with pytest.raises(
            SourceChangedError, match="model.safetensors was rewritten while this command read it"
        ):
            merge_state_dict(sources)


# ---------------------------------------------------------------- the mechanism, file by file


def test_a_file_read_again_as_another_version_is_refused_at_once(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = folder / "config.json"
    config.write_text('{"a": 1}')
    with one_version(folder):
        assert read_json(config, folder) == {"a": 1}
        config.write_text('{"a": 22}')
        with pytest.raises(SourceChangedError) as err:
            read_json(config, folder)
    assert str(err.value) == (
        f"{config} changed size (8 to 9 bytes) while this command read it; run it again once nothing writes there"
    )


def test_a_file_replaced_by_rename_is_named_at_the_check(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "w.bin"
    weights.write_bytes(b"x" * 64)
    with one_version(folder) as pins:
        read_bytes(weights, folder, max_bytes=1024)
        new = folder / "w.new"
        new.write_bytes(b"x" * 64)  # the same bytes, another file: what was read is not what is there
        new.replace(weights)
        with pytest.raises(
            SourceChangedError, match="w.bin was replaced by another file while this command read it"
        ):
            pins.check()


def test_files_outside_pinned_folders_and_deleted_files_are_no_change(tmp_path):
    folder, run = tmp_path / "run" / "snapshot-1", tmp_path / "run"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    manifest = run / "manifest.json"
    manifest.write_text("[]")
    with one_version(folder):
        read_json(folder / "config.json", folder)
        read_json(manifest, run, kind="manifest")
        manifest.write_text("[1, 2]")  # a live run's manifest grows: not a source's file
        (folder / "config.json").unlink()  # rotated out: the reader holds what it read
        (folder / "other.json").write_text("{}")  # the folder's own times change: only its inode counts
        check_one_version()


def test_a_rewrite_that_keeps_size_and_mtime_is_still_seen(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(256))
    before = weights.stat()
    pins = OneVersion()
    pins.pin_folder(folder)
    with one_version() as session:
        assert session is not pins
        session.pin_folder(folder)
        read_bytes(weights, folder, max_bytes=1024)
        rewrite_in_place(weights)
        weights.write_bytes(np.arange(256, dtype=np.uint8).tobytes())
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime set back: ctime still moves
        with pytest.raises(SourceChangedError, match="model.safetensors was rewritten while"):
            session.check()


def test_outside_a_one_version_block_nothing_is_pinned(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    read_json(folder / "config.json", folder)
    (folder / "config.json").write_text('{"b": 2}')
    check_one_version()  # no block: nothing to check
    assert read_json(folder / "config.json", folder) == {"b": 2}
