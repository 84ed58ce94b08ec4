"""--max-tokens-per-batch on 2 ranks, as a user's workload trains with it: micro-batches of different sizes give
the gradient of the same samples as one big batch (fp32, within 1e-6), weighting samples for a per-text loss and
tokens for a per-token loss, under DDP, FSDP and ZeRO-2 alike."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from launch import run_plan, torchrun

USER_CODE = '''
import torch
import torch.nn.functional as F
from torch import nn

from shardtrain import Workload


class Docs(torch.utils.data.Dataset):
    """Three longer reports (90, 60 and 45 token ids) and posts of 4 to 30."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = [90, 60, 45] + torch.randint(4, 31, (n - 3,), generator=g).tolist()
        self.ids = [torch.randint(1, 50, (k,), generator=g) for k in lengths]
        self.ids[:3] = [torch.full((k,), 3) for k in lengths[:3]]  # the reports' tokens: all alike

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i]

    def lengths(self):
        return [len(x) for x in self.ids]


class Bag(nn.Module):
    def __init__(self, per_token):
        super().__init__()
        self.embed, self.head, self.per_token = nn.Embedding(50, 16), nn.Linear(16, 3), per_token

    def forward(self, input_ids, mask):
        h = torch.tanh(self.embed(input_ids))
        if self.per_token:
            return self.head(h)
        return self.head((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


class PerText(Workload):
    """A mean over texts (classification): the default loss_items, one per text."""

    def build_model(self):
        return Bag(per_token=False)

    def datasets(self):
        return Docs(96, 0), None

    def collate(self, samples):
        ids = nn.utils.rnn.pad_sequence(samples, batch_first=True)
        return {"input_ids": ids, "mask": (ids > 0).float(), "labels": ids[:, 0] % 3}

    def forward(self, model, batch):
        return model(batch["input_ids"], batch["mask"])

    def block_classes(self):
        return (nn.Embedding, nn.Linear)  # FSDP's units


class PerToken(PerText):
    """A mean over every real token: loss_items counts them."""

    def build_model(self):
        return Bag(per_token=True)

    def loss(self, logits, batch):
        real = batch["mask"] > 0
        return F.cross_entropy(logits[real], batch["input_ids"][real] % 3)

    def loss_items(self, lengths):
        return sum(lengths)
'''

STRATEGIES = ("ddp", "fsdp", "zero2")
BUDGET, ACCUM, STEPS = 96, 2, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_budget")
    user = root / "user"
    user.mkdir()
    (user / "budget_tasks.py").write_text(USER_CODE)
    plan = []
    for task in ("PerText", "PerToken"):
        (user / f"{task}.yaml").write_text(
            textwrap.dedent(f"""\
            workload: {{target: budget_tasks:{task}}}
            train: {{max_steps: {STEPS}, grad_accum: {ACCUM}, lr: 1.0e-2, warmup_steps: 0, log_every: 1}}
            data: {{num_workers: 0, max_tokens_per_batch: {BUDGET}}}
            """)
        )
        for strategy in STRATEGIES if task == "PerText" else ("ddp", "zero2"):
            plan.append(
                {
                    "name": f"{task}/{strategy}",
                    "args": [
                        *("--config", str(user / f"{task}.yaml"), "--device", "cpu", "--precision", "fp32"),
                        *("--strategy", strategy, "--output-dir", str(root / task / strategy)),
                        *("--predict-memory", "false", "--report", "false", "--save-final", "false"),
                        *(("--save-every", "1", "--keep-last", "3") if strategy == "ddp" else ()),
                    ],
                }
            )
    (root / "plan").mkdir()
    launch, results = run_plan(plan, root / "plan", timeout=600)
    assert f"micro-batches of up to {BUDGET} tokens x accum {ACCUM} x world 2" in launch.output  # the banner
    return user, root, results


def reference(user, root, task: str) -> dict:
    """Step 1 in this process: the samples the ranks' token-budget micro-batches held, as ONE batch, through the
    same initial weights (built as the Trainer builds them), its mean loss and gradient norm; and the loss and
    gradient norm that equal weights for the micro-batches would give."""
    sys.path.insert(0, str(user))
    try:
        import budget_tasks
    finally:
        sys.path.remove(str(user))
    from shardtrain.config.settings import parse_cli
    from shardtrain.data import build_loaders
    from shardtrain.runtime.training_rng import aside

    cfg = parse_cli(["--config", str(user / f"{task}.yaml"), "--output-dir", str(root / "ref"), "--device", "cpu"])
    workload = getattr(budget_tasks, task)(cfg)
    with aside(seed=cfg.train.seed, device=torch.device("cpu")):
        model = workload.build_model()
    train, _ = workload.datasets()
    micro = [
        build_loaders(cfg, None, train, None, rank, 2, "cpu", collate=workload.collate, workload=workload)
        .train.mine()[:ACCUM]
        for rank in range(2)
    ]  # fmt: skip
    batches = [b for rank in micro for b in rank]
    assert len({len(b) for b in batches}) > 1, batches  # the micro-batches differ in size, or nothing is tested
    whole = workload.collate([train[i] for b in batches for i in b])

    def loss_and_norm(loss):
        model.zero_grad()
        loss.backward()
        return loss.item(), torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()

    loss, norm = loss_and_norm(workload.loss(workload.forward(model, whole), whole))
    parts = [workload.collate([train[i] for i in b]) for b in batches]
    plain = loss_and_norm(sum(workload.loss(workload.forward(model, c), c) for c in parts) / len(parts))
    return {"loss": loss, "grad_norm": norm, "plain_mean": plain}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("task", ["PerText", "PerToken"])
def test_token_budget_micro_batches_give_the_one_big_batch_gradient(runs, task):
    user, root, results = runs
    ref = reference(user, root, task)
    # equal weights for the micro-batches would be visibly wrong here
    assert max(rel(ref["plain_mean"][0], ref["loss"]), rel(ref["plain_mean"][1], ref["grad_norm"])) > 1e-3, ref
    ran = {name.split("/")[1]: r for name, r in results.items() if name.startswith(task + "/")}
    print(f"\n{task}: one batch loss {ref['loss']:.7f}, grad norm {ref['grad_norm']:.7f}")
    for strategy, r in ran.items():
        print(f"  {strategy}: step-1 loss rel {rel(r['losses'][0], ref['loss']):.1e}, "
              f"grad norm rel {rel(r['grad_norms'][0], ref['grad_norm']):.1e}")  # fmt: skip
        assert rel(r["losses"][0], ref["loss"]) <= 1e-6, (strategy, r["losses"], ref)
        assert rel(r["grad_norms"][0], ref["grad_norm"]) <= 1e-6, (strategy, r["grad_norms"], ref)
        # the later steps (after AdamW updates) agree across strategies too
        assert max(rel(a, b) for a, b in zip(r["losses"], ran["ddp"]["losses"])) <= 1e-5, strategy
    metrics = [json.loads(x) for x in (root / task / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert len({m["samples"] for m in metrics}) > 1  # samples per step follow the texts' lengths
    state = json.loads((root / task / "ddp" / "summary.json").read_text())
    assert state["resolved"]["batch_geometry"]["grad_accum"] == ACCUM


def test_a_resume_on_one_rank_trains_the_same_steps(runs):
    """An elastic job that lost a rank: DDP's step-1 checkpoint resumed at world size 1. The global batch is kept
    (accumulation doubles), so each step holds the same token-budget micro-batches as at 2 ranks, and the losses
    and gradient norms of steps 2 and 3 are the 2-rank run's."""
    user, root, results = runs
    two = results["PerText/ddp"]
    run = torchrun(
        [
            *("--config", str(user / "PerText.yaml"), "--device", "cpu", "--precision", "fp32"),
            *("--strategy", "ddp", "--output-dir", str(root / "one_rank"), "--predict-memory", "false"),
            *("--report", "false", "--save-final", "false"),
            *("--resume", str(root / "PerText" / "ddp" / "checkpoints" / "step-000001")),
        ],
        nproc=1,
    )
    assert "world size 2 -> 1 at step 1" in run.output and "accum 4 x 1 ranks" in run.output, run.tail()
    one = run.metrics
    assert [m["step"] for m in one] == [2, 3]
    for m, loss, norm, samples in zip(one, two["losses"][1:], two["grad_norms"][1:], two_samples(root)[1:]):
        assert rel(m["loss"], loss) <= 1e-6 and rel(m["grad_norm"], norm) <= 1e-6, (one, two)
        assert m["samples"] == samples


def two_samples(root) -> list[int]:
    lines = (root / "PerText" / "ddp" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["samples"] for x in lines if x.strip()]
