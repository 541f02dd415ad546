"""What the tests share: tiny Llama models built from configs, a locally trained tokenizer,
fast Trainer settings, ``require_*`` markers for optional extras, and :func:`launch`, the one
way tests start several processes (``torchrun`` or ``accelerate launch``).

Nothing here touches the network: models come from configs, the tokenizer is trained with
``tokenizers`` on a few kilobytes of the standard library's own source.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from transformers import DataCollatorForLanguageModeling

REPO_ROOT = Path(__file__).resolve().parents[1]
DIST_DIR = REPO_ROOT / "tests" / "dist"


def tiny_llama_config(vocab_size: int = 512, tie: bool = True, **overrides):
    """A 2-layer Llama config with a few tens of thousands of parameters."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def make_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    """A randomly initialised tiny LlamaForCausalLM (deterministic for a seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides))
    return model.to(dtype)


def sample_text(max_chars: int = 60_000) -> str:
    """Real text that every Python installation has: the source of a few stdlib modules."""
    import argparse
    import json as json_mod
    import textwrap

    parts = [inspect.getsource(m) for m in (textwrap, argparse, json_mod.decoder)]
    return "\n".join(parts)[:max_chars]


def write_small_tasks(folder: Path) -> Path:
    """Generated lm-eval tasks (12 items each, lines of at most 60 characters) with their held-out
    documents, from :func:`sample_text` cut into 30-line documents; returns ``folder``."""
    from hf_pma.evaluation.generated_tasks import TaskOptions, make_tasks

    lines = sample_text().splitlines()
    docs = ["\n".join(lines[i : i + 30]) for i in range(0, len(lines), 30)]
    make_tasks(docs, folder, eval_fraction=0.3, options=TaskOptions(num_items=12, max_line_chars=60))
    return Path(folder)


def train_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained locally, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_text().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


# Optional extras: CI installs them all and fails on any skip (see .ci/run).
require_peft = pytest.mark.skipif(_missing("peft"), reason="needs the peft extra (pip install hf-pma[peft])")
require_lm_eval = pytest.mark.skipif(
    _missing("lm_eval"), reason="needs the eval extra (pip install hf-pma[eval])"
)
require_matplotlib = pytest.mark.skipif(
    _missing("matplotlib"), reason="needs the plot extra (pip install hf-pma[plot])"
)
require_trl = pytest.mark.skipif(
    _missing("trl"), reason="needs the clients extra (pip install hf-pma[clients])"
)


def save_model_folder(
    path: Path, model, tokenizer=None, max_shard_size: str | int = "5GB", extra: dict | None = None
) -> Path:
    """Save a model (and tokenizer) as a plain HF folder; ``extra`` is written as pma.json."""
    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if extra is not None:
        (path / "pma.json").write_text(json.dumps(extra))
    return path


BLOCK = 32


def lm_datasets(tokenizer, n_eval: int = 16):
    """Blocks of the sample text: (train, eval) lists of {"input_ids": [...]}."""
    ids = tokenizer(sample_text(), add_special_tokens=False)["input_ids"]
    blocks = [{"input_ids": ids[i : i + BLOCK]} for i in range(0, len(ids) - BLOCK, BLOCK)]
    return blocks[:-n_eval], blocks[-n_eval:]


def lm_setup(tokenizer=None, seed: int = 0):
    """(model, tokenizer, train, eval, collator) for a tiny Llama."""
    tokenizer = tokenizer or train_tiny_tokenizer()
    train, evaluation = lm_datasets(tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return make_tiny_model(seed=seed), tokenizer, train, evaluation, collator


def quiet_args(**overrides) -> dict:
    """TrainingArguments keywords for fast, silent CPU runs."""
    base = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    base.update(overrides)
    return base


def markdown_rows(text: str) -> list[list[str]]:
    """The rows of the markdown tables in ``text`` (header rows included, rule rows left out),
    each a list of stripped cells."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            continue
        cells = [c.strip() for c in line[1:-1].split(" | ")]
        if all(c and set(c) <= set(":-") for c in cells):
            continue
        rows.append(cells)
    return rows


def hf_pma_command() -> str:
    """The ``hf-pma`` console script of the running Python."""
    return os.path.join(os.path.dirname(sys.executable), "hf-pma")


# ---------------------------------------------------------------------------------------------
# The hf-pma command
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CliResult:
    """What ``hf-pma ARGV`` did: its exit code and what it wrote to stdout and stderr."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


# Python's own warning filters at start-up (``python -W`` unset): what a user's terminal shows.
_STARTUP_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` of a plain interpreter: the warning to the current stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_cli(
    *argv: str | os.PathLike,
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    process: bool = False,
    timeout: float = 300,
    input: str | None = None,
) -> CliResult:
    """Run ``hf-pma ARGV``: the one way tests run the command.

    By default in this process (``hf_pma.cli.main``), as a fresh process would: stdout and stderr
    captured, hf-pma's and transformers' log lines written there in the command's format (not to
    pytest's log capture), Python's start-up warning filters, ``SystemExit`` (argparse, ``--help``)
    and an uncaught exception (its traceback, exit code 1) turned into the exit code. What the
    command changes in this process is put back afterwards: the environment (``env`` is applied
    on top; ``None`` unsets a variable), the current folder (``cwd``), torch's threads, the
    ``hf_pma`` and ``transformers`` loggers (levels, handlers, formats), the progress bars.

    ``process=True`` starts the installed console script instead, with ``env`` on top of this
    environment: for what only a real process shows (the entry point, the exit code the shell
    sees, what is imported, settings that libraries read once at import such as
    ``HF_ENDPOINT``, a process that another one races or kills). ``input`` is what that process
    reads on its standard input (a user answering a prompt).
    """
    args = [os.fspath(a) for a in argv]
    if process:
        done = subprocess.run(
            [hf_pma_command(), *args],
            capture_output=True,
            text=True,
            env=_process_env(env),
            cwd=cwd,
            timeout=timeout,
            input=input,
        )
        return CliResult(args, done.returncode, done.stdout, done.stderr)
    return _run_cli_here(args, env or {}, cwd)


def run_cli_in_one_process(
    *commands: Sequence[str | os.PathLike],
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300,
) -> list[CliResult]:
    """Run several ``hf-pma`` commands one after the other in one fresh process, each as
    :func:`run_cli` runs one in this process: for settings read once at import (``HF_ENDPOINT``)
    without paying the torch and transformers imports once per command."""
    argvs = [[os.fspath(a) for a in command] for command in commands]
    driver = (
        "import dataclasses, json, sys\n"
        "from tests.testing_utils import _run_cli_here\n"
        "done = [dataclasses.asdict(_run_cli_here(argv, {}, None)) for argv in json.loads(sys.argv[1])]\n"
        "sys.stdout.write('\\n' + json.dumps(done))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", driver, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=_process_env(env),
        cwd=cwd,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"the process running {len(argvs)} hf-pma commands failed:\n{done.stderr[-6000:]}"
        )
    return [CliResult(**result) for result in json.loads(done.stdout.rsplit("\n", 1)[-1])]


def _process_env(env: dict[str, str | None] | None) -> dict[str, str]:
    """This environment, offline, with ``env`` on top (``None`` unsets a variable)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    return full_env


def _run_cli_here(args: list[str], env: dict[str, str | None], cwd) -> CliResult:
    import contextlib
    import io
    import traceback
    from unittest import mock

    from transformers.utils import logging as hf_logging

    from hf_pma.cli import main

    hf_tqdm = importlib.import_module(
        "huggingface_hub.utils.tqdm"
    )  # the module (the package exports a class so named)
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    root, ours, theirs = logging.getLogger(), logging.getLogger("hf_pma"), hf_logging.get_logger()
    saved_loggers = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in (root, ours, theirs)]
    saved_handlers = [(h, h.formatter, getattr(h, "stream", None)) for h in theirs.handlers]
    saved_bars = (dict(hf_tqdm.progress_bar_states), hf_logging._tqdm_active)
    out, err = io.StringIO(), io.StringIO()
    try:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if cwd is not None:
            os.chdir(cwd)
        # A fresh process: no handler on the root logger (pytest's capture lives there), the
        # transformers handler writes to this command's stderr.
        root.handlers, ours.handlers = [], []
        for handler in theirs.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(err)
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
            mock.patch.object(warnings, "showwarning", _show_warning),
        ):
            warnings.resetwarnings()
            for action, category, module in reversed(_STARTUP_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            try:
                code = main(args)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) or stop.code is None else 1
                if stop.code is not None and not isinstance(stop.code, int):
                    err.write(f"{stop.code}\n")
            except Exception:  # what the interpreter does with an uncaught exception
                err.write(traceback.format_exc())
                code = 1
        return CliResult(args, int(code or 0), out.getvalue(), err.getvalue())
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
        for handler in ours.handlers:  # the command's own (bound to its captured stderr)
            handler.close()
        for lg, level, handlers, propagate in saved_loggers:
            lg.setLevel(level)
            lg.handlers = handlers
            lg.propagate = propagate
        for handler, formatter, stream in saved_handlers:
            handler.setFormatter(formatter)
            if stream is not None:
                handler.setStream(stream)
        hf_tqdm.progress_bar_states.clear()
        hf_tqdm.progress_bar_states.update(saved_bars[0])
        hf_logging._tqdm_active = saved_bars[1]


def text_rows(text: str) -> list[list[str]]:
    """The rows of the plain-text tables in ``text`` (``hf_pma.utils.formatting.text_table``):
    each table's header and body rows, cut at the columns its dashed rule marks, cells stripped."""
    import re

    lines = text.splitlines()
    rows = []
    for k, rule in enumerate(lines):
        if k == 0 or not rule.strip() or set(rule) - {"-", " "} or "--" not in rule:
            continue
        spans = [m.span() for m in re.finditer(r"-+", rule)]
        starts = [a for a, _ in spans] + [None]
        table = [lines[k - 1]]
        for line in lines[k + 1 :]:
            if not line.strip():
                break
            table.append(line)
        for line in table:
            rows.append(
                [
                    line[starts[i] : starts[i + 1]].strip() if starts[i + 1] else line[starts[i] :].strip()
                    for i in range(len(spans))
                ]
            )
    return rows


# ---------------------------------------------------------------------------------------------
# Multi-process launches
# ---------------------------------------------------------------------------------------------

# What a launcher prints when the port it was given was taken between choosing and binding.
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
# Errors a rank raises because another rank died first (never the root cause).
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL communicator was aborted"
)


@dataclasses.dataclass
class RankLog:
    """What one rank left in the launch's log folder."""

    rank: int
    folder: Path

    def read(self, stream: str = "stderr") -> str:
        path = self.folder / f"{stream}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    @property
    def error(self) -> dict | None:
        """The error file ``@record`` wrote (torch elastic), if any."""
        path = self.folder / "error.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None

    @property
    def traceback(self) -> str:
        """The rank's last Python traceback: from its error file, else from its stderr log."""
        error = self.error
        if error and isinstance(error.get("message"), dict):
            return (
                error["message"].get("message", "")
                + "\n"
                + error["message"].get("extraInfo", {}).get("py_callstack", "")
            )
        text = self.read("stderr")
        start = text.rfind("Traceback (most recent call last)")
        if start < 0:
            return ""
        return text[text.rfind("\n", 0, start) + 1 :]

    @property
    def failed_at(self) -> float:
        """When this rank failed: its error file's time, else when its stderr log was last written."""
        error = self.error
        stamp = None
        if error and isinstance(error.get("message"), dict):
            stamp = error["message"].get("extraInfo", {}).get("timestamp")
        log = self.folder / "stderr.log"
        mtime = log.stat().st_mtime if log.is_file() else float("inf")
        # Error files carry whole seconds: the log's time orders ranks that failed in the same second.
        return float(stamp) + (mtime % 1) if stamp is not None else mtime


@dataclasses.dataclass
class Launch:
    """A finished multi-process launch: its exit status, the launcher's own output and every
    rank's log (``log_dir/<rank>/{stdout,stderr}.log``, plus ``error.json`` for ranks that
    failed inside a function decorated with torch elastic's ``@record``)."""

    command: list[str]
    nproc: int
    returncode: int
    stdout: str
    stderr: str
    log_dir: Path
    timed_out: bool = False
    outputs: dict[tuple[int, str], str] = dataclasses.field(
        default_factory=dict
    )  # kept when the logs are deleted

    def rank_logs(self) -> list[RankLog]:
        """One :class:`RankLog` per rank (torchrun's layout: ``<run>/attempt_<k>/<rank>/``, last attempt)."""
        folders: dict[int, Path] = {}
        for folder in sorted(self.log_dir.glob("*/attempt_*/*")):
            if folder.is_dir() and folder.name.isdigit():
                folders[int(folder.name)] = folder  # later attempts sort last
        return [RankLog(rank, folders[rank]) for rank in sorted(folders)]

    def output(self, rank: int, stream: str = "stdout") -> str:
        """What ``rank`` printed to ``stream`` (``"stdout"`` or ``"stderr"``)."""
        if (rank, stream) in self.outputs:
            return self.outputs[rank, stream]
        return next((log.read(stream) for log in self.rank_logs() if log.rank == rank), "")

    def discard_logs(self) -> None:
        """Keep what every rank printed in memory (:meth:`output`) and delete the log folder."""
        for log in self.rank_logs():
            for stream in ("stdout", "stderr"):
                self.outputs[log.rank, stream] = log.read(stream)
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def first_failure(self) -> RankLog | None:
        """The rank that failed first: ranks with a traceback, those that only lost a peer last,
        then by time of failure."""
        failed = [log for log in self.rank_logs() if log.traceback]
        if not failed:
            return None
        return min(
            failed,
            key=lambda log: (bool(_PEER_GONE.search(log.traceback.strip().splitlines()[-1])), log.failed_at),
        )

    def report(self) -> str:
        """Why the launch failed, for an assertion message: the first failing rank's full
        traceback, where every log is, and the end of the launcher's own output."""
        what = "timed out (killed)" if self.timed_out else f"exited with {self.returncode}"
        lines = [f"{' '.join(self.command)}\n{what}; per-rank logs under {self.log_dir}"]
        first = None if self.timed_out else self.first_failure()
        if first is not None:
            lines.append(
                f"--- first failing rank: {first.rank} ({first.folder}) ---\n{first.traceback.rstrip()}"
            )
            others = [log.rank for log in self.rank_logs() if log.traceback and log.rank != first.rank]
            if others:
                lines.append(f"(ranks {others} failed after it)")
            return "\n".join(lines)
        # No rank raised (a hang, a signal, the launcher itself): every rank's end, then the launcher's.
        for log in self.rank_logs():
            lines.append(f"--- rank {log.rank} stderr (last 2000 characters) ---\n{log.read()[-2000:]}")
        lines.append(f"--- launcher stderr (last 3000 characters) ---\n{self.stderr[-3000:]}")
        return "\n".join(lines)

    def check(self) -> Launch:
        """Assert that the launch succeeded (the message is :meth:`report`); returns ``self``."""
        assert self.returncode == 0 and not self.timed_out, self.report()
        return self


def _port_for_accelerate() -> int:
    """A port free right now. ``accelerate launch`` needs a number; :func:`launch` retries with
    another one when the port is taken before the launcher binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_command(launcher: str, nproc: int, log_dir: Path, launcher_args: list[str]) -> list[str]:
    command = _launcher(launcher, nproc, log_dir)
    if launcher == "accelerate" and launcher_args:  # they replace the mode (--multi_gpu)
        command.remove("--multi_gpu")
    return [*command, *launcher_args]


def _launcher(launcher: str, nproc: int, log_dir: Path) -> list[str]:
    if launcher == "torchrun":
        # --standalone: the rendezvous store binds port 0 itself, so no port is ever chosen here.
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "--log-dir",
            str(log_dir),
            "--tee",
            "3",
        ]
    if launcher == "accelerate":
        # --cpu would start one process; ACCELERATE_USE_CPU with --multi_gpu starts nproc on gloo.
        # The console script, as users type it (the scripts read their parent's command line).
        accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
        return [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(nproc),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_port_for_accelerate()),
            "--log_dir",
            str(log_dir),
            "--tee",
            "3",
        ]
    raise ValueError(f"unknown launcher {launcher!r}: use 'torchrun' or 'accelerate'")


def _run(command: list[str], env: dict, cwd: Path | None, timeout: float) -> tuple[int, str, str, bool]:
    """Run in a session of its own: on timeout the launcher *and* its ranks are killed."""
    with subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return proc.returncode, out, err, True


def launch(
    script: str | Path,
    *args: str | Path,
    nproc: int = 2,
    launcher: str = "torchrun",
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 600,
    check: bool = True,
    launcher_args: list[str] | tuple[str, ...] = (),
) -> Launch:
    """Run ``script args`` in ``nproc`` processes (gloo on CPU) under ``torchrun`` or ``accelerate launch``.

    A relative ``script`` is looked up in ``tests/dist/``. Every rank's stdout and stderr go to
    its own log file; with ``check`` a failed launch fails the test with the first failing
    rank's full traceback (:meth:`Launch.report`). ``env`` is added to the test's environment;
    one thread per process. After a successful check the log folder is deleted (what the ranks
    printed stays readable through :meth:`Launch.output`). ``launcher_args`` go to the launcher
    after its usual flags; for accelerate they replace its mode flag ``--multi_gpu`` (``["--cpu"]``:
    the single-process mistake, whose one process writes to the launcher's own stdout and stderr).
    """
    script = Path(script)
    if not script.is_absolute():
        script = DIST_DIR / script
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    if launcher == "accelerate":
        full_env["ACCELERATE_USE_CPU"] = "1"
    full_env.update(env or {})
    for _ in range(3):
        log_dir = Path(tempfile.mkdtemp(prefix="hf-pma-launch-"))
        command = [
            *_launch_command(launcher, nproc, log_dir, list(launcher_args)),
            str(script),
            *map(str, args),
        ]
        returncode, out, err, timed_out = _run(command, full_env, Path(cwd) if cwd else None, timeout)
        result = Launch(command, nproc, returncode, out, err, log_dir, timed_out)
        if returncode == 0 or timed_out or not _PORT_TAKEN.search(out + err):
            break
        shutil.rmtree(log_dir, ignore_errors=True)  # the port was taken meanwhile: another one
    if check:
        result.check()
        result.discard_logs()
    return result


def rank_reports(out: str | Path, nproc: int, pattern: str = "result-rank{rank}.json") -> list[dict]:
    """The JSON report every rank of a launch wrote into ``out``, rank 0 first."""
    return [json.loads((Path(out) / pattern.format(rank=rank)).read_text()) for rank in range(nproc)]


# Launches that tests read, run once per session in the background (the ``shared_launch``
# fixture of tests/conftest.py): name -> job(out folder) -> Launch. Register with
# :func:`shared_launch_job` at import time (collection imports every test module first) and mark
# the tests that read it ``@pytest.mark.shared_launch(name)`` so that it starts with the session.
SHARED_LAUNCHES: dict[str, Callable[[Path], Launch]] = {}


def shared_launch_job(name: str) -> Callable[[Callable[[Path], Launch]], Callable[[Path], Launch]]:
    """Register ``job(out) -> Launch`` (launched with ``check=False``) as the shared launch ``name``."""

    def register(job: Callable[[Path], Launch]) -> Callable[[Path], Launch]:
        if name in SHARED_LAUNCHES and SHARED_LAUNCHES[name] is not job:
            raise ValueError(f"a shared launch named {name!r} is already registered")
        SHARED_LAUNCHES[name] = job
        return job

    return register


def load_pretrain_script(monkeypatch: pytest.MonkeyPatch):
    """scripts/pretrain.py as a module (its dataclasses need it in sys.modules while they are made)."""
    spec = importlib.util.spec_from_file_location("pretrain_script", REPO_ROOT / "scripts" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


class CollectLogs(logging.Handler):
    """A logging handler that keeps every message (DEBUG and up) in ``messages``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
