"""The strategy matrix in one torchrun launch (tests/dist/matrix_driver.py calls the same parse_cli() ->
train() as shardtrain/main.py, once per configuration, in one process group of 2 CPU ranks):

- every strategy x both tiny workloads x activation checkpointing off (10 steps) and on (3 steps);
- parity: fp32, dropout 0, same seed and data -> step-1 grad norm within 1e-5 relative, per-step losses within
  1e-4 (text-only Longformer) / 1e-2 (multimodal with BatchNorm) relative, against DDP;
- accumulation: micro 4 x accum 2 == micro 8 x accum 1 on every strategy;
- freezing under DDP, FSDP and ZeRO-3: frozen weights bit-identical until unfreeze_at_step, changed after;
- bf16 on every strategy (BatchNorm weights stay fp32 while its inputs are bf16), fp16 where CPU allows it;
- `shardtrain predict` from a DDP, an FSDP and a ZeRO-3 checkpoint of these runs reproduces their final eval.

Each strategy also runs once through shardtrain/main.py itself: tests/dist/test_entry_points.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch import REPO, cli, predicted_metrics, run_plan, strategy_variants, tiny_args

# The one strategy-name -> flags map (shardtrain parity's); the matrix leaves FSDP offload to test_memory.
STRATEGIES = {name: flags for name, flags in strategy_variants().items() if name != "fsdp_offload"}
WORKLOADS = ("longformer", "multimodal")
LOSS_RTOL = {"longformer": 1e-4, "multimodal": 1e-2}
GRAD_NORM_RTOL = 1e-5
PARITY_STEPS, AC_STEPS, ACCUM_STEPS = 10, 3, 5
FREEZE_AT, FREEZE_STEPS = 3, 6
FREEZE_STRATEGIES = ("ddp", "fsdp", "zero3")
PREDICTED_LONGFORMER = "longformer/fsdp/fp32"  # the one Longformer run that keeps its final checkpoint
NATIVE = ("ddp", "fsdp")  # torch GradScaler / ShardedGradScaler: fp16 on CPU is theirs to try


def _plan(data_dirs: dict, root: Path) -> list[dict]:
    plan = []

    def add(name, workload, strategy, *extra, **opts):
        out = root / name.replace("/", "_")
        # The final checkpoint (a DCP or DeepSpeed save, ~0.5 s) on the multimodal model, whose BatchNorm buffers
        # make its save the harder one (every strategy x precision x checkpointing save still runs once), and on
        # the Longformer run that the predict test below reads; the freeze runs' come from --save-every.
        no_save = ["--save-final", "false"] if workload == "longformer" and name != PREDICTED_LONGFORMER else []
        args = tiny_args(
            workload,
            data_dirs[workload],
            out,
            *STRATEGIES[strategy],
            "--report",
            "false",
            "--predict-memory",
            "false",
            "--max-eval-samples",
            "16",
            "--log-every",
            "100",
            *no_save,
            *extra,
        )
        plan.append({"name": name, "args": args, **opts})

    for workload in WORKLOADS:
        for strategy in STRATEGIES:
            add(f"{workload}/{strategy}/fp32", workload, strategy, "--max-steps", str(PARITY_STEPS))
            add(
                f"{workload}/{strategy}/ac",
                workload,
                strategy,
                "--max-steps",
                str(AC_STEPS),
                "--activation-checkpointing",
            )
    for strategy in STRATEGIES:  # longformer_tiny's micro-batch is 8; BatchNorm would see different batches
        add(
            f"longformer/{strategy}/accum",
            "longformer",
            strategy,
            "--max-steps",
            str(ACCUM_STEPS),
            "--per-device-batch-size",
            "4",
            "--grad-accum",
            "2",
        )
    for strategy in FREEZE_STRATEGIES:
        add(
            f"multimodal/{strategy}/freeze",
            "multimodal",
            strategy,
            "--max-steps",
            str(FREEZE_STEPS),
            "--freeze-layers",
            "1",
            "--unfreeze-at-step",
            str(FREEZE_AT),
            "--save-every",
            str(FREEZE_AT),
            "--keep-last",
            "5",
            weights=True,
        )
    for strategy in STRATEGIES:
        add(f"multimodal/{strategy}/bf16", "multimodal", strategy, "--max-steps", "2", "--precision", "bf16")
    # The shipped policies gather 16-bit parameters under bf16/fp16 (mixed_precision: true); this one keeps the
    # autocast-only path (fp32 gathers) a policy can still choose.
    fp32_gathers = root / "fsdp_fp32_gathers.yaml"
    fp32_gathers.write_text(
        (REPO / "fsdp_policies/default.yaml").read_text().replace("mixed_precision: true", "mixed_precision: false")
    )
    add(
        "multimodal/fsdp_fp32_gathers/bf16",
        "multimodal",
        "fsdp",
        "--max-steps",
        "2",
        "--precision",
        "bf16",
        "--fsdp-policy",
        str(fp32_gathers),
    )
    for workload in WORKLOADS:
        for strategy in NATIVE:
            add(f"{workload}/{strategy}/fp16", workload, strategy, "--max-steps", "2", "--precision", "fp16")
    # A probe, last: DeepSpeed's fp16 engine on the CPU accelerator (recorded, not required to work).
    add("longformer/zero2/fp16", "longformer", "zero2", "--max-steps", "2", "--precision", "fp16", expect_error=True)
    return plan


@pytest.fixture(scope="module")
def matrix(data_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("matrix")
    plan = _plan(data_dirs, root)
    run, results = run_plan(plan, root, timeout=1500, tail=80)
    for p in plan:
        if p.get("expect_error"):
            r = results[p["name"]]
            print(f"\nprobe {p['name']}: " + ("trains: losses " + str(r["losses"]) if r["ok"] else r["error"]))
    print(
        f"\nmatrix: {len(plan)} configurations in one launch, "
        f"{sum(r['seconds'] for r in results.values()):.0f}s of train() calls"
    )
    return results


def applied_rates(workload: str, steps: int) -> list[float]:
    """The learning rate of each of a tiny config's first `steps` steps, from its schedule."""
    import dataclasses

    from shardtrain.config.settings import from_dict, load_yaml
    from shardtrain.strategies.optim import lr_lambda

    t = from_dict(load_yaml(REPO / "configs" / f"{workload}_tiny.yaml")).train
    t = dataclasses.replace(t, max_steps=steps)
    return [t.lr * lr_lambda(t)(s) for s in range(steps)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_every_strategy_workload_and_checkpointing_mode_trains(matrix):
    for workload in WORKLOADS:
        for strategy in STRATEGIES:
            for arm, steps in (("fp32", PARITY_STEPS), ("ac", AC_STEPS)):
                r = matrix[f"{workload}/{strategy}/{arm}"]
                assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"]), (
                    workload,
                    strategy,
                    arm,
                )
                assert r["eval"]["n_examples"] == 16
                # Each step logs the rate it applied (it logged the next one: step 1 showed warmup's second rate,
                # and the last step 0.0).
                assert r["lrs"] == pytest.approx(applied_rates(workload, steps), rel=1e-6), (workload, strategy, arm)
                # checkpointing really wrapped blocks, and only when asked
                assert (r["describe"]["recompute_blocks"] > 0) == (arm == "ac"), r["describe"]
    assert matrix["multimodal/fsdp_sgo/fp32"]["describe"]["sharding"] == "SHARD_GRAD_OP"
    assert matrix["multimodal/fsdp/fp32"]["describe"]["sharding"] == "FULL_SHARD"
    for name in ("zero2_offload", "zero3_offload"):
        assert matrix[f"longformer/{name}/fp32"]["describe"]["offload"] is True
    # DeepSpeed's autotuner imports the MLflow client (~1 s of CPU per rank) where
    # shardtrain/strategies/deepspeed_import.py does not keep it out; no run here reports to MLflow.
    assert not [name for name, r in matrix.items() if r["mlflow_imported"]]


def test_every_run_leaves_the_process_as_it_found_it(matrix):
    """A later run in the same process trains as in a process of its own: ZeRO-3's zero.Init swaps DeepSpeed's
    linear in for torch.nn.functional.linear "unless manually reset", and the run gives torch's back at its end
    (before, an FSDP run after a ZeRO-3 one trained with DeepSpeed's and moved in the 8th digit by step 5)."""
    assert [name for name, r in matrix.items() if r["ok"] and not r["torch_linear_after"]] == []
    assert {"longformer/zero3/fp32", "multimodal/zero3_offload/ac"} <= set(matrix)


def parity_table(matrix) -> dict:
    """max relative deviation from DDP (fp32, checkpointing off) per workload and run."""
    table = {}
    for workload in WORKLOADS:
        ref = matrix[f"{workload}/ddp/fp32"]
        for strategy in STRATEGIES:
            for arm in ("fp32", "ac"):
                r = matrix[f"{workload}/{strategy}/{arm}"]
                n = len(r["losses"])
                table[(workload, strategy, arm)] = (
                    rel(r["grad_norms"][0], ref["grad_norms"][0]),
                    max(rel(a, b) for a, b in zip(r["losses"], ref["losses"][:n])),
                )
    return table


def test_parity_across_strategies(matrix):
    table = parity_table(matrix)
    print(
        "\nparity against ddp (fp32, dropout 0, same seed/data): workload strategy arm | "
        "step-1 grad-norm rel | max per-step loss rel"
    )
    for (workload, strategy, arm), (g, loss) in table.items():
        print(f"  {workload:<10} {strategy:<14} {arm:<4} | {g:.2e} | {loss:.2e}")
    for workload in WORKLOADS:
        rows = {k: v for k, v in table.items() if k[0] == workload}
        print(
            f"max {workload}: grad-norm {max(g for g, _ in rows.values()):.2e}, "
            f"loss {max(loss for _, loss in rows.values()):.2e}"
        )
    bad = {k: v for k, v in table.items() if v[0] > GRAD_NORM_RTOL or v[1] > LOSS_RTOL[k[0]]}
    assert not bad, f"beyond tolerance (grad norm {GRAD_NORM_RTOL}, loss {LOSS_RTOL}): {bad}"


def test_accumulation_matches_a_bigger_micro_batch(matrix):
    worst = (0.0, 0.0)
    for strategy in STRATEGIES:
        accum, whole = matrix[f"longformer/{strategy}/accum"], matrix[f"longformer/{strategy}/fp32"]
        assert accum["describe"]["grad_accum"] == 2 and accum["describe"]["global_batch_size"] == 16
        g = max(rel(a, b) for a, b in zip(accum["grad_norms"], whole["grad_norms"][:ACCUM_STEPS]))
        loss = max(rel(a, b) for a, b in zip(accum["losses"], whole["losses"][:ACCUM_STEPS]))
        worst = (max(worst[0], g), max(worst[1], loss))
        assert rel(accum["grad_norms"][0], whole["grad_norms"][0]) <= GRAD_NORM_RTOL, (
            strategy,
            accum["grad_norms"],
            whole["grad_norms"],
        )
        # Later grad norms follow weights that Adam moved from slightly different sums: the loss tolerance.
        assert g <= LOSS_RTOL["longformer"] and loss <= LOSS_RTOL["longformer"], (strategy, g, loss)
    print(f"\naccumulation 4x2 vs 8x1, max rel over {ACCUM_STEPS} steps: grad norm {worst[0]:.2e}, loss {worst[1]:.2e}")


@pytest.mark.parametrize("strategy", FREEZE_STRATEGIES)
def test_frozen_layers_stay_bit_identical_until_unfrozen(matrix, strategy):
    import torch
    from safetensors.torch import load_file

    r = matrix[f"multimodal/{strategy}/freeze"]
    w = r["weights"]
    init = load_file(w["init"])
    frozen = set(w["frozen"])
    assert any(n.startswith("text.") for n in frozen) and any(n.startswith("image.") for n in frozen)
    trainable = set(init) - frozen
    assert r["describe"]["params_frozen"] == sum(init[n].numel() for n in frozen)
    at_unfreeze, end = (load_file(w["steps"][str(s)]) for s in (FREEZE_AT, FREEZE_STEPS))
    assert set(at_unfreeze) == set(init) == set(end)
    moved = sorted(n for n in frozen if not torch.equal(at_unfreeze[n], init[n]))
    assert not moved, f"{strategy}: frozen parameters changed before step {FREEZE_AT}: {moved[:5]}"
    still = sorted(n for n in trainable if torch.equal(at_unfreeze[n], init[n]))
    assert not still, f"{strategy}: trainable parameters did not train before step {FREEZE_AT}: {still[:5]}"
    stuck = sorted(n for n in frozen if torch.equal(end[n], at_unfreeze[n]))
    assert not stuck, f"{strategy}: parameters still frozen after unfreeze_at_step {FREEZE_AT}: {stuck[:5]}"


def test_bf16_on_every_strategy_keeps_batchnorm_fp32(matrix):
    for name in [f"multimodal/{s}/bf16" for s in STRATEGIES] + ["multimodal/fsdp_fp32_gathers/bf16"]:
        r = matrix[name]
        assert r["describe"]["precision"] == "bf16"
        assert all(math.isfinite(x) for x in r["losses"]) and r["skipped_steps"] == 0, (name, r["losses"])
        assert r["bn_modules"] > 0 and r["bn_weight_dtypes"] == ["float32"], (name, r["bn_weight_dtypes"])
        if name.split("/")[1] in ("fsdp", "fsdp_sgo"):
            # The shipped policies' 16-bit gathers: the BatchNorms share one FSDP unit (one per norm made FSDP's
            # step 3.5x DDP's on an H200) whose fp32 policy casts their inputs up as well.
            assert r["describe"]["param_dtype"] == "bf16" and r["describe"]["reduce_dtype"] == "fp32", r["describe"]
            assert r["describe"]["norm_units"] == 1 and r["describe"]["units"] > 1, r["describe"]
            assert r["bn_input_dtypes"] == ["float32"], (name, r["bn_input_dtypes"])
        else:
            # autocast is really on around the CNN: its convolutions hand BatchNorm bf16 activations
            assert "bfloat16" in r["bn_input_dtypes"], (name, r["bn_input_dtypes"])


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("strategy", NATIVE)
def test_fp16_with_grad_scaler_on_cpu(matrix, strategy, workload):
    r = matrix[f"{workload}/{strategy}/fp16"]
    assert r["describe"]["precision"] == "fp16"
    assert all(math.isfinite(x) for x in r["losses"]), r["losses"]
    if workload == "multimodal":
        # FSDP's 16-bit gathers hand BatchNorm's own fp32 unit fp32 inputs; DDP's autocast hands it fp16
        want = ["float32"] if strategy == "fsdp" else None
        assert r["bn_weight_dtypes"] == ["float32"], r["bn_weight_dtypes"]
        assert r["bn_input_dtypes"] == want if want else "float16" in r["bn_input_dtypes"], r["bn_input_dtypes"]
    if strategy == "fsdp":
        assert r["describe"]["param_dtype"] == "fp16" and r["describe"]["reduce_dtype"] == "fp32", r["describe"]


def _run_dir(result: dict) -> str:
    return result["args"][result["args"].index("--output-dir") + 1]


@pytest.mark.parametrize(
    "name, flags",
    [
        ("multimodal/ddp/fp32", ["--top-k", "2"]),
        (PREDICTED_LONGFORMER, []),
        ("multimodal/zero3/fp32", ["--nproc", "2", "--batch-size", "3"]),
    ],
)
def test_predict_from_each_strategy_reproduces_the_runs_final_eval(matrix, name, flags, tmp_path):
    """predict RUN on the run's validation split: the same metrics as the run's own final evaluation (summary.json
    `eval`), from any strategy's checkpoint; with --nproc 2 every example once, in input order."""
    preds = tmp_path / "preds.jsonl"
    run = cli(["predict", _run_dir(matrix[name]), "--output", str(preds), *flags])
    assert predicted_metrics(run) == pytest.approx(matrix[name]["eval"], rel=1e-9, abs=1e-12), run.tail()
    lines = [json.loads(x) for x in preds.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(16)), [x["index"] for x in lines]
    # `row`: the row of validation.jsonl each line came from, from 0, as `predict --file` numbers them
    assert [x["row"] for x in lines] == list(range(16)), [x["row"] for x in lines]
    k = 2 if "--top-k" in flags else 3  # 3 classes: the default --top-k 5 gives all of them
    for x in lines:
        # Each line ties back to its source row (and the id column where the data has one).
        assert {"index", "row", "label", "probs", "true_label"} <= set(x) <= {
            "index",
            "row",
            "id",
            "label",
            "probs",
            "true_label",
        } and len(x["probs"]) == k, x
        assert x["label"] == next(iter(x["probs"])) and x["label"] in ("0", "1", "2"), x
        assert list(x["probs"].values()) == sorted(x["probs"].values(), reverse=True), x
    accuracy = sum(x["label"] == x["true_label"] for x in lines) / len(lines)
    assert accuracy == pytest.approx(matrix[name]["eval"]["accuracy"])
    assert not [p.name for p in tmp_path.iterdir() if p.name != "preds.jsonl"]  # no temporary left behind
