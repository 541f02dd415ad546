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
        (["--pairs", "0"], "--pairs must be at least 1, got 0"),
        (["--fsdp-pairs", "0"], "--fsdp-pairs must be at least 1, got 0"),
        (["--hidden", "100", "--heads", "12"], "--hidden (100) must be a multiple of --heads (12)"),
        (["--intervals", "100,1"], "every interval must be at least 2 steps"),
        (["--intervals", "ten"], "a comma-separated list of whole numbers"),
        (["--time-limit", "0"], "--time-limit must be positive"),
        (["--warmup-blocks", "-1"], "--warmup-blocks must be at least 0"),
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
    assert args.intervals == [100, 10] and args.fsdp_procs == 1 and args.seq == 512 and args.batch == 8
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
        ["--hidden", "256", "--heads", "4", "--fsdp-interval", "7", "--fsdp-pairs", "5", "--fsdp-procs", "2"]
    )
    command = gpu_check.fsdp_command(args, REPO_ROOT / "w", deadline=1e9)
    assert command[:2] == [sys.executable, "-m"] and command[2].split(".")[0] == "accelerate"
    # accelerate's own parser reads it: FSDP2, bf16, the asked world size, this script as worker.
    launch = launch_command_parser().parse_args(command[3:])
    assert launch.use_fsdp and str(launch.fsdp_version) == "2" and launch.mixed_precision == "bf16"
    assert launch.num_processes == 2 and launch.training_script == str(SCRIPT)
    worker = gpu_check.parse_args(launch.training_script_args)
    assert worker.fsdp_worker == REPO_ROOT / "w" and worker.deadline == 1e9
    for name in (*gpu_check.MODEL_ARGUMENTS, *gpu_check.RUN_ARGUMENTS):
        assert getattr(worker, name) == getattr(args, name), name


def test_the_blocks_alternate_with_and_without_the_callback_around_each_snapshot(gpu_check):
    layout = gpu_check.ab_blocks(interval=10, block_snapshots=1, warmup_blocks=1, pairs=2)
    assert layout == {"block": 10, "offset": 5, "steps": 5 + 10 * 5}
    roles = [gpu_check.block_role(step, layout, 1) for step in range(1, 56)]
    assert roles[:15] == [None] * 15  # the offset and the warm-up block (the callback on)
    # Pair 0: without, then with; pair 1: with, then without (ABBA).
    assert roles[15:25] == [(0, False)] * 10 and roles[25:35] == [(0, True)] * 10
    assert roles[35:45] == [(1, True)] * 10 and roles[45:55] == [(1, False)] * 10
    # Every snapshot (a multiple of the interval) falls inside a block, mid-way: not on its edge.
    for multiple in range(20, 60, 10):
        assert gpu_check.block_role(multiple - 4, layout, 1) == gpu_check.block_role(multiple + 5, layout, 1)
    # Short blocks get more pairs, up to the steps asked for.
    assert gpu_check.ab_pairs(100, 16, 1600) == 16 and gpu_check.ab_pairs(10, 16, 1600) == 80


def test_the_overhead_and_its_interval(gpu_check):
    layout = gpu_check.ab_blocks(interval=2, block_snapshots=1, warmup_blocks=0, pairs=3)
    # 1 offset step, then pairs: (off, on), (on, off), (off, on) of 2 steps each; "on" 1 % slower.
    step_ms = [50.0] + [100.0, 100.0, 101.0, 101.0] + [101.0, 101.0, 100.0, 100.0] + [100.0, 100.0, 101.0, 101.0]
    pairs = gpu_check.pair_means(step_ms, layout, 0)
    assert pairs == [(100.0, 101.0)] * 3
    ab = gpu_check.ab_overhead([(100.0, 101.0), (100.0, 100.5), (200.0, 203.0)])
    assert ab["pairs"] == 3 and ab["overhead_percent"] == pytest.approx(1.0)
    # t with 2 degrees of freedom: 4.303 x sd / sqrt(3); sd of (1, 0.5, 1.5) is 0.5.
    assert ab["ci95_half_width_percent"] == pytest.approx(4.303 * 0.5 / 3**0.5)
    assert ab["ci95_low_percent"] < 1.0 < ab["ci95_high_percent"]
    assert 0.5 <= ab["bootstrap95_low_percent"] <= 1.0 <= ab["bootstrap95_high_percent"] <= 1.5
    with pytest.raises(ValueError, match="at least two pairs"):
        gpu_check.ab_overhead([(100.0, 101.0)])
    # An incomplete last pair (a deadline) is left out.
    assert gpu_check.pair_means(step_ms[:-1], layout, 0) == [(100.0, 101.0)] * 2
    assert gpu_check.t_quantile_975(1) == 12.706 and gpu_check.t_quantile_975(100) == pytest.approx(1.984)
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


COSTS = {
    "snapshots": 5,
    "blocked_first_ms": 150.0,
    "blocked_steady_ms": 12.34,
    "blocked_ms": [150.0, 12.0, 12.34, 13.0, 11.0],
    "write_median_ms": 80.0,
    "write_ms": [90.0, 80.0, 80.0, 70.0, 85.0],
}
AB = {
    "interval_steps": 100,
    "block_steps": 100,
    "precision": "bf16",
    "steps_run": 3350,
    "step_ms": 44.4,
    "pairs": 16,
    "overhead_percent": 0.42,
    "ci95_low_percent": 0.01,
    "ci95_high_percent": 0.83,
    "ci95_half_width_percent": 0.41,
    "bootstrap95_low_percent": 0.05,
    "bootstrap95_high_percent": 0.8,
    "overhead_each_percent": [0.4] * 16,
    "blocked_share_percent": 0.4123,
    "blocked_total_ms": 100.0,
    "blocked_snapshot_ms": [150.0, 12.0, 12.5, 13.0, 11.0],
    "blocked_between_snapshots_ms": 7.25,
    "costs": COSTS,
    "staging": {"snapshots": 5, "reused": 4, "possible": 4, "all_pinned": True},
}
RESULTS = {
    "machine": {"gpu": "Some GPU", "torch": "2.13.0"},
    "train": [AB],
    "fsdp": {
        "world_size": 1,
        "snapshots": 5,
        "rank_files_ok": True,
        "merged_loads": True,
        "ab": {**AB, "interval_steps": 10, "block_steps": 10, "costs": {**COSTS, "blocked_steady_ms": 30.0}},
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
    assert body["overhead, a snapshot every 100 steps (bf16)"] == [
        "+0.42 %",
        "95% CI +0.01 to +0.83 % (bootstrap +0.05 to +0.80); 16 interleaved pairs of 100-step blocks, "
        "steps of 44.4 ms without",
    ]
    assert body["blocked by PMACallback (CUDA events), every 100"] == [
        "0.41 % of the time with it",
        "median 12.5 ms per snapshot, 7.2 ms in all between snapshots",
    ]
    assert body["blocked per snapshot, every 100"] == ["12.3 ms", "median of snapshots 2-5; the first 150.0 ms"]
    assert body["background write per snapshot, every 100"] == [
        "80.0 ms",
        "median, off the training thread; snapshots 4440 ms apart",
    ]
    assert body["pinned staging reuse, every 100"] == ["4/4", "every buffer pinned"]
    assert body["FSDP2 sharded snapshots (accelerate launch, world 1)"] == ["5 snapshots", "one file per rank, merge loads"]
    assert body["FSDP2 overhead, a snapshot every 10 steps (bf16)"][0] == "+0.42 %"
    assert body["FSDP2 blocked per snapshot, every 10"] == ["30.0 ms", "median of snapshots 2-5; the first 150.0 ms"]
    assert body["merged evaluation (eval_pma_loss)"] == ["5.4321", "live eval_loss 5.6789; 2.5 s"]
    # A part that did not run has no row; a failed check says so.
    partial = gpu_check.build_table(
        {"fsdp": {**RESULTS["fsdp"], "rank_files_ok": False, "problem": "snapshots without one file per rank: ['snapshot-8']"}}
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


def test_a_cpu_run_interleaves_blocks_with_and_without_the_callback(gpu_check, tmp_path, capsys):
    """``--cpu``: part 1 end to end in seconds (fp32, the CPU's clock): one Trainer run per
    interval whose blocks switch PMACallback on and off, the pairs' overhead with its interval, the
    callback's snapshot costs (only in blocks with it), the stretches around it, one table."""
    argv = "--cpu --parts train --hidden 64 --heads 4 --layers 1 --intermediate 128 --vocab 256"
    argv += " --seq 16 --batch 2 --intervals 4,2 --pairs 3 --min-ab-steps 0"
    assert gpu_check.main([*argv.split(), "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    every4, every2 = results["train"]
    for ab, interval in ((every4, 4), (every2, 2)):
        assert ab["precision"] == "fp32 (CPU)" and ab["pairs"] == 3 and ab["interval_steps"] == interval
        assert len(ab["overhead_each_percent"]) == 3 and ab["staging"] is None
        assert ab["ci95_low_percent"] <= ab["overhead_percent"] <= ab["ci95_high_percent"]
        # offset + warm-up block + 3 pairs of blocks; a snapshot in each block with the callback
        # (the warm-up one and 3 pairs), none in the blocks without it.
        assert ab["steps_run"] == interval // 2 + interval * 7
        assert ab["costs"]["snapshots"] == 4 == len(ab["blocked_snapshot_ms"])
        assert 0 < ab["blocked_share_percent"] < 100
    rows = {row[0]: row[1:] for row in markdown_rows(capsys.readouterr().out)}
    assert rows["blocked by PMACallback (CPU clock), every 4"][0].endswith("% of the time with it")
    assert rows["pinned staging reuse, every 2"] == ["-", "no GPU"]


def test_past_its_time_an_ab_stops_after_two_pairs(gpu_check, tmp_path):
    """``--time-limit`` spent at once: the A/B stops at the end of its second pair (the fewest an
    interval needs), not after the 5 pairs asked for."""
    argv = "--cpu --parts train --hidden 64 --heads 4 --layers 1 --intermediate 128 --vocab 256"
    argv += " --seq 16 --batch 2 --intervals 2 --pairs 5 --min-ab-steps 0 --time-limit 0.001"
    assert gpu_check.main([*argv.split(), "--out", str(tmp_path)]) == 0
    (ab,) = json.loads((tmp_path / "results.json").read_text())["train"]
    assert ab["pairs"] == 2 and ab["steps_run"] == 1 + 2 * 5  # offset, warm-up block, 2 pairs
