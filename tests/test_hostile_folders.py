"""Whole hostile run folders (``hypothesis``): symbolic links to files and folders inside and
outside, FIFOs, names with control characters, hostile record fields, oversized and deep JSON,
crafted safetensors headers; then every command that reads a run (merge, inspect, sweep, eval,
card, push to the local Hub stand-in, and the manifest's rotation and resume) runs on it under
Python's audit hook.

Whatever the folder holds: nothing outside the run is opened, listed, written or deleted; no
process is started; nothing is imported from the run; a refusal is hf-pma's one-line error
(exit 2), never a traceback; no control character reaches stdout, stderr or the card.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_pma.core.manifest import SnapshotRecord, add_snapshot, drop_snapshots_after
from hf_pma.publishing.hub import push_folder_to_hub
from tests.helpers.audit import AuditWatch, tree
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.hub_server import online_hub
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.pma_records import write_merged_folder
from tests.helpers.snapshot_runs import noise_deviation, write_run

TOKEN = "hostile-folder-test-token-0123456789"
SNAPSHOTS = ["snapshot-1000", "snapshot-2000", "snapshot-3000"]
# Characters no output may hold: C0 but tab and newline, DEL, C1, bidi controls, separators.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")

HOSTILE_TEXT = [
    "\x1b[2J\x1b[1;1Hmerged OK",
    "ok\nhf-pma merge: merged OK",
    "\u202egnp.exe",
    "{0}",
    "{0.__class__.__mro__}",
    "{:200000000}",
    "\x9b31m",
    "'); __import__('os').system('touch PWNED'); ('",
    "x" * 5000,
]
HOSTILE_VALUES = [*HOSTILE_TEXT, 1e300, -1e300, 10**400, -5, None, True, [], {}, {"a": [1]}, 0.5, "nan"]
RECORD_FIELDS = [
    "tokens",
    "step",
    "lr",
    "loss",
    "phase",
    "created",
    "path",
    "strategy",
    "window",
    "interval_tokens",
]
MERGE_RECORD_FIELDS = [
    "strategy",
    "window",
    "created",
    "snapshots",
    "sources",
    "weights",
    "alpha",
    "tokens",
    "phases",
]
SNAPSHOT_FILES = ["model.safetensors", "config.json", "pma.json", "generation_config.json"]
LINK_TARGETS = [
    "victim/secret.txt",
    "victim/model/model.safetensors",
    "victim/model/config.json",
    "victim",
    "inside",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer):
    """A run of three snapshots, a merged folder with its records, held-out text, and a victim
    folder outside both (a secret and a real model) for links to aim at."""
    root = tmp_path_factory.mktemp("hostile-base")
    run, _ = write_run(root / "run", 3, noise_deviation(), tokenizer=tiny_tokenizer)
    merged = write_merged_folder(root / "m", tiny_tokenizer, careless=False)
    victim = root / "victim"
    victim.mkdir()
    (victim / "secret.txt").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot for anyone\n")
    save_model_folder(victim / "model", make_tiny_model(seed=7))
    heldout = root / "heldout.txt"
    heldout.write_text(sample_text(600))
    return {"run": run, "merged": merged, "victim": victim, "heldout": heldout}


def _deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def _crafted_header(kind: str) -> bytes:
    """A safetensors file whose header lies in one of the ways the safetensors library refuses."""
    tensors = {
        "overflow": {"w": {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [0, 0]}},
        "negative": {"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}},
        "past_end": {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4_000_000]}},
        "product": {"w": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}},
        "dtype": {"w": {"dtype": "F1024", "shape": [1], "data_offsets": [0, 128]}},
        "not_object": [],
        "metadata": {
            "__metadata__": {"format": ["pt"]},
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        },
    }[kind]
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0" * 16


@st.composite
def mutations(draw):
    """One to three changes to a good run folder and its merged folder."""
    changes = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ["link", "fifo", "dirlink", "name", "record", "merge_record", "deep", "header", "support"]
            )
        )
        snapshot = draw(st.sampled_from(SNAPSHOTS))
        if kind == "link":
            changes.append(
                (kind, snapshot, draw(st.sampled_from(SNAPSHOT_FILES)), draw(st.sampled_from(LINK_TARGETS)))
            )
        elif kind == "fifo":
            changes.append((kind, snapshot, draw(st.sampled_from([*SNAPSHOT_FILES, "tokenizer.json"])), None))
        elif kind == "dirlink":
            changes.append((kind, snapshot, None, draw(st.sampled_from(["victim/model", "victim"]))))
        elif kind == "name":
            changes.append(
                (kind, snapshot, draw(st.sampled_from(HOSTILE_TEXT[:3] + ["checkpoint-5\n"])), None)
            )
        elif kind == "record":
            where = draw(st.sampled_from(["manifest", "pma.json"]))
            changes.append(
                (
                    kind,
                    snapshot,
                    (where, draw(st.sampled_from(RECORD_FIELDS))),
                    draw(st.sampled_from(HOSTILE_VALUES)),
                )
            )
        elif kind == "merge_record":
            changes.append(
                (
                    kind,
                    None,
                    draw(st.sampled_from(MERGE_RECORD_FIELDS)),
                    draw(st.sampled_from(HOSTILE_VALUES)),
                )
            )
        elif kind == "deep":
            where = draw(
                st.sampled_from(["config.json", "pma.json", "manifest", "merged-config", "pma_merge.json"])
            )
            changes.append((kind, snapshot, where, draw(st.sampled_from([100_000, 5000]))))
        elif kind == "header":
            changes.append(
                (
                    kind,
                    snapshot,
                    None,
                    draw(
                        st.sampled_from(
                            ["overflow", "negative", "past_end", "product", "dtype", "not_object", "metadata"]
                        )
                    ),
                )
            )
        else:  # a support file of the newest snapshot: a link out, or code
            changes.append(
                (
                    kind,
                    "snapshot-3000",
                    draw(st.sampled_from(["tokenizer.model", "modeling_evil.py", "special_tokens_map.json"])),
                    draw(st.sampled_from(["victim/secret.txt", "code"])),
                )
            )
    return changes


def _replace(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):  # a file, a link, a FIFO
        path.unlink()


def _apply(changes: list, run: Path, merged: Path, victim: Path) -> None:
    pma = run / "pma"
    for kind, snapshot, what, value in changes:
        folder = pma / (snapshot or SNAPSHOTS[-1])
        if not folder.is_dir() or folder.is_symlink():  # an earlier change replaced it
            continue
        if kind == "link":
            target = folder.parent / SNAPSHOTS[0] / what if value == "inside" else victim.parent / value
            _replace(folder / what)
            os.symlink(target, folder / what)
        elif kind == "fifo":
            _replace(folder / what if what != "tokenizer.json" else run / what)
            os.mkfifo(folder / what if what != "tokenizer.json" else run / what)
        elif kind == "dirlink":
            shutil.rmtree(folder)
            os.symlink(victim.parent / value, folder)
        elif kind == "name":
            (folder / f"notes{what}.txt").write_text("hi")
            twin = run / f"checkpoint-5{what}" if what != "checkpoint-5\n" else run / what
            twin.mkdir(exist_ok=True)
            for name in ("config.json", "model.safetensors"):
                if (folder / name).is_file() and not (folder / name).is_symlink():
                    shutil.copy(folder / name, twin / name)
        elif kind == "record":
            where, field = what
            record = folder / "pma.json"
            if not (
                record.is_file() and not record.is_symlink()
            ):  # an earlier change made it a link or a FIFO
                continue
            try:
                json.loads((pma / "manifest.json").read_text())
                json.loads(record.read_text())
            except (ValueError, RecursionError):  # an earlier change nested it deep
                continue
            if where == "manifest":
                data = json.loads((pma / "manifest.json").read_text())
                for entry in data["snapshots"]:
                    if entry.get("path") == snapshot:
                        entry[field] = value
                (pma / "manifest.json").write_text(json.dumps(data))
            else:
                data = json.loads((folder / "pma.json").read_text())
                data[field] = value
                (folder / "pma.json").write_text(json.dumps(data))
        elif kind == "merge_record":
            try:
                data = json.loads((merged / "pma_merge.json").read_text())
            except (ValueError, RecursionError):  # an earlier change nested it deep
                continue
            data[what] = value
            (merged / "pma_merge.json").write_text(json.dumps(data))
        elif kind == "deep":
            target = {
                "config.json": folder / "config.json",
                "pma.json": folder / "pma.json",
                "manifest": pma / "manifest.json",
                "merged-config": merged / "config.json",
                "pma_merge.json": merged / "pma_merge.json",
            }[what]
            _replace(target)  # an earlier change may have made it a FIFO or a link
            target.write_text(_deep_json(value))
        elif kind == "header":
            _replace(folder / "model.safetensors")
            (folder / "model.safetensors").write_bytes(_crafted_header(value))
        elif kind == "support":
            _replace(folder / what)
            if value == "code":
                (folder / what).write_text("open('PWNED', 'w').write('ran')\n")
            else:
                os.symlink(victim / "secret.txt", folder / what)


def _check_output(text: str, name: str) -> None:
    assert "Traceback" not in text, f"{name}: {text[-3000:]}"
    found = CONTROL.search(text)
    assert found is None, f"{name}: control character {found.group()!r} in {text[-2000:]!r}"


def _check_cli(result, name: str) -> None:
    _check_output(result.stdout, name)
    _check_output(result.stderr, name)
    assert result.returncode in (0, 2), f"{name}: exit {result.returncode}: {result.stderr[-3000:]}"
    if result.returncode == 2:
        assert result.stderr.strip().splitlines()[-1].startswith(f"hf-pma {result.argv[0]}: error: "), (
            result.stderr
        )


def _check_library_error(err: BaseException, name: str) -> None:
    assert isinstance(err, (ValueError, FileNotFoundError, FileExistsError, PermissionError)), (
        f"{name}: {err!r}"
    )
    assert "\n" not in str(err) and CONTROL.search(str(err)) is None, f"{name}: {str(err)!r}"
    assert "/hf_pma/" in traceback.extract_tb(err.__traceback__)[-1].filename, f"{name}: {err!r}"


def _copy(base: dict, into: Path) -> tuple[Path, Path]:
    run = into / "run"
    merged = into / "merged"
    shutil.copytree(base["run"], run, symlinks=True)
    shutil.copytree(base["merged"], merged, symlinks=True)
    return run, merged


def _attack(base: dict, changes: list, commands: list[str], hub=None) -> dict[str, int]:
    """Apply ``changes`` to a copy of the base folders, run ``commands`` on it under the audit
    hook, check everything this module promises; return each command's exit code (0: done)."""
    codes: dict[str, int] = {}
    victim = base["victim"]
    with tempfile.TemporaryDirectory(dir=victim.parent) as tmp:
        tmp = Path(tmp)
        run, merged = _copy(base, tmp)
        _apply(changes, run, merged, victim)
        out = tmp / "out"
        out.mkdir()
        before = tree(victim)
        argv = {
            "merge": ["merge", run, "-o", out / "merged", "-q"],
            "inspect": ["inspect", run, "--plot", "", "-q"],
            "card": ["card", merged, "--no-plot", "-q"],
            "sweep": [
                "sweep",
                run,
                "--window",
                "2",
                "--eval-file",
                base["heldout"],
                "--block-size",
                "32",
                "-o",
                out / "s.json",
                "--no-plot",
                "-q",
            ],
            "eval": [
                "eval",
                run,
                "--last",
                "2",
                "--eval-file",
                base["heldout"],
                "--block-size",
                "32",
                "-o",
                out / "e.json",
                "-q",
            ],
        }
        with AuditWatch(victim, processes=True, import_roots=(run, merged)) as watch:
            for name in commands:
                if name == "push":
                    try:
                        push_folder_to_hub(merged, "my-org/model", token=TOKEN, endpoint=hub.url)
                        codes[name] = 0
                    except Exception as err:
                        _check_library_error(err, "push")
                        codes[name] = 2
                elif name == "manifest":
                    codes[name] = 0
                    for call in (
                        lambda: drop_snapshots_after(run / "pma", 1500),
                        lambda: add_snapshot(
                            run / "pma", SnapshotRecord("snapshot-4000", 4000, 40), keep_last=1
                        ),
                    ):
                        try:
                            call()
                        except Exception as err:
                            _check_library_error(err, "manifest")
                            codes[name] = 2
                else:
                    result = run_cli(*argv[name])
                    _check_cli(result, name)
                    codes[name] = result.returncode
        assert watch.touched == [], watch.touched
        assert watch.started == [], watch.started
        assert watch.imported == [], watch.imported
        assert tree(victim) == before
        assert not list(tmp.rglob("PWNED")) and not Path("PWNED").exists()
        card = merged / "README.md"
        if card.is_file() and not card.is_symlink():
            text = card.read_text(encoding="utf-8", errors="replace")
            assert len(text) < 1_000_000, "a card of a megabyte"
            assert CONTROL.search(text) is None, "control character in the card"
            assert "__import__" not in text.replace(repr(HOSTILE_TEXT[7]), ""), (
                "a name reached the card's code unquoted"
            )
        for copied in (out / "merged").rglob("*") if (out / "merged").is_dir() else []:
            assert not copied.is_symlink(), copied
            if copied.is_file():
                assert b"OPENSSH PRIVATE KEY" not in copied.read_bytes(), (
                    f"{copied} holds the victim's secret"
                )
    return codes


def test_the_untouched_folders_pass_every_command(base, monkeypatch, tmp_path):
    """The control: without a change every command succeeds, so a refusal above is the change's."""
    with online_hub(monkeypatch, tmp_path, (TOKEN,)) as hub:
        codes = _attack(base, [], ["merge", "inspect", "card", "push", "sweep", "eval", "manifest"], hub=hub)
    assert codes == dict.fromkeys(["merge", "inspect", "card", "push", "sweep", "eval", "manifest"], 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=mutations())
def test_hostile_folders_fast_commands(base, monkeypatch, tmp_path, changes):
    """merge, inspect, card, push and the manifest's rotation and resume on a hostile folder."""
    with online_hub(monkeypatch, tmp_path, (TOKEN,)) as hub:
        _attack(base, changes, ["merge", "inspect", "card", "push", "manifest"], hub=hub)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=mutations())
def test_hostile_folders_evaluating_commands(base, changes):
    """sweep and eval (which load models and tokenizers) on a hostile folder."""
    _attack(base, changes, ["sweep", "eval"])
