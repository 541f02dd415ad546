"""One way out: outputs, claims, temporaries and records are created exclusively and never through a
link, in places checked before any work; hf-pma deletes or replaces only what it wrote (by name and
record, and only when nothing else is inside); a resume deletes nothing the run has not passed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pma.cli import main
from hf_pma.core.manifest import (
    MODEL_SUPPORT_FILES,
    PMA_SUBDIR,
    SnapshotRecord,
    clean_incomplete,
    is_excluded,
    manifest_snapshots,
)
from hf_pma.snapshots.callback import PMACallback
from hf_pma.snapshots.gather import gather_full_state_dict
from hf_pma.snapshots.sharded import mark_sharded_tmp_dir, sharded_tmp_dir
from hf_pma.snapshots.writer import prepare_snapshot, write_snapshot
from hf_pma.utils.fs import (
    RUN_MANIFESTS,
    atomic_write_text,
    check_output_folder,
    claim_path,
    embedded_name,
    parse_temporary,
    remove_stale_temporaries,
    temporary_path,
)
from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.snapshot_runs import copy_run, noise_deviation, write_run
from tests.helpers.training import TRAIN_SMALL_TPS, StopAt, train_small

TPS = TRAIN_SMALL_TPS


def the_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A run of 3 snapshots (read only by these tests: copy it to change it)."""
    run, _ = write_run(tmp_path_factory.mktemp("small") / "run", 3, noise_deviation())
    return run


# ---------------------------------------------------------------- claims and temporaries


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "folder"])
def test_a_planted_claim_is_refused_in_one_line_and_nothing_outside_is_written(
    small_run, tmp_path, capsys, kind
):
    victim = tmp_path / "victim.txt"
    victim.write_text("my thesis")
    out = tmp_path / "out" / "merged"
    out.parent.mkdir()
    claim = claim_path(out)
    {
        "symlink": lambda: claim.symlink_to(victim),
        "hardlink": lambda: os.link(victim, claim),
        "fifo": lambda: os.mkfifo(claim),
        "folder": lambda: claim.mkdir(),
    }[kind]()
    assert main(["merge", str(small_run), "-o", str(out), "-q"]) == 2
    error = the_error(capsys.readouterr().err)
    assert f"the claim file {claim} of output folder {out} is not a regular file" in error, error
    assert victim.read_text() == "my thesis" and not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [claim.name]  # no temporary either


def test_atomic_writes_never_follow_a_link_planted_at_a_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    target = tmp_path / "record.json"
    probe = parse_temporary(temporary_path(target).name)
    n = int(temporary_path(target).name.rsplit("-", 1)[1])
    planted = [
        target.with_name(f".record.json.tmp-{probe['host']}-{os.getpid()}-{n + k}") for k in range(1, 4)
    ]
    for link in planted:
        link.symlink_to(victim)
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and victim.read_text() == "keep"
    assert all(link.is_symlink() for link in planted)  # not ours: left as they are


def test_names_at_the_file_name_limit(small_run, tmp_path):
    """A legal 255-byte output name: its claim and temporaries fit NAME_MAX, stay recognisable,
    and a dead writer's temporary of that name is found again."""
    long_name = "m" * 200 + "é" * 27 + "x"  # 255 bytes in UTF-8
    assert len(os.fsencode(long_name)) == 255
    out = tmp_path / long_name
    embedded = embedded_name(out)
    assert embedded.startswith("m" * 100) and len(os.fsencode(embedded)) <= 255 - 107
    assert embedded == embedded_name(tmp_path / long_name) != embedded_name(tmp_path / (long_name[:-1] + "y"))
    for kind in ("tmp", "deleting"):
        name = temporary_path(out, kind).name
        assert len(os.fsencode(name)) <= 255 and parse_temporary(name)["name"] == embedded
    assert len(os.fsencode(claim_path(out).name)) <= 255
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".{embedded}.tmp-{socket.gethostname()}-{int(dead.stdout)}-0"
    stale.mkdir()
    assert remove_stale_temporaries(tmp_path, long_name) == [stale]
    assert main(["merge", str(small_run), "-o", str(out), "-q"]) == 0
    assert (out / "pma_merge.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [long_name]


# ---------------------------------------------------------------- places checked before any work


def test_output_places_are_checked_before_any_work(small_run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)
    (tmp_path / "file").write_text("x")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    cases = {
        tmp_path / "link": "is a symbolic link",
        tmp_path / "file": "exists and is not a folder",
        run
        / "pma"
        / "snapshot-1000"
        / "my-merge": f"it lies inside {run / 'pma' / 'snapshot-1000'}, a snapshot listed in",
    }
    if os.geteuid() != 0:  # root writes anywhere
        cases[readonly / "merged"] = "is not writable"
    readonly.chmod(0o555)
    try:
        for output, why in cases.items():
            assert main(["merge", str(small_run), "-o", str(output), "--last", "2"]) == 2, output
            captured = capsys.readouterr()
            assert why in the_error(captured.err) and "Merging" not in captured.err, captured.err
        assert list(empty.iterdir()) == [] and list(readonly.iterdir()) == []
        assert not (run / "pma" / "snapshot-1000" / "my-merge").exists()
        for command in (
            ["consolidate", str(run / "pma" / "snapshot-1000")],
            ["make-tasks", str(tmp_path / "file")],
        ):
            assert main([*command, "-o", str(tmp_path / "link"), "-q"]) == 2
            assert "is a symbolic link" in the_error(capsys.readouterr().err)
    finally:
        readonly.chmod(0o755)
    # The library's one check, for the commands that write folders.
    with pytest.raises(FileExistsError, match="lies inside"):
        check_output_folder(run / "pma" / "snapshot-2000" / "a" / "b", False)
    check_output_folder(run / "elsewhere", False)  # beside the snapshots: fine


def test_run_manifest_names_match_the_manifest_module():
    from hf_pma.core.manifest import MANIFEST_NAME

    assert RUN_MANIFESTS == (MANIFEST_NAME, f"{PMA_SUBDIR}/{MANIFEST_NAME}")
    assert "config.json" in MODEL_SUPPORT_FILES


# ---------------------------------------------------------------- deleting only what hf-pma wrote


@pytest.fixture
def resumable(trained, tmp_path):
    """A copy of the finished 8-step run of tests/test_run_folder_trust.py (snapshots at steps
    2, 4, 6, 8; checkpoints at 4 and 8)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    train_small(out, [PMACallback(interval_tokens=2 * TPS)])
    return out


def test_snapshot_records_list_their_files(trained):
    folder = trained / "pma" / f"snapshot-{2 * TPS}"
    files = json.loads((folder / "pma.json").read_text())["extra"]["files"]
    assert files == sorted(p.name for p in folder.iterdir())
    assert "files" not in manifest_snapshots(trained / "pma")[0].extra  # the manifest stays small


def test_keep_last_leaves_a_snapshot_folder_holding_a_users_merge(resumable, caplog):
    pma = resumable / "pma"
    oldest = pma / f"snapshot-{2 * TPS}"
    mine = oldest / "my-merge"
    mine.mkdir()
    (mine / "model.safetensors").write_text("weeks of work")
    stray = pma / f"snapshot-{4 * TPS}" / "notes.txt"
    stray.write_text("mine too")
    with caplog.at_level(logging.WARNING):
        train_small(
            resumable,
            [PMACallback(interval_tokens=2 * TPS, keep_last=1)],
            resume=str(resumable / "checkpoint-4"),
        )
    assert [r.step for r in manifest_snapshots(pma)] == [8]
    assert (mine / "model.safetensors").read_text() == "weeks of work" and stray.read_text() == "mine too"
    assert not (pma / f"snapshot-{6 * TPS}").exists()  # entirely hf-pma's: deleted as before
    warnings = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert len(warnings) == 2 and "it holds the folder 'my-merge'" in warnings[0], warnings


def test_a_users_folder_named_like_a_snapshot_stops_training_at_the_start(tmp_path):
    pma = tmp_path / "run" / "pma"
    users = pma / f"snapshot-{2 * TPS}"
    users.mkdir(parents=True)
    (users / "mine.txt").write_text("keep")
    with pytest.raises(
        FileExistsError, match=rf"{users} is a folder without pma.json, not a snapshot"
    ) as info:
        train_small(tmp_path / "run", [PMACallback(interval_tokens=2 * TPS)], max_steps=4)
    assert "\n" not in str(info.value)
    assert (
        sorted(p.name for p in pma.iterdir()) == [users.name] and (users / "mine.txt").read_text() == "keep"
    )
    assert not (tmp_path / "run" / "checkpoint-2").exists()


def test_a_snapshot_never_replaces_a_folder_that_is_not_entirely_hf_pmas(tmp_path):
    pma = tmp_path / "pma"
    model = make_tiny_model(seed=1)

    def job(tokens):
        return prepare_snapshot(
            model, gather_full_state_dict(model), SnapshotRecord(f"snapshot-{tokens}", tokens, 1)
        )

    users = pma / "snapshot-10"
    users.mkdir(parents=True)
    (users / "mine.txt").write_text("keep")
    with pytest.raises(
        FileExistsError, match="will not replace .*snapshot-10 with a snapshot: it is not a snapshot folder"
    ):
        write_snapshot(job(10), pma)
    write_snapshot(job(20), pma)
    (pma / "snapshot-20" / "extra.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="it holds the file 'extra.txt'"):
        write_snapshot(job(20), pma)
    (pma / "snapshot-20" / "extra.txt").unlink()
    write_snapshot(job(20), pma)  # entirely hf-pma's: replaced
    assert (users / "mine.txt").read_text() == "keep"


def test_resume_sets_later_snapshots_aside_until_the_run_passes_them(resumable):
    pma = resumable / "pma"
    before = {p.name: (p / "model.safetensors").read_bytes() for p in pma.glob("snapshot-*")}
    # Interrupted right after resuming at step 4: nothing is lost, the gap is in the manifest.
    with pytest.raises(KeyboardInterrupt):
        train_small(
            resumable,
            [StopAt(5), PMACallback(interval_tokens=2 * TPS)],
            resume=str(resumable / "checkpoint-4"),
        )
    records = manifest_snapshots(pma)
    assert [(r.step, is_excluded(r), r.extra.get("set_aside_at")) for r in records] == [
        (2, False, None),
        (4, False, None),
        (6, True, 4 * TPS),
        (8, True, 4 * TPS),
    ]
    assert "past the resume point at 256 tokens" in records[2].extra["excluded_reason"]
    assert {p.name: (p / "model.safetensors").read_bytes() for p in pma.glob("snapshot-*")} == before
    # Resumed again and run to the end: each was replaced by the new snapshot at its tokens.
    train_small(resumable, [PMACallback(interval_tokens=2 * TPS)], resume=str(resumable / "checkpoint-4"))
    records = manifest_snapshots(pma)
    assert [(r.step, is_excluded(r), r.extra.get("set_aside_at")) for r in records] == [
        (2, False, None),
        (4, False, None),
        (6, False, None),
        (8, False, None),
    ]
    assert sorted(p.name for p in pma.iterdir() if p.name.startswith(".")) == []


def test_resume_drops_set_aside_snapshots_the_run_passed_without_retaking_them(resumable):
    pma = resumable / "pma"
    # The resumed run snapshots at other token counts (every 3 steps): 6 and 8 are passed, not retaken.
    train_small(resumable, [PMACallback(interval_tokens=3 * TPS)], resume=str(resumable / "checkpoint-4"))
    assert [r.step for r in manifest_snapshots(pma)] == [2, 4, 6]
    assert (
        json.loads((pma / f"snapshot-{6 * TPS}" / "pma.json").read_text())["extra"]["interval_tokens"]
        == 3 * TPS
    )
    assert not (pma / f"snapshot-{8 * TPS}").exists()


def test_start_up_cleanup_touches_only_hf_pmas_leftovers(tmp_path, caplog):
    pma = tmp_path / PMA_SUBDIR
    pma.mkdir()
    # Names that earlier development versions gave temporaries (no released version wrote them),
    # and hf-pma's sharded temporary name without the mark its ranks write first: the user's.
    users = [pma / ".tmp-notes", pma / ".deleting-draft", pma / ".tmp-snapshot-5-extra"]
    users += [pma / ".tmp-snapshot-32-99-0", pma / ".deleting-snapshot-32-99", pma / ".manifest.json.x1y2.tmp"]
    for path in users:
        path.write_text("the user's")
    unmarked = pma / ".tmp-snapshot-128"
    unmarked.mkdir()
    (unmarked / "notes.txt").write_text("the user's")
    ours = [sharded_tmp_dir(pma, "snapshot-64")]  # as a rank makes it, cut before its file was complete
    ours[0].mkdir()
    mark_sharded_tmp_dir(ours[0])
    (ours[0] / "shard-00001-model-00001-of-00001.safetensors.partial").write_text("half")
    odd = pma / ".tmp-snapshot-96"  # marked, but holding a folder of someone's: left
    (odd / "sub").mkdir(parents=True)
    mark_sharded_tmp_dir(odd)
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        removed = clean_incomplete(pma)
    assert sorted(removed) == sorted(ours)
    assert all(p.read_text() == "the user's" for p in users) and odd.is_dir()
    assert (unmarked / "notes.txt").read_text() == "the user's"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(str(p) in logged for p in ours)


# ---------------------------------------------------------------- every way a command ends

PAUSE_AT = Path(__file__).parent / "dist" / "pause_at.py"
# (command, the stage it is stopped at, the signal): every command that writes, stopped while it
# holds a claim, a temporary folder, or reads under a shared claim.
STOPS = [
    ("merge", "hf_pma.merging.engine:remove_stale_temporaries", signal.SIGTERM),  # claimed, nothing written
    ("merge", "hf_pma.io.safetensors:SafetensorsWriter.write_at", signal.SIGHUP),  # writing the temporary
    ("merge", "hf_pma.merging.engine:publish_folder", signal.SIGTERM),  # written, not yet published
    ("merge --overwrite", "hf_pma.merging.engine:publish_folder", signal.SIGINT),  # replacing an earlier merge
    ("eval --record", "hf_pma.evaluation.loading:_load_model_for_eval", signal.SIGTERM),  # reading, shared claim
    ("eval --record", "hf_pma.evaluation.records:atomic_write_json", signal.SIGHUP),  # the record's claim held
    ("consolidate", "hf_pma.merging.consolidate:write_shard_index", signal.SIGTERM),  # shards written
    ("sweep --best", "hf_pma.evaluation.records:write_eval_record", signal.SIGTERM),  # the best merge's records
]


def _leftovers(root: Path) -> list[str]:
    """Claims and temporaries of hf-pma anywhere under ``root``."""
    return sorted(
        str(Path(folder, name).relative_to(root))
        for folder, dirs, files in os.walk(root)
        for name in dirs + files
        if name.endswith(".claim") or parse_temporary(name) is not None
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, stage, signum", STOPS, ids=[f"{c.split()[0]}-{s.split(':')[1]}-{g.name}" for c, s, g in STOPS]
)
def test_a_signal_at_any_stage_ends_in_one_line_with_128_plus_the_signal_and_leaves_nothing(
    small_run, tmp_path, tiny_tokenizer, command, stage, signum
):
    run = copy_run(small_run, tmp_path / "run")
    snapshots = [str(run / PMA_SUBDIR / f"snapshot-{t}") for t in (1000, 2000, 3000)]
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "out"
    name = command.split()[0]
    if name == "merge":
        args = [*snapshots, "-o", out, "--workers", "1"]
        if "--overwrite" in command:
            assert run_cli("merge", *snapshots[:2], "-o", out, "-q").returncode == 0
            args.append("--overwrite")
    elif name == "eval":
        save_model_folder(out, make_tiny_model(seed=1), tiny_tokenizer)
        args = [out, "--eval-file", heldout, "--block-size", "32", "--record", out, "-o", tmp_path / "results.json"]
    elif name == "consolidate":
        from tests.helpers.sharded_files import LAYOUTS, write_sharded

        model = make_tiny_model(seed=0)
        model.save_pretrained(tmp_path / "full")
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        args = [write_sharded(tmp_path / "dcp", state, LAYOUTS["rows-2"], config_from=tmp_path / "full"), "-o", out]
    else:
        tiny_tokenizer.save_pretrained(run)
        args = [run, "--eval-file", heldout, "--block-size", "32", "--window", "2", "-o", tmp_path / "sweep.json",
                "--no-plot", "--best", out]
    before = sorted(os.listdir(out)) if out.exists() else None
    proc = subprocess.Popen(
        [sys.executable, str(PAUSE_AT), stage, name, *map(str, args), "-q"],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    try:
        for line in proc.stderr:
            if line.startswith("PAUSED "):
                break
        else:
            pytest.fail(f"never paused at {stage}; exit {proc.wait()}")
        proc.send_signal(signum)
        proc.stdin.close()  # a paused worker thread goes on (and stops at its next chunk)
        assert proc.wait(timeout=120) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    ending = "interrupted" if signum == signal.SIGINT else f"interrupted by {signal.Signals(signum).name}"
    assert "Traceback" not in err and err.strip().splitlines() == [f"hf-pma {name}: {ending}"], err
    assert _leftovers(tmp_path) == []
    if name in ("merge", "consolidate"):
        assert (sorted(os.listdir(out)) if out.exists() else None) == before  # an earlier merge is still whole
    if name == "eval":  # the record untouched; the -o file (written first) whole, or not there
        assert sorted(os.listdir(out)) == before
        results = tmp_path / "results.json"
        assert json.loads(results.read_text())["results"] if "records" in stage else not results.exists()


OUTPUT_ENDS = {
    "ascii-stdout": {"env": {"PYTHONIOENCODING": "ascii"}},
    "c-locale": {"env": {"LC_ALL": "C", "LANG": "C"}},
    "reader-gone": {"close_reader": True},  # `hf-pma merge ... | head -0`
    "stdout-closed": {"close_fd": 1},  # `hf-pma merge ... >&-`
    "stdin-and-stdout-closed": {"close_fd": (0, 1)},
}


@pytest.mark.parametrize("case", list(OUTPUT_ENDS))
def test_a_merge_that_succeeded_stays_a_success_whatever_its_stdout(small_run, tmp_path, case):
    """A merge into a non-ASCII folder whose stdout cannot encode the name, is closed, or whose
    reader is gone: exit 0, nothing on stderr, the merge complete (one output path: write_out)."""
    how = OUTPUT_ENDS[case]
    out = tmp_path / "fusión-模型"
    closing = how.get("close_fd", ())
    closing = (closing,) if isinstance(closing, int) else closing
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hf_pma.cli import main; sys.exit(main())", "merge",
         *(str(small_run / PMA_SUBDIR / f"snapshot-{t}") for t in (1000, 2000, 3000)), "-o", str(out), "-q"],
        stdout=subprocess.PIPE if "close_fd" not in how else None,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **how.get("env", {})},
        preexec_fn=(lambda: [os.close(fd) for fd in closing]) if closing else None,
    )
    if how.get("close_reader"):
        proc.stdout.close()
    stdout, stderr = (b"", proc.stderr.read()) if proc.stdout is None or proc.stdout.closed else proc.communicate()[:2]
    assert proc.wait(timeout=300) == 0, stderr.decode(errors="replace")
    assert stderr == b""
    assert (out / "pma_merge.json").is_file() and any(out.glob("*.safetensors"))
    assert _leftovers(tmp_path) == []
    if case == "ascii-stdout":
        assert stdout.decode("ascii").endswith("-> " + str(out).encode("ascii", "backslashreplace").decode() + "\n")


# ---------------------------------------------------------------- limits

LIMITED = """
import resource, sys
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard if hard > 0 else resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from hf_pma.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def run_of_40(tmp_path_factory):
    run, _ = write_run(tmp_path_factory.mktemp("forty") / "run", 40, noise_deviation())
    return run


@pytest.mark.parametrize("command", ["merge", "sweep"])
def test_a_low_soft_open_file_limit_is_raised_for_a_40_snapshot_merge(run_of_40, tmp_path, command):
    """Soft limit 40, hard limit as it is: every snapshot's file is held open
    together, so the soft limit is raised first (as push did, one helper now)."""
    out = tmp_path / "merged"
    args = ["merge", run_of_40, "--last", "40", "-o", out] if command == "merge" else [
        "sweep", run_of_40, "--eval-file", _heldout(tmp_path), "--block-size", "32", "--window", "40", "--strategy",
        "sma", "-o", tmp_path / "sweep.json", "--no-plot", "--tokenizer", _tokenizer_folder(tmp_path),
    ]
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, "40", "0", *map(str, args), "-q"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if command == "merge":
        assert len(json.loads((out / "pma_merge.json").read_text())["sources"]) == 40
    else:
        assert json.loads((tmp_path / "sweep.json").read_text())["best"] is not None
    assert _leftovers(tmp_path) == []


def test_an_open_file_hard_limit_below_the_merge_is_one_line_before_any_work(run_of_40, tmp_path):
    out = tmp_path / "merged"
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, "64", "64", "merge", str(run_of_40), "--last", "40", "-o", str(out), "-q"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 2 and the_error(done.stderr) == (
        "hf-pma merge: error: the 40 sources hold 40 weight files to read together, more than this process may open "
        "at once (ulimit -n 64): raise the limit or use fewer sources"
    ), done.stderr
    assert sorted(os.listdir(tmp_path)) == []


def _heldout(tmp_path: Path) -> Path:
    path = tmp_path / "heldout.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return path


def _tokenizer_folder(tmp_path: Path) -> Path:
    from tests.helpers.models import train_tiny_tokenizer

    folder = tmp_path / "tokenizer"
    train_tiny_tokenizer().save_pretrained(folder)
    return folder


def test_workers_beyond_what_the_cores_can_use_are_capped_before_any_thread_starts(
    small_run, tmp_path, monkeypatch, caplog
):
    """``--workers 20000`` on a 0.5 MB merge started 20,000 threads (664 MB, 5 s): capped to 4 per
    usable core, and never more than the chunks to merge; the output is the same bytes."""
    import threading

    from hf_pma.merging.chunks import WORKERS_PER_CORE, default_workers

    started = []
    start = threading.Thread.start

    def counted(self):
        if self.name.startswith("hf-pma-merge-"):
            started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    snapshots = [small_run / PMA_SUBDIR / f"snapshot-{t}" for t in (1000, 2000, 3000)]
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        assert main(["merge", *map(str, snapshots), "-o", str(tmp_path / "many"), "--workers", "20000"]) == 0
    cap = WORKERS_PER_CORE * default_workers()
    assert 1 <= len(started) <= cap
    assert f"workers=20,000 capped to {cap} ({WORKERS_PER_CORE} per usable core" in caplog.text
    assert main(["merge", *map(str, snapshots), "-o", str(tmp_path / "one"), "--workers", "1", "-q"]) == 0
    for one in (tmp_path / "one").glob("*.safetensors"):
        assert one.read_bytes() == (tmp_path / "many" / one.name).read_bytes()


# ---------------------------------------------------------------- a full disk at every write


def _fill(folder: Path) -> None:
    """Fill ``folder``'s filesystem to the last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\0")
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("full", ["output", "record", "both"])
def test_eval_record_on_a_full_disk_keeps_the_evaluation(tmp_path, small_filesystem, tiny_tokenizer, full):
    """The ``-o`` file and the record are each written whole or not at all, one not stopping the
    other; the table is printed whatever fails, then one line names what failed and what was kept.
    The record's claim is released and nothing temporary stays, on either disk."""
    model = save_model_folder(tmp_path / "model", make_tiny_model(seed=1), tiny_tokenizer)
    heldout = _heldout(tmp_path)
    output = (small_filesystem if full in ("output", "both") else tmp_path) / "results.json"
    record = (small_filesystem if full in ("record", "both") else tmp_path) / "merged"
    record.mkdir()
    earlier = {"results": {"earlier": {"lm": {"loss": 1.0}}}, "eval_dataset": None}
    (record / "pma_eval.json").write_text(json.dumps(earlier))
    _fill(small_filesystem)
    done = run_cli(
        "eval", model, "--labels", "new", "--eval-file", heldout, "--block-size", "32", "--record", record,
        "-o", output, "-q",
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    error = errors[0]
    assert [c.strip() for c in done.stdout.splitlines()[0].split("|")[1:3]] == ["metric", "new"], done.stdout
    failed_paths = {"output": [output], "record": [record / "pma_eval.json"], "both": [output, record / "pma_eval.json"]}
    for path in failed_paths[full]:
        assert f"no space left on the device to write {path}" in error
    assert error.endswith(
        "the results are printed above"
        + {"output": f" and recorded in {record / 'pma_eval.json'}", "record": f" and written to {output}", "both": ""}[full]
    ), error
    new = json.loads((record / "pma_eval.json").read_text())
    if full == "output":
        assert not output.exists() and sorted(new["results"]) == ["earlier", "new"]
    else:
        assert new == earlier  # the old record, whole
    if full == "record":
        assert sorted(json.loads(output.read_text())["results"]) == ["new"]
    for root in (tmp_path, small_filesystem):
        assert _leftovers(root) == []
