"""How a run stops (docs/checkpoints.md, "Stopping"): on a preemption signal or Ctrl-C it finishes its step, saves and
exits 0 or 130 with one line; a second Ctrl-C stops at once; a reader that goes away (`| head`) never hangs it.

Every launch here goes through an entry point users run: `python -m shardtrain train` (which relaunches
itself under torchrun with --nproc 2) or torchrun itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import (
    BIN,
    MAIN,
    REPO,
    cli_background,
    free_port,
    kill_tree,
    test_env,
    tiny_args,
    torchrun,
    torchrun_background,
)

LONG = ["--strategy", "ddp", "--max-steps", "500", "--device", "cpu", "--log-every", "1"]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_until(condition, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} early:\n{log.read_text()[-3000:]}")
        if time.time() > deadline:
            kill_tree(proc.pid)
            raise AssertionError(f"timed out waiting:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 120) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise AssertionError(f"did not stop within {timeout}s (a hang?):\n{log.read_text()[-3000:]}") from None
    return code, log.read_text()


def _committed_at_final_step(out: Path) -> int:
    summary = json.loads((out / "summary.json").read_text())
    step = summary["final_step"]
    assert summary["preempted"] is True and 0 < step < 500, summary
    assert (out / "checkpoints" / f"step-{step:06d}" / "COMMITTED").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:06d}"
    return step


@pytest.mark.parametrize(
    "sig,target", [(signal.SIGUSR1, "parent"), (signal.SIGTERM, "parent"), (signal.SIGTERM, "agent")]
)
def test_preemption_signal_to_shardtrain_train_saves_and_exits_0(ld_data, tmp_path, sig, target):
    """What SageMaker and Slurm signal is the parent `shardtrain train` (or, by a user's hand, the torchrun
    agent it started): the workers must hear it and save, and the command must exit 0 with no traceback (a
    wrapper reads anything else as a crash). The DataLoader workers hear a SIGTERM to the agent too."""
    import psutil

    out, log = tmp_path / "run", tmp_path / "log"
    proc = cli_background(
        ["train", *tiny_args("longformer", ld_data, out, *LONG, "--nproc", "2", "--num-workers", "2")], log=log
    )
    _wait_until(lambda: _steps_logged(out) >= 2, proc, log)
    (psutil.Process(proc.pid).children()[0] if target == "agent" else proc).send_signal(sig)
    code, output = _finish(proc, log)
    assert code == 0, output[-3000:]
    step = _committed_at_final_step(out)
    assert f"step {step}: stopped on a preemption signal; resume with --resume auto" in output
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]


def test_sigkill_of_shardtrain_train_ends_the_whole_job(ld_data, tmp_path):
    """`kill -9` (or `timeout -s KILL`) of `shardtrain train --nproc 2`: nothing can be passed on, so the agent,
    in a session of its own, must notice by itself. Every process of the job is gone within seconds, and nothing
    trains on: the job had gone on as orphans, writing checkpoints that a rerun then raced."""
    import psutil

    out, log = tmp_path / "run", tmp_path / "log"
    proc = cli_background(
        ["train", *tiny_args("longformer", ld_data, out, *LONG, "--nproc", "2", "--num-workers", "2")], log=log
    )
    _wait_until(lambda: _steps_logged(out) >= 2, proc, log)
    job = psutil.Process(proc.pid).children(recursive=True)  # the agent, 2 ranks, their DataLoader workers
    assert len(job) >= 3, job
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(job, timeout=15)
    try:
        assert not alive, f"still running after the launcher's SIGKILL: {[p.cmdline()[:4] for p in alive]}"
    finally:
        for p in alive:
            p.kill()
    steps = _steps_logged(out)
    time.sleep(1)
    assert _steps_logged(out) == steps


def test_a_rank_killed_by_sigkill_is_named_in_one_line(ld_data, tmp_path):
    """The host's OOM killer (or kill -9) takes one worker: the job stopped with exit 137 and its log just ended,
    as a hang or a lost log collector would look."""
    import psutil

    out, log = tmp_path / "run", tmp_path / "log"
    proc = cli_background(["train", *tiny_args("longformer", ld_data, out, *LONG, "--nproc", "2")], log=log)
    _wait_until(lambda: _steps_logged(out) >= 2, proc, log)
    (agent,) = psutil.Process(proc.pid).children()
    rank1 = next(w for w in agent.children() if w.environ().get("RANK") == "1")
    rank1.kill()
    code, output = _finish(proc, log)
    assert code == 137, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("shardtrain: error:")]
    assert errors == [
        f"shardtrain: error: rank 1 (pid {rank1.pid}) was killed by SIGKILL (kill -9, or the host's out-of-memory "
        f"killer: see dmesg), and the job stopped; rerun the same command to go on from the last committed "
        f"checkpoint (--resume auto)"
    ], output[-3000:]


def test_a_second_job_in_a_training_runs_folder_is_refused_and_the_first_trains_on(ld_data, tmp_path):
    """A job submitted twice, the second started as torchrun starts it (no `shardtrain train` parent to check
    first): its rank 0 finds the folder held and every rank stops in one line, before reading a checkpoint. The
    first run trains on, saves on SIGTERM and exits 0: nothing of it was read, cleared or overwritten."""
    out, log = tmp_path / "run", tmp_path / "log"
    first = cli_background(["train", *tiny_args("longformer", ld_data, out, *LONG, "--nproc", "2")], log=log)
    _wait_until(lambda: _steps_logged(out) >= 2, first, log)
    second = torchrun(
        tiny_args("longformer", ld_data, out, *LONG, "--resume", "auto"),
        check=False,
        env=test_env(TORCH_DISTRIBUTED_DEBUG="DETAIL"),
    )
    # (Under a bare torchrun the exit code and the report after the workers' line are torchrun's own: 1.)
    errors = [line for line in second.output.splitlines() if line.startswith("shardtrain: error:")]
    assert second.returncode != 0 and errors, second.tail()
    assert all(f"{out}: another run is training in it (pid " in line for line in errors), errors
    assert "resumed from" not in second.output, second.tail()
    first.send_signal(signal.SIGTERM)
    code, output = _finish(first, log)
    assert code == 0, output[-3000:]
    _committed_at_final_step(out)


def _sigterm_every_process(root_pid: int, times: int) -> None:
    """What `scancel` and a cgroup stop (systemd, a container runtime) do: SIGTERM to every process of the job
    at once: the parent, torchrun's agent, the workers and their DataLoader workers; `times` rounds in a row."""
    import psutil

    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    assert any(p.name() == "pt_data_worker" for p in procs), [p.name() for p in procs]
    for _ in range(times):
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass


@pytest.mark.parametrize("launcher,times", [("shardtrain --nproc 2", 1), ("shardtrain --nproc 2", 2), ("torchrun", 2)])
def test_sigterm_to_every_process_at_once_saves_and_exits_0(ld_data, tmp_path, launcher, times):
    """Every process signalled at once, once or twice in a row. Before, the agent's handler re-entered itself
    mid-import (the second SIGTERM: direct, plus the one its parent relays) and exited 1 with a traceback, and
    the DataLoader workers died of it, failing the step being finished: no checkpoint."""
    out, log = tmp_path / "run", tmp_path / "log"
    args = tiny_args("longformer", ld_data, out, *LONG, "--num-workers", "2")
    if launcher == "torchrun":
        proc = torchrun_background(args, log=log)
    else:
        proc = cli_background(["train", *args, "--nproc", "2"], log=log)
    _wait_until(lambda: _steps_logged(out) >= 2, proc, log)
    _sigterm_every_process(proc.pid, times)
    code, output = _finish(proc, log)
    step = _committed_at_final_step(out)
    assert f"step {step}: stopped on a preemption signal; resume with --resume auto" in output, output[-3000:]
    assert "shardtrain: error" not in output and "DataLoader worker" not in output, output[-3000:]
    if launcher != "torchrun":  # a bare torchrun's own exit code and report are torchrun's (docs/checkpoints.md)
        assert code == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize("nproc", ["2", "1"])
def test_ctrl_c_finishes_the_step_saves_and_exits_130(ld_data, tmp_path, nproc):
    """Ctrl-C in a terminal signals the whole foreground process group: with --nproc 1 that includes the
    DataLoader workers, which must not die of it before the step is finished and saved."""
    out, log = tmp_path / "run", tmp_path / "log"
    proc = cli_background(
        ["train", *tiny_args("longformer", ld_data, out, *LONG, "--nproc", nproc, "--num-workers", "2")], log=log
    )
    _wait_until(lambda: _steps_logged(out) >= 2, proc, log)
    os.killpg(proc.pid, signal.SIGINT)
    code, output = _finish(proc, log)
    assert code == 130, output[-3000:]
    step = _committed_at_final_step(out)
    assert f"step {step}: stopped on Ctrl-C; resume with --resume auto" in output
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "Ctrl-C"
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]


def test_ctrl_c_under_torchrun_saves(ld_data, tmp_path):
    """torchrun passes a Ctrl-C on to its workers, which save; its own exit code and report are torchrun's."""
    out, log = tmp_path / "run", tmp_path / "log"
    proc = torchrun_background(tiny_args("longformer", ld_data, out, *LONG), log=log)
    _wait_until(lambda: _steps_logged(out) >= 2, proc, log)
    os.killpg(proc.pid, signal.SIGINT)
    code, output = _finish(proc, log)
    step = _committed_at_final_step(out)
    assert f"step {step}: stopped on Ctrl-C" in output, output[-3000:]


def test_second_ctrl_c_stops_at_once_without_saving(ld_data, tmp_path):
    """Rank 0 stalls in step 3 (fault injection: a slow step). The first Ctrl-C asks for a save after the
    step; the second one, during the stall, must end the job within seconds, not after the step."""
    out, log = tmp_path / "run", tmp_path / "log"
    env = test_env(SHARDTRAIN_FAULT="stall@3:0")
    proc = cli_background(["train", *tiny_args("longformer", ld_data, out, *LONG, "--nproc", "2")], log=log, env=env)
    _wait_until(lambda: "stalling at stall@3" in log.read_text(), proc, log)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    code, output = _finish(proc, log, timeout=60)
    assert time.time() - t0 < 20, output[-3000:]
    assert code == 130, output[-3000:]
    assert not (out / "checkpoints").exists(), output[-3000:]  # nothing committed after the first Ctrl-C


@pytest.mark.parametrize("launcher", ["shardtrain --nproc 2", "torchrun"])
def test_a_reader_that_goes_away_does_not_hang_training(ld_data, tmp_path, launcher):
    """`| head -n 5`: the console output is dropped once the pipe closes; training, metrics and the final
    checkpoint go on. Before, rank 0 died of BrokenPipeError and its exit waited for ranks still training."""
    out = tmp_path / "run"
    args = tiny_args(
        "longformer", ld_data, out, "--strategy", "ddp", "--max-steps", "6", "--device", "cpu", "--log-every", "1"
    )
    if launcher == "torchrun":
        cmd = [
            str(BIN / "torchrun"),
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(MAIN),
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "shardtrain", "train", *args, "--nproc", "2"]
    script = " ".join(f"'{a}'" for a in cmd) + f" 2>'{tmp_path / 'stderr'}' | head -n 5; echo ${{PIPESTATUS[0]}}"
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=REPO, env=test_env(), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise AssertionError(f"hung after its reader went away:\n{(tmp_path / 'stderr').read_text()[-3000:]}") from None
    lines = stdout.splitlines()
    assert len(lines) == 6 and lines[-1] == "0", stdout + (tmp_path / "stderr").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 6 and _steps_logged(out) == 6
    assert (out / "checkpoints" / "step-000006" / "COMMITTED").is_file()


def test_help_into_head_ends_quietly(tmp_path):
    script = f"'{sys.executable}' -m shardtrain --help 2>'{tmp_path / 'stderr'}' | head -n 1; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", script], cwd=REPO, env=test_env(), capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["usage: shardtrain <command> [options]", "0"], done.stdout
    assert (tmp_path / "stderr").read_text() == ""
