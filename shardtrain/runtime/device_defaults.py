"""Per-process settings that depend on the device a run trains on: CUDA's fast fp32 math (TF32, cuDNN
autotuning) unless --deterministic, DeepSpeed's accelerator, and each rank's share of the CPUs."""

from __future__ import annotations

import os


def cuda_math(device_type: str, deterministic: bool) -> dict:
    """On CUDA: TF32 matmuls and convolutions, and cuDNN autotuning (cudnn.benchmark), unless `deterministic`,
    which turns both off and asks cuDNN for deterministic kernels. TF32 keeps fp32's range with a 10-bit
    mantissa: ~3x the fp32 matmul rate on A100/H100 (V100 has no TF32 and ignores it). What is on goes into the
    banner and summary.json (`cuda_math`); {} on CPU, where none of it applies."""
    if device_type != "cuda":
        return {}
    import torch

    fast = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = fast
    torch.backends.cudnn.allow_tf32 = fast
    torch.set_float32_matmul_precision("high" if fast else "highest")
    torch.backends.cudnn.benchmark = fast
    torch.backends.cudnn.deterministic = deterministic
    return {"tf32": fast, "cudnn_benchmark": fast, "deterministic": deterministic}


def deepspeed_accelerator(device_type: str, env=os.environ) -> str | None:
    """Point DeepSpeed at the device this run trains on, before it is imported (it reads DS_ACCELERATOR once).
    A CPU run sets cpu where nothing is set (DeepSpeed would pick CUDA wherever a GPU is visible); a CUDA run
    with DS_ACCELERATOR=cpu inherited from a shell or a Makefile would run DeepSpeed's CPU ops beside NCCL:
    it trains on cuda, and the returned line says so."""
    if device_type == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
        return None
    if device_type == "cuda" and env.get("DS_ACCELERATOR") == "cpu":
        env["DS_ACCELERATOR"] = "cuda"
        return (
            "DS_ACCELERATOR=cpu is set in the environment but this run trains on CUDA: DeepSpeed uses its cuda "
            "accelerator instead; unset DS_ACCELERATOR (or use --device cpu for a CPU run)"
        )
    return None


def allotted_cpus() -> int:
    """The CPUs this process may run on (a Slurm task's or a container's share), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(nproc: int, cpus: int | None = None) -> int:
    """OMP_NUM_THREADS for each of `nproc` processes sharing `cpus`: an equal share, at least 1. CPU Adam
    (the *_offload configs) and CPU training run on these threads; 1 each leaves the rest of the allotment idle."""
    return max(1, (cpus if cpus is not None else allotted_cpus()) // max(1, nproc))
