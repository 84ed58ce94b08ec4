"""The CUDA-only paths, checked on this CPU machine. Where CUDA is needed it is faked:
torch's FakeTensorMode makes tensors that say device cuda:0 without a GPU (so a collective's input device can be
checked), and torch.cuda.is_available / device_count, the process group and the NCCL backend name are mocked.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from launch import REPO, free_port, test_env
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardtrain.config.settings import ConfigError
from shardtrain.runtime import distributed

CUDA0 = torch.device("cuda", 0)


class FakeNccl:
    """A 2-rank NCCL group as the helpers see it: collectives record their tensor's device and refuse a CPU
    tensor the way NCCL does ('Tensors must be CUDA and dense')."""

    def __init__(self, monkeypatch):
        self.devices: list[str] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        for name in ("all_reduce", "broadcast"):
            monkeypatch.setattr(dist, name, self._collective)

    def _collective(self, t, *args, **kwargs):
        self.devices.append(str(t.device))
        if t.device.type != "cuda":
            raise ValueError("Tensors must be CUDA and dense")


# ---- 1. FSDP CPU offload: buffers on the compute device -------------------------------------------------------
class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("position_ids", torch.arange(4), persistent=False)  # RoBERTa's kind


def test_offload_materialises_parameters_on_cpu_and_buffers_on_the_compute_device():
    from shardtrain.strategies.fsdp import materialise

    # The meta device stands in for cuda:N here (FakeTensorMode refuses to_empty's parameter swap): any device
    # but the CPU shows where each tensor went.
    compute = torch.device("meta")
    with torch.device("meta"):
        model = WithBuffers()
    materialise(model, compute, cpu_offload=True)
    assert {str(p.device) for p in model.parameters()} == {"cpu"}
    assert {n: str(b.device) for n, b in model.named_buffers()} == {
        "position_ids": "meta",
        "norm.running_mean": "meta",
        "norm.running_var": "meta",
        "norm.num_batches_tracked": "meta",
    }
    with torch.device("meta"):
        model = WithBuffers()
    materialise(model, compute, cpu_offload=False)  # no offload: everything on the compute device
    assert {str(t.device) for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# One process, world size 1 (a process group is global state): FSDP2 setup with the shipped offload policy and
# with the default policy at bf16, on a model with BatchNorm and a non-persistent buffer.
FSDP_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from torch import nn
from shardtrain.config.settings import Config, replace_fields
from shardtrain.runtime.distributed import DistInfo
from shardtrain.strategies import fsdp
from shardtrain.workloads.base import Workload

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("position_ids", torch.arange(8), persistent=False)
    def forward(self, x):
        return self.norm(self.lin(x)) + self.position_ids.float() * 0

class Blocks(Workload):
    def build_model(self):
        return nn.Sequential(Block(), Block(), nn.Linear(8, 3))
    def block_classes(self):
        return (Block,)

placed = []
real = fsdp.materialise
def spy(model, device, cpu_offload):
    placed.append([str(device), cpu_offload])
    return real(model, device, cpu_offload)
fsdp.materialise = spy

out = {}
for name, policy, precision in (("offload", "fsdp_policies/offload.yaml", "fp32"),
                                ("default_bf16", "fsdp_policies/default.yaml", "bf16")):
    cfg = Config()
    cfg = replace_fields(cfg, fsdp_policy=policy, precision=precision, warmup_steps=0)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    s = fsdp.FSDPStrategy(cfg, info, Blocks(cfg))
    def build(on_meta=False, load_weights=True):
        torch.manual_seed(0)
        if on_meta:
            with torch.device("meta"):
                return Blocks(cfg).build_model()
        return Blocks(cfg).build_model()
    s.setup(build, set())
    s.train()
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, key=key: [seen.setdefault(key, str(m.weight.dtype)), None][1])
             for key, m in (("linear_weight", s.model.get_submodule("0.lin")),
                                                  ("batchnorm_weight", s.model.get_submodule("0.norm")))]
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with s.micro_step(is_last=True):
        loss = nn.functional.cross_entropy(s.model({"input": x}).float(), y)  # the batch, as the loop passes it
        s.backward(loss)
    s.step(grad_norm=float(s.grad_norm_share().sqrt()))
    s.eval()  # sync_buffers
    out[name] = {"describe": s.describe(), "in_forward": seen,
                 "buffers": sorted({str(b.device) for b in s.model.buffers()}),
                 "bn_steps": int(s.model.get_submodule("0.norm").num_batches_tracked)}
out["placed"] = placed
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def fsdp_runs():
    proc = subprocess.run(
        [sys.executable, "-c", FSDP_SCRIPT, str(free_port())],
        cwd=REPO,
        env=test_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def test_fsdp_setup_places_offloaded_buffers_through_materialise(fsdp_runs):
    # setup hands materialise the strategy's compute device (cuda:N on a GPU) and the policy's offload flag
    assert fsdp_runs["placed"] == [["cpu", True], ["cpu", False]]
    off = fsdp_runs["offload"]
    assert off["describe"]["offload"] is True and off["buffers"] == ["cpu"] and off["bn_steps"] == 1


# ---- 2. collectives move their tensors to the group's device ------------------------------------------------
def test_all_reduce_sum_moves_a_cpu_tensor_to_the_nccl_device(monkeypatch):
    from shardtrain.runtime import distributed

    nccl = FakeNccl(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # examples/causal_lm's metric_sums returns CPU tensors; evaluate() sums them with this helper
        out = distributed.all_reduce_sum(torch.tensor([3.0, 4.0], dtype=torch.float64), CUDA0)
        assert out.device == CUDA0
        buf = torch.zeros(3)  # a CPU buffer (BatchNorm statistics under FSDP offload, before item 1)
        assert distributed.broadcast_(buf, src=0) is buf and buf.device.type == "cpu"
    assert nccl.devices == ["cuda:0", "cuda:0"]


def test_gloo_collectives_keep_cpu_tensors(monkeypatch):
    from shardtrain.runtime import distributed

    nccl = FakeNccl(monkeypatch)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: nccl.devices.append(str(t.device)))
    assert distributed.all_reduce_sum([1.0], torch.device("cpu")).tolist() == [1.0]
    assert nccl.devices == ["cpu"]


# ---- 3. one visible GPU per process ---------------------------------------------------------------------------
def _launcher_env(monkeypatch, rank: int, world: int):
    for k, v in {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(k, v)


def test_a_rank_that_sees_one_gpu_uses_it_whatever_its_local_rank(monkeypatch):
    from shardtrain.runtime import distributed

    # srun --gpus-per-task=1 / --gpu-bind: rank 2 of 3 on the node sees exactly one GPU, its own
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen, started = [], []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: started.append(kw))
    _launcher_env(monkeypatch, 2, 3)
    info = distributed.init_distributed("cuda")
    assert chosen == [0] and info.device == CUDA0 and info.backend == "nccl" and info.local_rank == 2
    assert started[0]["backend"] == "nccl" and started[0]["device_id"] == CUDA0


def test_several_visible_gpus_still_need_one_per_local_rank(monkeypatch):
    from shardtrain.runtime import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.local_cuda_index(1) == 1
    with pytest.raises(ConfigError, match="local rank 2 has no GPU: 2 visible"):
        distributed.local_cuda_index(2)


# ---- 4. the --async-save gloo group checks the host's address under NCCL too ------------------------------------
def test_the_checkpoint_gloo_group_refuses_a_loopback_hostname_under_nccl(monkeypatch):
    from shardtrain.strategies.base import checkpoint_group

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    made = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "group")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")  # Debian's /etc/hosts
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 of 4 ranks here: the job spans nodes
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME"):
        checkpoint_group()
    assert made == []
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    # the main group's --dist-timeout, whatever an earlier test in this process left there
    monkeypatch.setattr(distributed, "_pg_timeout_s", 42.0)
    assert checkpoint_group() == "group"
    assert made == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=42)}]


# ---- 5. DS_ACCELERATOR only where a CPU run is meant -----------------------------------------------------------
def test_ds_accelerator_follows_the_run_device():
    from shardtrain.runtime.device_defaults import deepspeed_accelerator

    env = {}
    assert deepspeed_accelerator("cpu", env) is None and env == {"DS_ACCELERATOR": "cpu"}
    env = {"DS_ACCELERATOR": "cpu"}  # inherited from `make` or a shell
    line = deepspeed_accelerator("cuda", env)
    assert env == {"DS_ACCELERATOR": "cuda"} and "\n" not in line and "DS_ACCELERATOR=cpu" in line
    env = {}
    assert deepspeed_accelerator("cuda", env) is None and env == {}  # DeepSpeed detects CUDA itself


def test_the_makefile_sets_ds_accelerator_only_for_its_cpu_targets():
    text = (REPO / "Makefile").read_text()
    assert "\nexport DS_ACCELERATOR" not in text  # not for every recipe (a GPU `make bench` would inherit it)
    assert "test test-unit test-dist demo: export DS_ACCELERATOR ?= cpu" in text


def test_the_gpu_suite_does_not_pass_a_cpu_accelerator_to_gpu_cases(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    env = gpu_suite.child_env(dry=False, base={"DS_ACCELERATOR": "cpu", "PATH": "/bin"})
    assert "DS_ACCELERATOR" not in env and "DS_ACCELERATOR=cpu" in capsys.readouterr().out
    assert gpu_suite.child_env(dry=True, base={})["DS_ACCELERATOR"] == "cpu"


# ---- 6. TF32 and cudnn.benchmark on CUDA, one switch off, shown in the banner -------------------------------------
@pytest.fixture
def restore_math():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.get_float32_matmul_precision(),
    )
    yield
    (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    ) = saved[:4]
    torch.set_float32_matmul_precision(saved[4])


def test_cuda_runs_default_to_tf32_and_cudnn_autotuning_and_deterministic_turns_them_off(restore_math):
    from shardtrain.config.settings import parse_cli
    from shardtrain.observability.banner import format_banner
    from shardtrain.runtime.device_defaults import cuda_math

    assert parse_cli([]).train.deterministic is False
    assert parse_cli(["--deterministic", "true"]).train.deterministic is True
    assert cuda_math("cpu", False) == {}
    on = cuda_math("cuda", parse_cli([]).train.deterministic)
    assert on == {"tf32": True, "cudnn_benchmark": True, "deterministic": False}
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "high"
    off = cuda_math("cuda", True)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.benchmark
    assert torch.backends.cudnn.deterministic and torch.get_float32_matmul_precision() == "highest"

    info = {
        "strategy": "ddp",
        "world_size": 1,
        "precision": "fp32",
        "activation_checkpointing": False,
        "params_total": 1,
        "params_trainable": 1,
        "params_frozen": 0,
        "micro_batch_size": 1,
        "grad_accum": 1,
        "global_batch_size": 1,
        "train_examples": 1,
        "eval_examples": 1,
        "steps_per_epoch": 1,
    }
    assert "cuda math   TF32 matmuls, cudnn.benchmark on (--deterministic true turns them off)" in format_banner(
        {**info, "cuda_math": on}
    )
    assert "cuda math   TF32 and cudnn.benchmark off (--deterministic: deterministic cuDNN)" in format_banner(
        {**info, "cuda_math": off}
    )
    assert "cuda math" not in format_banner({**info, "cuda_math": {}})


def test_train_sets_the_cuda_math_before_building_anything():
    text = (REPO / "shardtrain" / "loop" / "train.py").read_text()
    # Trainer.__init__ starts the processes (_start_processes) before it makes the strategy ...
    assert text.index("        self._start_processes(cfg)\n") < text.index("strategy = make_strategy(")
    # ... and _start_processes sets the CUDA math right after the process group, before it returns.
    start = text[text.index("    def _start_processes(") :]
    start = start[: start.index("\n    def ", 1)]
    init = start.index("dist_info = init_distributed(")
    assert init < start.index("self.cuda_math = cuda_math(dist_info.device.type, cfg.train.deterministic)")
    assert "self.cuda_math,\n" in text  # into describe_run: the banner and summary.json `run`


# ---- 7. each rank its share of the CPUs ----------------------------------------------------------------------
def test_the_local_launcher_gives_each_rank_its_share_of_the_cpus(monkeypatch):
    from shardtrain.runtime import launch

    seen = []
    monkeypatch.setattr(launch, "run_forwarding_signals", lambda cmd, env: seen.append(env["OMP_NUM_THREADS"]) or 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    launch.launch_local(4, ["x.py"], shown="x.py")
    launch.launch_local(32, ["x.py"], shown="x.py")  # more processes than CPUs: still 1 each
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's own wins
    launch.launch_local(4, ["x.py"], shown="x.py")
    assert seen == ["4", "1", "3"]


def srun_train(tmp_path, fakes: dict[str, str], env: dict) -> subprocess.CompletedProcess:
    """slurm/srun_train.sh's shardtrain_srun, under the sbatch scripts' `set -euo pipefail`, with `fakes` (name:
    script body) first on PATH for srun, scontrol and the python of its checks before srun (tests/dist/test_slurm.py
    runs the real ones)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in fakes.items():
        (fake / name).write_text(f"#!/bin/bash\n{body}\n")
        (fake / name).chmod(0o755)
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {REPO}/slurm/srun_train.sh && shardtrain_srun"],
        env={"PATH": f"{fake}:/usr/bin:/bin", "CONFIG": str(config), "SLURM_NNODES": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_srun_train_gives_each_task_its_cpus_per_task(tmp_path):
    fakes = {
        "srun": 'echo "OMP=$OMP_NUM_THREADS ARGS=$*"',
        "scontrol": "echo node1",
        "python": 'echo "CHECK NTASKS=$SLURM_NTASKS ARGS=$*"',
    }
    run = srun_train(tmp_path, fakes, {"SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "20", "SLURM_JOB_ID": "7"})
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("OMP=")]
    assert line.startswith("OMP=5 ") and "--cpus-per-task=5" in line
    (check,) = [x for x in run.stdout.splitlines() if x.startswith("CHECK ")]
    assert check.startswith("CHECK NTASKS=4 ARGS=-u shardtrain/main.py ") and check.endswith(" --check-only")


@pytest.mark.parametrize("nodelist, first", [("gpu01", "gpu01"), ("gpu[07-09,12],cpu3", "gpu07"), ("a,b", "a")])
def test_srun_train_without_a_working_scontrol_takes_the_first_host_of_the_nodelist(tmp_path, nodelist, first):
    """A site where the job cannot run scontrol (a container, no slurm.conf): under the sbatch scripts' `set -euo
    pipefail` the failed `$(scontrol show hostnames ...)` ended the job with exit 1 and no line, before the
    fallback to SLURM_JOB_NODELIST that follows it."""
    fakes = {
        "srun": 'echo "SRUN MASTER_ADDR=$MASTER_ADDR"',
        "scontrol": 'echo "scontrol: error: resolve_ctls_from_dns_srv" >&2; exit 1',
        "python": "exit 0",
    }
    env = {"SLURM_GPUS_ON_NODE": "3", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodelist}
    run = srun_train(tmp_path, fakes, env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SRUN MASTER_ADDR={first}\n" in run.stdout, run.stdout + run.stderr


# ---- 8. FSDP under bf16: 16-bit all-gathers, fp32 reduce-scatters, fp32 BatchNorm -------------------------------
def test_the_shipped_fsdp_policies_gather_in_16_bits_and_reduce_in_fp32():
    from shardtrain.strategies.fsdp import mixed_precision_policy, wire_dtypes
    from shardtrain.strategies.fsdp_policy import load_policy

    for path in sorted((REPO / "fsdp_policies").glob("*.yaml")):
        policy = load_policy(str(path))
        for precision, low in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            mp = mixed_precision_policy(policy, precision)
            assert mp is not None, path.name
            assert (mp.param_dtype, mp.reduce_dtype) == (low, torch.float32), path.name
        assert mixed_precision_policy(policy, "fp32") is None
    off = load_policy(str(REPO / "fsdp_policies/default.yaml"))
    off.mixed_precision = False
    assert mixed_precision_policy(off, "bf16") is None
    assert wire_dtypes(off, "bf16")["why_fp32_params"] == "the policy's mixed_precision is false"


def test_the_planner_prices_fsdp_gathers_at_the_wire_dtype():
    from shardtrain.memory.planner import ModelCount, gathers_16bit, model_states

    m = ModelCount(params=1_000_000, largest_unit=10_000, small_params=1_000, buffer_bytes=0, layers=2)
    assert model_states("fsdp", m, 4, "bf16")["gpu"]["overhead"] == 2 * 2 * m.largest_unit  # 16-bit gathers
    assert model_states("fsdp", m, 4, "fp32")["gpu"]["overhead"] == 2 * 4 * m.largest_unit
    assert model_states("fsdp", m, 4, "bf16", gathered_16bit=False)["gpu"]["overhead"] == 2 * 4 * m.largest_unit
    assert gathers_16bit("fsdp", "bf16", str(REPO / "fsdp_policies/default.yaml"))
    assert not gathers_16bit("ddp", "bf16") and not gathers_16bit("fsdp", "fp32")


def test_fsdp_bf16_gathers_linear_weights_in_bf16_and_keeps_batchnorm_fp32(fsdp_runs):
    run = fsdp_runs["default_bf16"]
    assert run["in_forward"] == {"linear_weight": "torch.bfloat16", "batchnorm_weight": "torch.float32"}
    d = run["describe"]
    assert (d["mixed_precision_params"], d["param_dtype"], d["reduce_dtype"]) == (True, "bf16", "fp32")


# ---- 9. parity's tolerance by precision and device --------------------------------------------------------------
def test_parity_tolerance_follows_precision_and_device(tmp_path, monkeypatch):
    from shardtrain.commands.parity import TOLERANCES, default_tolerances, run_settings, runs_settings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  precision: bf16\n")
    assert run_settings(str(config), []) == ("bf16", "cpu")
    assert run_settings(str(config), ["--precision", "fp32", "--device", "cuda"]) == ("fp32", "cuda")
    assert run_settings(None, ["--device", "cuda", "--deterministic", "true"]) == ("fp32", "cuda-deterministic")
    assert default_tolerances("fp32", "cpu") == (1e-4, 1e-3)  # the CPU-measured default, unchanged
    assert default_tolerances("bf16", "cuda") == TOLERANCES[("bf16", "cuda")]
    # looser where the arithmetic is: TF32 and 16-bit formats
    assert default_tolerances("fp32", "cuda")[0] > default_tolerances("fp32", "cuda-deterministic")[0] > 1e-4
    assert default_tolerances("bf16", "cuda")[0] > default_tolerances("fp16", "cuda")[0] > 1e-4
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"precision": "fp16", "ranks": [{"device": "cuda:0"}]}))
    assert runs_settings(f"{run},{run}") == ("fp16", "cuda")


def test_parity_says_which_tolerance_it_uses(tmp_path, capsys):
    from test_reports import config, write_run

    from shardtrain import cli

    # bf16 runs on CPU 5e-3 apart: within bf16's tolerance, outside fp32's
    a = write_run(tmp_path / "ddp", config(**{"train.precision": "bf16"}), losses=[1.0, 0.9])
    b = write_run(tmp_path / "fsdp", config(**{"train.precision": "bf16"}), losses=[1.0, 0.9 * (1 + 5e-3)])
    assert cli.main(["parity", "--runs", f"{a},{b}"]) == 0
    out = capsys.readouterr().out
    assert "parity: tolerances for bf16 on cpu: loss 0.02, grad norm 0.05 (relative)" in out, out
    assert cli.main(["parity", "--runs", f"{a},{b}", "--tolerance", "1e-4"]) == 1


# ---- 10-11. the GPU suite: preflight, the hard stop, the result under the caller's --out ------------------------
def _gpu_suite():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return gpu_suite


def test_the_gpu_suite_preflight_names_the_missing_package_and_still_writes_the_json(tmp_path, monkeypatch, capsys):
    suite = _gpu_suite()
    monkeypatch.setattr(suite, "PREFLIGHT", ("torch", "no_such_package_shardtrain"))
    out = tmp_path / "OUT" / "gpu_suite.json"
    assert suite.main(["--dry-run", "--work", str(tmp_path / "w"), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "preflight: cannot import no_such_package_shardtrain (ModuleNotFoundError" in err and "\n" == err[-1]
    result = json.loads(out.read_text())
    assert "no_such_package_shardtrain" in result["preflight_error"] and result["complete"] is False
    assert {r["status"] for r in result["cases"]} == {"pending"}  # nothing ran, nothing is lost either


def test_the_gpu_suite_has_no_duplicate_case_and_runs_never_run_paths_first():
    suite = _gpu_suite()
    keys = [(str(c[2]), tuple(c[3])) for c in suite.CASES]
    assert len(set(keys)) == len(keys), "two cases run the same config and flags"
    groups = list(dict.fromkeys(c[1] for c in suite.CASES))  # in order of first appearance
    assert groups[:4] == ["fp16", "oom", "offload", "compile"]
    flags = [f for c in suite.CASES for f in c[3]]
    assert "--compile" in flags and "fp16" in flags and "fsdp_policies/offload.yaml" in " ".join(flags)


def test_the_gpu_suite_shell_keeps_its_hard_stop_above_budget_plus_the_longest_case(tmp_path):
    fake = tmp_path / "py"
    fake.write_text('#!/bin/bash\necho "PY $*"\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PY": str(fake)}
    for args, stop in (([], 300 + 240 + 30), (["--budget-s", "100", "--case-timeout-s=50"], 180)):
        run = subprocess.run(
            ["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), "--out", "o.json", "--work", "w", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr
        assert f"hard stop {stop} s" in run.stdout, run.stdout
        (line,) = [x for x in run.stdout.splitlines() if x.startswith("PY ")]
        assert "benchmarks/gpu_suite.py" in line and "--out o.json --work w" in line


def test_parity_runs_start_where_parity_was_started(tmp_path, monkeypatch):
    """They started in the checkout: a config's relative data_dir was looked for there (`folder not found:
    data/multimodal ... read from the working directory, <the checkout>`), and a relative --out was written there
    while parity read it here."""
    from pathlib import Path

    from shardtrain.commands import parity

    started = []

    def record(cmd, **kw):
        started.append((kw.get("cwd"), cmd[cmd.index("--output-dir") + 1]))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(parity.subprocess, "run", record)
    monkeypatch.chdir(tmp_path)
    args = parity.argparse.Namespace(config=str(REPO / "configs/multimodal_tiny.yaml"), nproc=2, steps=2)
    assert parity.run_one("ddp", args, [], [], Path("out")) == Path("out/ddp")
    ((cwd, output_dir),) = started
    assert cwd in (None, str(tmp_path)) and output_dir == "out/ddp"


def test_parity_says_when_runs_parted_after_agreeing_for_many_steps(tmp_path, capsys):
    """A trial compared two healthy 20-step runs of the shipped tiny config (ddp, fsdp): DIVERGED at step 13, and
    nothing said that the 12 steps before agreed to 1e-7, the mark of summation-order noise, not of a bug."""
    from test_reports import config, write_run

    from shardtrain import cli

    agreed = [1.0 - 0.05 * i for i in range(12)]
    a = write_run(tmp_path / "ddp", config(), losses=[*agreed, 0.3, 0.25])
    b = write_run(tmp_path / "fsdp", config(), losses=[*(x * (1 + 1e-7) for x in agreed), 0.3 * 1.01, 0.25 * 1.02])
    assert cli.main(["parity", "--runs", f"{a},{b}"]) == 1
    out = capsys.readouterr().out
    assert "parity: DIVERGED at step 13: " in out
    assert "parity: note: the first 5 steps agreed within 1.0e-07 (loss) and 0.0e+00 (grad norm)" in out, out
    # Apart from the first steps: no such note.
    c = write_run(tmp_path / "wrong", config(), losses=[x * 1.01 for x in [*agreed, 0.3, 0.25]])
    assert cli.main(["parity", "--runs", f"{a},{c}"]) == 1
    assert "parity: note: the first" not in capsys.readouterr().out
