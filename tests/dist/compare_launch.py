"""The ``compare`` scenario of tests/dist/scenarios.py (read by tests/analysis/test_compare_runs.py).

``hf-pma compare`` under ``accelerate launch`` with 2 processes: every rank runs the command, the
main process alone evaluates (the held-out LM log line is counted per rank), writes the JSON and
prints the table. Rank 0 first writes three tiny runs (5 snapshots each, flat recorded losses so
that the automatic window is 2 and checked on the held-out text's selection split; an annealed
model each) and 20 held-out documents; each rank writes what it saw to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from hf_pma.cli import main
from hf_pma.utils.distributed import distributed_rank_and_size
from tests.helpers.data import sample_text
from tests.helpers.models import make_tiny_model, save_model_folder, train_tiny_tokenizer
from tests.helpers.output import CollectLogs
from tests.helpers.snapshot_runs import float_params, noise_deviation, write_run


def write_inputs(inputs: Path) -> None:
    """Three runs with an annealed model each at their last snapshot, and a held-out file."""
    tokenizer = train_tiny_tokenizer()
    for i, name in enumerate(("a", "b", "c")):
        run, _ = write_run(
            inputs / name, 5, noise_deviation(0.05 * (i + 1), seed=i), tokenizer=tokenizer, losses=[4.0] * 5
        )
        model = make_tiny_model(seed=0)
        with torch.no_grad():
            for p in float_params(model).values():
                p.add_(0.01 * (i + 1) * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        save_model_folder(run / "annealed", model)
        (run / "annealed" / "pma_anneal.json").write_text(json.dumps({"end_tokens": 5000}))
    text = sample_text(8000)
    (inputs / "heldout.jsonl").write_text(
        "".join(json.dumps({"text": text[i : i + 400]}) + "\n" for i in range(0, 8000, 400))
    )


def run(out: Path) -> None:
    rank, world_size = distributed_rank_and_size()
    inputs = out / "inputs"
    if rank == 0:
        write_inputs(inputs)
    dist.barrier()
    logs = CollectLogs()
    evaluator_logger = logging.getLogger("hf_pma.evaluation.language_modeling")
    evaluator_logger.addHandler(logs)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(
                [
                    "compare",
                    *(str(inputs / n) for n in "abc"),
                    "--eval-file",
                    str(inputs / "heldout.jsonl"),
                    "--block-size",
                    "64",
                    "-o",
                    str(out / "compare.json"),
                ]
            )
    finally:
        evaluator_logger.removeHandler(logs)
    report = {
        "rank": rank,
        "world_size": world_size,
        "code": code,
        "evaluations": sum(m.startswith("Held-out LM:") for m in logs.messages),
        "stdout": stdout.getvalue(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
