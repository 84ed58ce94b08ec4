"""The namespace hosts themselves (tests/hosts.py): separate hostnames, addresses only inside them, a working
link between them, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys

import hosts as hosts_module
import pytest

PY = sys.executable


def test_nodes_are_separate_hosts_on_one_link(namespace_hosts):
    hosts = namespace_hosts(2)
    node1, node2 = hosts["node1"], hosts["node2"]
    server = node1.popen(
        [
            PY,
            "-c",
            "import socket; s = socket.create_server(('0.0.0.0', 29555)); c, _ = s.accept();"
            "c.sendall(socket.gethostname().encode())",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    probe = (
        "import socket, time\n"
        "for _ in range(100):\n"
        "    try: c = socket.create_connection(('node1', 29555), timeout=1); break\n"
        "    except OSError: time.sleep(0.05)\n"
        "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), c.recv(64).decode())"
    )
    seen = node2.run([PY, "-c", probe], capture_output=True, text=True, timeout=30)
    server.wait(timeout=30)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["node2", "10.213.0.2", "node1"]
    # Each node has its own /dev/shm, as separate machines do (DeepSpeed's shm ops name segments per local rank).
    node1.run(["sh", "-c", "touch /dev/shm/shardtrain-probe"], check=True)
    assert node2.run(["test", "-e", "/dev/shm/shardtrain-probe"]).returncode == 1
    # The machine's own namespace has no address of the nodes' subnet, and its /etc/hosts is untouched.
    assert hosts_module.SUBNET not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert "node1" not in open("/etc/hosts").read()


def test_teardown_removes_everything_and_a_leftover_is_named(namespace_hosts, tmp_path):
    hosts = namespace_hosts(2)
    names = [n.netns for n in hosts.nodes] + [hosts.switch]
    sleeper = hosts["node2"].popen(["sleep", "600"])
    hosts.teardown()
    assert sleeper.wait(timeout=10) == -9
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)

    stale = f"{hosts_module.PREFIX}-stale-node1"  # as a run killed before its teardown would leave it
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with pytest.raises(RuntimeError, match=f"left network namespace {stale} behind"):
            hosts_module.Hosts(2, tag="after").__enter__()
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=True)


def test_torchrun_rendezvous_across_two_nodes(namespace_hosts):
    """The launch helpers' multi-node form: one torchrun per node, c10d rendezvous at node1."""
    from launch import run_together, torchrun_nodes_cmd

    hosts = namespace_hosts(2)
    probe = hosts.dir / "probe.py"
    probe.write_text(
        "import os, socket, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "names = [None] * dist.get_world_size()\n"
        "dist.all_gather_object(names, socket.gethostname())\n"
        "print('hosts', dist.get_rank(), ','.join(names))\n"
        "dist.destroy_process_group()\n"
    )
    runs = run_together([node.wrap(torchrun_nodes_cmd([], nproc=1, script=probe)) for node in hosts.nodes], timeout=120)
    seen = [next(line.split()[1:] for line in r.output.splitlines() if line.startswith("hosts ")) for r in runs]
    assert sorted(rank for rank, _ in seen) == ["0", "1"]
    assert all(sorted(names.split(",")) == ["node1", "node2"] for _, names in seen), seen


def test_hosts_of_a_live_test_process_are_not_leftovers(namespace_hosts):
    """Namespaces of another test session still running on this machine (its pid is in their names) are in use,
    not left over: they must not stop this session's start. Once that process is gone, they are leftovers."""
    other = subprocess.Popen(["sleep", "60"])
    busy = f"{hosts_module.PREFIX}-{other.pid}-0-node1"
    subprocess.run(["ip", "netns", "add", busy], check=True)
    try:
        namespace_hosts(2)  # starts beside the busy namespace
        other.kill()
        other.wait()
        with pytest.raises(RuntimeError, match=f"left network namespace {busy} behind"):  # its process is dead
            hosts_module.Hosts(2, tag="after").__enter__()
    finally:
        other.kill()
        subprocess.run(["ip", "netns", "del", busy], check=True)
