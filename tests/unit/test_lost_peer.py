"""What a failed collective means, said in one line (runtime/distributed.lost_peer_line, cli.run_guarded), and the
--dist-timeout setting behind the process group's timeout. The real failures across hosts:
tests/dist/test_multi_node.py."""

from __future__ import annotations

import socket

import pytest

from shardtrain import cli
from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.runtime import distributed

GLOO_TIMEOUT = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "5000ms for recv operation to complete"
)
GLOO_CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.213.0.1]:60302")


def fail_with(exc):
    def fn(argv):
        raise exc

    return fn


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket closes


def test_a_timeout_names_dist_timeout_and_its_value(monkeypatch):
    monkeypatch.setattr(distributed, "_pg_timeout_s", 5.0)
    line = distributed.lost_peer_line(GLOO_TIMEOUT)
    assert line.startswith("a collective waited --dist-timeout (parallel.dist_timeout) = 5 s for the other ranks")
    assert "went silent" in line and "Timed out waiting 5000ms" in line and "\n" not in line
    assert cli._lost_peer(GLOO_TIMEOUT)


def test_a_store_that_no_longer_answers_is_named_with_no_failover(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(closed_port()))
    line = distributed.lost_peer_line(GLOO_CLOSED)
    assert line.startswith("lost the job's c10d store at 127.0.0.1:")
    assert "no failover" in line and "--resume auto" in line and "etcd-v2" in line and "\n" not in line


def test_a_peer_lost_while_the_store_answers_is_left_to_the_plain_line(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as server:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(server.getsockname()[1]))
        assert distributed.lost_peer_line(GLOO_CLOSED) is None


def test_each_nodes_first_rank_says_the_explained_line_at_once(capsys, monkeypatch):
    """A node's launcher stops its workers ~0.1 s after it loses the store: no quiet wait before this line."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(cli, "QUIET_SECONDS", 60.0)  # would fail the test by its length if it were waited
    monkeypatch.setattr(distributed, "_pg_timeout_s", 5.0)
    assert cli.run_guarded(fail_with(GLOO_TIMEOUT), []) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardtrain: error: a collective waited --dist-timeout") and err.count("\n") == 1


def test_dist_timeout_is_a_positive_setting():
    assert parse_cli(["--dist-timeout", "30"]).parallel.dist_timeout == 30.0
    assert parse_cli([]).parallel.dist_timeout == 1800.0
    with pytest.raises(ConfigError, match=r"--dist-timeout \(parallel.dist_timeout\) must be positive"):
        parse_cli(["--dist-timeout", "0"])


def test_a_hostname_on_loopback_is_refused_only_for_a_job_across_nodes(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "trainhost")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(
        ConfigError,
        match=r"^trainhost: this host's name resolves to 127.0.1.1 \(loopback\).*"
        r"GLOO_SOCKET_IFNAME",
    ):
        distributed.check_gloo_address(world=2)
    distributed.check_gloo_address(world=1)  # one host: loopback is right
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    distributed.check_gloo_address(world=2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "1")  # the deepspeed launcher's name for it
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME"):
        distributed.check_gloo_address(world=2)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    distributed.check_gloo_address(world=2)


def test_side_groups_fail_after_the_dist_timeout_too(monkeypatch):
    """OOM recovery's meeting point (every DDP step) and --async-save's writes use gloo groups of their own; a peer
    gone silent while one of them waits must end after --dist-timeout, not after new_group's 30-minute default."""
    import datetime

    from shardtrain.runtime import distributed

    made = []
    monkeypatch.setattr(distributed, "_pg_timeout_s", 5.0)
    monkeypatch.setattr(distributed, "check_gloo_address", lambda world: None)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "new_group", lambda **kwargs: made.append(kwargs) or "group")
    assert distributed.new_gloo_group() == "group"
    assert made == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=5)}]
