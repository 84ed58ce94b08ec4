"""Freezing saves the memory users freeze for, under every strategy, and unfreezing keeps the trajectory.

One launch of tests/dist/matrix_driver.py (2 CPU ranks, tiny Longformer, fp32, dropout 0): each strategy trains
6 steps with the embeddings and the lowest layer frozen until step 3 (checkpoints at 2, 4, 6); then resumes from
the checkpoint before the unfreeze (step 2) and after it (step 4), under the same strategy and across strategies
(a DDP checkpoint taken while frozen continues under ZeRO-3, and the reverse).
- a frozen parameter holds no gradient and no optimizer state: rank 0's grads and optimizer bytes (shardtrain's
  memory accounting) while frozen are the trainable share of those after the unfreeze, under ddp, fsdp, zero2 and
  zero3 (DeepSpeed rebuilds its engine at the unfreeze: before, it held both for frozen parameters too);
- the losses and gradient norms of every strategy match DDP's across the unfreeze, and every resumed run continues
  its strategy's uninterrupted run.
FSDP's root unit mixes frozen (embeddings) and trainable (classifier) parameters here, so
freezing must work inside one sharded unit.

In the same launch, a user's workload whose build_model freezes its pretrained backbone by hand,
with --freeze-layers 1 / --unfreeze-at-step 3 on top (its freezable names overlap the backbone: the embeddings):
- the backbone holds no gradient and no optimizer state, and its weights (and BatchNorm statistics) end exactly as
  built, under ddp, fsdp, zero2 and zero3, and after a resume under the same strategy and across strategies;
- the unfreeze trains the --freeze-layers head block only; the summary counts the backbone as frozen;
- `--lr-multipliers` naming the backbone is taken under ddp and zero2 alike, with one warning.
FSDP's root unit holds the frozen embeddings and BatchNorm beside the trainable output layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from launch import run_plan, strategy_variants, tiny_args

from shardtrain.checkpointing.portable import read_portable

STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")
STEPS, UNFREEZE_AT = 6, 3
# (resumed under, checkpoint of, at step): before the unfreeze (2) and after it (4)
RESUMES = (
    ("zero2", "zero2", 2),
    ("zero2", "zero2", 4),
    ("zero3", "zero3", 2),
    ("zero3", "zero3", 4),
    ("zero3", "ddp", 2),
    ("ddp", "zero3", 2),
    ("ddp", "ddp", 4),
    ("fsdp", "zero2", 4),
)
RTOL = 1e-4
USER_RESUMES = (("zero3", "zero3", 4), ("zero3", "ddp", 2), ("fsdp", "zero2", 4))
# --lr-multipliers on the part the user's build_model froze, under a strategy that keeps frozen parameters in its
# optimizer's list and one that leaves them out
LR_ON_FROZEN = ("ddp", "zero2")

# A user's workload file, as users write one: the backbone stands for a pretrained encoder, frozen by hand.
USER_WORKLOAD = """
import torch
from torch import nn
from torch.utils.data import Dataset

from shardtrain import Workload


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.ff(self.norm(x)))


class Backbone(nn.Module):
    def __init__(self, vocab, d, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.bn = nn.BatchNorm1d(d)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.bn(x.mean(1))


class Classifier(nn.Module):
    def __init__(self, vocab=64, d=32, layers=4, labels=3):
        super().__init__()
        self.backbone = Backbone(vocab, d, layers)
        self.blocks = nn.ModuleList([Block(d)])
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(d, labels)

    def forward(self, input_ids):
        x = self.backbone(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.drop(x))


class Tokens(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)
        self.labels = self.ids[:, :4].sum(1) % 3

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class FrozenBackbone(Workload):
    def build_model(self):
        model = Classifier()
        for p in model.backbone.parameters():
            p.requires_grad = False
        return model

    def datasets(self):
        return Tokens(128, 0), Tokens(32, 1)

    def block_classes(self):
        return (Block,)

    def freezable_parameter_names(self, n):
        prefixes = ("backbone.embed.", *(f"blocks.{i}." for i in range(n)))
        return [name for name, _ in Classifier().named_parameters() if name.startswith(prefixes)]
"""
USER_CONFIG = """workload:
  target: frozen_backbone:FrozenBackbone
train:
  per_device_batch_size: 8
  lr: 1.0e-3
  warmup_steps: 0
parallel:
  device: cpu
"""


@pytest.fixture(scope="module")
def runs(ld_data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("freezing")
    flags = strategy_variants()
    plan = []

    def add(name, strategy, *extra):
        plan.append(
            {
                "name": name,
                "args": tiny_args(
                    "longformer",
                    ld_data,
                    root / name.replace("/", "_"),
                    *flags[strategy],
                    "--max-steps",
                    str(STEPS),
                    "--freeze-layers",
                    "1",
                    "--unfreeze-at-step",
                    str(UNFREEZE_AT),
                    "--log-every",
                    "100",
                    "--max-eval-samples",
                    "8",
                    "--memory-every",
                    "5",
                    *extra,
                ),
            }
        )

    (root / "frozen_backbone.py").write_text(USER_WORKLOAD)
    (root / "frozen_backbone.yaml").write_text(USER_CONFIG)

    def add_user(name, strategy, *extra):
        plan.append(
            {
                "name": name,
                "args": [
                    "--config",
                    str(root / "frozen_backbone.yaml"),
                    *flags[strategy],
                    "--output-dir",
                    str(root / name.replace("/", "_")),
                    "--resume",
                    "none",
                    "--max-steps",
                    str(STEPS),
                    "--freeze-layers",
                    "1",
                    "--unfreeze-at-step",
                    str(UNFREEZE_AT),
                    "--log-every",
                    "100",
                    "--memory-every",
                    "5",
                    "--report",
                    "false",
                    *extra,
                ],
            }
        )

    for s in STRATEGIES:
        add(f"full/{s}", s, "--save-every", "2", "--keep-last", "5")
    for under, writer, step in RESUMES:
        ckpt = root / f"full_{writer}" / "checkpoints" / f"step-{step:06d}"
        add(
            f"resume/{under}/{writer}@{step}",
            under,
            "--resume",
            str(ckpt),
            "--save-every",
            "0",
            "--save-final",
            "false",
        )
    for s in STRATEGIES:
        add_user(f"user/{s}", s, "--save-every", "2", "--keep-last", "5")
    for under, writer, step in USER_RESUMES:
        ckpt = root / f"user_{writer}" / "checkpoints" / f"step-{step:06d}"
        add_user(f"user-resume/{under}/{writer}@{step}", under, "--resume", str(ckpt), "--save-every", "0")
    for s in LR_ON_FROZEN:  # last: probes (a refusal is recorded, not raised); no --freeze-layers, as the user ran
        out = root / f"user-lr_{s}"
        args = ["--config", str(root / "frozen_backbone.yaml"), *flags[s], "--output-dir", str(out), "--resume", "none"]
        args += ["--max-steps", "1", "--save-every", "0", "--report", "false", "--lr-multipliers", '{"backbone": 0.5}']
        plan.append({"name": f"user-lr/{s}", "args": args, "expect_error": True})
    run, results = run_plan(plan, root, timeout=900, tail=80)
    for name in results:
        results[name]["dir"] = str(root / name.replace("/", "_"))
    results["launch"] = {"output": run.output}
    return results


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def mem_at(run: dict, step: int) -> dict:
    lines = (Path(run["dir"]) / "metrics.jsonl").read_text().splitlines()
    (rec,) = [json.loads(x) for x in lines if x.strip() and json.loads(x)["step"] == step]
    return rec["mem"]["0"]


def test_frozen_parameters_hold_no_gradient_or_optimizer_state(runs):
    summary = json.loads((Path(runs["full/ddp"]["dir"]) / "summary.json").read_text())
    share = 1 - summary["params_frozen"] / summary["params_total"]
    assert 0.02 < share < 0.5, summary["params_frozen"]
    for s in STRATEGIES:
        frozen, unfrozen = mem_at(runs[f"full/{s}"], 2), mem_at(runs[f"full/{s}"], 5)
        for key in ("grads", "optimizer"):
            ratio = frozen[key] / unfrozen[key]
            print(
                f"{s:<6} {key:<9} frozen {frozen[key]:>8} B, unfrozen {unfrozen[key]:>8} B: {ratio:.3f} "
                f"(trainable share {share:.3f})"
            )
            assert ratio <= 1.2 * share, (s, key, frozen[key], unfrozen[key], share)


def test_trajectory_matches_ddp_across_the_unfreeze(runs):
    ref = runs["full/ddp"]
    assert len(ref["losses"]) == STEPS and all(math.isfinite(x) for x in ref["losses"])
    for s in STRATEGIES:
        r = runs[f"full/{s}"]
        loss = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
        grad = max(rel(a, b) for a, b in zip(r["grad_norms"], ref["grad_norms"]))
        print(f"{s:<6} vs ddp over {STEPS} steps (unfreeze at {UNFREEZE_AT}): loss {loss:.1e}, grad norm {grad:.1e}")
        assert len(r["losses"]) == STEPS and loss <= RTOL and grad <= RTOL, (s, r["losses"], ref["losses"])
    # the unfreeze is visible: more parameters get gradients from step UNFREEZE_AT + 1 on
    assert ref["grad_norms"][UNFREEZE_AT] > ref["grad_norms"][UNFREEZE_AT - 1] * 0.2


@pytest.mark.parametrize("under,writer,step", RESUMES, ids=[f"{u}<-{w}@{s}" for u, w, s in RESUMES])
def test_resume_across_the_unfreeze_continues_the_run(runs, under, writer, step):
    full, resumed = runs[f"full/{under}"], runs[f"resume/{under}/{writer}@{step}"]
    assert len(resumed["losses"]) == STEPS - step, resumed["losses"]
    pairs = list(zip(resumed["losses"] + resumed["grad_norms"], full["losses"][step:] + full["grad_norms"][step:]))
    worst = max(rel(a, b) for a, b in pairs)
    print(f"{under} resumed from {writer}'s step {step}: max rel {worst:.1e}")
    assert worst <= RTOL, (resumed["losses"], full["losses"][step:])


def user_model(root: Path):
    """The user's model as build_model gives it (the run's seed), and the names it freezes itself."""
    import importlib
    import sys

    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("frozen_backbone")
    finally:
        sys.path.remove(str(root))
    torch.manual_seed(42)
    model = module.FrozenBackbone(None).build_model()
    return model, {n for n, p in model.named_parameters() if not p.requires_grad}


def test_what_the_users_build_model_froze_stays_frozen(runs):
    model, backbone = user_model(Path(runs["user/ddp"]["dir"]).parent)
    built = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    held = backbone | {n for n in built if n.startswith("backbone.bn.")}  # with the BatchNorm statistics
    assert backbone and {n for n in held if "running" in n}
    total = sum(p.numel() for p in model.parameters())
    frozen_share = sum(built[n].numel() for n in backbone) / total
    head_block = {n for n in built if n.startswith("blocks.0.")}  # --freeze-layers 1, unfrozen at step 3
    at_start = sum(built[n].numel() for n in backbone | head_block)
    for name in [*(f"user/{s}" for s in STRATEGIES), *(f"user-resume/{u}/{w}@{k}" for u, w, k in USER_RESUMES)]:
        run = runs[name]
        summary = json.loads((Path(run["dir"]) / "summary.json").read_text())
        assert (summary["params_total"], summary["params_frozen"]) == (total, at_start), (name, summary)
        assert summary["frozen_parts"] == ["backbone", "blocks"], (name, summary["frozen_parts"])  # as the banner
        final = read_portable(Path(run["dir"]) / "checkpoints" / f"step-{STEPS:06d}", optimizer=True)
        moved = sorted(n for n in held if not torch.equal(final["model"][n], built[n]))
        with_state = sorted(k for k in final["optim"] if k.rsplit(".", 1)[0] in backbone)
        print(
            f"{name:<24} frozen {summary['params_frozen']:,} of {total:,}; backbone tensors moved: {len(moved)}, "
            f"with optimizer state: {len(with_state)}"
        )
        assert not moved and not with_state, (name, moved, with_state)
        # the unfreeze reached the --freeze-layers block (not frozen by the user), and trained it
        assert all(not torch.equal(final["model"][n], built[n]) for n in head_block), name
        assert {f"{n}.exp_avg" for n in head_block} <= set(final["optim"]), name
    for s in STRATEGIES:  # no gradient: rank 0's gradient bytes after the unfreeze are the trainable share's
        mem = mem_at(runs[f"user/{s}"], 5)
        ratio = mem["grads"] / mem["params"]
        print(f"{s:<6} grads / params bytes {ratio:.3f} (trainable share {1 - frozen_share:.3f})")
        assert ratio <= 1.2 * (1 - frozen_share), (s, mem)


@pytest.mark.parametrize("under,writer,step", USER_RESUMES, ids=[f"{u}<-{w}@{s}" for u, w, s in USER_RESUMES])
def test_a_resumed_user_frozen_run_continues_the_run(runs, under, writer, step):
    full, resumed = runs[f"user/{under}"], runs[f"user-resume/{under}/{writer}@{step}"]
    pairs = list(zip(resumed["losses"] + resumed["grad_norms"], full["losses"][step:] + full["grad_norms"][step:]))
    worst = max(rel(a, b) for a, b in pairs)
    print(f"user workload: {under} resumed from {writer}'s step {step}: max rel {worst:.1e}")
    assert len(resumed["losses"]) == STEPS - step and worst <= RTOL, (resumed["losses"], full["losses"][step:])


def test_a_factor_for_what_the_users_build_model_froze_is_taken_alike_and_said_to_change_nothing(runs):
    """`--lr-multipliers '{"backbone": 0.5}'` where the user's build_model froze the backbone: ZeRO refused it as a
    key that "matches no parameter of the model" (it checked the keys against its optimizer's parameters, which
    leave the frozen ones out) while DDP took it in silence. Every strategy now takes it, and says in one line that
    the factor changes nothing (--freeze-layers' overlap with the backbone unfreezes none of it)."""
    for s in LR_ON_FROZEN:
        record = runs[f"user-lr/{s}"]
        assert record["ok"], (s, record.get("error"))
    line = (
        "[shardtrain] warning: --lr-multipliers (train.lr_multipliers): 'backbone' names only parameters that do "
        "not train in this run (frozen by FrozenBackbone.build_model() or --freeze-layers): its factor changes nothing"
    )
    assert runs["launch"]["output"].count(line) == len(LR_ON_FROZEN), runs["launch"]["output"][-3000:]
