"""--async-save with real processes (docs/checkpoints.md, "Asynchronous saves"): per strategy family, kill -9 of the
whole job while a background checkpoint write is in flight leaves the previous checkpoint committed and `latest`
pointing at it; `--resume auto` continues from it and ends exactly where an uninterrupted synchronous run ends.
A preemption (SIGUSR1) waits for the write it started and commits it before exiting 0.

The killed runs go through main.py (the file users run), all at once; the references and the resumes then share
ONE launch of tests/dist/matrix_driver.py."""

from __future__ import annotations

import json
import subprocess
import time

from launch import kill_tree, run_plan, test_env, tiny_args, torchrun_background

from shardtrain.checkpointing.portable import read_portable
from shardtrain.checkpointing.store import checkpoints_root, committed_steps, is_committed, latest_committed

# One per strategy family, and both ZeRO stages: each snapshots only its own partitions, which ZeRO-2 (flat
# partitions across parameters) and ZeRO-3 (one range of every parameter) lay out differently.
FAMILIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--ds", "ds_configs/zero2.json"],
    "zero3": ["--ds", "ds_configs/zero3.json"],
}
SMALL = [
    "--per-device-batch-size",
    "8",
    "--save-every",
    "2",
    "--keep-last",
    "3",
    "--max-steps",
    "6",
    "--eval-every",
    "0",
]


def args(data, out, family, *extra):
    return tiny_args("multimodal", data, out, *SMALL, *FAMILIES[family], *extra)


def steps_logged(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_kill_9_during_async_write_keeps_previous_checkpoint_and_resumes_exactly(mm_data, tmp_path):
    # Rank 0's write of the step-4 checkpoint stalls (fault injection: 300 s inside DCP's write, in the background
    # thread); training goes on to step 6, whose save must wait for it. Then the whole job is SIGKILLed.
    env = test_env(SHARDTRAIN_FAULT="write_stall@4:0")
    jobs = {}
    for family in FAMILIES:
        out = tmp_path / family
        jobs[family] = (
            out,
            torchrun_background(
                args(mm_data, out, family, "--async-save", "--resume", "auto"), env=env, log=tmp_path / f"{family}.log"
            ),
        )
    # Beside them, a preemption: SIGUSR1 to the workers of an --async-save run on slow storage (a 2 s write).
    preempted, pre_log = tmp_path / "preempted", tmp_path / "preempted.log"
    pre = torchrun_background(
        tiny_args(
            "multimodal",
            mm_data,
            preempted,
            "--per-device-batch-size",
            "8",
            "--strategy",
            "ddp",
            "--max-steps",
            "500",
            "--save-every",
            "0",
            "--eval-every",
            "0",
            "--async-save",
        ),
        env=test_env(SHARDTRAIN_WRITE_DELAY=2),
        log=pre_log,
    )
    deadline = time.time() + 600
    try:
        while steps_logged(preempted) < 3:
            assert pre.poll() is None and time.time() < deadline, pre_log.read_text()[-3000:]
            time.sleep(0.2)
        subprocess.run(["pkill", "-USR1", "-P", str(pre.pid)], check=True)
        for family, (out, proc) in jobs.items():
            log = tmp_path / f"{family}.log"
            # Steps past 4 logged while step 4's write is still in flight: the save did not stall training.
            while not (steps_logged(out) >= 6 and "stalling the checkpoint write" in log.read_text()):
                assert proc.poll() is None, f"{family} ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
                assert time.time() < deadline, f"{family}: timed out:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)
            kill_tree(proc.pid)  # SIGKILL to the agent and every worker, as a scheduler's cgroup kill does
            proc.wait(timeout=60)
        assert pre.wait(timeout=300) == 0, pre_log.read_text()[-3000:]
    finally:
        for proc in [pre, *(p for _, p in jobs.values())]:
            kill_tree(proc.pid)
    # The preempted run waited for its background write and committed it before exiting 0.
    step = json.loads((preempted / "summary.json").read_text())["final_step"]
    root = checkpoints_root(preempted)
    assert (root / "latest").read_text().strip() == f"step-{step:06d}" and is_committed(root / f"step-{step:06d}")
    text = pre_log.read_text()
    assert text.index(f"committed {root / f'step-{step:06d}'}") < text.index(f"step {step}: stopped on"), text[-3000:]

    for family, (out, _) in jobs.items():
        root = checkpoints_root(out)
        assert (root / "latest").read_text().strip() == "step-000002", family
        assert latest_committed(root).name == "step-000002", family
        assert (root / "step-000004").is_dir() and not is_committed(root / "step-000004"), family
        log = (tmp_path / f"{family}.log").read_text()
        assert "step 4: saving" in log and "committed " + str(root / "step-000004") not in log, family

    # One launch: each family's uninterrupted synchronous run (saving only at its end: a save changes nothing that
    # training computes), and the resume of each killed run.
    plan = [
        {"name": f"ref-{f}", "args": args(mm_data, tmp_path / f"ref-{f}", f, "--save-every", "0")} for f in FAMILIES
    ]
    plan += [
        {"name": f"resume-{f}", "args": args(mm_data, tmp_path / f, f, "--async-save", "--resume", "auto")}
        for f in FAMILIES
    ]
    (tmp_path / "plan").mkdir()
    run, results = run_plan(plan, tmp_path / "plan", timeout=900)
    for family in FAMILIES:
        out, ref = tmp_path / family, tmp_path / f"ref-{family}"
        assert f"resumed from {checkpoints_root(out) / 'step-000002'} at step 2" in run.output, family
        root = checkpoints_root(out)
        assert [p.name for p in committed_steps(root)] == ["step-000002", "step-000004", "step-000006"], family
        assert (root / "latest").read_text().strip() == "step-000006", family
        got, want = results[f"resume-{family}"]["losses"], results[f"ref-{family}"]["losses"]
        assert len(got) == 6 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (family, got, want)
        final, final_ref = (read_portable(latest_committed(checkpoints_root(d)), optimizer=True) for d in (out, ref))
        assert max_diff(final["model"], final_ref["model"]) <= 1e-6, family
        assert max_diff(final["optim"], final_ref["optim"]) <= 1e-6, family
        summary = json.loads((out / "summary.json").read_text())
        # Saves at steps 4 and 6 (the end of the run waits for the last write and commits it).
        assert len(summary["checkpoint_save_seconds"]) == len(summary["checkpoint_write_seconds"]) == 2, summary
        print(
            f"\n{family}: async blocking {summary['checkpoint_save_seconds']} s, "
            f"write {summary['checkpoint_write_seconds']} s; sync (final save) "
            f"{json.loads((ref / 'summary.json').read_text())['checkpoint_save_seconds']} s"
        )
