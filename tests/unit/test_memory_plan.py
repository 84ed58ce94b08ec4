"""shardtrain.memory.accounting counting rules and shardtrain.memory.planner arithmetic, in one process."""

from __future__ import annotations

import re

import pytest
import torch
from launch import REPO
from torch import nn

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.loop.oom import smaller_micro_batch
from shardtrain.memory.accounting import SavedActivations, count_bytes
from shardtrain.memory.planner import GIB, ModelCount, model_states, paper_formula, plan, resolve_gpu


def test_storages_are_counted_once_under_their_first_category():
    flat = torch.zeros(100)
    view_a, view_b = flat[:50], flat[50:]
    other = torch.zeros(10, dtype=torch.float64)
    out = count_bytes(
        [("params", view_a), ("grads", view_b), ("optimizer", other), ("grads", None)], torch.device("cpu")
    )
    assert out["params"] == 400 and out["grads"] == 0 and out["optimizer"] == 80
    assert out["model_state"] == 480 and out["device"] == 480


def test_saved_activations_exclude_weights_and_shrink_with_checkpointing():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(8, 64, requires_grad=True)
    with SavedActivations() as plain:
        block(x).sum()
    with SavedActivations() as ckpt:
        checkpoint(block, x, use_reentrant=False).sum()
    # x (8x64), the hidden pre-GELU and post-GELU (8x256 each): weights are parameters, not activations
    assert plain.bytes == 4 * (8 * 64 + 2 * 8 * 256)
    assert ckpt.bytes == 4 * 8 * 64  # only the checkpointed block's input stays


def test_a_forward_nothing_differentiates_counts_the_same_and_keeps_nothing():
    """The planner's measurement (backward=False) needs no backward: the same bytes as with the graph kept for
    one, checkpointed or not; and a saved output is freed with the outputs, where the graph's C++ cycle with
    its grad_fn keeps it until a backward."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(8, 64, requires_grad=True)
    for forward in (lambda: block(x).sum(), lambda: checkpoint(block, x, use_reentrant=False).sum()):
        with SavedActivations() as for_backward:
            forward()
        with SavedActivations(backward=False) as forward_only:
            forward()
        assert forward_only.bytes == for_backward.bytes > 0
    alive = {}
    for backward in (True, False):
        with SavedActivations(backward=backward) as saved:
            y = torch.exp(x)  # saves its own output
        ref = weakref.ref(y)
        del y
        gc.collect()
        alive[backward] = ref() is not None
        assert saved.bytes == 8 * 64 * 4
    assert alive == {True: True, False: False}


def test_smaller_micro_batch_keeps_the_global_batch_whole():
    assert [smaller_micro_batch(n) for n in (16, 6, 3, 2, 1)] == [8, 3, 1, 1, None]


def test_model_state_formulas():
    m = ModelCount(params=1_000_000, largest_unit=10_000, small_params=1_000, buffer_bytes=0, layers=2)
    psi, n = m.params, 4
    ddp = model_states("ddp", m, n, "fp32")["gpu"]
    assert ddp["params"] + ddp["grads"] + ddp["optimizer"] == 16 * psi
    fsdp = model_states("fsdp", m, n, "bf16")["gpu"]
    assert fsdp["params"] + fsdp["grads"] + fsdp["optimizer"] == 16 * psi / n
    z2 = model_states("zero2", m, n, "fp32")["gpu"]
    assert z2["params"] + z2["grads"] + z2["optimizer"] == 4 * psi + 16 * psi / n
    z2_fp16 = model_states("zero2", m, n, "fp16")["gpu"]
    assert z2_fp16["params"] == 2 * psi  # DeepSpeed fp16 keeps 16-bit weights; master is in the optimizer
    z3 = model_states("zero3", m, n, "fp32")
    assert z3["gpu"]["params"] + z3["gpu"]["grads"] + z3["gpu"]["optimizer"] == 20 * psi / n + 4 * m.small_params
    off = model_states("zero3_offload", m, n, "fp32")
    assert off["gpu"]["grads"] == off["gpu"]["optimizer"] == 0 and off["host"] == 24 * psi / n
    assert paper_formula("zero2", psi, n) == {
        "zero_paper": 2 * psi + 14 * psi / n,
        "deepspeed_estimator": 2 * psi + 18 * psi / n,
    }
    assert paper_formula("zero3", psi, n)["zero_paper"] == 16 * psi / n
    assert paper_formula("ddp", psi, n)["zero_paper"] == 16 * psi


def test_unknown_gpu_is_a_config_error():
    assert resolve_gpu("A100").memory_gib == 40 and not resolve_gpu("v100-16gb").bf16
    with pytest.raises(ConfigError, match="--gpu h300: unknown GPU; known: a100-40gb.*--memory-budget-gb"):
        resolve_gpu("h300")


def test_the_cloud_instances_cards_are_known_and_any_other_plans_with_its_memory_given(tmp_path, capsys):
    """SageMaker's g5 (A10G) and g6 (L4) cards were unknown, and `--gpu l4 --memory-budget-gb 22` was refused
    for the name before the budget was read."""
    from shardtrain.commands.plan import main

    assert (resolve_gpu("a10g").memory_gib, resolve_gpu("L4").memory_gib, resolve_gpu("t4").bf16) == (24, 24, False)
    config = str(REPO / "configs/multimodal_tiny.yaml")
    assert main(["--config", config, "--gpus", "2", "--gpu", "MI300X", "--memory-budget-gb", "22"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert " on 2 x MI300X (22 GiB), fp32, micro-batch 16" in first, first


def test_nothing_fits_gives_a_smaller_micro_batch_with_the_same_global_batch(tmp_path):
    cfg = parse_cli(
        [
            "--config",
            str(REPO / "configs/multimodal_tiny.yaml"),
            "--output-dir",
            str(tmp_path),
            "--max-length",
            "16",
            "--per-device-batch-size",
            "16",
            "--grad-accum",
            "1",
        ]
    )
    roomy = plan(cfg, 2, 1 * GIB, cuda=False)
    assert roomy["recommendation"]["variant"] == "ddp" and roomy["recommendation"]["micro_batch_size"] == 16
    assert len(roomy["rows"]) == 16  # 8 variants x checkpointing off/on
    # Below every model-state footprint at micro-batch 16 but above fsdp_offload's at a smaller batch.
    rows16 = {(r["variant"], r["activation_checkpointing"]): r["total_bytes"] for r in roomy["rows"]}
    budget = min(rows16.values()) * 0.99 / 0.95
    tight = plan(cfg, 2, budget, cuda=False)
    rec = tight["recommendation"]
    assert rec is not None and rec["micro_batch_size"] < 16
    assert rec["micro_batch_size"] * rec["grad_accum"] * 2 == tight["global_batch_size"] == 32
    assert "keeps global batch 32" in tight["note"]


def test_parameters_frozen_for_the_whole_run_get_no_grads_or_optimizer_state_in_the_prediction():
    from dataclasses import replace

    from shardtrain.config.settings import parse_cli
    from shardtrain.memory.planner import count_model

    m = ModelCount(params=1_000_000, largest_unit=10_000, small_params=1_000, buffer_bytes=0, layers=2)
    part, n = replace(m, frozen=750_000), 2
    for variant in ("ddp", "fsdp", "zero2", "zero3"):
        full, frozen = model_states(variant, m, n, "fp32")["gpu"], model_states(variant, part, n, "fp32")["gpu"]
        assert frozen["params"] == full["params"], variant
        assert frozen["grads"] == full["grads"] / 4 and frozen["optimizer"] == full["optimizer"] / 4, variant
    base = ["--config", "configs/multimodal_tiny.yaml", "--freeze-layers", "1"]
    held = count_model(parse_cli(base))
    assert 0 < held.frozen < held.params
    # unfrozen before the end: the run needs their state too, so they count in full
    assert count_model(parse_cli([*base, "--unfreeze-at-step", "5"])).frozen == 0


def _table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    return lines[first : first + 3]  # the header and the two rows


def test_plan_tables_widen_each_column_to_its_widest_cell():
    """Long names and big figures widen their column instead of running into the next one (both tables)."""
    from shardtrain.memory.planner import format_plan, format_workload_plan

    huge = 123_456.78 * GIB
    gpu = {
        "params": huge,
        "grads": 1.5 * GIB,
        "optimizer": huge,
        "activations": 2.25 * GIB,
        "comm": 0.0,
        "overhead": 0.5 * GIB,
    }
    row = {
        "variant": "zero3_offload_with_a_long_name",
        "activation_checkpointing": False,
        "gpu_bytes": gpu,
        "total_bytes": 3 * huge,
        "model_state_bytes": 2 * huge,
        "host_bytes_per_gpu": huge,
        "save_host_bytes_per_gpu": 1.5 * GIB,
        "headroom_bytes": -3 * huge,
        "fits": False,
        "fits_before_activations": False,
        "relative_cost": 2.926,
        "zero_paper": huge,
    }
    short = {**row, "variant": "ddp", "activation_checkpointing": True, "relative_cost": 1.0, "fits": True}
    del short["zero_paper"]
    common = {"model_params": 10**12, "gpus": 8, "capacity_bytes": 80 * GIB, "precision": "bf16", "rows": [row, short]}
    builtin = format_plan(
        {**common, "seq_len": 4096, "micro_batch_size": 8, "global_batch_size": 64, "recommendation": None, "note": ""},
        "A100 80GB",
    )
    workload = format_workload_plan(
        {**common, "workload": "Tiny", "largest_unit_params": 10**9, "activations": "not predicted"}, "A100 80GB"
    )
    for text, n_columns in ((builtin, 15), (workload, 13)):
        table = _table_lines(text)
        # Every cell is set off from its neighbours by at least two spaces, and right-aligned figures end
        # where their column does, so every line of the table is equally long.
        assert [len(re.split(r" {2,}", line)) for line in table] == [n_columns] * 3, "\n".join(table)
        assert len({len(line) for line in table}) == 1, "\n".join(table)
        assert "zero3_offload_with_a_long_name  " in table[1] and "123456.78" in table[1], table[1]
    # The cost column in two decimals, as every other figure: it read "1.0" above "2.926".
    costs = [re.split(r" {2,}", line)[-2] for line in _table_lines(builtin)[1:]]
    assert costs == ["2.93", "1.00"], costs


def test_the_activation_measurement_frees_its_models_without_a_full_collection(monkeypatch):
    """The banner's prediction builds six small models; a gc.collect() after each cost seconds of start-up.
    Reference counting alone must free them (no cycles keep a model or its saved tensors alive)."""
    import gc
    import weakref

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.memory import planner

    built = []

    def recording_build(*a, **kw):
        model = build_model(*a, **kw)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr("shardtrain.builtin_workloads.networks.build_model", recording_build)
    monkeypatch.setattr(gc, "collect", lambda *a: pytest.fail("a full garbage collection in the prediction"))
    for config in ("configs/longformer_tiny.yaml", "configs/multimodal_tiny.yaml"):
        cfg = parse_cli(["--config", str(REPO / config)])
        assert planner._saved_bytes(cfg, 32, recompute=False, precision="fp32") > 0
    assert len(built) == 2 and all(ref() is None for ref in built)


@pytest.mark.parametrize("config", ["configs/longformer_tiny.yaml", "configs/multimodal_tiny.yaml"])
def test_the_measurement_draws_no_random_weights_and_saves_what_random_weights_save(config, monkeypatch):
    """Drawing random weights for throwaway models was half of `plan`'s time (and of the banner's at every start);
    a forward saves what the shapes decide, so zero weights save the same bytes to the byte."""
    from shardtrain.builtin_workloads import memory_model, networks

    measure = memory_model.BuiltinMemoryModel(parse_cli(["--config", str(REPO / config)]))
    cases = [(1, False, "fp32", False), (2, True, "fp32", False), (2, False, "bf16", True)]
    draws = []
    for name in ("normal_", "uniform_"):
        own = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _own=own, **k: draws.append(t.shape) or _own(t, *a, **k))
    zeros = [measure.saved_bytes(layers, 32, rec, precision, 2, g16) for layers, rec, precision, g16 in cases]
    assert draws == []
    monkeypatch.undo()

    def randomly_initialised(cfg, vocab):
        return networks.build_model(cfg.model, cfg.data, vocab, load_weights=False)

    monkeypatch.setattr(memory_model, "_built_without_random_init", randomly_initialised)
    drawn = [measure.saved_bytes(layers, 32, rec, precision, 2, g16) for layers, rec, precision, g16 in cases]
    assert zeros == drawn and all(b > 0 for b in zeros)


def test_zero3_activations_are_measured_with_deepspeeds_linear():
    """zero.Init swaps DeepSpeed's linear in for torch's (mem_efficient_linear, on by default), and a ZeRO-3 run
    trains with it: it saves a non-contiguous input as it is, where torch's linear saves the contiguous copy it
    makes (Longformer transposes its hidden states). ZeRO-3's prediction measures with it; the others do not."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.memory.planner import activation_bytes, count_model, gpu_bytes

    cfg = parse_cli(["--config", str(REPO / "configs/longformer_tiny.yaml"), "--data-dir", "/nonexistent"])
    m = count_model(cfg)
    own = F.linear
    torch_linear, ds_linear = (
        activation_bytes(cfg, 4, 64, 0.0, "fp32", m.layers, ds_linear=ds)["saved"] for ds in (False, True)
    )
    assert ds_linear < 0.95 * torch_linear, (ds_linear, torch_linear)
    assert F.linear is own  # the measurement puts torch's back
    # The run's own forward under DeepSpeed's linear saves what the ZeRO-3 prediction says.
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data, cfg.data.tokenizer_vocab_size, load_weights=False).train()
    F.linear = zero3_linear_wrap
    try:
        with SavedActivations(backward=False) as saved:
            model(input_ids=torch.randint(3, 1000, (4, 64)), attention_mask=torch.ones(4, 64, dtype=torch.long))
    finally:
        F.linear = own
    assert abs(saved.bytes - ds_linear) / ds_linear < 0.02, (saved.bytes, ds_linear)
    at_max = {
        ds: activation_bytes(cfg, 4, cfg.data.max_length, 0.0, "fp32", m.layers, ds_linear=ds)["saved"]
        for ds in (False, True)
    }
    for variant in ("ddp", "fsdp", "zero2", "zero3", "zero3_offload"):
        g, _ = gpu_bytes(cfg, variant, m, 2, 4, "fp32", 0.0, False)
        assert g["activations"] == at_max[variant.startswith("zero3")], variant


def test_a_gpu_plan_measures_dropout_and_attention_as_cudas_kernels_save_them():
    """The planner measures on CPU, where dropout keeps its mask in the input's dtype and attention with dropout
    falls back to the math path (the L x L weights, their mask, fp32 copies of q, k, v). CUDA's fused kernels
    keep a bool mask, and q, k, v, the output and a row statistic. Measured with the CPU's kernels, the plan was
    10 to 33% over the step peaks of the H200 run (benchmarks/results/gpu_suite.json)."""
    import torch.nn.functional as F

    from shardtrain.memory.planner import _kernels_of, activation_bytes, count_model

    own = (F.dropout, F.scaled_dot_product_attention)
    x = torch.randn(64, 128, requires_grad=True)
    b, h, length, d = 2, 4, 32, 8
    q, k, v = (torch.randn(b, h, length, d, requires_grad=True) for _ in range(3))

    def drop():
        return F.dropout(x, 0.1, training=True)

    def attend():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    def saved(cuda: bool, op) -> int:
        with _kernels_of(cuda), SavedActivations(backward=False) as s:
            op()
        return s.bytes

    assert saved(False, drop) == 4 * x.numel() and saved(True, drop) == x.numel()  # an fp32 mask; a bool one
    q_k_v_out_and_row_statistic = 4 * (4 * b * h * length * d + b * h * length)
    assert saved(True, attend) == q_k_v_out_and_row_statistic
    assert saved(False, attend) >= q_k_v_out_and_row_statistic + 4 * 2 * b * h * length * length
    assert (F.dropout, F.scaled_dot_product_attention) == own  # put back
    # Through the planner, the tiny multimodal model (SDPA attention) with the shipped configs' dropout.
    cfg = parse_cli(
        ["--config", str(REPO / "configs/multimodal_tiny.yaml"), "--data-dir", "/nonexistent", "--dropout", "0.1"]
    )
    m = count_model(cfg)
    on_cpu, on_cuda = (activation_bytes(cfg, 4, 64, 0.0, "bf16", m.layers, cuda=c)["saved"] for c in (False, True))
    assert on_cuda < 0.95 * on_cpu, (on_cuda, on_cpu)  # 8% less here, where the images dominate


@pytest.mark.parametrize("config", ["multimodal_tiny", "longformer_tiny"])
def test_the_measurement_computes_no_product_of_zero_weights_and_saves_the_same_bytes(config, monkeypatch):
    """The built-ins' forward runs on zero weights, whose products are zeros: allocated, not computed (it was 22
    of the 42 s of CPU that `plan` took for the 4096-token Longformer), and dropout draws no mask. What is saved
    for backward is the same to the byte: the tiny models with the shipped configs' dropout, convolutions
    (ResNet), SDPA and sliding-window attention, each precision, with and without checkpointing, on either
    kernel set."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from shardtrain.builtin_workloads import memory_model
    from shardtrain.memory.planner import _saved_bytes

    aten = torch.ops.aten
    products = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution}

    class Computed(TorchDispatchMode):
        """What reaches the kernels: the mode under test sits inside this one and passes on what it computes."""

        zero_products, draws = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            operands = [a for a in args[:3] if isinstance(a, torch.Tensor) and a.dim() >= 2 and not a.is_meta]
            if func in products or func.overloadpacket in products:  # on meta tensors: a shape, not a product
                Computed.zero_products += any(not a.any() for a in operands)
            Computed.draws += func in (aten.bernoulli_.float, aten.native_dropout.default)
            return func(*args, **(kwargs or {}))

    config_file = str(REPO / f"configs/{config}.yaml")
    cfg = parse_cli(["--config", config_file, "--data-dir", "/nonexistent", "--dropout", "0.1"])
    cases = [(p, r, c) for p in ("fp32", "bf16") for r in (False, True) for c in (False, True)]
    with Computed():
        shortcut = {case: _saved_bytes(cfg, 64, case[1], case[0], cuda=case[2]) for case in cases}
    assert Computed.zero_products == 0 and Computed.draws == 0, (Computed.zero_products, Computed.draws)
    monkeypatch.setattr(memory_model, "_ShapesOnly", contextlib.nullcontext)
    computed = {case: _saved_bytes(cfg, 64, case[1], case[0], cuda=case[2]) for case in cases}
    assert shortcut == computed


def test_a_token_budget_fits_the_shortest_texts_too_or_is_not_offered(tmp_path):
    """The multimodal configs' plan offered a budget checked from 16-token texts up (--max-tokens-per-batch 11968
    for the report's config on 3 x A100 40GB), and 8-token posts then made micro-batches of 1,496 samples: 68 GiB
    by the plan's own table. The budget now fits down to one-token texts. Here (the tiny config in 0.2 GiB) it
    holds fewer full-length texts than the recommended micro-batch, as the images cost the same at any text
    length, so none is offered."""
    from shardtrain.memory.planner import HEADROOM, budget_lengths, count_model, format_plan, gpu_bytes

    cfg = parse_cli(["--config", str(REPO / "configs/multimodal_tiny.yaml"), "--output-dir", str(tmp_path)])
    capacity = 0.2 * GIB
    p = plan(cfg, 2, capacity, cuda=False)
    rec, budget = p["recommendation"], p["max_tokens_per_batch"]
    assert budget_lengths(cfg)[0] == 1 and budget_lengths(cfg)[-1] == cfg.data.max_length
    m = count_model(cfg)

    def total(length):
        g, _ = gpu_bytes(cfg, rec["variant"], m, 2, budget // length, "fp32", 0.0, False, seq_len=length)
        return sum(g.values())

    assert rec["checkpointed_blocks"] == 0
    assert all(total(length) <= capacity * (1 - HEADROOM) for length in (1, 2, 3, 5, 8, 16, 32, 64))
    assert budget // cfg.data.max_length < rec["micro_batch_size"]
    text = format_plan(p, "test gpu")
    assert "token budget: none suits: one that fits 1-token texts too holds" in text, text
    assert "--max-tokens-per-batch" not in text


def test_plan_proposes_the_largest_token_budget_that_fits_at_every_text_length(tmp_path):
    """--max-tokens-per-batch N from the per-token activation model: N // L texts of length L fit for every L up
    to max_length, and one window more does not at some L. The budget holds at least the recommended
    micro-batch of max_length texts (that fits by the recommendation itself)."""
    from shardtrain.memory.planner import HEADROOM, budget_lengths, count_model, format_plan, gpu_bytes

    cfg = parse_cli(["--config", str(REPO / "configs/longformer_tiny.yaml"), "--output-dir", str(tmp_path),
                     "--max-length", "1024", "--per-device-batch-size", "2"])  # fmt: skip
    capacity = 0.25 * GIB
    p = plan(cfg, 2, capacity, cuda=False)
    rec, budget, window = p["recommendation"], p["max_tokens_per_batch"], cfg.model.attention_window
    assert rec is not None and budget % window == 0 and budget >= rec["micro_batch_size"] * 1024
    assert budget_lengths(cfg) == list(range(window, 1024 + 1, window))
    m = count_model(cfg)
    share = rec["checkpointed_blocks"] / m.blocks

    def total(tokens, length):
        g, _ = gpu_bytes(cfg, rec["variant"], m, 2, tokens // length, "fp32", share, False, seq_len=length)
        return sum(g.values())

    limit = capacity * (1 - HEADROOM)
    assert all(total(budget, L) <= limit for L in budget_lengths(cfg) if budget // L)
    assert any(total(budget + window, L) > limit for L in budget_lengths(cfg))
    text = format_plan(p, "test gpu")
    assert f"--max-tokens-per-batch {budget} fits" in text
    # The budget as given: it read "(0 GiB)" and "(0.21 GiB of 0)", a recommendation over its own budget.
    assert "test gpu (0.25 GiB)" in text and " GiB of 0.25)" in text, text


def test_a_plan_without_a_memory_limit_proposes_no_token_budget(tmp_path):
    """capacity=inf (benchmarks/gpu_suite.py's whole-row prediction): every budget fits, so there is none to
    propose, and the search must end."""
    cfg = parse_cli(["--config", str(REPO / "configs/longformer_tiny.yaml"), "--output-dir", str(tmp_path)])
    p = plan(cfg, 1, float("inf"), cuda=False)
    assert p["recommendation"] is not None and p["max_tokens_per_batch"] is None
