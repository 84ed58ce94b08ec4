"""The idle-GPU guard's verdict on synthetic rank tables (the CUDA cases cannot run on this CPU machine),
and the one-line errors around device selection."""

from __future__ import annotations

import pytest
import torch

from shardtrain.config.settings import ConfigError
from shardtrain.runtime.gpu_guard import check_devices, check_rank_table


def row(rank, host="h1", local_rank=None, device=None, visible=4, uuid=""):
    local_rank = rank if local_rank is None else local_rank
    return {
        "rank": rank,
        "host": host,
        "local_rank": local_rank,
        "device": device if device is not None else f"cuda:{local_rank}",
        "device_uuid": uuid,
        "device_name": "V100",
        "visible_gpus": visible,
    }


def test_four_visible_world_one_warns_with_the_launch_line():
    v = check_rank_table([row(0)])
    assert v.error is None
    assert len(v.warnings) == 1
    w = v.warnings[0]
    assert "only 1 of 4 visible GPUs" in w and "3 sit idle" in w
    assert "--nproc auto" in w and "torchrun --nproc_per_node=4" in w
    assert "ModelTrainer(distributed=Torchrun()) (SDK v2: distribution=" in w


def test_one_process_per_gpu_is_clean():
    v = check_rank_table([row(r) for r in range(4)])
    assert v.error is None and v.warnings == []


def test_two_ranks_on_one_gpu_is_an_error_naming_them():
    v = check_rank_table([row(0, local_rank=0), row(1, local_rank=0), row(2, local_rank=1), row(3, local_rank=2)])
    assert v.error is not None and "\n" not in v.error
    assert "ranks 0, 1 on h1 all use cuda:0" in v.error and "LOCAL_RANK" in v.error
    # cuda:3 is idle on top of the clash
    assert any("only 3 of 4" in w for w in v.warnings)


def test_gpus_pinned_by_cuda_visible_devices_are_told_apart_by_uuid():
    # srun-style binding: each rank sees one GPU, which it calls cuda:0
    table = [row(r, local_rank=0, visible=1, uuid=f"GPU-{r}") for r in range(4)]
    v = check_rank_table(table)
    assert v.error is None and v.warnings == []


def test_same_device_name_on_different_hosts_is_fine_and_hosts_are_checked_separately():
    table = [row(0, "a", 0, visible=2), row(1, "a", 1, visible=2), row(2, "b", 0, visible=4), row(3, "b", 1, visible=4)]
    v = check_rank_table(table)
    assert v.error is None
    assert len(v.warnings) == 1 and v.warnings[0].startswith("b: only 2 of 4")


def test_cpu_training_with_gpus_visible_warns_and_without_gpus_is_silent():
    assert "drop --device cpu" in check_rank_table([row(0, device="cpu", visible=2)]).warnings[0]
    assert check_rank_table([row(0, device="cpu", visible=0), row(1, device="cpu", visible=0)]).warnings == []


def test_check_devices_raises_one_line_and_only_rank0_warns():
    with pytest.raises(ConfigError, match="all use cuda:0"):
        check_devices([row(0, local_rank=0), row(1, local_rank=0)], True, print)
    said = []
    check_devices([row(0)], False, said.append)
    assert said == []
    check_devices([row(0)], True, said.append)
    assert len(said) == 1 and "idle" in said[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_requested_without_gpu_is_one_line():
    from shardtrain.runtime.distributed import resolve_device_type

    with pytest.raises(ConfigError) as e:
        resolve_device_type("cuda")
    assert "\n" not in str(e.value) and "--device cpu" in str(e.value)
    assert resolve_device_type("auto") == "cpu"  # gloo, never nccl, on a CPU machine


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    from shardtrain.runtime import distributed

    # Pretend 2 GPUs; the check fires before any CUDA or process-group call.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for k, v in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        distributed.init_distributed("cuda")
    assert "local rank 3 has no GPU: 2 visible" in str(e.value) and "--nproc_per_node=2" in str(e.value)


def test_world_size_without_rank_is_an_error_not_a_hang(monkeypatch):
    from shardtrain.runtime.distributed import adopt_launcher_env

    for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="WORLD_SIZE=4 is set but RANK is not"):
        adopt_launcher_env()


def test_nodes_that_share_a_hostname_are_told_apart_by_their_node():
    # One container image everywhere: both nodes call themselves trainhost, each rank uses its node's cuda:0.
    table = [{**row(r, "trainhost", 0, visible=2), "node": str(r)} for r in range(2)]
    v = check_rank_table(table)
    assert v.error is None
    assert [w.split(":")[0] for w in v.warnings] == ["trainhost (node 0)", "trainhost (node 1)"]
    assert all("only 1 of 2 visible GPUs are used" in w for w in v.warnings)
    # Two ranks of one node on one GPU are still a clash.
    clash = [{**row(r, "trainhost", 0, visible=2), "node": "0"} for r in range(2)]
    assert "ranks 0, 1 on trainhost all use cuda:0" in check_rank_table(clash).error
