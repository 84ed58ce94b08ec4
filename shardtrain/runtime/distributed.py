"""Process group from whatever launched us (torchrun, the deepspeed launcher, srun, SageMaker, or a plain
`python`), one device per rank, rank-0 helpers, and a teardown that cannot abort at exit."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtrain.config.settings import ConfigError, where


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=30
        ).stdout.split()
        return out[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        # Without scontrol, a plain "host1,host2" or single-host list still works.
        return nodelist.split(",")[0]


def adopt_launcher_env() -> None:
    """Map the launcher's variables onto torch's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*.

    torchrun and the deepspeed launcher already set them. `srun` with one task per GPU only sets
    SLURM_* variables, and Slurm sets no MASTER_ADDR / MASTER_PORT at all.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
        # A port derived from the job id lets concurrent jobs on a shared node avoid each other.
        env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return
    if int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" not in env:
        # Rank 0 of WORLD_SIZE would wait for peers that never start: a hang, not an error, otherwise.
        raise ConfigError(
            f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: start one process per GPU "
            f"with torchrun --nproc_per_node=N (it sets both), or unset WORLD_SIZE"
        )
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{where('device')}=cuda, but no CUDA device is visible here; use --device cpu")
    return requested


def init_distributed(device_request: str, timeout_s: float | None = None) -> DistInfo:
    adopt_launcher_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = resolve_device_type(device_request)
    if device_type == "cuda":
        index = local_cuda_index(local_rank)
        # Before the process group: NCCL binds each rank to the current device.
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if backend == "gloo":
        check_gloo_address(world)
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("SHARDTRAIN_PG_TIMEOUT", 1800)))
    global _pg_timeout_s
    _pg_timeout_s = timeout.total_seconds()
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=device if device_type == "cuda" else None,
                store=attempt_store(rank, world, timeout),
            )
        except (RuntimeError, ValueError) as e:
            addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "address already in use" in msg.lower() or "EADDRINUSE" in msg:
                raise ConfigError(
                    f"master port {addr} is in use: set MASTER_PORT (or torchrun --master-port) to a free port"
                ) from None
            raise ConfigError(f"cannot start the {backend} process group at {addr}: {msg}") from None
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device, backend=backend)


def local_cuda_index(local_rank: int) -> int:
    """The CUDA device this process trains on. One visible GPU (srun --gpus-per-task=1, --gpu-bind, a launcher
    that sets CUDA_VISIBLE_DEVICES per rank) is this rank's own, whatever its local rank: every rank calls its GPU
    cuda:0, and gpu_guard tells them apart by UUID (and stops ranks that really share one). With several
    visible, the local rank picks one."""
    n = torch.cuda.device_count()
    if n == 1:
        return 0
    if local_rank >= n:
        raise ConfigError(
            f"local rank {local_rank} has no GPU: {n} visible on {socket.gethostname()}; "
            f"start at most {n} processes per node (--nproc_per_node={n})"
        )
    return local_rank


def new_gloo_group():
    """A gloo group of all ranks beside the main one (--async-save's checkpoint writes). Gloo gives the other
    ranks the address this host's name resolves to whatever the main backend is, so the loopback check applies
    under NCCL too."""
    check_gloo_address(dist.get_world_size())
    # The main group's timeout (--dist-timeout), not new_group's own default (30 min): a peer gone silent while
    # this group waits (OOM recovery's meeting point, every DDP step) must fail after the same seconds.
    timeout = datetime.timedelta(seconds=_pg_timeout_s) if _pg_timeout_s else None
    return dist.new_group(backend="gloo", timeout=timeout)


def check_gloo_address(world: int) -> None:
    """Gloo tells the other ranks to reach this one at the address its hostname resolves to. Where that is loopback
    (`127.0.1.1 myhost` in /etc/hosts, as Debian writes it) the ranks of other nodes connect to themselves and
    the job hangs at start-up; GLOO_SOCKET_IFNAME names the interface to use instead. Checked only for a job that
    spans nodes (fewer processes on this node than in the job): on one host loopback is right."""
    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE; Slurm neither (not checked there).
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    if local_world >= world or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return  # gloo fails with its own error naming the host
    if addr.startswith("127."):
        raise ConfigError(
            f"{host}: this host's name resolves to {addr} (loopback), which gloo would give the other "
            f"nodes as this rank's address; set GLOO_SOCKET_IFNAME to the network interface the nodes "
            f"share (e.g. GLOO_SOCKET_IFNAME=eth0), or make {host} resolve to that interface's address"
        )


_pg_timeout_s: float | None = None  # the process group's collective timeout, for lost_peer_line()


def lost_peer_line(e: BaseException) -> str | None:
    """One line that says what a failed collective means across hosts, or None when it is not one of these:
    - a timeout: a rank or its link went silent (a dead link sends no reset), and --dist-timeout ran out;
    - the job's store (MASTER_ADDR:MASTER_PORT) no longer answers: the host that held it is gone, and torchrun's
      c10d rendezvous keeps its store on one host with no failover, so nothing can go on."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = f"({type(e).__name__}: {first[:300]})"
    if "timed out" in first.lower() or "timeout" in first.lower():
        seconds = f" = {_pg_timeout_s:g} s" if _pg_timeout_s else ""
        return (
            f"a collective waited {where('dist_timeout')}{seconds} for the other ranks and gave up: a node or "
            f"the link to it went silent; the job stops here, resume with --resume auto {cause}"
        )
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port and not _answers(addr, int(port)):
        return (
            f"lost the job's c10d store at {addr}:{port} (MASTER_ADDR:MASTER_PORT): the host or process that "
            f"held it is gone, and c10d has no failover, so the job ends; start every node again with --resume "
            f"auto to go on from the last checkpoint (an etcd rendezvous, --rdzv-backend=etcd-v2, outlives any "
            f"one host: docs/multi-node.md) {cause}"
        )
    return None


def _answers(addr: str, port: int, seconds: float = 2.0) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=seconds):
            return True
    except OSError:
        return False


def attempt_store(rank: int, world: int, timeout: datetime.timedelta):
    """torchrun keeps one rendezvous store for all restarts of its workers (--max-restarts). Keys that a
    killed attempt left there (gloo's peer addresses) can be read by the next attempt, which then waits to
    connect to a dead process until the timeout: measured here as a hang after a restart. A prefix per
    attempt keeps every attempt's keys apart. None (torch's default) outside torchrun, and where the agent
    does not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, what elastic jobs need): then rank 0
    starts a new store at a new port for every attempt, and the restart count, which each agent keeps for
    itself, differs between a node that restarted and one that joined afresh (pytorch/pytorch#135712): a
    prefix from it kept the two apart, and the job hung (tests/dist/test_elastic.py)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"shardtrain/attempt_{attempt}", store)


def group_device(group=None) -> torch.device:
    """Where a collective's tensors must be for the group's backend: NCCL takes CUDA tensors only (a CPU tensor
    raises at the first collective: a workload's metric_sums may well return one), gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _grouped() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum over ranks, on the group's device (the values' own in one process)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64, device=device)
    if _grouped():
        t = t.to(group_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if _grouped():
        t = t.to(group_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


_HOST_FLAG_GROUP = None  # made by the first any_rank_on_host call, which every rank makes at the same point


def any_rank_on_host(flag: bool) -> bool:
    """True on every rank if it is true on any, over a gloo group of its own on the host: no GPU stream to wait
    behind and no device sync, for flags asked between a step's passes (OOM recovery's meeting points)."""
    global _HOST_FLAG_GROUP
    if not _grouped():
        return flag
    if _HOST_FLAG_GROUP is None:
        _HOST_FLAG_GROUP = new_gloo_group()
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, group=_HOST_FLAG_GROUP)
    return t.item() > 0


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any: ranks must agree before skipping, saving or stopping."""
    return all_reduce_max(1.0 if flag else 0.0, device) > 0


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s values into `t` on every rank, in place, wherever `t` lives (a CPU buffer under NCCL goes
    through the GPU)."""
    if not _grouped():
        return t
    dev = group_device()
    if t.device == dev:
        dist.broadcast(t, src=src)
        return t
    moved = t.to(dev)
    dist.broadcast(moved, src=src)
    t.copy_(moved)
    return t


def barrier() -> None:
    if _grouped():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank ([obj] in one process)."""
    if not _grouped():
        return [obj]
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, obj)
    return table


def gather_object(obj, dst: int = 0) -> list | None:
    """Every rank's `obj` in rank order on rank `dst`, None elsewhere ([obj] in one process)."""
    if not _grouped():
        return [obj]
    table = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, table, dst=dst)
    return table


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_rank_info(info: DistInfo) -> list[dict]:
    """Every rank's (host, local rank, device), gathered on all ranks: the banner and the idle-GPU
    guard read the same table."""
    own = {
        "rank": info.rank,
        "host": socket.gethostname(),
        "local_rank": info.local_rank,
        "node": node_index(),
        "device": str(info.device),
        "device_name": torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu",
        "visible_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device_uuid": str(torch.cuda.get_device_properties(info.device).uuid) if info.device.type == "cuda" else "",
    }
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [own]
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, own)
    return table


def node_index() -> str | None:
    """Which node of the job this process runs on, as its launcher numbers them (torchrun GROUP_RANK, the deepspeed
    launcher CROSS_RANK, Slurm SLURM_NODEID): nodes can share a hostname (one container image everywhere), and
    the GPU guard must not take two nodes' cuda:0 for one GPU. None when no launcher says."""
    for name in ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID"):
        if os.environ.get(name) is not None:
            return os.environ[name]
    return None


def teardown_and_exit(code: int) -> None:
    """Leave without the gloo SIGABRT seen here in ~1 of 8-30 runs at interpreter shutdown.

    barrier -> destroy_process_group -> flush -> os._exit gave 0 aborts in 30+ runs.
    """
    if dist.is_initialized():
        try:
            if code == 0:
                barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already on the way out; the exit code says what matters
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
