"""The ``eval`` scenario of tests/dist/scenarios.py (read by tests/evaluation/test_eval_cli.py).

Evaluation must run once, on the main process, while the other rank waits and then receives the
same result; the CLI must print its table once. Rank 0 first writes the inputs (a tiny model
with its tokenizer, generated tasks) to ``OUT/inputs``; each rank writes what it saw to
``OUT/rank<r>.json``, and the CLI its report to ``OUT/cli.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_pma.cli import main
from hf_pma.evaluation.evaluator import evaluate_language_modeling, evaluate_model
from hf_pma.utils.distributed import distributed_rank_and_size, run_locally, run_on_main_process
from tests.helpers.data import write_small_tasks
from tests.helpers.models import make_tiny_model, save_model_folder, train_tiny_tokenizer


def fail_on_main() -> None:
    raise ValueError(f"bad input seen by rank {distributed_rank_and_size()[0]}")


def write_inputs(inputs: Path) -> None:
    """A tiny model folder with its tokenizer, and generated tasks with their held-out documents."""
    save_model_folder(inputs / "model", make_tiny_model(seed=1, initializer_range=0.3), train_tiny_tokenizer())
    write_small_tasks(inputs / "tasks")


def run(out: Path) -> None:
    rank, world_size = distributed_rank_and_size()
    inputs = out / "inputs"
    if rank == 0:
        with run_locally():  # make_tasks runs on the main process and waits for the others: not here
            write_inputs(inputs)
    dist.barrier()
    model_dir, task_dir = inputs / "model", inputs / "tasks"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    texts = [json.loads(line)["text"] for line in (task_dir / "heldout.jsonl").read_text().splitlines()][:4]
    result = evaluate_model(
        model,
        tokenizer,
        texts=texts,
        tasks="pma_next_line",
        include_path=task_dir,
        limit=5,
        bootstrap_iters=0,
    )
    report = {"rank": rank, "world_size": world_size, "forwards": len(forwards), "results": result["results"]}
    try:  # an error on the main process reaches every rank, as the same exception
        run_on_main_process(fail_on_main)
    except ValueError as err:
        report["error"] = str(err)
    if rank == 0:
        # Code guarded to one rank: run_locally keeps it from waiting for the other rank.
        with run_locally():
            report["local"] = evaluate_language_modeling(model, tokenizer, texts, progress=False)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    args = ["eval", str(model_dir), "--eval-file", str(task_dir / "heldout.jsonl"), "--limit", "4"]
    args += ["--tasks", "pma_cloze", "--include-path", str(task_dir), "--bootstrap-iters", "0"]
    if main([*args, "-o", str(out / "cli.json"), "-q"]) != 0:
        raise RuntimeError(f"hf-pma eval failed on rank {rank}")
