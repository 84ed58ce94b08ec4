"""Hosts for multi-node tests: Linux network namespaces on a private bridge.

Each node is a network namespace whose one veth leads into a "switch" namespace holding the bridge. Nothing is
added to the machine's own namespace: no address exists outside these namespaces, and no packet can leave them.

Commands run on a node through `nsenter --net` (not `ip netns exec`, which remounts /sys and hides the cgroups
slurmd needs) and `unshare --uts --mount`, so each node has its own hostname, its own /etc/hosts (a file of the
test's bind-mounted over it: the machine's /etc is never edited) and its own /dev/shm, as separate machines do.
The filesystem is otherwise shared, like a cluster's shared home; `private_dirs` hides a folder from one node.

    with Hosts(2) as hosts:          # node1 10.213.0.1, node2 10.213.0.2
        hosts["node2"].popen(["python", "-c", "import socket; print(socket.gethostname())"])

Teardown always runs: every process in a node is killed and every namespace deleted, pass or fail. A namespace
left by an earlier run that could not tear down (the test process was SIGKILLed) fails the next start with a
line naming it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "shardtrain-t"  # every namespace these tests create starts with this
SUBNET = "10.213.0"  # lives only inside the namespaces; a node's address is SUBNET.<its number>
TOOLS = ("ip", "unshare", "nsenter", "mount")


def unavailable() -> str | None:
    """Why namespace hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (CI runs as root)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"network-namespace hosts need {', '.join(missing)} on PATH"
    return None


def _owner_alive(netns: str) -> bool:
    """Whether the process that built `netns` (its name carries that pid) still runs: then the namespace is in
    use by a concurrent test session on this machine, not left over."""
    pid = netns[len(PREFIX) + 1 :].split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def leftovers(mine: str | None = None) -> list[str]:
    """Namespaces and links of these tests that still exist; `mine`: a name part of this process's own hosts,
    which are not leftovers, and neither are those of another live test process."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    found += [
        f"network namespace {line.split()[0]}"
        for line in netns
        if line.startswith(PREFIX)
        and not (mine and line.startswith(f"{PREFIX}-{mine}-"))
        and not (mine and _owner_alive(line.split()[0]))
    ]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    found += [
        f"link {line.split(':')[1].strip().split('@')[0]}"
        for line in links
        if len(line.split(":")) > 1 and line.split(":")[1].strip().startswith(("st-", PREFIX))
    ]
    return found


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Node:
    name: str  # its hostname: node1, node2, ...
    address: str
    netns: str
    hosts_file: Path
    private_dirs: list[Path] = field(default_factory=list)  # folders this node sees empty (its own tmpfs)
    hostname: str | None = None  # what gethostname() says on it; None: its name (set before starting commands)

    def wrap(self, cmd: list[str], setup: str = "") -> list[str]:
        """`cmd` as run on this node. `setup`: shell lines run first, inside the node (e.g. slurmd's mounts)."""
        lines = [
            f"hostname {shlex.quote(self.hostname or self.name)}",
            f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts",
            "mount -t tmpfs -o size=2g tmpfs /dev/shm",
        ]
        lines += [f"mount -t tmpfs tmpfs {shlex.quote(str(d))}" for d in self.private_dirs]
        if setup:
            lines.append(setup)
        script = " && ".join(lines) + ' && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *cmd,
        ]

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(cmd), **kwargs)

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.wrap(cmd), **kwargs)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class Hosts:
    """`count` nodes named node1..nodeN (addresses SUBNET.1..N) on one bridge."""

    def __init__(self, count: int = 2, tag: str | None = None):
        self.tag = f"{os.getpid()}-{tag}" if tag else str(os.getpid())
        self.switch = f"{PREFIX}-{self.tag}-switch"
        self.dir = Path(tempfile.mkdtemp(prefix="shardtrain-hosts-"))
        hosts_file = self.dir / "hosts"
        self.nodes = [
            Node(f"node{i}", f"{SUBNET}.{i}", f"{PREFIX}-{self.tag}-node{i}", hosts_file) for i in range(1, count + 1)
        ]
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in self.nodes))

    def __getitem__(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def __enter__(self) -> "Hosts":
        left = leftovers(mine=str(os.getpid()))  # this process's other hosts are in use, not left over
        if left:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise RuntimeError(
                f"an earlier test run left {left[0]} behind (and {len(left) - 1} more); remove it "
                f"(`ip netns del NAME`) before running the multi-node tests"
            )
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def run_on_script(self) -> Path:
        """An executable `run-on NODE CMD...` that runs CMD on that node (Node.wrap): how a shell script starts
        things on these hosts (slurm/local-cluster/start.sh --run-on). It lives, and goes, with the hosts."""
        path = self.dir / "run-on"
        cases = "".join(f'    {n.name}) exec {shlex.join(n.wrap([]))} "$@" ;;\n' for n in self.nodes)
        path.write_text(
            f'#!/bin/sh\n# run-on NODE CMD...\nnode=$1; shift\ncase "$node" in\n{cases}'
            f'    *) echo "run-on: no host $node" >&2; exit 2 ;;\nesac\n'
        )
        path.chmod(0o755)
        return path

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes, start=1):
            _ip("netns", "add", node.netns)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                f"port{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                node.netns,
            )
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Kill what runs on the nodes, then delete every namespace (which takes their links and the bridge)."""
        for name in [n.netns for n in self.nodes] + [self.switch]:
            if not Path(f"/run/netns/{name}").exists():
                continue
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            for pid in out.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        left = [x for x in leftovers() if f"-{self.tag}-" in x]
        assert not left, f"teardown left {', '.join(left)}"
