"""What a user sees in their terminal: a plain Trainer script with ``PMACallback`` (default
logging shows warnings only) is told where the snapshots go and what they cost, and never sees
``save_pretrained``'s chatter for snapshot files; the ``hf-pma`` command's ``-q``/``-v``."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from transformers import LlamaConfig
from transformers.utils import logging as hf_logging

from hf_pma.utils.logs import notice, quiet_info
from tests.helpers.cli import run_cli
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.output import CollectLogs
from tests.helpers.repo import REPO_ROOT

# A user's script: nothing about logging, a tokenizer as processing_class (so snapshot folders
# get tokenizer files), a checkpoint at the end from the training thread.
PLAIN_SCRIPT = """
import sys
import transformers
from transformers import Trainer, TrainingArguments
from hf_pma import PMACallback
from tests.helpers.training import lm_setup, quiet_args

out, verbosity = sys.argv[1], sys.argv[2]
if verbosity == "info":
    transformers.logging.set_verbosity_info()
model, tokenizer, train, _, collator = lm_setup()
args = TrainingArguments(output_dir=out, max_steps=8, **quiet_args())
trainer = Trainer(model, args, train_dataset=train, data_collator=collator, processing_class=tokenizer,
                  callbacks=[PMACallback(interval_tokens=2 * 4 * 32)])
trainer.train()
trainer.save_model(out + "/final")
"""


# The cost line, either form (hf_pma.snapshots.planning.cost_message, unmeasured_cost_message).
COST_LINE = re.compile(r"hf-pma: (snapshots|\d+ snapshot\(s\)) cost ")


def run_plain_script(out: Path, verbosity: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_SCRIPT, str(out), verbosity],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((out / "pma").glob("snapshot-*"))) == 4  # steps 2, 4, 6, 8
    return proc.stderr


def test_plain_script_default_logging_shows_the_summary_and_no_save_chatter(tmp_path):
    err = run_plain_script(tmp_path, "default")
    pma = str((tmp_path / "pma").absolute())
    start = [line for line in err.splitlines() if "hf-pma: a snapshot every 256 tokens" in line]
    assert len(start) == 1, err
    assert pma in start[0] and "2.0 steps" in start[0] and "disk:" in start[0] and "free space of" in start[0]
    # What the snapshots cost reaches the user once: measured against the step times, or (this run
    # is short: every other step follows a snapshot) what they blocked and wrote.
    cost = [line for line in err.splitlines() if COST_LINE.search(line)]
    assert len(cost) == 1 and "KiB" in cost[0], err
    end = [line for line in err.splitlines() if "hf-pma: 4 snapshots" in line]
    assert len(end) == 1 and f"hf-pma merge {pma}" in end[0]
    assert "saved in" not in err


def test_save_chatter_is_silenced_for_snapshots_only_even_at_info(tmp_path):
    err = run_plain_script(tmp_path, "info")
    # transformers' own INFO is shown: the Trainer's banner and the final save_model's files...
    assert "***** Running training *****" in err
    final = str(tmp_path / "final")
    assert f"Configuration saved in {final}/config.json" in err
    # ...but not one line for the snapshot folders (config, generation config, tokenizer).
    saved = [line for line in err.splitlines() if "saved in" in line]
    assert saved and all(final in line for line in saved), saved
    assert "hf-pma: a snapshot every 256 tokens" in err


def test_quiet_info_drops_only_the_calling_threads_records():
    config = LlamaConfig()
    module_logger = logging.getLogger(
        "transformers.configuration_utils"
    )  # where "Configuration saved in" goes
    collect = CollectLogs()
    module_logger.addHandler(collect)
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with quiet_info(config):
            module_logger.info("from the writer")
            module_logger.warning("a writer's warning")
            inside.set()
            leave.wait(10)

    try:
        thread = threading.Thread(target=writer)
        thread.start()
        inside.wait(10)
        module_logger.info("from the training thread")  # while the writer is inside the block
        leave.set()
        thread.join()
        module_logger.info("after the block")
    finally:
        hf_logging.set_verbosity(previous)
        module_logger.removeHandler(collect)
    assert collect.messages == ["a writer's warning", "from the training thread", "after the block"]


def test_notice_is_a_warning_for_plain_scripts_and_info_where_info_is_shown(caplog):
    """Shown at WARNING's level where only warnings are, but named INFO: news is no warning."""
    logger = logging.getLogger("hf_pma.test_notice")
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        notice(logger, "one")
    with caplog.at_level(logging.INFO, logger="hf_pma"):
        notice(logger, "two")
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the user asked transformers to be quiet
    try:
        with caplog.at_level(logging.WARNING, logger="hf_pma"):
            notice(logger, "three")
    finally:
        hf_logging.set_verbosity(previous)
    got = [(r.levelno, r.levelname, r.getMessage()) for r in caplog.records if r.name == logger.name]
    assert got == [(logging.WARNING, "INFO", "one"), (logging.INFO, "INFO", "two")]
    assert {r.filename for r in caplog.records if r.name == logger.name} == {"test_logs.py"}  # the caller's line


def test_a_level_the_script_set_survives_the_pmatrainer_it_builds(tmp_path, monkeypatch):
    from hf_pma import PMATrainer, PMATrainingArguments
    from hf_pma.utils import logs

    hf_pma_logger = logging.getLogger("hf_pma")
    monkeypatch.setattr(hf_pma_logger, "level", hf_pma_logger.level)  # restored afterwards
    monkeypatch.setattr(logs, "_default_level", None)
    previous = hf_logging.get_verbosity()

    def build() -> None:
        args = PMATrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[])
        PMATrainer(model=make_tiny_model(seed=0), args=args)

    try:
        logs.enable_logging(logging.INFO)  # the script asks for hf-pma's INFO lines
        build()
        assert hf_pma_logger.level == logging.INFO
        # Nobody set a level: the Trainer's call follows transformers' verbosity, each time.
        hf_pma_logger.setLevel(logging.NOTSET)
        logs._default_level = None
        build()
        assert hf_pma_logger.level == hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        logs.enable_logging()
        assert hf_pma_logger.level == logging.ERROR
        # A level set on the logger directly is the user's too.
        hf_pma_logger.setLevel(logging.DEBUG)
        build()
        assert hf_pma_logger.level == logging.DEBUG
    finally:
        hf_logging.set_verbosity(previous)


def _cli(*argv: str):
    """``hf-pma ARGV`` in a terminal: a process of its own."""
    return run_cli(*argv, env={"OMP_NUM_THREADS": "1"}, process=True, timeout=120)


def test_cli_quiet_and_verbose(tmp_path):
    sources = [str(save_model_folder(tmp_path / f"m{i}", make_tiny_model(seed=i))) for i in range(2)]
    default = _cli("merge", *sources, "-o", str(tmp_path / "a"))
    assert default.returncode == 0, default.stderr
    assert "[INFO|hf_pma.merging.engine]" in default.stderr and "DEBUG" not in default.stderr
    assert "saved in" not in default.stderr  # transformers' own INFO stays hidden by default
    for quiet in (["merge", "-q"], ["-q", "merge"]):
        out = tmp_path / f"q{len(quiet[0])}"
        proc = _cli(*quiet, *sources, "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        assert (out / "model.safetensors").is_file()
        assert proc.stderr == "", proc.stderr  # nothing: no info logs, no progress bar
    verbose = _cli("merge", "-v", *sources, "-o", str(tmp_path / "v"))
    assert verbose.returncode == 0, verbose.stderr
    assert "[INFO|hf_pma.merging.engine]" in verbose.stderr
    # -v shows the traceback of a bad input, without it one line.
    bad = _cli("merge", str(tmp_path / "missing"), "-o", str(tmp_path / "b"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    bad_v = _cli("merge", "-v", str(tmp_path / "missing"), "-o", str(tmp_path / "b"))
    assert bad_v.returncode != 0 and "Traceback" in bad_v.stderr


def test_cpu_threads_leave_the_busy_cores():
    from hf_pma.utils.threads import free_core_threads, usable_cores

    assert free_core_threads(2, 2, 0.3) == 2  # an idle machine keeps torch's default
    assert free_core_threads(2, 2, 1.6) == 1  # another job on one of 2 cores: 1 thread
    assert free_core_threads(2, 2, 7.0) == 1  # never fewer than 1
    assert free_core_threads(16, 16, 4.2) == 12
    assert free_core_threads(4, 16, 2.0) == 4  # never more than torch would use
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_cli_respects_omp_num_threads():
    # With OMP_NUM_THREADS set, the command leaves torch's threads alone whatever the load.
    probe = (
        "import os, sys, torch; from hf_pma.utils.threads import fit_cpu_threads; "
        "print(fit_cpu_threads(), torch.get_num_threads())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["None", "1"], out.stderr


def _redraws(make, updates: int = 2000, tick: float = 0.2) -> int:
    """The carriage-return redraws a bar writes over ``updates`` updates, ``tick`` seconds apart
    on a clock of its own (no real time passes)."""
    import io

    log = io.StringIO()
    bar = make(total=updates, file=log)
    clock = iter(bar.start_t + tick * n for n in range(1, 10 * updates))
    bar._time = lambda: next(clock)
    for _ in range(updates):
        bar.update(1)
    bar.close()
    return log.getvalue().count("\r")


def test_progress_bars_into_a_file_or_pipe_redraw_rarely():
    """Into a file (not a terminal) 2,000 updates over 400 s leave a few redraws, where tqdm's
    own pace writes one per update; on a terminal it keeps tqdm's own pace."""
    import io

    from tqdm.auto import tqdm

    from hf_pma.utils.logs import PROGRESS_INTERVAL_NOT_A_TERMINAL_S, progress_bar

    assert _redraws(tqdm) > 1000  # what a log got before
    assert _redraws(progress_bar) <= 10  # 400 s / 60 s, and the last

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    with progress_bar(total=1, file=Terminal()) as bar:
        assert bar.mininterval == 0.1  # tqdm's default
    with progress_bar(total=1, file=io.StringIO()) as bar:
        assert bar.mininterval == bar.maxinterval == PROGRESS_INTERVAL_NOT_A_TERMINAL_S


def test_every_progress_bar_of_hf_pma_is_made_by_progress_bar():
    """One mechanism: no module of hf_pma makes a tqdm bar but hf_pma.utils.logs."""
    from tests.helpers.repo import REPO_ROOT

    makers = [
        str(p.relative_to(REPO_ROOT))
        for p in (REPO_ROOT / "hf_pma").rglob("*.py")
        if p.name != "logs.py" and re.search(r"^\s*(from tqdm|import tqdm)", p.read_text(), re.M)
    ]
    assert makers == [], f"these modules make tqdm bars of their own (use hf_pma.utils.logs.progress_bar): {makers}"
