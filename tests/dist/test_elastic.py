"""Losing a node and getting it back (docs/elastic.md): an elastic torchrun job on two namespace hosts
(tests/hosts.py), node2 killed with SIGKILL mid-run, node1 going on alone from the last checkpoint, node2
started again and the job back at world size 2, to max_steps, with the global batch and the data position kept."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from launch import REPO, kill_tree, test_env, tiny_args, torchrun_nodes_cmd

MAX_STEPS = 16
GLOBAL_BATCH = 8  # micro-batch 4 x accum 1 x 2 ranks
# The times a membership change takes are these (docs/elastic.md): the agent's monitor interval (torchrun's
# default 0.1 s), how long a rendezvous waits for more nodes once the minimum is there (last_call_timeout),
# and how soon a silent node is dropped from it (keep_alive_interval x keep_alive_max_attempt).
LAUNCHER = [
    "--max-restarts=3",
    "--rdzv-id=elastic-test",
    "--rdzv-conf=join_timeout=60,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3",
]


def wait_for(what: str, condition, procs: dict, logs: dict, timeout: float = 120.0):
    """Poll `condition` until it gives something; fail with every node's log tail if a launch ended or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        ended = [name for name, p in procs.items() if p.poll() is not None]
        if ended:
            break
        time.sleep(0.1)
    # Only the logs of launches started so far: a missing one would hide this failure behind a FileNotFoundError.
    tails = "\n".join(
        f"--- {name}\n" + "\n".join(Path(log).read_text().splitlines()[-30:])
        for name, log in logs.items()
        if Path(log).exists()
    )
    raise AssertionError(f"waiting for {what}: {'ended: ' + ', '.join(ended) if ended else 'timed out'}\n{tails}")


def set_hold(hold: Path, step: int) -> None:
    """SHARDTRAIN_FAULT_HOLD: steps >= `step` wait (written whole, so a reader never sees half of it)."""
    tmp = hold.with_suffix(".tmp")
    tmp.write_text(str(step))
    tmp.replace(hold)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def membership_record(out: Path, world: int):
    return next((r for r in records(out) if (r.get("membership") or {}).get("world_size_after") == world), None)


def test_a_lost_node_rejoins_and_the_job_ends_at_max_steps(namespace_hosts, mm_data, tmp_path):
    hosts = namespace_hosts(2)
    out, hold = tmp_path / "out", tmp_path / "hold"
    args = tiny_args(
        "multimodal",
        mm_data,
        out,
        "--resume",
        "auto",
        "--save-every",
        "2",
        "--max-steps",
        str(MAX_STEPS),
        "--per-device-batch-size",
        "4",
        "--log-every",
        "1",
        "--warmup-steps",
        "0",
    )
    cmd = torchrun_nodes_cmd(args, nproc=1, nnodes="1:2", extra_launcher_args=LAUNCHER)
    # With torch's default, a rendezvous store shared with the workers, node2's agent could not re-join
    # (docs/elastic.md, "Pitfalls"). INFO: the agents' own lines, for a failure's log tail.
    env = test_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, SHARDTRAIN_FAULT_HOLD=hold, LOGLEVEL="INFO")
    logs = {name: tmp_path / f"{name}.log" for name in ("node1", "node2", "node2-again")}

    def start(node: str, log: str) -> subprocess.Popen:
        return hosts[node].popen(cmd, cwd=REPO, env=env, stdout=open(logs[log], "w"), stderr=subprocess.STDOUT)

    # The run waits at step 3 (after the step-2 checkpoint) for the kill, and at world size 1 at step 4 for
    # node2's return: the job's steps (~0.1 s) never race this test's polling, however loaded the machine.
    # (Before, a starved test process once saw the first checkpoint only after the job had finished.)
    set_hold(hold, 3)
    # node2 first: it waits for node1's rendezvous store, so both join the first round (within last_call_timeout).
    procs = {"node2": start("node2", "node2"), "node1": start("node1", "node1")}
    try:
        wait_for(
            "a checkpoint at world size 2", lambda: list((out / "checkpoints").glob("step-*/COMMITTED")), procs, logs
        )
        kill_tree(procs["node2"].pid)  # the whole node: nsenter's child, its torchrun agent and its worker
        killed_at = time.time()
        assert procs.pop("node2").wait(timeout=30) != 0
        set_hold(hold, 4)  # node1's held step 3 goes on, meets its lost peer, and the agent restarts it alone
        alone = wait_for("the first step at world size 1", lambda: membership_record(out, 1), procs, logs)
        # node1 now waits at step 4 until the agent restarts it for node2's return (its stop signal ends the hold).
        rejoined_at = time.time()
        procs["node2-again"] = start("node2", "node2-again")
        back = wait_for("the first step at world size 2 again", lambda: membership_record(out, 2), procs, logs)
        for name, p in procs.items():
            assert p.wait(timeout=120) == 0, f"{name} exited {p.returncode}:\n{logs[name].read_text()[-3000:]}"
    finally:
        for p in procs.values():
            kill_tree(p.pid)
    print(
        f"\nkill -> first step at world size 1: {alone['wall_time'] - killed_at:.1f} s; node2 started again -> "
        f"first step at world size 2: {back['wall_time'] - rejoined_at:.1f} s"
    )

    node1 = logs["node1"].read_text()
    assert "resumed from" in node1 and "world size 2 -> 1 at step" in node1, node1[-3000:]
    assert f"global batch {GLOBAL_BATCH} kept as micro-batch 4 x accum 2 x 1 ranks" in node1, node1[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    changes = summary["membership"]
    assert [(c["world_size_before"], c["world_size_after"]) for c in changes] == [(2, 1), (1, 2)], changes
    assert changes[0]["hosts_before"] is not None and sorted(changes[0]["hosts_before"]) == ["node1", "node2"]
    assert changes[0]["hosts_after"] == ["node1"] and sorted(changes[1]["hosts_after"]) == ["node1", "node2"]
    assert [(c["micro_batch_size"], c["grad_accum"]) for c in changes] == [(4, 2), (4, 1)]
    assert all(c["global_batch_size"] == GLOBAL_BATCH and c["global_batch_kept"] for c in changes)
    assert [r["membership"] for r in (alone, back)] == changes

    # Every step's loss once, to max_steps: the steps after the last checkpoint before the kill were redone.
    steps = records(out)
    assert [r["step"] for r in steps] == list(range(1, MAX_STEPS + 1)) and summary["final_step"] == MAX_STEPS
    assert len(summary["train_loss"]) == MAX_STEPS
    # The data position: every step took the same global batch from one epoch's permutation (256 samples),
    # so the last checkpoint is exactly MAX_STEPS x GLOBAL_BATCH into it.
    final = json.loads((out / "checkpoints" / f"step-{MAX_STEPS:06d}" / "trainer_state.json").read_text())
    assert final["data"]["epoch"] == 0 and final["data"]["global_samples_in_epoch"] == MAX_STEPS * GLOBAL_BATCH
    assert summary["run"]["global_batch_size"] == GLOBAL_BATCH and summary["run"]["world_size"] == 2
