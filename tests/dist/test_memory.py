"""Memory accounting (shardtrain.memory.accounting) against the planner's prediction (shardtrain.memory.planner),
every strategy; --oom-recovery and --strategy auto. 2 CPU ranks, ONE launch (tests/dist/matrix_driver.py runs each
configuration through parse_cli -> train).

The planner predicts from the config alone (meta-device count, activations measured at batch 1 on a 1- and
2-layer copy); the run measures by walking the tensors each rank holds. They must agree within 10%.

The shipped tiny configs (configs/*_tiny.yaml) at fp32 and bf16, as configured, under FSDP (the demo's
strategy) with the startup prediction on: the banner's prediction (for max_length) must hold where the batches
are that long, and the end-of-run prediction at each rank's measured [micro-batch, tokens] everywhere (the
docs/memory.md's "within 4%"); `shardtrain plan` must print the same figures as the banner.

OOM: rank 0 raises a real torch.OutOfMemoryError (--inject-oom-above 8) at micro-batch 16; the run must
finish at micro-batch 8 x accum 2 with the same global batch and the same losses and gradient norms (fp32,
1e-5) as a run started at micro-batch 8 x accum 2. At micro-batch 1 it must give up with a clear message.
Auto: two --memory-budget-gb values lead to two different choices, each recorded in summary.json.

--activation-checkpointing auto: a 4-layer Longformer with a --memory-budget-gb that the planner's prediction
fits with 2 of its 4 blocks checkpointed (computed here, for each strategy), and every-2; each run checkpoints
the planner's blocks, says so in the banner, measures the activations it predicted (within 10%), and trains as a
run without checkpointing does (fp32, dropout 0: the matrix's parity tolerances).
"""

from __future__ import annotations

import json

import launch
import pytest
from launch import REPO, strategy_variants, tiny_args, torchrun

DRIVER = REPO / "tests" / "dist" / "matrix_driver.py"
VARIANTS = strategy_variants()
# Every text truncated to the same length, so every rank's activations have the planner's shape.
COMMON = [
    "--max-steps",
    "2",
    "--max-length",
    "16",
    "--max-eval-samples",
    "8",
    "--report",
    "false",
    "--log-every",
    "100",
]
TOLERANCE = 0.10
OOM_STRATEGIES = ("ddp", "fsdp", "zero2")
OOM_COMMON = [
    "--max-steps",
    "2",
    "--max-length",
    "16",
    "--max-eval-samples",
    "8",
    "--report",
    "false",
    "--log-every",
    "100",
]
BUDGETS = {"roomy": "1.0", "tight": "0.06"}  # GiB per rank; the tiny model needs ~0.08 under DDP
DOCS_CLAIM = 0.04
# A 4-layer tiny Longformer, so that "some of the blocks" has more than one answer.
AC_TEXT = '{"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "intermediate_size": 64}'
AC_COMMON = ["--text-config", AC_TEXT, *OOM_COMMON[:2], "--predict-memory", "true", *OOM_COMMON[4:]]
AC_AUTO = ("ddp", "fsdp", "zero3")
AC_WANTED = 2  # of 4 blocks
LOSS_RTOL, GRAD_NORM_RTOL = 1e-4, 1e-5  # tests/dist/test_matrix.py's, for the text-only Longformer
# (workload, precision, extra flags): the configs as shipped, and the multimodal one at --max-length 16, where
# every text is cut to 16 tokens and so every batch has the banner's shape (the synthetic texts are ~20 tokens,
# under its max_length 64; the Longformer data's batches reach its 256).
TINY = (
    [("multimodal", p, ()) for p in ("fp32", "bf16")]
    + [("longformer", p, ()) for p in ("fp32", "bf16")]
    + [("multimodal", p, ("--max-length", "16")) for p in ("fp32", "bf16")]
)


def tiny_name(workload: str, precision: str, extra: tuple) -> str:
    return f"tiny-{workload}-{precision}" + ("-full" if extra else "")


def ac_budget(args: list[str], blocks: int) -> float:
    """A --memory-budget-gb under which the planner's predicted peak fits with `blocks` checkpointed blocks and
    not with one fewer: halfway between the two predictions, before the planner's headroom."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.memory.planner import GIB, HEADROOM, count_model, gpu_bytes, variant_of

    cfg = parse_cli(args)
    m, variant = count_model(cfg), variant_of(cfg)
    assert m.blocks == 4, m

    def peak(k):
        return sum(gpu_bytes(cfg, variant, m, 2, 8, "fp32", k / m.blocks, False)[0].values())

    return (peak(blocks - 1) + peak(blocks)) / 2 / (1 - HEADROOM) / GIB


@pytest.fixture(scope="module")
def launched(mm_data, ld_data, tmp_path_factory):
    """ONE launch for every memory, OOM and auto configuration (imports and process-group start paid once)."""
    root = tmp_path_factory.mktemp("memory")
    plan = []

    def add(name, *flags, workload="multimodal", **opts):
        data = {"multimodal": mm_data, "longformer": ld_data}[workload]
        # No final checkpoint: nothing here reads one, and each costs a DCP or DeepSpeed write. FSDP offload keeps
        # its own: no other test saves one.
        no_save = [] if name == "fsdp_offload" else ["--save-final", "false"]
        plan.append({"name": name, "args": tiny_args(workload, data, root / name, *no_save, *flags), **opts})

    def add_ac_auto(v):
        budget = ac_budget(tiny_args("longformer", ld_data, root, *VARIANTS[v], *AC_COMMON), AC_WANTED)
        flags = ("--activation-checkpointing", "auto", "--memory-budget-gb", repr(budget))
        add(f"ac-auto-{v}", *VARIANTS[v], *AC_COMMON, *flags, workload="longformer")

    # First, as in a fresh process: after every strategy's run in this process (DeepSpeed's included), the
    # banner's bf16 measurement came out 1% off the same measurement in a fresh process.
    for workload, precision, extra in TINY:
        add(
            tiny_name(workload, precision, extra),
            "--strategy",
            "fsdp",
            "--precision",
            precision,
            "--max-steps",
            "2",
            "--max-eval-samples",
            "8",
            "--log-every",
            "100",
            "--predict-memory",
            "true",
            *extra,
            workload=workload,
        )
    # Before any ZeRO-3 run: zero.Init swaps DeepSpeed's linear in for torch's for the rest of the process
    # (shardtrain/memory/planner.py), and ac_budget plans ddp and fsdp in this process, with torch's.
    add("ac-none", *VARIANTS["ddp"], *AC_COMMON, workload="longformer")
    for v in AC_AUTO:
        if v != "zero3":
            add_ac_auto(v)
    add("ac-every-2", *VARIANTS["zero2"], *AC_COMMON, "--activation-checkpointing", "every-2", workload="longformer")
    for v, flags in VARIANTS.items():
        add(v, *flags, *COMMON)
    add_ac_auto("zero3")  # after the variants' ZeRO-3 runs (above)
    for s in OOM_STRATEGIES:
        add(f"oom-{s}", *VARIANTS[s], *OOM_COMMON, "--per-device-batch-size", "16", "--inject-oom-above", "8")
        add(f"ref-{s}", *VARIANTS[s], *OOM_COMMON, "--per-device-batch-size", "8", "--grad-accum", "2")
    for name, gb in BUDGETS.items():
        add(f"auto-{name}", "--strategy", "auto", "--memory-budget-gb", gb, *OOM_COMMON)
    # Last: it ends in an error (every rank raises the same one, after the step's all-reduce). 64 px images:
    # at micro-batch 1 the ResNet's BatchNorm needs more than one value per channel.
    add(
        "oom-gives-up",
        *VARIANTS["ddp"],
        *OOM_COMMON,
        "--image-size",
        "64",
        "--per-device-batch-size",
        "2",
        "--inject-oom-above",
        "0",
        expect_error=True,
    )
    (root / "plan.json").write_text(json.dumps(plan))
    run = torchrun([str(root / "plan.json"), str(root)], script=DRIVER, timeout=600, env=launch.test_env(), check=False)
    assert run.returncode == 0, run.tail(80)
    results = json.loads((root / "results.json").read_text())
    summaries = {
        p["name"]: json.loads((root / p["name"] / "summary.json").read_text())
        for p in plan
        if (root / p["name"] / "summary.json").exists()
    }
    return {
        "plan": {p["name"]: p["args"] for p in plan},
        "results": results,
        "summaries": summaries,
        "output": run.output,
    }


@pytest.fixture(scope="module")
def runs(launched) -> dict:
    return {v: (launched["plan"][v], launched["summaries"][v]) for v in VARIANTS}


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def test_measured_memory_matches_the_plan_for_every_strategy(runs):
    from shardtrain.config.settings import parse_cli
    from shardtrain.memory.planner import activation_bytes, count_model, model_states

    table = {}
    for variant, (args, summary) in runs.items():
        cfg = parse_cli(args)
        m = count_model(cfg)
        assert rel(m.params, summary["params_total"]) < 0.01, (m.params, summary["params_total"])
        pred = model_states(variant, m, 2, "fp32")
        # CPU ranks: "offloaded" state lives in the same RAM as the rest, so compare all of it.
        pred_state = pred["gpu"]["params"] + pred["gpu"]["grads"] + pred["gpu"]["optimizer"] + pred["host"]
        pred_act = activation_bytes(cfg, 16, 16, False, "fp32", m.layers)["saved"]
        per_rank = summary["memory"]["per_rank"]
        assert summary["memory"]["step"] == 2 and set(per_rank) == {"0", "1"}
        for rank, rec in per_rank.items():
            table[(variant, rank)] = (rec["model_state"], pred_state, rec["activations"], pred_act)
            assert rel(rec["model_state"], pred_state) < TOLERANCE, (variant, rank, rec, pred_state)
            assert rel(rec["activations"], pred_act) < TOLERANCE, (variant, rank, rec["activations"], pred_act)
            assert rec["comm"] == pred["gpu"]["comm"], (variant, rank, rec["comm"], pred["gpu"]["comm"])
    print("\nvariant/rank: measured vs predicted model state, activations (bytes)")
    for key, v in table.items():
        print(key, v)


def test_banner_and_plan_predict_the_tiny_configs_within_the_readme_claim(launched):
    """Parameters exactly (the trained tokenizer's vocabulary), model state, saved activations and their sum
    within 4% per rank; the banner's own figure where the batch has its shape; plan's row = the banner."""
    from shardtrain.config.settings import parse_cli
    from shardtrain.memory.planner import GIB, plan

    table = []
    for workload, precision, extra in TINY:
        name = tiny_name(workload, precision, extra)
        s = launched["summaries"][name]
        banner = s["memory_prediction"]
        assert banner["parameters"] == s["params_total"], (name, banner["parameters"], s["params_total"])
        for rank, rec in s["memory"]["per_rank"].items():
            at = s["memory"]["predicted"][rank]
            assert at["batch"] == f"{rec['batch'][0]} x {rec['batch'][1]} tokens", (name, rank, at, rec["batch"])
            measured = {
                "model_state": rec["model_state"],
                "activations": rec["activations"],
                "total": rec["model_state"] + rec["activations"],
            }
            predicted = {"model_state": at["model_state_gib"] * GIB, "activations": at["activations_gib"] * GIB}
            predicted["total"] = predicted["model_state"] + predicted["activations"]
            if at["batch"] == banner["batch"]:  # the batch had the banner's shape: its figure must hold too
                assert at["activations_gib"] == banner["activations_gib"], (name, rank, at, banner)
            for key, value in measured.items():
                table.append((name, rank, key, value, predicted[key], at["batch"], banner["batch"]))
                assert rel(predicted[key], value) < DOCS_CLAIM, table[-1]
        cfg = parse_cli(launched["plan"][name])
        row = next(
            r
            for r in plan(cfg, 2, GIB, cuda=False)["rows"]
            if r["variant"] == banner["variant"]
            and not r["activation_checkpointing"]
            and r["micro_batch_size"] == cfg.train.per_device_batch_size
        )
        assert row["gpu_bytes"]["activations"] / GIB == pytest.approx(banner["activations_gib"], rel=1e-9), name
        assert (
            row["gpu_bytes"]["params"] + row["gpu_bytes"]["grads"] + row["gpu_bytes"]["optimizer"]
        ) / GIB == pytest.approx(banner["model_state_gib"], rel=1e-9), name
    assert launched["output"].count("plan 1 ") >= len(TINY)  # the end-of-run table shows the prediction
    print("\nrun, rank, part: measured vs predicted bytes (at the measured batch; banner's batch)")
    for r in table:
        print(r)


def test_each_rank_holds_its_share(runs):
    """Sharded strategies: each of 2 ranks holds about half of DDP's model state; metrics.jsonl has it too."""
    ddp = runs["ddp"][1]["memory"]["per_rank"]["0"]["model_state"]
    for variant in ("fsdp", "fsdp_sgo"):
        for rec in runs[variant][1]["memory"]["per_rank"].values():
            assert 0.45 < rec["model_state"] / ddp < 0.55, (variant, rec["model_state"], ddp)
    for rec in runs["zero3"][1]["memory"]["per_rank"].values():
        # ZeRO-3 keeps an extra fp32 master partition and small parameters whole: 20Ψ/N + persistent
        assert 0.6 < rec["model_state"] / ddp < 0.75, (rec["model_state"], ddp)
    construction = runs["zero3"][1]["memory"]["construction"]
    assert set(construction) == {"0", "1"} and all(r["peak_rss"] > 0 for r in construction.values())


@pytest.mark.parametrize("strategy", OOM_STRATEGIES)
def test_oom_recovery_keeps_global_batch_and_trajectory(launched, strategy):
    results, summaries = launched["results"], launched["summaries"]
    got, ref = results[f"oom-{strategy}"], results[f"ref-{strategy}"]
    s = summaries[f"oom-{strategy}"]
    assert s["oom_recovery"]["events"] == [{"step": 1, "ranks": 1, "from": [16, 1], "to": [8, 2]}]
    assert (s["oom_recovery"]["micro_batch_size"], s["oom_recovery"]["grad_accum"]) == (8, 2)
    assert s["global_batch_size"] == summaries[f"ref-{strategy}"]["global_batch_size"] == 32
    assert len(got["losses"]) == 2
    for a, b in zip(got["losses"], ref["losses"]):
        assert rel(a, b) < 1e-5, (strategy, got["losses"], ref["losses"])
    for a, b in zip(got["grad_norms"], ref["grad_norms"]):
        assert rel(a, b) < 1e-5, (strategy, got["grad_norms"], ref["grad_norms"])


def test_oom_is_logged_once_per_event_and_gives_up_at_micro_batch_1(launched):
    results, output = launched["results"], launched["output"]
    assert output.count("out of memory on 1 rank(s) at micro-batch 16 x accum 1; redoing") == len(OOM_STRATEGIES)
    r = results["oom-gives-up"]
    assert not r["ok"] and r["error"].startswith("MemoryError: step 1: out of memory on 1 rank(s) at micro-batch 1")


def test_auto_picks_differently_for_two_budgets(launched):
    summaries, output = launched["summaries"], launched["output"]
    roomy, tight = summaries["auto-roomy"], summaries["auto-tight"]
    assert roomy["strategy"] == "ddp", roomy["strategy"]
    assert tight["strategy"] != "ddp"
    for s in (roomy, tight):  # the global batch of the config (16 x 1 x 2) is kept
        assert s["global_batch_size"] == 32
    assert output.count("--strategy auto: ") == 2
    assert "--strategy auto: ddp" in output and "that fit 1.00 GiB per rank" in output


def test_auto_checkpoints_the_fewest_blocks_that_fit(launched):
    from shardtrain.memory.planner import GIB

    summaries, results, output = launched["summaries"], launched["results"], launched["output"]
    ref = results["ac-none"]
    assert summaries["ac-none"]["resolved"]["recompute"]["checkpointed_blocks"] == 0
    for name, blocks in [*((f"ac-auto-{v}", AC_WANTED) for v in AC_AUTO), ("ac-every-2", 2)]:
        s = summaries[name]
        assert s["resolved"]["recompute"]["checkpointed_blocks"] == blocks, (name, s["resolved"]["recompute"])
        assert s["resolved"]["recompute"]["blocks"] == 4, (name, s["resolved"]["recompute"])
        assert s["run"]["strategy_settings"]["recompute_blocks"] == blocks, (name, s["run"]["strategy_settings"])
        for rank, rec in s["memory"]["per_rank"].items():
            predicted = s["memory"]["predicted"][rank]["activations_gib"] * GIB
            assert rel(rec["activations"], predicted) < TOLERANCE, (name, rank, rec["activations"], predicted)
        got = results[name]
        assert rel(got["grad_norms"][0], ref["grad_norms"][0]) <= GRAD_NORM_RTOL, (name, got, ref)
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert rel(a, b) <= LOSS_RTOL, (name, got["losses"], ref["losses"])
    # Fewer blocks saved fewer activations than none, more than all would: the measurement, not the planner.
    none = summaries["ac-none"]["memory"]["per_rank"]["0"]["activations"]
    assert summaries["ac-auto-ddp"]["memory"]["per_rank"]["0"]["activations"] < 0.8 * none
    assert output.count(f"activation checkpointing auto: {AC_WANTED} of 4 blocks: predicted peak") == len(AC_AUTO)
    assert output.count("activation checkpointing every-2: 2 of 4 blocks (recompute ~") == 1
