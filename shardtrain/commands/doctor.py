"""`shardtrain doctor`: what this machine and this environment will do to a training run, before it runs.

    shardtrain doctor              # report + one line per problem, each with its fix
    shardtrain doctor --json       # the same, machine-readable
    shardtrain doctor --config configs/longformer_4096.yaml   # also checks loader workers against the CPUs

Exit code 1 when something would stop training (a launcher variable that makes rank 0 wait forever,
a network interface NCCL cannot find...); warnings alone exit 0.
Everything heavy (torch, DeepSpeed) is imported inside the functions: importing this module is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Mapping

from shardtrain.config.sagemaker_env import TORCHRUN_HINT

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
)
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_GPUS_ON_NODE",
    "SLURM_CPUS_PER_TASK",
)
SAGEMAKER_VARS = ("SM_NUM_GPUS", "SM_NUM_CPUS", "SM_HOSTS", "SM_CURRENT_HOST", "SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR")
DS_OPS = ("CPUAdamBuilder", "FusedAdamBuilder")


@dataclass
class Problem:
    level: str  # "error" blocks training; "warning" costs speed or surprises
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.level}: {self.message} -> {self.fix}"


# ---- facts ---------------------------------------------------------------------------------------
def versions() -> dict:
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
    except (RuntimeError, AttributeError):
        out["nccl"] = None
    for lib in ("deepspeed", "transformers"):
        try:
            out[lib] = metadata.version(lib)  # the metadata, not `import deepspeed`: that takes seconds
        except metadata.PackageNotFoundError:
            out[lib] = None
    return out


def gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_gb": round(p.total_memory / 2**30, 1),
                "compute_capability": f"{p.major}.{p.minor}",
                "bf16": p.major >= 8,
            }
        )
    return out


def deepspeed_ops() -> dict:
    """Whether DeepSpeed could JIT-build its Adam ops here; is_compatible() checks without building."""
    info = {
        "ninja": bool(shutil.which("ninja")) or _has_module("ninja"),
        "cxx": shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++"),
    }
    if not _has_module("deepspeed"):
        return {**info, "ops": {}}
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda_available() else "cuda")
    from shardtrain.strategies.deepspeed_import import import_deepspeed

    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    ops = {}
    for name in DS_OPS:
        try:
            builder = accel.create_op_builder(name)
            ops[builder.NAME if builder else name] = bool(builder and builder.is_compatible(verbose=False))
        except Exception:  # noqa: BLE001 - a broken op builder is a "no" for this report
            ops[name] = False
    return {**info, "ops": ops, "accelerator": accel._name}


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


# ---- checks: pure functions over the environment and the facts -----------------------------------
def check_launcher(env: Mapping[str, str], n_gpus: int) -> list[Problem]:
    out = []
    world = _int(env.get("WORLD_SIZE"))
    rank = _int(env.get("RANK"))
    if world is not None and world > 1 and rank is None:
        out.append(
            Problem(
                "error",
                f"WORLD_SIZE={world} is set but RANK is not: rank 0 would wait for peers that never start",
                f"launch with torchrun --nproc_per_node={n_gpus or 'N'} "
                f"(it sets RANK per process), or unset WORLD_SIZE",
            )
        )
    if world is not None and rank is not None and not 0 <= rank < world:
        out.append(
            Problem(
                "error",
                f"RANK={rank} is outside 0..WORLD_SIZE-1 ({world - 1})",
                "let the launcher set RANK/WORLD_SIZE instead of setting them by hand",
            )
        )
    if world is not None and world > 1 and rank is not None:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        if missing:
            out.append(
                Problem(
                    "error",
                    f"WORLD_SIZE={world} but {' and '.join(missing)} unset: the ranks cannot meet",
                    "launch with torchrun, or export MASTER_ADDR=<rank-0 host> MASTER_PORT=29500",
                )
            )
        if "LOCAL_RANK" not in env and "SLURM_LOCALID" not in env:
            out.append(
                Problem(
                    "warning",
                    "RANK/WORLD_SIZE are set but LOCAL_RANK is not: every process would use GPU 0",
                    "launch with torchrun or srun, which set LOCAL_RANK",
                )
            )
    local = _int(env.get("LOCAL_RANK"))
    if n_gpus and local is not None and local >= n_gpus:
        out.append(
            Problem(
                "error",
                f"LOCAL_RANK={local} but only {n_gpus} GPU(s) visible",
                f"start at most {n_gpus} processes per node (--nproc_per_node={n_gpus})",
            )
        )
    if n_gpus > 1 and rank is None and not _int(env.get("SLURM_NTASKS", "1")) > 1:
        out.append(
            Problem(
                "warning",
                f"{n_gpus} GPUs visible and no launcher: a plain single process would use GPU 0 only",
                f"`shardtrain train` relaunches itself with "
                f"{n_gpus} processes (--nproc auto); with your own script use "
                f"torchrun --nproc_per_node={n_gpus}",
            )
        )
    return out


def _data_hyperparameter(env: Mapping[str, str]) -> str | None:
    """The hyperparameter (SM_HPS) that names the job's data other than by the channels' jsonl layout."""
    try:
        hps = json.loads(env.get("SM_HPS") or "{}")
    except ValueError:
        return None
    keys = {k.replace("-", "_") for k in hps} if isinstance(hps, dict) else set()
    return next((k for k in ("train_file", "dataset_name", "train_dir") if k in keys), None)


def check_sagemaker(env: Mapping[str, str], n_gpus: int) -> list[Problem]:
    out = []
    channels = {k: v for k, v in env.items() if k.startswith("SM_CHANNEL_")}
    for name, path in sorted(channels.items()):
        if not os.path.isdir(path):
            out.append(Problem("error", f"{name}={path} is not a folder", "check the channel's S3 input"))
    train = env.get("SM_CHANNEL_TRAIN") or env.get("SM_CHANNEL_TRAINING")
    named = _data_hyperparameter(env)
    if named:  # the data is named by a hyperparameter (a csv, a dataset): the channels are not the jsonl layout
        train = None
    if train and os.path.isdir(train) and not os.path.isfile(os.path.join(train, "train.jsonl")):
        from shardtrain.data.records import other_forms

        out.append(
            Problem(
                "error",
                f"the train channel {train} has no train.jsonl{other_forms(Path(train), 'train')}",
                "upload train.jsonl (and its images) at the channel's S3 prefix, or name the data with a "
                "hyperparameter (train_file=/opt/ml/input/data/train/train.csv)",
            )
        )
    if (
        train
        and os.path.isdir(train)
        and not env.get("SM_CHANNEL_VALIDATION")
        and not os.path.isfile(os.path.join(train, "validation.jsonl"))
    ):
        out.append(
            Problem(
                "error",
                f"no validation data: no SM_CHANNEL_VALIDATION and no validation.jsonl in {train}",
                "add a 'validation' channel or put validation.jsonl beside train.jsonl",
            )
        )
    sm_gpus = _int(env.get("SM_NUM_GPUS"))
    if sm_gpus is not None and sm_gpus != n_gpus:
        out.append(
            Problem(
                "warning",
                f"SM_NUM_GPUS={sm_gpus} but torch sees {n_gpus} GPU(s)",
                "check CUDA_VISIBLE_DEVICES and that the image's torch is a CUDA build",
            )
        )
    try:
        hosts = json.loads(env.get("SM_HOSTS", "[]"))
    except json.JSONDecodeError:
        hosts = []
        out.append(
            Problem("error", f"SM_HOSTS is not a JSON list: {env['SM_HOSTS']!r}", "let the SageMaker toolkit set it")
        )
    if len(hosts) > 1 and "RANK" not in env:
        out.append(
            Problem(
                "error",
                f"{len(hosts)} SageMaker hosts and no launcher: each would train alone",
                f"start the job with {TORCHRUN_HINT}",
            )
        )
    return out


def check_threads(env: Mapping[str, str], cpus: int, procs_per_node: int, workers: int | None) -> list[Problem]:
    out = []
    per_proc = max(1, cpus // max(1, procs_per_node))
    omp = env.get("OMP_NUM_THREADS")
    if omp is None:
        out.append(
            Problem(
                "warning",
                "OMP_NUM_THREADS is unset: torchrun sets 1, the deepspeed launcher sets "
                "nothing (unset, a CPU run here was 1.8x slower)",
                f"export OMP_NUM_THREADS={per_proc} ({_count(cpus, 'CPU')} for {_count(procs_per_node, 'process')})",
            )
        )
    elif (_int(omp) or 0) * procs_per_node > cpus:
        out.append(
            Problem(
                "warning",
                f"OMP_NUM_THREADS={omp} x {_count(procs_per_node, 'process')} > "
                f"{_count(cpus, 'CPU')}: "
                f"threads fight for cores",
                f"export OMP_NUM_THREADS={per_proc}",
            )
        )
    if workers is not None and procs_per_node * (1 + workers) > cpus:
        fit = max(0, cpus // max(1, procs_per_node) - 1)
        out.append(
            Problem(
                "warning",
                f"{_count(workers, 'loader worker')} x {_count(procs_per_node, 'process')} "
                f"+ the processes themselves = {procs_per_node * (1 + workers)} > "
                f"{_count(cpus, 'CPU')}",
                f"--num-workers {fit}",
            )
        )
    return out


def check_nccl(env: Mapping[str, str], ifaces: list[str]) -> list[Problem]:
    out = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = env.get(var)
        if value and ifaces and not value.startswith("^") and not _iface_matches(value, ifaces):
            out.append(
                Problem(
                    "error",
                    f"{var}={value} matches no network interface here ({', '.join(ifaces)})",
                    f"unset {var} or name one of them",
                )
            )
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"):
        if env.get(var) == "1":
            out.append(
                Problem(
                    "warning", f"{var}=1 forces a slower transport", f"unset {var} unless it works around a known hang"
                )
            )
    if env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        out.append(
            Problem(
                "warning",
                f"NCCL_DEBUG={env['NCCL_DEBUG']} floods the log",
                "unset NCCL_DEBUG (or WARN) once the problem it was for is solved",
            )
        )
    return out


def check_ops(ops: dict) -> list[Problem]:
    out = []
    if not ops.get("cxx"):
        out.append(
            Problem(
                "warning",
                "no C++ compiler: DeepSpeed cannot JIT-build cpu_adam / fused_adam",
                'apt-get install g++ (or set "torch_adam": true in the DeepSpeed optimizer params)',
            )
        )
    if not ops.get("ninja"):
        out.append(Problem("warning", "ninja not found: DeepSpeed cannot JIT-build its ops", "pip install ninja"))
    for name, ok in ops.get("ops", {}).items():
        if not ok:
            out.append(
                Problem(
                    "warning",
                    f"DeepSpeed op {name} is not buildable here",
                    'use "torch_adam": true, or no optimizer offload',
                )
            )
    return out


def _iface_matches(value: str, ifaces: list[str]) -> bool:
    # NCCL's syntax: comma-separated prefixes, "=name" for an exact name.
    for item in value.split(","):
        item = item.strip()
        if item.startswith("="):
            if item[1:] in ifaces:
                return True
        elif any(name.startswith(item) for name in ifaces):
            return True
    return False


def _count(n: int, noun: str) -> str:
    """ "1 process", "2 processes", "1 CPU", "4 CPUs"."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{n} {noun}s"


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# ---- the report ----------------------------------------------------------------------------------
def diagnose(env: Mapping[str, str], workers: int | None = None) -> dict:
    gpu_list = gpus()
    ops = deepspeed_ops()
    procs = _int(env.get("LOCAL_WORLD_SIZE")) or _int(env.get("SLURM_NTASKS_PER_NODE")) or max(1, len(gpu_list))
    cpus = cpu_count()
    problems = (
        check_launcher(env, len(gpu_list))
        + check_sagemaker(env, len(gpu_list))
        + check_threads(env, cpus, procs, workers)
        + check_nccl(env, interfaces())
        + check_ops(ops)
    )
    pick = lambda names: {k: env[k] for k in names if k in env}  # noqa: E731
    return {
        "versions": versions(),
        "gpus": gpu_list,
        "deepspeed_ops": ops,
        "env": {
            "launcher": pick(LAUNCHER_VARS),
            "slurm": pick(SLURM_VARS),
            "sagemaker": {**pick(SAGEMAKER_VARS), **{k: v for k, v in env.items() if k.startswith("SM_CHANNEL_")}},
            "nccl": {k: v for k, v in env.items() if k.startswith("NCCL_")},
            "omp_num_threads": env.get("OMP_NUM_THREADS"),
        },
        "cpus": cpus,
        "processes_per_node": procs,
        "loader_workers": workers,
        "problems": [asdict(p) for p in problems],
        "ok": not any(p.level == "error" for p in problems),
    }


def render(report: dict) -> str:
    v = report["versions"]
    lines = ["versions: " + " | ".join(f"{k} {v[k] or '-'}" for k in v)]
    if report["gpus"]:
        for g in report["gpus"]:
            lines.append(
                f"gpu {g['index']}: {g['name']} | {g['memory_gb']} GiB | compute {g['compute_capability']} | "
                f"bf16 {'yes' if g['bf16'] else 'no (use fp16)'}"
            )
    else:
        lines.append("gpus: none visible (CPU training with gloo)")
    ops = report["deepspeed_ops"]
    lines.append(
        f"deepspeed ops: ninja {'yes' if ops['ninja'] else 'no'} | c++ {ops['cxx'] or 'no'} | "
        + " | ".join(f"{k} {'buildable' if ok else 'not buildable'}" for k, ok in ops["ops"].items())
    )
    for group, values in report["env"].items():
        if isinstance(values, dict):
            lines.append(f"{group}: " + (" ".join(f"{k}={val}" for k, val in values.items()) or "-"))
    lines.append(
        f"threads: OMP_NUM_THREADS={report['env']['omp_num_threads'] or 'unset'} | "
        f"{_count(report['cpus'], 'CPU')} | {_count(report['processes_per_node'], 'process')} per node"
        + (f" | {_count(report['loader_workers'], 'loader worker')}" if report["loader_workers"] is not None else "")
    )
    problems = [Problem(**p) for p in report["problems"]]
    lines += [p.line() for p in problems]
    errors = sum(p.level == "error" for p in problems)
    lines.append(
        f"{_count(errors, 'error')}, {_count(len(problems) - errors, 'warning')}" if problems else "no problems found"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--config", help="a training config: its loader workers are checked against the CPUs")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    workers = None
    if args.config:
        from shardtrain.config.settings import from_dict, load_yaml

        cfg = from_dict(load_yaml(args.config), source=f"--config {args.config}")
        # Unset: the default (data/loaders.py) fits the CPUs by its own rule, so there is nothing to check.
        workers = cfg.data.num_workers
    report = diagnose(os.environ, workers)
    print(json.dumps(report, indent=1) if args.json else render(report), flush=True)
    return 0 if report["ok"] else 1
