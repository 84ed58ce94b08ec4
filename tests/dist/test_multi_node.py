"""Multi-node runs across two network-namespace hosts (tests/hosts.py), one rank per node:

- torchrun c10d rendezvous: DDP, FSDP, ZeRO-2 and ZeRO-3 in one launch of the matrix driver give the losses and
  gradient norms of the same world size on one host; on nodes that share one hostname, which the store host cannot
  recognise itself by, with the documented settings (`--rdzv-conf is_host=`, `--local-addr`, GLOO_SOCKET_IFNAME);
- the deepspeed launcher without ssh (hostfile, --no_ssh, --node_rank, --master_addr): trains, and the banner's
  rank table and the GPU guard see two hosts;
- an output dir that only node1 sees: one line at start-up naming --output-dir and node2;
- losing the host of the c10d store: the other node exits non-zero within seconds with one line that says so, and
  the next start resumes from the last committed checkpoint;
- a link that goes silent: every rank fails after --dist-timeout with one line that says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from launch import BIN, DRIVER, MAIN, REPO, kill_tree, run_plan, run_together, test_env, tiny_args, torchrun_nodes_cmd

LOSS_RTOL, GRAD_NORM_RTOL = 1e-4, 1e-5  # as tests/dist/test_matrix.py's parity on Longformer
PARITY_STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "zero2": ["--strategy", "zero2"],
    "zero3": ["--strategy", "zero3"],
}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _short(ld_data: Path, out: Path, *extra: str) -> list[str]:
    return tiny_args("longformer", ld_data, out, "--max-eval-samples", "16", "--log-every", "1", *extra)


def test_torchrun_c10d_parity_across_hosts_that_share_one_hostname(namespace_hosts, ld_data, tmp_path):
    hosts = namespace_hosts(2)
    # Both nodes call themselves `trainhost`, which each resolves to its own loopback (as Debian's installer
    # writes /etc/hosts): torch's agent on node1 cannot tell that the endpoint node1 is itself, and would
    # advertise `trainhost` to the other node as the workers' MASTER_ADDR, and gloo each rank's address as loopback.
    same = hosts.dir / "hosts-same-name"
    same.write_text(
        "127.0.0.1 localhost\n127.0.1.1 trainhost\n" + "".join(f"{n.address} {n.name}\n" for n in hosts.nodes)
    )
    for node in hosts.nodes:
        node.hostname, node.hosts_file = "trainhost", same

    # Without the settings nobody would host the rendezvous store: node1's agent asks torch whether the endpoint
    # is itself, and torch says no (a launch that shows it waits out read_timeout: docs/multi-node.md).
    probe = (
        "from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname as is_me\n"
        "print('endpoint-is-me', is_me('node1'), is_me('10.213.0.1'))"
    )
    seen = hosts["node1"].run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "endpoint-is-me False False" in seen.stdout, seen.stdout + seen.stderr

    # With them (and GLOO_SOCKET_IFNAME): the four strategies in one process group of two hosts, against the same
    # plan on one host.
    def plan(root: Path) -> list[dict]:
        return [
            {"name": name, "args": _short(ld_data, root / name, *flags, "--max-steps", "3")}
            for name, flags in PARITY_STRATEGIES.items()
        ]

    nodes_root, one_root = tmp_path / "nodes", tmp_path / "one_host"
    nodes_root.mkdir(), one_root.mkdir()
    (nodes_root / "plan.json").write_text(json.dumps(plan(nodes_root)))
    runs = run_together(
        [
            node.wrap(
                torchrun_nodes_cmd(
                    [str(nodes_root / "plan.json"), str(nodes_root)],
                    endpoint="node1:29402",
                    script=DRIVER,
                    extra_launcher_args=[
                        "--rdzv-conf",
                        f"is_host={int(node.name == 'node1')}",
                        "--local-addr",
                        node.address,
                    ],
                )
            )
            for node in hosts.nodes
        ],
        timeout=600,
        env=test_env(GLOO_SOCKET_IFNAME="eth0"),
    )
    across = json.loads((nodes_root / "results.json").read_text())
    _, one_host = run_plan(plan(one_root), one_root, timeout=600)
    for name in PARITY_STRATEGIES:
        a, b = across[name], one_host[name]
        assert len(a["losses"]) == 3, (name, a)
        assert rel(a["grad_norms"][0], b["grad_norms"][0]) < GRAD_NORM_RTOL, (name, a["grad_norms"], b["grad_norms"])
        assert max(rel(x, y) for x, y in zip(a["losses"], b["losses"])) < LOSS_RTOL, (name, a["losses"], b["losses"])
    print(
        "\n"
        + "\n".join(
            f"{name}: across hosts {across[name]['losses']} one host {one_host[name]['losses']}"
            for name in PARITY_STRATEGIES
        )
    )
    assert sum("[matrix]" in r.output for r in runs) >= 1


def test_deepspeed_launcher_without_ssh_and_the_banner_sees_two_hosts(namespace_hosts, ld_data, tmp_path):
    hosts = namespace_hosts(2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    out = tmp_path / "run"
    cmds = [
        node.wrap(
            [
                str(BIN / "deepspeed"),
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(k),
                "--master_addr",
                "node1",
                "--master_port",
                "29500",
                str(MAIN),
                *_short(ld_data, out, "--ds", "ds_configs/zero2.json", "--max-steps", "2"),
            ]
        )
        for k, node in enumerate(hosts.nodes)
    ]
    t0 = time.monotonic()
    node1, _ = run_together(cmds, timeout=300)
    print(f"\ndeepspeed launcher across 2 hosts: {time.monotonic() - t0:.1f}s")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_step"] == 2
    assert [(r["rank"], r["host"], r["node"]) for r in summary["ranks"]] == [(0, "node1", "0"), (1, "node2", "1")]
    # The banner's rank table: one row per rank, each on its own host.
    rows = re.findall(r"^\s+(\d+)\s+(node\d)\s+(\d+)\s+cpu", node1.output, re.M)
    assert rows == [("0", "node1", "0"), ("1", "node2", "0")], node1.tail(60)
    # The GPU guard groups ranks by host and node (the launcher's CROSS_RANK): two hosts with local rank 0 each
    # is no clash, and nothing is idle.
    assert "all use" not in node1.output and "!" * 20 not in node1.output
    assert not list(out.glob(".shardtrain-shared-*")), "the start-up marker was left in the output dir"


def test_an_output_dir_one_host_cannot_see_fails_at_start_naming_it(namespace_hosts, ld_data, tmp_path):
    hosts = namespace_hosts(2)
    out = tmp_path / "run"
    out.mkdir()
    hosts["node2"].private_dirs = [out]  # node2 sees its own empty tmpfs there, as a host without the share would
    t0 = time.monotonic()
    runs = run_together(
        [
            node.wrap(torchrun_nodes_cmd(_short(ld_data, out, "--max-steps", "2"), endpoint="node1:29403"))
            for node in hosts.nodes
        ],
        timeout=180,
        check=False,
    )
    seconds = time.monotonic() - t0
    assert all(r.returncode != 0 for r in runs)
    lines = [line for r in runs for line in r.output.splitlines() if line.startswith("shardtrain: error")]
    assert lines, runs[0].tail(30)
    assert all(
        "--output-dir (checkpoint.output_dir)" in line
        and "is not shared: node2 (rank 1)" in line
        and "on node1" in line
        for line in lines
    ), lines
    assert not (out / "checkpoints").exists() and not list(out.glob(".shardtrain-shared-*"))
    print(f"\nunshared output dir refused in {seconds:.1f}s: {lines[0]}")


def _wait_for(predicate, seconds: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert all(p.poll() is None for p in procs), f"a node exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds}s"
        time.sleep(0.2)


def _committed_step(out: Path) -> int | None:
    latest = out / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip().split("-")[-1])
    except (OSError, ValueError):
        return None


def test_losing_the_store_host_ends_the_job_in_seconds_and_the_next_start_resumes(namespace_hosts, ld_data, tmp_path):
    hosts = namespace_hosts(2)
    node1, node2 = hosts["node1"], hosts["node2"]
    out = tmp_path / "run"
    args = _short(ld_data, out, "--max-steps", "400", "--save-every", "2", "--eval-every", "0")
    logs = [tmp_path / f"{n.name}.log" for n in hosts.nodes]
    procs = [
        node.popen(
            torchrun_nodes_cmd(args, endpoint="node1:29404"),
            cwd=str(REPO),
            env=test_env(),
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        for node, log in zip(hosts.nodes, logs)
    ]
    try:
        _wait_for(lambda: (_committed_step(out) or 0) >= 4, 240, "checkpoint at step 4", procs)
        kill_tree(procs[0].pid)  # node1: its torchrun agent (the store host) and its worker, at once
        t_kill = time.monotonic()
        procs[0].wait(timeout=30)
        _wait_for(lambda: not node1.pids(), 10, "empty node1")
        code = procs[1].wait(timeout=120)
        # node2's torchrun may exit before its worker, which then says its line: wait for the node to empty.
        _wait_for(lambda: not node2.pids(), 30, "empty node2")
        seconds = time.monotonic() - t_kill
    finally:
        for p in procs:
            kill_tree(p.pid)
    text = logs[1].read_text()
    assert code != 0, text[-3000:]
    ours = [line for line in text.splitlines() if "lost the job's c10d store at node1:" in line]
    # Our line comes from node2's worker; its torchrun may stop that worker ~0.1 s after losing the store, before
    # it prints (seen once in a full run). Then the launcher's own line is the one that says so.
    launchers = [line for line in text.splitlines() if "RendezvousConnectionError: The connection to the C10d" in line]
    if ours:
        assert len(ours) == 1 and "no failover" in ours[0] and "--resume auto" in ours[0], text[-3000:]
    assert ours or launchers, text[-3000:]
    assert seconds < 30, f"node2 took {seconds:.1f}s to exit after its store host died"
    print(f"\nnode2 exited {code} {seconds:.1f}s after node1 was killed: {(ours or launchers)[0]}")

    # The next start, on both nodes, goes on from the last committed checkpoint.
    last = _committed_step(out)
    assert last is not None and last >= 4
    t0 = time.monotonic()
    resumed = run_together(
        [
            node.wrap(
                torchrun_nodes_cmd(
                    _short(ld_data, out, "--max-steps", str(last + 2), "--resume", "auto", "--eval-every", "0"),
                    endpoint="node1:29405",
                )
            )
            for node in hosts.nodes
        ],
        timeout=240,
    )
    assert f"at step {last}" in resumed[0].output and "resumed from" in resumed[0].output, resumed[0].tail(30)
    assert json.loads((out / "summary.json").read_text())["final_step"] == last + 2
    print(f"resumed on both nodes from step {last} and ended at {last + 2} in {time.monotonic() - t0:.1f}s")


def test_a_silent_link_fails_every_rank_after_dist_timeout(namespace_hosts, ld_data, tmp_path):
    hosts = namespace_hosts(2)
    out = tmp_path / "run"
    timeout_s = 5
    args = _short(ld_data, out, "--max-steps", "400", "--eval-every", "0", "--dist-timeout", str(timeout_s))
    logs = [tmp_path / f"{n.name}.log" for n in hosts.nodes]
    procs = [
        node.popen(
            torchrun_nodes_cmd(args, endpoint="node1:29406"),
            cwd=str(REPO),
            env=test_env(),
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        for node, log in zip(hosts.nodes, logs)
    ]
    metrics = out / "metrics.jsonl"
    said = "a collective waited --dist-timeout (parallel.dist_timeout) = 5 s"
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240, "two steps", procs)
        # node2's cable is pulled: no reset, no FIN, its peers just stop hearing from it.
        subprocess.run(["ip", "-n", hosts["node2"].netns, "link", "set", "eth0", "down"], check=True)
        t_down = time.monotonic()
        _wait_for(lambda: all(said in log.read_text() for log in logs), 60, "line from each node's rank")
        said_after = time.monotonic() - t_down
        # node1 keeps the rendezvous store: its torchrun ends with its worker. node2's torchrun stays blocked in
        # torch's store client, past read_timeout (docs/multi-node.md): its worker is gone, the test ends it.
        code1 = procs[0].wait(timeout=60)
        node1_after = time.monotonic() - t_down
    finally:
        for p in procs:
            kill_tree(p.pid)
    texts = [log.read_text() for log in logs]
    assert code1 != 0
    for text in texts:
        ours = [line for line in text.splitlines() if said in line]
        assert len(ours) == 1 and "went silent" in ours[0] and "--resume auto" in ours[0], text[-3000:]
    print(
        f"\nlink down: both ranks said so after {said_after:.1f}s, node1's torchrun exited {code1} after "
        f"{node1_after:.1f}s (--dist-timeout {timeout_s})"
    )
    assert said_after < timeout_s + 30
