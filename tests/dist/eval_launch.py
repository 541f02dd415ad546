"""Launched by tests/test_eval_cli.py with ``accelerate launch --num_processes 2``.

Evaluation must run once, on the main process, while the other rank waits and then receives the
same result; the CLI must print its table once. Each rank writes what it saw to OUT/rank<r>.json.

    python tests/dist/eval_launch.py MODEL_DIR TASK_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_pma.cli import main
from hf_pma.evaluation.evaluator import evaluate_language_modeling, evaluate_model
from hf_pma.utils.distributed import distributed_rank_and_size, run_locally, run_on_main_process

torch.set_num_threads(1)


def fail_on_main() -> None:
    raise ValueError(f"bad input seen by rank {distributed_rank_and_size()[0]}")


def run() -> int:
    model_dir, task_dir, out_dir = (Path(a) for a in sys.argv[1:4])
    rank, world_size = distributed_rank_and_size()
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
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return main(
        [
            "eval",
            str(model_dir),
            "--eval-file",
            str(task_dir / "heldout.jsonl"),
            "--limit",
            "4",
            "--tasks",
            "pma_cloze",
            "--include-path",
            str(task_dir),
            "--bootstrap-iters",
            "0",
            "-o",
            str(out_dir / "cli.json"),
            "-q",
        ]
    )


if __name__ == "__main__":
    # torch elastic's error file: the test names the first failing rank and shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(run)())
