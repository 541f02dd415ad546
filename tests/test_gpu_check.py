"""benchmarks/gpu_check.py on CPU: everything but the GPU runs themselves (those are the ``gpu``
tier, tests/gpu/): the one-line stop without CUDA, the arguments, the numbers and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.output import markdown_rows
from tests.helpers.repo import REPO_ROOT, load_script

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    return load_script(SCRIPT)


def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(SCRIPT), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert (
        lines == [lines[0]]
        and lines[0].startswith("gpu_check.py: no CUDA GPU")
        and "nothing was run" in lines[0]
    )
    # At once: it stopped before importing transformers (no model, no training) and wrote nothing.
    imported = {
        line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert "torch" in imported and "transformers" not in imported
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--hidden", "100", "--heads", "12"], "--hidden (100) must be a multiple of --heads (12)"),
        (["--steps", "10", "--warmup", "10"], "--warmup must be in [0, --steps)"),
        (["--steps", "10", "--warmup", "2", "--interval-steps", "10"], "no snapshot would be taken"),
        (["--parts", "train,fsdb"], "unknown part(s) fsdb; choose from train, fsdp, eval"),
    ],
)
def test_bad_arguments_stop_with_one_line(gpu_check, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        gpu_check.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_defaults_are_a_100m_llama_and_the_count_is_llamas_own(gpu_check):
    from transformers import LlamaConfig, LlamaForCausalLM

    args = gpu_check.parse_args([])
    assert args.parts == ["train", "fsdp", "eval"] and args.out == gpu_check.RESULTS_DIR
    count = gpu_check.llama_parameter_count(
        args.hidden, args.layers, args.intermediate, args.vocab, args.heads
    )
    assert 90e6 < count < 130e6, count
    for tie, kv_heads in ((True, 4), (False, 2)):
        config = LlamaConfig(
            vocab_size=301,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            tie_word_embeddings=tie,
        )
        real = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        assert gpu_check.llama_parameter_count(64, 2, 96, 301, 4, kv_heads=kv_heads, tie=tie) == real


def test_the_fsdp_run_gets_the_same_model_and_schedule(gpu_check):
    from accelerate.commands.launch import launch_command_parser

    args = gpu_check.parse_args(
        ["--hidden", "256", "--heads", "4", "--steps", "30", "--interval-steps", "7", "--fsdp-procs", "2"]
    )
    command = gpu_check.fsdp_command(args, REPO_ROOT / "w")
    assert command[:2] == [sys.executable, "-m"] and command[2].split(".")[0] == "accelerate"
    # accelerate's own parser reads it: FSDP2, bf16, the asked world size, this script as worker.
    launch = launch_command_parser().parse_args(command[3:])
    assert launch.use_fsdp and str(launch.fsdp_version) == "2" and launch.mixed_precision == "bf16"
    assert launch.num_processes == 2 and launch.training_script == str(SCRIPT)
    worker = gpu_check.parse_args(launch.training_script_args)
    assert worker.fsdp_worker == REPO_ROOT / "w"
    for name in gpu_check.MODEL_ARGUMENTS:
        assert getattr(worker, name) == getattr(args, name), name


def test_numbers(gpu_check):
    assert gpu_check.overhead_percent(100.0, 103.0) == pytest.approx(3.0)
    paired = gpu_check.paired_overheads([(100.0, 101.0), (100.0, 99.5), (200.0, 203.0)])
    assert paired["pairs"] == 3 and paired["overhead_percent"] == pytest.approx(1.0)
    assert paired["overhead_min_percent"] == pytest.approx(-0.5)
    assert paired["overhead_max_percent"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no pair of runs"):
        gpu_check.paired_overheads([])
    share = gpu_check.blocked_share([0.5, 20.0, 0.5, 30.0], 10_000.0, [20.0, 30.0])
    assert share["blocked_share_percent"] == pytest.approx(0.51)
    assert share["blocked_between_snapshots_ms"] == pytest.approx(1.0)
    # The pinned pool (blocks made, bytes held) before the first snapshot, then after each one.
    grew, kept = (3, 10), (5, 10 + 1000)
    assert gpu_check.staging_reuse([grew, kept, kept, (6, 2000), (6, 2000)], snapshot_bytes=1000) == {
        "snapshots": 4,
        "reused": 2,
        "possible": 3,
        "all_pinned": True,
    }
    assert gpu_check.staging_reuse([grew, (3, 10)], snapshot_bytes=1000)["all_pinned"] is False
    assert gpu_check.staging_reuse([grew], 1000) == {
        "snapshots": 0,
        "reused": 0,
        "possible": 0,
        "all_pinned": False,
    }


COSTS = {
    "snapshots": 5,
    "blocked_first_ms": 150.0,
    "blocked_steady_ms": 12.34,
    "blocked_ms": [150.0, 12.0, 12.34, 13.0, 11.0],
    "write_median_ms": 80.0,
    "write_ms": [90.0, 80.0, 80.0, 70.0, 85.0],
}
RESULTS = {
    "machine": {"gpu": "Some GPU", "torch": "2.13.0"},
    "train": {
        "parameters": 109_000_000,
        "baseline": {"steps": 60, "step_ms": 100.0, "mean_ms": 100.5},
        "pma": {
            "steps": 60,
            "step_ms": 100.2,
            "mean_ms": 102.0,
            "costs": COSTS,
            "staging": {"snapshots": 5, "reused": 4, "possible": 4, "all_pinned": True},
        },
        "interval_steps": 10,
        "interval_ms": 1005.0,
        "pairs": 6,
        "overhead_percent": 1.49,
        "overhead_min_percent": 0.8,
        "overhead_max_percent": 2.04,
        "blocked_share_percent": 0.4123,
        "blocked_snapshot_ms": [150.0, 12.0, 12.5, 13.0, 11.0],
        "blocked_between_snapshots_ms": 7.25,
    },
    "fsdp": {
        "world_size": 1,
        "snapshots": 5,
        "rank_files_ok": True,
        "merged_loads": True,
        "costs": {**COSTS, "blocked_steady_ms": 30.0},
        "interval_ms": 990.0,
    },
    "eval": {"eval_pma_loss": 5.4321, "eval_loss": 5.6789, "seconds": 2.5},
}


def test_snapshot_costs_split_the_first_snapshot_from_the_steady_state(gpu_check):
    costs = gpu_check.snapshot_costs([0.2, 0.01, 0.03, 0.02], [0.1, 0.3])
    assert costs["snapshots"] == 4 and costs["blocked_first_ms"] == pytest.approx(200.0)
    assert costs["blocked_steady_ms"] == pytest.approx(20.0) and costs["write_median_ms"] == pytest.approx(
        200.0
    )
    assert costs["blocked_ms"] == [200.0, 10.0, 30.0, 20.0]
    single = gpu_check.snapshot_costs([0.5], [])
    assert single["blocked_steady_ms"] is None and single["write_median_ms"] is None
    with pytest.raises(ValueError, match="no snapshot was taken"):
        gpu_check.snapshot_costs([], [0.1])


def test_one_table_and_the_results_files(gpu_check, tmp_path):
    table = gpu_check.build_table(RESULTS)
    rows = markdown_rows(table)
    assert rows[0] == ["check", "result", "detail"]
    body = {row[0]: row[1:] for row in rows[1:]}
    assert body["bf16 step time, no snapshots"] == [
        "100.0 ms",
        "mean 100.5 ms; 109M parameters, 60 steps timed",
    ]
    assert body["bf16 step time, PMACallback"] == [
        "100.2 ms",
        "mean 102.0 ms: throughput overhead +1.5 % (median of 6 alternating pairs, range +0.8 to +2.0 %) "
        "at a snapshot every 10 steps",
    ]
    assert body["blocked by PMACallback (CUDA events)"] == [
        "0.41 % of the run",
        "median 12.5 ms per snapshot, 7.2 ms in all between snapshots",
    ]
    assert body["blocked per snapshot"] == ["12.3 ms", "median of snapshots 2-5; the first 150.0 ms"]
    assert body["background write per snapshot"] == [
        "80.0 ms",
        "median, off the training thread; snapshots 1005 ms apart",
    ]
    assert body["pinned staging reuse"] == ["4/4", "every buffer pinned"]
    assert body["FSDP2 sharded snapshots (accelerate launch, world 1)"] == [
        "5 snapshots",
        "one file per rank, merge loads",
    ]
    assert body["FSDP2 blocked per snapshot"] == ["30.0 ms", "median of snapshots 2-5; the first 150.0 ms"]
    assert body["FSDP2 rank write per snapshot"][0] == "80.0 ms"
    assert body["merged evaluation (eval_pma_loss)"] == ["5.4321", "live eval_loss 5.6789; 2.5 s"]
    # A part that did not run has no row; a failed check says so.
    partial = gpu_check.build_table(
        {
            "fsdp": {
                **RESULTS["fsdp"],
                "rank_files_ok": False,
                "problem": "snapshots without one file per rank: ['snapshot-8']",
            }
        }
    )
    row = markdown_rows(partial)[1]
    assert row[2].startswith("FAILED: snapshots without one file per rank")
    with pytest.raises(ValueError, match="no part of the check ran"):
        gpu_check.build_table({"machine": {}})

    written = gpu_check.save_results(tmp_path / "gpu_check", RESULTS, table)
    assert [p.name for p in written] == ["results.md", "results.json"]
    assert json.loads(written[1].read_text()) == RESULTS
    text = written[0].read_text()
    assert text.startswith("# GPU check\n\ngpu Some GPU, torch 2.13.0\n") and table in text


def test_a_cpu_run_times_alternating_pairs_and_the_blocked_part(gpu_check, tmp_path, capsys):
    """``--cpu``: part 1 end to end in seconds (fp32, the CPU's clock): pairs of runs without and
    with PMACallback, the callback's own snapshot costs (``PMACallback.snapshot_costs``), the
    stretches around the callback, one table."""
    argv = "--cpu --parts train --hidden 64 --heads 4 --layers 1 --intermediate 128 --vocab 256"
    argv += " --seq 16 --batch 2 --steps 9 --warmup 1 --interval-steps 4 --rounds 2"
    assert gpu_check.main([*argv.split(), "--out", str(tmp_path)]) == 0
    train = json.loads((tmp_path / "results.json").read_text())["train"]
    assert train["precision"] == "fp32 (CPU)" and train["pairs"] == 2
    assert len(train["overhead_each_percent"]) == 2 and train["pma"]["staging"] is None
    costs = train["pma"]["costs"]
    assert costs["snapshots"] == 2 == len(costs["write_ms"]) == len(train["blocked_snapshot_ms"])
    assert 0 < train["blocked_share_percent"] < 100 and train["baseline"]["steps"] == 2 * 8
    rows = {row[0]: row[1:] for row in markdown_rows(capsys.readouterr().out)}
    assert rows["blocked by PMACallback (CPU clock)"][0].endswith("% of the run")
    assert rows["pinned staging reuse"] == ["-", "no GPU"]
