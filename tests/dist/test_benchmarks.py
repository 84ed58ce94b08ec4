"""The benchmarks' CPU dry-run modes (the benchmarks themselves are not part of `make test`): each script
runs end to end through real processes and writes JSON of the documented shape."""

from __future__ import annotations

import json
import sys

from launch import REPO, run, test_env

BENCH = REPO / "benchmarks"


def test_overhead_dry_run(tmp_path):
    out = tmp_path / "overhead.json"
    # Every contender script once, on the one cell they all run (tiny Longformer, DDP: 6 steps each), and a cell
    # where two peers refuse the strategy on CPU: their own error lines must land in the JSON, not a crash.
    peers = "shardtrain,handwritten,accelerate,fabric,hf_trainer"
    run(
        [
            sys.executable,
            str(BENCH / "overhead.py"),
            "--dry-run",
            "--cells",
            "longformer_tiny:ddp,longformer_tiny:fsdp",
            "--contenders",
            peers,
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["nproc"] == 2
    ddp, fsdp = result["cells"]
    assert (ddp["config"], ddp["strategy"], fsdp["strategy"]) == ("longformer_tiny", "ddp", "fsdp")
    medians = ddp["samples_per_sec_median"]
    assert all(medians[c] > 0 for c in peers.split(","))
    assert ddp["ratio_vs_handwritten"] == medians["shardtrain"] / medians["handwritten"]
    assert set(ddp["paired_ratio_median"]) == {"handwritten", "accelerate", "fabric", "hf_trainer"}
    assert all(r["steps_timed"] == 3 for rs in ddp["runs"].values() for r in rs)  # 6 steps - 2 warm-up - 1
    # FSDP: Fabric shards (FSDP2 through ModelParallelStrategy); Accelerate and HF Trainer say why they cannot.
    assert fsdp["samples_per_sec_median"]["fabric"] > 0
    assert "Accelerate would not shard" in fsdp["paired_ratio_median"]["accelerate"]["skipped"]
    assert "not DistributedType.FSDP" in fsdp["paired_ratio_median"]["hf_trainer"]["skipped"]
    assert len(result["cells"][0]["machine_load"]["loadavg_before"]) == 3


def test_startup_dry_run(tmp_path):
    out = tmp_path / "startup.json"
    # shardtrain through torchrun and through `shardtrain train --nproc 2` (the parent relaunch), and the
    # hand-written loop: one warm DDP round each.
    run(
        [
            sys.executable,
            str(BENCH / "startup.py"),
            "--dry-run",
            "--contenders",
            "shardtrain,shardtrain_cli,handwritten",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        timeout=400,
    )
    result = json.loads(out.read_text())
    entries = {e["contender"]: e for e in result["entries"]}
    assert set(entries) == {"shardtrain", "shardtrain_cli", "handwritten"}
    assert all(e["strategy"] == "ddp" and e["warm_seconds"] > 0 and e["cold_seconds"] is None for e in entries.values())
    phases = entries["shardtrain_cli"]["warm_phases_median"]
    assert list(phases) == [
        "imports",
        "process_group",
        "data",
        "model_build",
        "strategy_setup",
        "banner_and_prediction",
        "first_step",
    ]
    assert all(v >= 0 for v in phases.values())
    # the phases tile the whole start-up: launch to the end of step 1
    assert abs(sum(phases.values()) - entries["shardtrain_cli"]["warm_seconds"]) < 0.01


def test_gpu_suite_dry_run(tmp_path):
    """benchmarks/gpu_suite.sh end to end on CPU with tiny cases: the never-run GPU paths the suite puts first
    (fp16 with GradScaler, OOM recovery, FSDP offload) in one process, and a crash inside the fourth case (the
    test-only GPU_SUITE_TEST_DIE_IN): the JSON, rewritten after every case, keeps all three, says the fourth died,
    and the fifth still runs, in a process started after the crash."""
    out = tmp_path / "results" / "gpu_suite.json"
    # The ZeRO, compile and Longformer-at-4096 cases run in the full dry run (`gpu_suite.py --dry-run`): DeepSpeed's
    # start-up and AOTAutograd's tracing would triple this test's time.
    cases = "fp16_ddp_grad_scaler,oom_recovery_real,fsdp_offload,strategy_zero3_offload,profile_ddp"
    env = test_env(PY=sys.executable, GPU_SUITE_TEST_DIE_IN="strategy_zero3_offload")
    env.pop("DS_ACCELERATOR", None)  # the dry run sets it for its own CPU cases
    run(
        [
            str(REPO / "benchmarks" / "gpu_suite.sh"),
            "--dry-run",
            "--cases",
            cases,
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--budget-s",
            "200",
            "--case-timeout-s",
            "200",
        ],
        timeout=400,
        env=env,
        check=False,
    )
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["environment"]["cuda_available"] is False
    assert result["complete"] is True and result["budget_s"] == 200
    assert result["environment"]["ds_accelerator"] is None  # the shell's; the cases got cpu (dry run)
    assert {"fusion_mfu_min", "fusion_mfu_best", "met"} <= set(result["targets"])
    rows = {r["name"]: r for r in result["cases"]}
    assert list(rows) == cases.split(",")
    for name in cases.split(",")[:3]:
        r = rows[name]
        assert r["status"] == "ok", (name, r.get("error"))
        assert r["samples_per_sec"] > 0 and r["flops_per_sample"] > 0, name
        assert r["flops_method"].startswith(("counted:", "estimate:")), name
        assert r["mfu"] is None and r["step_peak_allocated_gib"] is None  # CPU: no peak FLOPs, no CUDA allocator
        assert r["cuda_math"] == {}  # CPU: TF32 and cudnn.benchmark do not apply
        planner = r["planner"]
        assert planner["predicted_peak_gib"] > 0 and {"comm", "overhead", "activations"} <= set(planner["parts_gib"])
    died = rows["strategy_zero3_offload"]
    assert died["status"] == "died" and "exited 9 inside it" in died["error"], died
    after = rows["profile_ddp"]  # the case behind the crash, in a new process
    assert after["status"] == "ok" and after["profile"]["ranks"], after.get("error")
    assert rows["fp16_ddp_grad_scaler"]["precision"] == "fp16"
    # Longformer's forward reads values: the meta-device count falls back, and the JSON says so
    assert rows["fp16_ddp_grad_scaler"]["flops_method"].startswith("estimate:")
    oom = rows["oom_recovery_real"]
    assert oom["micro_batch_after_recovery"] == 2 and oom["oom_recovery"]["events"], oom
    assert rows["fsdp_offload"]["offload"] is True and rows["fsdp_offload"]["strategy"] == "fsdp"


def test_loader_dry_run(tmp_path):
    out = tmp_path / "loader.json"
    run(
        [sys.executable, str(BENCH / "loader.py"), "--dry-run", "--work", str(tmp_path / "work"), "--out", str(out)],
        timeout=300,
        env=test_env(),
    )
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["shipped_num_workers"] == 4
    rates = result["loader_samples_per_sec_median"]
    assert set(rates) == {"jpeg_500x375", "jpeg_1600x1200", "cache"}
    assert all(r[w] > 0 for r in rates.values() for w in ("0", "2"))
    target = result["gpu_rate_at_40pct_mfu"]
    assert target["flops_per_sample"] > 1e10 and target["H100"] > target["A100"] > 0  # RoBERTa-base + ResNet-50
    needed = result["workers_needed_per_gpu_at_40pct_mfu"]
    assert all(needed[s][g] > 0 for s in rates for g in ("A100", "H100"))
    assert result["cache_build_images_per_sec"] > 0
    assert all(v > 0 for rates in result["decode_images_per_sec_one_core"].values() for v in rates.values())


def test_length_batching_dry_run(tmp_path):
    # The three contenders as 2-rank torchrun jobs on a log-normal corpus: --group-by-length and the token budget
    # pad less, and the JSON holds the paired ratios, each run's peak RSS and the padding the loop's own order gives.
    out = tmp_path / "length_batching.json"
    run([sys.executable, str(BENCH / "length_batching.py"), "--dry-run", "--work", str(tmp_path / "work"),
         "--out", str(out)], timeout=400)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["nproc"] == 2
    assert result["paired_speedup_median"] > 0 and len(result["paired_speedup_per_round"]) == 1
    padding = result["padding_share_median"]
    assert 0 <= padding["group_by_length"] < padding["pad_to_longest"] / 2
    assert 0 <= padding["token_budget"] < padding["pad_to_longest"] / 2
    assert all(v > 100 for v in result["peak_rss_mib_median"].values())
    assert set(result["paired_vs_pad_to_longest_median"]) == {"group_by_length", "token_budget"}
    # the budget: micro-batch 4 x the dry-run corpus's longest text, padded to the window; fewer, fuller steps
    assert result["max_tokens_per_batch"] % 16 == 0 and result["max_tokens_per_batch"] <= 4 * 512
    assert result["steps_per_epoch"]["token_budget"] < result["steps_per_epoch"]["pad_to_longest"]
