"""Checkpoints that never lose work: exact resume after kill -9 (each strategy), torn saves, torchrun
restarts, preemption by SIGUSR1, a full disk, cross-strategy handover and export; the best checkpoint and early
stopping across a kill. Real processes, gloo."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time

import pytest
import torch
from launch import REPO, test_env, tiny_args, torchrun, torchrun_background, torchrun_cmd
from launch import run as run_cmd

from shardtrain.checkpointing.portable import read_portable
from shardtrain.checkpointing.store import checkpoints_root, committed_steps, latest_committed

STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--ds", "ds_configs/zero2.json"],
    "zero3": ["--ds", "ds_configs/zero3.json"],
}
SMALL = ["--per-device-batch-size", "8", "--save-every", "2", "--keep-last", "3"]
# DDP on three ranks, as the first report's 3 x A100 train: with two, the ranks' gradients sum to the same bits in
# any order, so a resume that reduced in another bucket layout would still pass (it did, and drifted on three).
KILL_TEST_NPROC = {"ddp": 3}
# The kill test's runs as users start them: dropout as every shipped real config has it, and the banner's memory
# prediction on (the default: it builds and runs throwaway models at every start, each resume's included).
AS_SHIPPED = ["--dropout", "0.1", "--predict-memory", "true"]


def args(data, out, strategy, *extra):
    return tiny_args("multimodal", data, out, *SMALL, *STRATEGIES[strategy], *extra)


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def uninterrupted(mm_data, tmp_path_factory) -> dict:
    """Each strategy's uninterrupted 6-step run, the reference of the kill test: the two-rank ones in ONE launch
    of tests/dist/matrix_driver.py (the same parse_cli -> train as main.py; imports and process-group start paid
    once), DDP's three ranks through main.py. The runs under test, the killed ones, each go through main.py."""
    from launch import run_plan

    root = tmp_path_factory.mktemp("uninterrupted")
    reference = {s: args(mm_data, root / s, s, "--max-steps", "6", "--dropout", "0.1") for s in STRATEGIES}
    on_two = [{"name": s, "args": a} for s, a in reference.items() if s not in KILL_TEST_NPROC]
    run_plan(on_two, root, timeout=600, fresh=True)  # compared bit for bit with the main.py runs
    for s, nproc in KILL_TEST_NPROC.items():
        torchrun(reference[s], nproc=nproc, timeout=600)
    return {s: root / s for s in STRATEGIES}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_kill_at_three_points_resumes_exactly(strategy, mm_data, tmp_path, uninterrupted):
    """One torchrun launch with --max-restarts 3 dies three times (DDP on three ranks, the others on two):
    rank 1 SIGKILLed mid-step 3, rank 0 SIGKILLed after writing its step-4 shards but before COMMITTED, rank 0
    SIGKILLed mid-step 5. Each restart resumes by itself (--resume auto); the result equals an uninterrupted run,
    with dropout 0.1 and the banner's memory prediction on (which, measured after the RNG was restored, had moved
    rank 0's dropout stream: max |loss diff| 2.0e-2 under ddp)."""
    ref = uninterrupted[strategy]
    out = tmp_path / "killed"
    env = test_env(SHARDTRAIN_FAULT="step@3:1,save@4:0,step@5:0", SHARDTRAIN_FAULT_ONCE_DIR=tmp_path / "fired")
    # Two spare restarts beyond the three faults: a slow restart must not fail the test by itself.
    run = torchrun(
        args(mm_data, out, strategy, "--max-steps", "6", "--resume", "auto", *AS_SHIPPED),
        nproc=KILL_TEST_NPROC.get(strategy, 2),
        env=env,
        extra_launcher_args=["--max-restarts", "5"],
        timeout=900,
    )
    resumed = [line.split(" at step ")[1] for line in run.output.splitlines() if line.startswith("resumed from ")]
    assert run.output.count("[fault injection]") == 3, run.tail()
    # The torn save is passed over, and said so (it was silent: `latest` named it while step 2 was resumed).
    assert "step-000004: no COMMITTED (a save cut short), passed over: resuming from step-000002" in run.output
    # The torn step-4 save is ignored: the restart after it resumes from step 2 again; the last from 4.
    assert resumed.count("2") >= 2 and resumed[-1] == "4" and resumed == sorted(resumed), run.tail()
    assert [p.name for p in committed_steps(checkpoints_root(out))] == ["step-000002", "step-000004", "step-000006"]
    assert not [
        p
        for p in checkpoints_root(out).iterdir()
        if p.name.startswith("step-") and p not in committed_steps(checkpoints_root(out))
    ], "a partial step directory was left"
    ref_losses, got = losses(ref), losses(out)
    # Bit-exact, dropout on: the resumed ranks draw the masks the uninterrupted run drew.
    assert len(got) == 6 and got == ref_losses, (ref_losses, got)
    final_ref = read_portable(latest_committed(checkpoints_root(ref)), optimizer=True)
    final = read_portable(latest_committed(checkpoints_root(out)), optimizer=True)
    assert max_diff(final_ref["model"], final["model"]) <= 1e-6
    assert max_diff(final_ref["optim"], final["optim"]) <= 1e-6
    print(
        f"\n{strategy}: max |loss diff| {max(abs(a - b) for a, b in zip(ref_losses, got)):.2e}, "
        f"max |weight diff| {max_diff(final_ref['model'], final['model']):.2e}, "
        f"save seconds {json.loads((ref / 'summary.json').read_text())['checkpoint_save_seconds']}"
    )


def _wait_for(pred, proc, timeout=120.0):
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, f"run ended early (exit {proc.returncode})"
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.05)


def _steps_logged(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigusr1_to_workers_then_kill9_of_the_job_then_resume(mm_data, tmp_path):
    """Preemption as documented for torchrun: SIGUSR1 to the agent's children (the workers; the agent
    itself would die of it). Then a real external SIGKILL of the whole job, and a resume that completes."""
    out = tmp_path / "run"
    a = tiny_args(
        "multimodal",
        mm_data,
        out,
        "--per-device-batch-size",
        "8",
        "--strategy",
        "ddp",
        "--max-steps",
        "200",
        "--save-every",
        "0",
        "--eval-every",
        "0",
    )
    proc = torchrun_background(a, log=tmp_path / "a.log")
    _wait_for(lambda: _steps_logged(out) >= 3, proc)
    subprocess.run(["pkill", "-USR1", "-P", str(proc.pid)], check=True)
    assert proc.wait(timeout=120) == 0, (tmp_path / "a.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preempted"] and summary["final_step"] < 200
    ckpt = latest_committed(checkpoints_root(out))
    assert ckpt is not None and ckpt.name == f"step-{summary['final_step']:06d}"

    # Resume with periodic saves; SIGKILL every process of the job once a new checkpoint is committed.
    b = [x if x != "none" else "auto" for x in a]
    b[b.index("--save-every") + 1] = "2"
    proc = torchrun_background(b, log=tmp_path / "b.log")
    _wait_for(lambda: (latest_committed(checkpoints_root(out)) or ckpt).name > ckpt.name, proc)
    # torchrun starts each worker in its own session, so killpg(agent) would leave them training as orphans
    # (seen here): SIGKILL the agent and its workers together, as a scheduler's cgroup kill does.
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in [proc.pid, *map(int, workers)]:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = latest_committed(checkpoints_root(out))
    done = torchrun(
        b[: b.index("--max-steps") + 1] + [str(int(killed_at.name[5:]) + 2)] + b[b.index("--max-steps") + 2 :]
    )
    assert f"resumed from {killed_at}" in done.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, int(killed_at.name[5:]) + 3)), steps


def in_a_full_filesystem(cmd: list[str], mount_at, megabytes: int, keep) -> list[str]:
    """`cmd` writing into a tmpfs of `megabytes` at `mount_at`, mounted in a mount namespace of its own: no other
    process sees it, and it is gone when `cmd` ends, pass or fail. Its files are copied to `keep` first."""
    q = shlex.quote
    script = (
        f"mount -t tmpfs -o size={megabytes}m tmpfs {q(str(mount_at))} && "
        f"{{ {shlex.join(cmd)}; rc=$?; cp -a {q(str(mount_at))}/. {q(str(keep))}; exit $rc; }}"
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint_and_a_cut_shard_is_named(mm_data, tmp_path):
    """A real full filesystem (a tmpfs that holds the step-2 checkpoint and not the step-4 one): DCP wraps the
    write's ENOSPC in its CheckpointException, whose cause the line lost ("a rank failed to write its shards")
    while an injected OSError passed. Then the kept step-2 checkpoint with a shard cut short, as a host dying
    mid-copy leaves it: resuming said it in ~150 lines of both ranks' tracebacks, naming no file."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("SHARDTRAIN_REQUIRE_NETNS") == "1":  # CI is root: there this test must run
            pytest.fail("SHARDTRAIN_REQUIRE_NETNS=1 but a private tmpfs needs root and unshare")
        pytest.skip("a private tmpfs needs root and unshare")
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    kept.mkdir()
    cmd = torchrun_cmd(args(mm_data, disk / "run", "ddp", "--max-steps", "6"))
    run = run_cmd(in_a_full_filesystem(cmd, disk, 80, kept), check=False)
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if "shardtrain: error:" in line]
    assert len(errors) == 1 and "(No space left on device)" in errors[0], run.tail()
    assert "step-000002 is intact" in errors[0], errors
    assert 'File "' + str(REPO / "shardtrain") not in run.output  # no traceback through our code (torchrun
    # itself always prints its ChildFailedError report when a worker exits non-zero)
    root = checkpoints_root(kept / "run")
    assert [p.name for p in root.iterdir() if p.name.startswith("step-")] == ["step-000002"]
    assert (root / "latest").read_text().strip() == "step-000002"

    shard = sorted((root / "step-000002" / "model_optim").glob("*.distcp"))[-1]
    os.truncate(shard, shard.stat().st_size // 3)
    resumed = torchrun(args(mm_data, kept / "run", "ddp", "--max-steps", "6", "--resume", "auto"), check=False)
    assert resumed.returncode != 0
    errors = [line for line in resumed.output.splitlines() if "shardtrain: error:" in line]
    assert len(errors) == 1 and f"checkpoint file {shard} is truncated (" in errors[0], resumed.tail()
    assert 'File "' + str(REPO / "shardtrain") not in resumed.output, resumed.tail()


def test_cross_strategy_zero2_to_fsdp_to_ddp_and_export(mm_data, tmp_path):
    """ZeRO-2 on 2 ranks -> FSDP on 2 -> DDP on 1 -> ZeRO-2 on 2: weights and Adam moments identical at each
    handover.
    Each handover run resumes at step 4 with --max-steps 4, so its only save is the converted checkpoint."""
    z2, fs, dp = tmp_path / "zero2", tmp_path / "fsdp", tmp_path / "ddp1"
    torchrun(args(mm_data, z2, "zero2", "--max-steps", "4"))
    to_fsdp = torchrun(
        args(mm_data, fs, "fsdp", "--max-steps", "4", "--resume", str(z2 / "checkpoints" / "step-000004"))
    )
    to_ddp = torchrun(
        args(mm_data, dp, "ddp", "--max-steps", "4", "--resume", str(fs / "checkpoints" / "step-000004")), nproc=1
    )
    # Each handover is said (into DDP and FSDP it was silent; into ZeRO only).
    assert "written under zero2 and training goes on under fsdp" in to_fsdp.output, to_fsdp.tail()
    assert "written under fsdp and training goes on under ddp" in to_ddp.output, to_ddp.tail()
    back = tmp_path / "zero2-again"  # and back into DeepSpeed from another world size's checkpoint
    torchrun(args(mm_data, back, "zero2", "--max-steps", "4", "--resume", str(dp / "checkpoints" / "step-000004")))
    states = [read_portable(d / "checkpoints" / "step-000004", optimizer=True) for d in (z2, fs, dp, back)]
    for before, after in zip(states, states[1:]):
        assert max_diff(before["model"], after["model"]) == 0.0
        assert max_diff(before["optim"], after["optim"]) == 0.0
    trainer = json.loads((dp / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert trainer["strategy"]["strategy"] == "ddp" and trainer["world_size"] == 1

    # Export from the DeepSpeed checkpoint, one process: the exported model reproduces the run's eval.
    exp = tmp_path / "export"
    from launch import cli

    exported = cli(["export", str(z2), str(exp), "--eval"])
    # Its own two lines and nothing else: no library warning, deprecation or progress bar (chatter.py).
    assert [line.split(" ")[0] for line in exported.output.splitlines()] == ["exported", "fp32"], exported.output
    info = json.loads((exp / "shardtrain_export.json").read_text())
    run_eval = json.loads((z2 / "summary.json").read_text())["eval"]
    assert info["eval_fp32"]["accuracy"] == run_eval["accuracy"]
    assert info["eval_fp32"]["macro_f1"] == pytest.approx(run_eval["macro_f1"], abs=1e-12)
    from shardtrain.checkpointing.export import load_export

    model = load_export(exp)
    from safetensors.torch import load_file

    exported = load_file(str(exp / "model.safetensors"))
    assert max_diff({k: exported[k] for k in states[0]["model"]}, states[0]["model"]) == 0.0
    assert isinstance(model, torch.nn.Module)


def test_every_finished_run_keeps_its_end_and_a_changed_resume_says_so(ld_data, mm_data, tmp_path):
    """A run with no --save-every still ends with a committed checkpoint, and `export` of the run folder takes
    it. Extending it with other settings says what changed in one line; a resume with nothing left to train
    leaves summary.json alone. With --save-final false, `export RUN` refuses a checkpoint older than the run."""
    from launch import cli

    out = tmp_path / "run"
    a = tiny_args("longformer", ld_data, out, "--strategy", "ddp", "--max-steps", "4", "--log-every", "1")
    torchrun(a)
    assert [p.name for p in committed_steps(checkpoints_root(out))] == ["step-000004"]
    exported = cli(["export", str(out), str(tmp_path / "exp4")])
    # One line, its own: no library warning or HF "Writing model shards" bar on stderr.
    assert exported.output.startswith("exported ") and len(exported.output.splitlines()) == 1, exported.output
    assert "step-000004" in exported.output, exported.output

    extend = [x if x != "none" else "auto" for x in a] + ["--max-steps", "6", "--per-device-batch-size", "2"]
    run = torchrun(extend)
    notes = [line for line in run.output.splitlines() if "with changed settings" in line]
    assert len(notes) == 1, run.tail()
    assert (
        "resuming from step 4 with changed settings: --max-steps 4 -> 6; the learning rate follows the new schedule:"
    ) in notes[0] and "--per-device-batch-size 8 -> 2: global batch 16 -> 4" in notes[0], notes
    assert run.summary["final_step"] == 6 and run.summary["resumed_with_changes"]
    assert latest_committed(checkpoints_root(out)).name == "step-000006"

    before = (out / "summary.json").read_bytes()
    shorter = [x if x != "6" else "3" for x in extend]
    run = torchrun(shorter)
    assert "nothing to train: " in run.output and "step 6 and --max-steps is 3" in run.output, run.tail()
    assert (out / "summary.json").read_bytes() == before
    # The other built-in into this folder: not "nothing to train" (exit 0, the model never trained), one line.
    other = torchrun(tiny_args("multimodal", mm_data, out, "--max-steps", "3", "--resume", "auto"), check=False)
    assert other.returncode != 0 and "holds a run of longformer (step-000006), and this run trains multimodal" in (
        other.output
    ), other.tail()
    assert "nothing to train" not in other.output and (out / "summary.json").read_bytes() == before
    # The same workload at another size: the checkpoint the user never named is named, with what changed since
    # its run and the way out (it said `--resume runs/x/...: checkpoint is from another model: ...` alone).
    resized = cli(["train", *extend, "--max-steps", "8", "--num-labels", "5", "--nproc", "1"], check=False)
    error = resized.output.strip().splitlines()[-1]
    assert resized.returncode == 2 and error.startswith(
        f"shardtrain: error: the checkpoint --resume auto found, {checkpoints_root(out) / 'step-000006'}, is from "
        "another model: shape checkpoint vs model"
    ), resized.tail()
    assert error.endswith(
        "; changed since its run: --num-labels 3 -> 5: train into another --output-dir, or start over in it with "
        "--resume none --overwrite-output-dir"
    ), error
    assert (out / "summary.json").read_bytes() == before

    unsaved = tmp_path / "unsaved"
    torchrun(
        tiny_args(
            "longformer",
            ld_data,
            unsaved,
            "--strategy",
            "ddp",
            "--max-steps",
            "3",
            "--save-every",
            "2",
            "--save-final",
            "false",
        )
    )
    refused = cli(["export", str(unsaved), str(tmp_path / "exp")], check=False)
    assert refused.returncode == 2, refused.output
    assert "the newest checkpoint is step 2, but the run ended at step 3 (summary.json)" in refused.output
    assert len(refused.output.strip().splitlines()) == 1, refused.output
    cli(["export", str(unsaved / "checkpoints" / "step-000002"), str(tmp_path / "exp2")])


# The best checkpoint and early stopping (docs/checkpoints.md, "The best checkpoint and early stopping"): patience 2,
# so that every run stops at step 3 of 10. n_examples never changes, so its first evaluation stays the best; with
# accuracy and a threshold of 1.0 no evaluation after the first can improve by more than it, while a larger
# accuracy still becomes the best (HF's rule).
EARLY = [
    "--per-device-batch-size",
    "8",
    "--max-steps",
    "10",
    "--eval-every",
    "1",
    "--save-every",
    "1",
    "--keep-last",
    "1",
    "--early-stopping-patience",
    "2",
    "--max-eval-samples",
    "16",
    "--resume",
    "auto",
    "--log-every",
    "100",
]
BEST_RUNS = {  # the first is killed; its restart resumes it
    "zero3": ["--metric-for-best-model", "n_examples"],
    "ddp": ["--metric-for-best-model", "n_examples", "--final-model-checkpoint", "best"],
    "fsdp": ["--early-stopping-threshold", "1.0"],  # the default metric: accuracy, the first key
    "zero2": ["--early-stopping-threshold", "1.0", "--async-save"],
}


def test_best_checkpoint_and_early_stopping_on_every_strategy_across_a_kill(mm_data, tmp_path):
    """The four strategies in ONE launch of the matrix driver (run_plan), each stopping early at step 3 as a finished
    run does: its final checkpoint, summary.json `stopped_by: early_stopping`, exit 0; `checkpoints/best` names the
    best evaluation's checkpoint, which --keep-last 1 kept. The first run (zero3) is SIGKILLed on rank 1 mid-step
    3, after one evaluation without improvement; torchrun restarts the driver, which resumes it from step 2 with
    that count: it stops at step 3 again (a lost count would stop it at step 4)."""
    from launch import run_plan

    def final_model(s, extra):  # where --final-model-checkpoint best asks for it
        return ["--final-model-dir", str(tmp_path / s / "final_model")] if "--final-model-checkpoint" in extra else []

    plan = [
        {"name": s, "args": args(mm_data, tmp_path / s, s, *EARLY, *extra, *final_model(s, extra))}
        for s, extra in BEST_RUNS.items()
    ]
    # The patience running out at --max-steps itself: a run that finished, not one that stopped early.
    at_end = ["--early-stopping-threshold", "1.0", "--max-steps", "3"]
    plan.append({"name": "at_end", "args": args(mm_data, tmp_path / "at_end", "ddp", *EARLY, *at_end)})
    env = test_env(SHARDTRAIN_FAULT="step@3:1", SHARDTRAIN_FAULT_ONCE_DIR=tmp_path / "fired")
    run, _ = run_plan(plan, tmp_path, timeout=900, env=env, extra_launcher_args=["--max-restarts", "2"])
    assert run.output.count("[fault injection]") == 1, run.tail()
    assert f"resumed from {tmp_path / 'zero3' / 'checkpoints' / 'step-000002'} at step 2" in run.output, run.tail()
    for strategy, extra in BEST_RUNS.items():
        out = tmp_path / strategy
        summary = json.loads((out / "summary.json").read_text())
        evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [1, 2, 3], (strategy, evals)
        metric = "n_examples" if "n_examples" in extra else "accuracy"
        values = [e[metric] for e in evals]
        best = 1 + max(range(3), key=lambda i: (values[i], -i))  # the earliest of the largest
        assert summary["final_step"] == 3 and summary["stopped_by"] == "early_stopping", (strategy, summary)
        assert not summary["preempted"] and summary["eval"] == {
            k: v for k, v in evals[-1].items() if k not in ("step", "final")
        }
        assert summary["best"]["metric"] == metric and summary["best"]["step"] == best, (strategy, summary["best"])
        assert summary["best"]["evals_without_improvement"] == 2, (strategy, summary["best"])
        root = checkpoints_root(out)
        assert [p.name for p in committed_steps(root)] == sorted({f"step-{best:06d}", "step-000003"}), strategy
        assert (root / "best").read_text().strip() == f"step-{best:06d}"
        assert (root / "latest").read_text().strip() == "step-000003"
        saved = json.loads((root / "step-000003" / "trainer_state.json").read_text())["best"]
        assert (saved["step"], saved["evals_without_improvement"]) == (best, 2), (strategy, saved)
    exported = json.loads((tmp_path / "ddp" / "final_model" / "shardtrain_export.json").read_text())
    assert exported["checkpoint"] == str(checkpoints_root(tmp_path / "ddp") / "step-000001")
    at_end = json.loads((tmp_path / "at_end" / "summary.json").read_text())
    assert at_end["final_step"] == 3 and at_end["stopped_by"] is None, at_end
    assert at_end["best"]["evals_without_improvement"] == 2, at_end["best"]
