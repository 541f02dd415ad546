"""Cases of the trust classes beyond the ones each class's own tests name, tried as an attacker
would: a run's ``pma/`` or ``checkpoint-N`` that links out of it, a ``.bin`` weight file that is
a FIFO, file outputs (``-o``, ``--plot``, ``--record``) at a link or inside a listed snapshot."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from hf_pma.merging.hub_revisions import list_revisions, parse_progress
from hf_pma.publishing.hub import push_folder_to_hub
from tests.helpers.cli import run_cli
from tests.helpers.hub_server import HubServer, online_cli_env, online_hub
from tests.helpers.models import make_tiny_model
from tests.helpers.pma_records import write_merged_folder
from tests.helpers.snapshot_runs import copy_run


@pytest.fixture
def run(pristine_run, tmp_path):
    """A fresh copy of a 3-snapshot run."""
    return copy_run(pristine_run, tmp_path)


def _error(done) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.startswith("hf-pma ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_runs_pma_or_checkpoint_folder_linking_out_of_it_is_refused(run, tmp_path):
    # pma/ moved elsewhere and linked back: its manifest and records are someone else's folder's.
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run / "pma", elsewhere)
    (run / "pma").symlink_to(elsewhere)
    for argv in (("inspect", run, "--no-diagnostics"), ("merge", run, "-o", tmp_path / "m")):
        line = _error(run_cli(*argv))
        assert line.endswith(f"{run / 'pma'} is a symbolic link to outside the folder {run.resolve()}"), line
    assert not (tmp_path / "m").exists()
    # A run of Trainer checkpoints, one of which links out of it.
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    shutil.copytree(elsewhere / "snapshot-1000", ckpts / "checkpoint-10")
    (ckpts / "checkpoint-20").symlink_to(elsewhere / "snapshot-2000")
    line = _error(run_cli("inspect", ckpts, "--no-diagnostics"))
    assert line.endswith(
        f"{ckpts / 'checkpoint-20'} is a symbolic link to outside the folder {ckpts.resolve()}"
    )


def test_a_bin_weight_file_that_is_a_fifo_is_named_not_called_deleted(run, tmp_path):
    snapshot = run / "pma" / "snapshot-2000"
    (snapshot / "model.safetensors").unlink()
    os.mkfifo(snapshot / "pytorch_model.bin")
    line = _error(run_cli("merge", run, "--last", "all", "-o", tmp_path / "m"))
    assert line == f"hf-pma merge: error: {snapshot / 'pytorch_model.bin'} is not a regular file (a FIFO)"


def test_file_outputs_at_a_link_or_inside_a_listed_snapshot_are_refused_before_any_work(run, tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("mine")
    (tmp_path / "report.json").symlink_to(victim)
    line = _error(run_cli("inspect", run, "--no-diagnostics", "-o", tmp_path / "report.json"))
    assert "--output" in line and "is a symbolic link" in line
    line = _error(run_cli("inspect", run, "--plot", tmp_path / "report.json"))
    assert "--plot" in line and "is a symbolic link" in line
    assert (tmp_path / "report.json").is_symlink() and victim.read_text() == "mine"

    old = run / "pma" / "snapshot-1000"
    before = sorted(p.name for p in old.iterdir())
    newest = run / "pma" / "snapshot-3000"
    for argv in (
        ("inspect", run, "--no-diagnostics", "-o", old / "report.json"),
        ("inspect", run, "--plot", old / "plot.png"),
        ("eval", newest, "--tokenizer", newest, "--eval-file", victim, "-o", old / "results.json"),
        ("eval", newest, "--tokenizer", newest, "--eval-file", victim, "--record", old),
    ):
        line = _error(run_cli(*argv))
        assert "lies inside" in line and f"a snapshot listed in {run / 'pma' / 'manifest.json'}" in line, line
    assert sorted(p.name for p in old.iterdir()) == before


def test_a_hub_ref_name_carries_no_progress_past_a_records_range_or_in_other_digits(tiny_tokenizer, tmp_path):
    # step + 30 digits was merged and recorded as is: the merge's pma_merge.json was then refused
    # by hf-pma card and push. Fullwidth digits ("step１２３" shows like "step123") were read as 123.
    hostile = ("step" + "9" * 30, "step１２３", "step٣", "tokens" + "9" * 25 + "T")
    assert all(parse_progress(name) == {"step": None, "tokens": None, "stage": None} for name in hostile)
    assert parse_progress("step" + "9" * 18)["step"] == 10**18 - 1
    folder = tmp_path / "model"
    make_tiny_model(seed=0).save_pretrained(folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    with HubServer() as hub:
        hub.add_repo("evil/progress")
        for i, name in enumerate(("step100", "step200", *hostile[:2])):
            hub.commit_files("evil/progress", name, files, message=str(i))
        revisions = list_revisions("evil/progress", "step*", endpoint=hub.url)
    assert {r.name: r.step for r in revisions} == {
        "step100": 100,
        "step200": 200,
        hostile[0]: None,
        hostile[1]: None,
    }


PUSH_TOKEN = "plain-secret-value-0123456789"


@pytest.fixture
def many_files(tmp_path, tiny_tokenizer):
    """A merged folder (no card yet) holding 300 more small files."""
    folder = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    (folder / "extra").mkdir()
    for i in range(300):
        (folder / "extra" / f"{i}.txt").write_text(str(i))
    return folder


def test_a_push_of_more_files_than_the_soft_open_file_limit_raises_it(monkeypatch, tmp_path, many_files):
    # Every pushed file is held open until the commit: with the soft limit below that, the repo was
    # created, then the push failed on "Too many open files" and left it empty.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 150
    if hard != resource.RLIM_INFINITY and hard < 2 * low:  # the hard limit must leave room to raise
        low = hard // 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with online_hub(monkeypatch, tmp_path, (PUSH_TOKEN,)) as hub:
            push_folder_to_hub(many_files, "my-org/model", token=PUSH_TOKEN, endpoint=hub.url)
            pushed = hub.files("my-org/model")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len([name for name in pushed if name.startswith("extra/")]) == 300 and "README.md" in pushed


def test_a_push_of_more_files_than_the_process_may_open_is_one_line_and_creates_no_repo(
    monkeypatch, tmp_path, many_files
):
    driver = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))\n"
        "from hf_pma.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    with online_hub(monkeypatch, tmp_path, (PUSH_TOKEN,)) as hub:
        env = {
            **os.environ,
            **{k: v for k, v in online_cli_env(hub, PUSH_TOKEN, str(tmp_path / "home")).items() if v},
        }
        env.pop("HF_HUB_OFFLINE", None)
        done = subprocess.run(
            [sys.executable, "-c", driver, "push", str(many_files), "--repo-id", "my-org/model"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1] == (
            f"hf-pma push: error: {many_files} holds 308 files to push, more than this process may open at "
            "once (ulimit -n 200): raise the limit or push fewer files"
        )
        assert hub.requests == [] and hub.repos == {}
    assert not (many_files / "README.md").exists()


def test_verbose_tracebacks_are_redacted_and_escaped(monkeypatch, tmp_path):
    # -v printed Python's own traceback: a password in HF_ENDPOINT (in the URLs of Hub errors) and a
    # name's escape sequences reached the terminal as they were.
    missing = tmp_path / "run\x1b[2J\u202e" / "missing"
    done = run_cli("merge", "-v", missing, "-o", tmp_path / "m")
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert [line for line in done.stderr.splitlines() if not line.isprintable()] == []
    assert "run\\x1b[2J\\u202e" in done.stderr
    with online_hub(monkeypatch, tmp_path, (PUSH_TOKEN,)) as hub:
        env = online_cli_env(hub, PUSH_TOKEN, str(tmp_path / "home"))
        env["HF_ENDPOINT"] = hub.url.replace("http://", "http://alice:Pa55wordSECRET@")
        done = run_cli(
            "-v", "merge", "org/nothere@main", "org/nothere@v2", "-o", tmp_path / "m", env=env, process=True
        )
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert "Pa55word" not in done.stderr and "http://***@127.0.0.1" in done.stderr


@pytest.mark.parametrize("name", ["vocab.txt", "source.spm", "preprocessor_config.json"])
def test_eval_refuses_any_tokenizer_file_linking_out_whatever_its_name(tmp_path, tiny_tokenizer, name):
    # A file list named the tokenizer files it checked: a BertTokenizer's vocab.txt linking to a
    # file outside was read by transformers.
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    secret = tmp_path / "secret.txt"
    secret.write_text("[PAD]\n[UNK]\nTOPSECRET\n")
    (merged / name).symlink_to(secret)
    fifo = tmp_path / "fifo-model"
    shutil.copytree(merged, fifo, symlinks=True)
    (fifo / name).unlink()
    os.mkfifo(fifo / name)
    text = tmp_path / "heldout.txt"
    text.write_text("hello world " * 50)
    for folder, why in ((merged, f"is a symbolic link to outside the folder {merged}"), (fifo, "(a FIFO)")):
        done = run_cli("eval", folder, "--eval-file", text, "--device", "cpu", "--limit", "1", cwd=tmp_path)
        assert done.returncode == 2 and "TOPSECRET" not in done.stdout + done.stderr
        assert _error(done) == f"hf-pma eval: error: {folder / name} " + (
            why if why.startswith("is") else f"is not a regular file {why}"
        )


def test_record_values_cannot_make_links_or_html_in_the_card(tmp_path, tiny_tokenizer):
    # Escaping control characters and '|' left markdown itself: a dataset name or a snapshot's phase
    # "[Download the weights](https://evil.example)" was a link in the card the user publishes.
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    link, html = "[Download the weights](https://evil.example/x)", "<img src=x onerror=alert(1)>"
    training = json.loads((merged / "pma_training.json").read_text())
    training["datasets"] = [link, html, "a\\|b", "c\\](https://evil.example/y)"]
    (merged / "pma_training.json").write_text(json.dumps(training))
    merge = json.loads((merged / "pma_merge.json").read_text())
    merge["sources"][0]["phase"] = link
    (merged / "pma_merge.json").write_text(json.dumps(merge))
    done = run_cli("card", merged, "--no-plot")
    assert done.returncode == 0, done.stderr
    text = (merged / "README.md").read_text()
    assert "](https://evil" not in text.replace("\\](https://evil", "") and "<img" not in text
    assert "[Download the weights\\](https://evil.example/x)" in text
    assert "&lt;img src=x onerror=alert(1)>" in text and "a\\\\\\|b" in text and "c\\\\\\](https" in text


def test_consolidate_overwrite_replaces_its_own_output_of_a_folder_without_a_record(tmp_path):
    # A DCP folder without pma.json was consolidated into a folder with no record: hf-pma's own
    # output was then "not written by hf-pma" to --overwrite.
    from tests.helpers.sharded_files import LAYOUTS, write_sharded

    model = make_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "full")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    folder = write_sharded(tmp_path / "dcp", state, LAYOUTS["rows-2"], config_from=tmp_path / "full")
    for _ in range(2):
        done = run_cli("consolidate", folder, "-o", tmp_path / "out", "--overwrite")
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "pma.json").is_file()


def test_eval_leaves_a_link_a_load_never_reads_alone(tmp_path, tiny_tokenizer):
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    (tmp_path / "scratch.log").write_text("log")
    (merged / "train.log").symlink_to(tmp_path / "scratch.log")  # a log kept on a scratch disk
    text = tmp_path / "heldout.txt"
    text.write_text("hello world " * 50)
    done = run_cli("eval", merged, "--eval-file", text, "--device", "cpu", "--limit", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_training_whose_pma_folder_is_a_link_out_writes_nothing_there(tmp_path):
    from hf_pma.snapshots.callback import PMACallback
    from tests.helpers.training import TRAIN_SMALL_TPS, train_small

    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "pma").symlink_to(victim)
    with pytest.raises(
        ValueError, match="is a symbolic link; hf-pma writes snapshots only into a real folder"
    ):
        train_small(out, [PMACallback(interval_tokens=2 * TRAIN_SMALL_TPS)], max_steps=4)
    assert list(victim.iterdir()) == []


def test_eval_of_a_config_whose_shapes_disagree_with_the_weights_is_one_line(tmp_path, tiny_tokenizer):
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    config = json.loads((merged / "config.json").read_text())
    (merged / "config.json").write_text(
        json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8})
    )
    text = tmp_path / "heldout.txt"
    text.write_text("hello world " * 50)
    done = run_cli(
        "eval", merged, "--eval-file", text, "--device", "cpu", "-o", tmp_path / "e.json", cwd=tmp_path
    )
    assert "does not load" in _error(done) and "Traceback" not in done.stderr


def test_compare_refuses_an_annealed_folder_linking_out_of_its_run(run, tmp_path, tiny_tokenizer):
    # run/annealed/ linked to another folder's model and record: compare evaluated that model as the run's.
    other = tmp_path / "other"
    shutil.copytree(run, other, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run / "pma" / "snapshot-3000", elsewhere)
    (elsewhere / "pma_anneal.json").write_text(json.dumps({"end_tokens": 3000}))
    (run / "annealed").symlink_to(elsewhere)
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    text = tmp_path / "heldout.txt"
    text.write_text("hello world " * 50)
    done = run_cli("compare", run, other, "--eval-file", text, "--tokenizer", tmp_path / "tok", "-q")
    assert _error(done).endswith(
        f"{run / 'annealed'} is a symbolic link to outside the folder {run.resolve()}"
    )


def test_an_anneal_record_that_is_a_fifo_or_counts_past_any_run_is_refused(tmp_path):
    from hf_pma.analysis.comparison import read_anneal_record

    folder = tmp_path / "annealed"
    folder.mkdir()
    os.mkfifo(folder / "pma_anneal.json")  # was taken for no record (the run's own tokens used)
    with pytest.raises(ValueError, match="is not a regular file"):
        read_anneal_record(folder)
    (folder / "pma_anneal.json").unlink()
    (folder / "pma_anneal.json").write_text('{"end_tokens": ' + "9" * 400 + "}")
    with pytest.raises(ValueError, match="end_tokens should be a count, got 9999"):
        read_anneal_record(folder)


def test_the_card_refuses_a_comparison_of_the_wrong_shape_in_one_line(tmp_path, tiny_tokenizer):
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    record = json.loads((merged / "pma_eval.json").read_text())
    models = {"last snapshot": {"loss": 3.0}}
    for comparison, what in (  # the first two were a TypeError's traceback
        ({"reference": ["last"], "models": models}, "comparison['reference'] should be a model label"),
        ({"annealed": {"a": 1}, "models": models}, "comparison['annealed'] should be a model label"),
        ({"models": {"x": [1]}}, "comparison['models']['x'] should be an object"),
        ([1, 2], "pma_eval.json: comparison should be an object"),
    ):
        (merged / "pma_eval.json").write_text(json.dumps({**record, "comparison": comparison}))
        line = _error(run_cli("card", merged, "--no-plot"))
        assert what in line, line


def test_the_annealed_fork_refuses_an_output_folder_that_is_a_link(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hf_pma.training.annealing import anneal_from_checkpoint

    victim = tmp_path / "victim"
    victim.mkdir()
    # An earlier fork's record: the fork trained into the folder the link points to.
    (victim / "pma_anneal.json").write_text("{}")
    out = tmp_path / "run"
    out.mkdir()
    (out / "annealed").symlink_to(victim)
    args = TrainingArguments(output_dir=str(out), lr_scheduler_type="constant", report_to=[])
    trainer = Trainer(make_tiny_model(), args)
    with pytest.raises(
        ValueError, match="annealed is a symbolic link; the annealed fork writes only into a real"
    ):
        anneal_from_checkpoint(trainer, out / "checkpoint-6", steps=2)
    assert sorted(p.name for p in victim.iterdir()) == ["pma_anneal.json"]


def test_an_online_average_resume_file_that_is_a_fifo_is_refused_not_restarted_empty(tmp_path):
    from hf_pma.core.manifest import SnapshotRecord
    from hf_pma.snapshots.sharded import ShardedOnlineAverageSink
    from hf_pma.snapshots.sinks import ONLINE_STATE_NAME, OnlineAverageSink, ResumePoint, online_state_name

    model = make_tiny_model(seed=0)
    sink = ShardedOnlineAverageSink(tmp_path / "pma", online="sma", rank=0, world_size=1)
    sink.open(None)
    sink.take(model, SnapshotRecord(path="snapshot-100", tokens=100, step=1))
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    sink.save_checkpoint(checkpoint)
    resume = ResumePoint(100, 1, checkpoint)
    saved = checkpoint / online_state_name(0)
    good = saved.read_bytes()
    # The average's bookkeeping says a window started past any run's tokens: refused (was taken).
    header_length = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + header_length])
    state = json.loads(header["__metadata__"]["online_state"])
    header["__metadata__"]["online_state"] = json.dumps({**state, "window_start": 10**30})
    text = json.dumps(header).encode()
    saved.write_bytes(len(text).to_bytes(8, "little") + text + good[8 + header_length :])
    with pytest.raises(ValueError, match="'window_start' is not a token count"):
        ShardedOnlineAverageSink(tmp_path / "a", online="sma", rank=0, world_size=1).open(resume)
    # A FIFO in place of the rank file or of an unsharded run's file: each sink restarted the average empty.
    saved.unlink()
    os.mkfifo(saved)
    with pytest.raises(ValueError, match="pma_online-rank0.safetensors is not a regular file \\(a FIFO\\)"):
        ShardedOnlineAverageSink(tmp_path / "b", online="sma", rank=0, world_size=1).open(resume)
    with pytest.raises(ValueError, match="pma_online-rank0.safetensors is not a regular file \\(a FIFO\\)"):
        OnlineAverageSink(tmp_path / "c", online="sma").open(resume)
    saved.unlink()
    os.mkfifo(checkpoint / ONLINE_STATE_NAME)
    for sink in (
        OnlineAverageSink(tmp_path / "d", online="sma"),
        ShardedOnlineAverageSink(tmp_path / "e", online="sma", rank=0, world_size=1),
    ):
        with pytest.raises(ValueError, match="pma_online.safetensors is not a regular file \\(a FIFO\\)"):
            sink.open(resume)


def test_eval_record_into_a_record_whose_comparison_the_card_refuses_fails_before_evaluating(
    tmp_path, tiny_tokenizer
):
    merged = write_merged_folder(tmp_path, tiny_tokenizer, careless=False)
    record = json.loads((merged / "pma_eval.json").read_text())
    (merged / "pma_eval.json").write_text(json.dumps({**record, "comparison": {"reference": [1]}}))
    text = tmp_path / "heldout.txt"
    text.write_text("hello world " * 50)
    # It evaluated and kept the comparison, which every card of the folder then refused.
    done = run_cli("eval", merged, "--eval-file", text, "--device", "cpu", "--record", merged, cwd=tmp_path)
    assert "pma_eval.json: comparison['reference'] should be a model label, found [1]" in _error(done)
    assert json.loads((merged / "pma_eval.json").read_text())["results"] == record["results"]


# ---------------------------------------------------------------- a stderr that cannot be written


def _stderr_gone():
    """A pipe whose reader has left (``hf-pma merge ... 2>&1 | head -1``): its write end."""
    read, write = os.pipe()
    os.close(read)
    return write


# The command as its console script runs it, in a process whose streams and limits a test sets.
CLI = "import sys; from hf_pma.cli import main; sys.exit(main())"

STDERR_ENDS = {
    "reader-gone": _stderr_gone,
    "full-disk": lambda: os.open("/dev/full", os.O_WRONLY),  # `2>job.err` on a full disk or quota
}


@pytest.mark.parametrize("case", list(STDERR_ENDS))
def test_a_stderr_that_cannot_be_written_neither_fails_a_merge_nor_changes_an_errors_status(run, tmp_path, case):
    """Logs and progress bars (no -q) to a stderr that fails every write: the merge still
    succeeds, whole, with nothing left behind; a bad command still exits 2 (not 1, a traceback
    nobody sees)."""
    out = tmp_path / "merged"
    for argv, status in (([run, "-o", out], 0), ([tmp_path / "nothere", "-o", tmp_path / "m2"], 2)):
        fd = STDERR_ENDS[case]()
        try:
            done = subprocess.run(
                [sys.executable, "-c", CLI, "merge", *map(str, argv)], stdout=subprocess.DEVNULL, stderr=fd,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=300,
            )
        finally:
            os.close(fd)
        assert done.returncode == status, argv
    assert (out / "pma_merge.json").is_file() and any(out.glob("*.safetensors"))
    assert not (tmp_path / "m2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------- --overwrite, checked again at the replace


def test_a_file_the_user_adds_to_a_merge_while_overwrite_replaces_it_is_kept(run, tmp_path, monkeypatch):
    """``merge --overwrite`` checks, before any work, that the old merge is all hf-pma's; a file
    the user puts into it while the new one is written (a merge takes minutes to hours) is not
    deleted with it at the replace: one line naming it, the old merge and the file kept."""
    import hf_pma.merging.engine as engine

    out = tmp_path / "merged"
    assert run_cli("merge", run, "-o", out, "--last", "2").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = engine.write_shard_index

    def user_adds_a_file(*args, **kwargs):  # while the new merge is being written
        (out / "notes.txt").write_text("mine")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "write_shard_index", user_adds_a_file)
    line = _error(run_cli("merge", run, "-o", out, "--overwrite"))
    assert "notes.txt" in line and "move them out" in line, line
    assert (out / "notes.txt").read_text() == "mine"
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "notes.txt"} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_file_the_user_adds_to_tasks_while_overwrite_replaces_them_is_kept(tmp_path, monkeypatch):
    """The same for ``make-tasks --overwrite`` (the one check, at the replace, of every output folder)."""
    import hf_pma.evaluation.generated_tasks as generated_tasks
    from tests.helpers.data import corpus as documents

    corpus, tasks = tmp_path / "corpus", tmp_path / "tasks"
    corpus.mkdir()
    for i, doc in enumerate(documents()):
        (corpus / f"doc{i:03d}.py").write_text(doc)
    options = ("--eval-fraction", "0.3", "--num-items", "10")
    assert run_cli("make-tasks", corpus, "-o", tasks, *options).returncode == 0
    before = {p.name: p.read_bytes() for p in tasks.iterdir()}
    real = generated_tasks._write_jsonl

    def user_adds_a_file(*args, **kwargs):
        (tasks / "mine.yaml").write_text("task: mine\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(generated_tasks, "_write_jsonl", user_adds_a_file)
    line = _error(run_cli("make-tasks", corpus, "-o", tasks, *options, "--overwrite"))
    assert "mine.yaml" in line and "move them out" in line, line
    assert {p.name: p.read_bytes() for p in tasks.iterdir() if p.name != "mine.yaml"} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_readme_the_user_wrote_beside_a_merge_is_not_hf_pmas_by_its_name(run, tmp_path):
    """README.md is hf-pma's card only when hf-pma generated it (its mark), not by its name: a
    model card the user wrote in an earlier merge is named by ``--overwrite`` and kept, and
    ``hf-pma card`` does not write over it; a card
    that ``hf-pma card`` wrote is replaced with the merge."""
    out = tmp_path / "merged"
    assert run_cli("merge", run, "-o", out).returncode == 0
    (out / "README.md").write_text("# My model\n\nNotes I wrote by hand.\n")
    line = _error(run_cli("merge", run, "-o", out, "--overwrite"))
    assert "README.md" in line and "move them out" in line, line
    assert (out / "README.md").read_text().startswith("# My model")
    line = _error(run_cli("card", out))  # nor does hf-pma card write over it
    assert "README.md" in line and "hf-pma did not generate it" in line, line
    assert (out / "README.md").read_text().startswith("# My model")
    (out / "README.md").unlink()
    assert run_cli("card", out).returncode == 0 and (out / "README.md").is_file()
    assert run_cli("merge", run, "-o", out, "--overwrite").returncode == 0
    assert not (out / "README.md").exists()


# ---------------------------------------------------------------- a GET that sends more than its HEAD announced


def test_a_download_whose_get_announces_more_than_its_head_stops_at_the_head(tmp_path):
    """transformers and huggingface_hub ask a file's size by HEAD first and write the GET's body
    to disk before comparing: a GET whose Content-Length says more than the HEAD did is bounded
    by the smaller (the HEAD's), never by what the larger claims."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx2

    from hf_pma.utils.hub_transport import BoundedTransport, HubAnswerTooLarge

    sent = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(64 * 2**20))
            self.end_headers()
            try:
                for _ in range(1024):
                    self.wfile.write(b"\0" * 65536)
                    sent.append(65536)
            except OSError:  # the client hung up
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/org/model/resolve/main/model.safetensors"
    try:
        with httpx2.Client(transport=BoundedTransport(httpx2.HTTPTransport(), lambda: 30)) as client:
            assert client.head(url).headers["Content-Length"] == "1000"
            with pytest.raises(HubAnswerTooLarge, match="sent more than 1,000 bytes"):
                with client.stream("GET", url) as response:
                    for _ in response.iter_bytes():
                        pass
    finally:
        server.shutdown()
        server.server_close()
    assert sum(sent) < 32 * 2**20


# ---------------------------------------------------------------- one claim per folder, whatever its path


@pytest.mark.parametrize("spelling", ["link", "dot-dot"])
def test_a_folder_named_through_a_link_or_dot_dot_has_the_claim_of_the_folder(tmp_path, spelling):
    """``hf-pma card latest`` (a link to the merge) or ``eval M/sub/..`` while ``merge --overwrite
    M`` holds M: the same claim, not a second one beside the link (or inside M), so the reader
    waits for the writer and sees one version."""
    from hf_pma.utils.fs import FolderClaim, OutputBusyError

    folder = tmp_path / "merged"
    (folder / "sub").mkdir(parents=True)
    other = {"link": tmp_path / "latest", "dot-dot": folder / "sub" / ".."}[spelling]
    if spelling == "link":
        other.symlink_to(folder)
    holder = subprocess.Popen(  # the writer, in another process: a merge replacing the folder
        [sys.executable, "-c", "import sys; from hf_pma.utils.fs import FolderClaim; c = FolderClaim(sys.argv[1]).acquire();"
         " print('held', flush=True); sys.stdin.read()", str(folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        for shared in (True, False):  # a reader (eval, push) and a record's writer (card, eval --record)
            with pytest.raises(OutputBusyError, match="is being written by another process"):
                FolderClaim(other, shared=shared).acquire(wait=0)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with FolderClaim(other):  # once the writer is done
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["merged", *(["latest"] if spelling == "link" else [])])
    assert [p.name for p in (folder / "sub").iterdir()] == []


# ---------------------------------------------------------------- a low hard limit that still fits the work


def test_a_merge_of_a_few_files_runs_under_a_hard_open_file_limit_of_64(run, tmp_path):
    """A container's ``ulimit -n 64`` (hard): a 3-snapshot merge holds a few dozen files at most,
    and runs; the check counts the files this process has open, not a fixed 256 on top."""
    out = tmp_path / "merged"
    done = subprocess.run(
        [sys.executable, "-c", CLI, "merge", str(run), "--last", "3", "-o", str(out), "-q"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)), timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "pma_merge.json").read_text())["sources"] and any(out.glob("*.safetensors"))
