"""The per-rank memory monitor counts every kind of state tensor a run can hold."""

from __future__ import annotations

import torch

from shardtrain.memory.accounting import count_bytes


def test_torchaos_8bit_optimizer_state_is_counted_by_its_codes_and_scales():
    # --optim adamw_8bit's moments are a wrapper subclass with no storage of its own: reading one crashed the
    # first step's monitor on CUDA ("invalid python storage", the GPU suite's optim_adamw_8bit_ddp case).
    from torchao.optim.subclass_8bit import OptimState8bit

    exp_avg = OptimState8bit.zeros((64, 256), signed=True, block_size=256, device="cpu")
    exp_avg_sq = OptimState8bit.zeros((64, 256), signed=False, block_size=256, device="cpu")
    counted = count_bytes([("optimizer", exp_avg), ("optimizer", exp_avg_sq)], torch.device("cpu"))
    parts = [t for s in (exp_avg, exp_avg_sq) for t in (s.codes, s.scale, s.qmap)]
    inner = {t.untyped_storage().data_ptr(): t.nbytes for t in parts}
    assert counted["optimizer"] == sum(inner.values())
    assert counted["optimizer"] >= 2 * 64 * 256  # one byte per element for each moment, plus scales
    assert counted["model_state"] == counted["optimizer"]


def test_the_end_tables_plan_rows_say_they_are_at_the_measured_batch():
    """The banner plans at full length (16 x 64 tokens on the tiny config) and each `plan r` row under the end-of-run
    table at the batch that rank measured (16 x 20): a row that said only "(at 16 x 20 tokens)" read as a second,
    different prediction for the same run."""
    from shardtrain.memory.accounting import MIB, format_table

    measured = {"0": {"params": 10 * MIB, "activations": 7 * MIB}}
    predicted = {"0": {"params_gib": 10 / 1024, "activations_gib": 7.1 / 1024, "batch": "16 x 20 tokens"}}
    plan_row = format_table(measured, 2, predicted).splitlines()[-1]
    assert plan_row.startswith("plan 0") and "7.10" in plan_row, plan_row
    assert plan_row.endswith("(the plan at the measured 16 x 20 tokens; the banner's was at full length)"), plan_row
