"""README's "Your own model" section, as a new user would use it: its workload file and YAML, copied out of the
README, trained with `shardtrain train` on 2 ranks; and `shardtrain.fit` from a plain `python my_script.py`."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
from launch import REPO, cli, run

from shardtrain.checkpointing.store import committed_steps

SECTION = REPO.joinpath("README.md").read_text().split("## Your own model", 1)[1].split("\n## ", 1)[0]


def block(lang: str, index: int = 0) -> str:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, re.S)[index]


@pytest.fixture(scope="module")
def user_dir(mm_data, tmp_path_factory) -> Path:
    """The README's files, plus a tiny local RoBERTa-architecture model folder standing in for a hub name."""
    from transformers import BertTokenizerFast, RobertaConfig, RobertaForSequenceClassification

    d = tmp_path_factory.mktemp("user")
    (d / "my_tasks.py").write_text(block("python"))
    (d / "my_run.yaml").write_text(block("yaml"))
    words = sorted(
        {
            w
            for line in (mm_data / "train.jsonl").read_text().splitlines()
            if line.strip()
            for w in json.loads(line)["text"].split()
        }
    )
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    model_dir = d / "tiny-roberta"
    tok = BertTokenizerFast(vocab=str(d / "vocab.txt"))  # vocab_file= gives every word [UNK] in transformers 5
    assert tok.unk_token_id not in tok(words[0])["input_ids"], "the tokenizer knows none of the data's words"
    tok.save_pretrained(str(model_dir))
    cfg = RobertaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=300,
        pad_token_id=0,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    RobertaForSequenceClassification(cfg).save_pretrained(str(model_dir))
    return d


def test_the_readme_workload_trains_under_fsdp_from_its_yaml(user_dir, mm_data, tmp_path, capsys):
    args = json.dumps({"model": str(user_dir / "tiny-roberta"), "data": str(mm_data), "num_labels": 3})
    r = cli(
        [
            "train",
            "--config",
            str(user_dir / "my_run.yaml"),
            "--workload-args",
            args,
            "--strategy",
            "fsdp",
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--max-steps",
            "3",
            "--per-device-batch-size",
            "8",
            "--num-workers",
            "0",
            # A source flag this workload's datasets() never reads (it reads its own data): said, not ignored.
            "--train-file",
            str(tmp_path / "not_read.csv"),
            "--output-dir",
            str(tmp_path / "run"),
            "--resume",
            "none",
            "--predict-memory",
            "false",
            "--report",
            "false",
        ],
        timeout=300,
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 3 and summary["eval"]["n_examples"] == 64, r.tail()
    unread = "warning: --train-file (data.train_file) names training data, but the workload's datasets() did not"
    assert r.output.count(unread) == 1, r.tail()  # rank 0 says it, once
    assert summary["units"] == 2, summary  # RobertaLayer x 2, from the model's _no_split_modules

    # `shardtrain export` of the run: the workload (imported from the working directory) rebuilds the model
    # and writes it with Workload.export's default: model.safetensors + workload.json.
    run([sys.executable, "-m", "shardtrain", "export", str(tmp_path / "run"), str(tmp_path / "export")], cwd=user_dir)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert (
        "classifier.out_proj.weight" in exported
        and exported["roberta.embeddings.word_embeddings.weight"].shape[1] == 32
    )
    assert json.loads((tmp_path / "export" / "workload.json").read_text())["target"] == "my_tasks:Sentiment"

    # --workload / --workload-args on export: rebuild with other args (here the data's place on "this machine")
    # and evaluate the exported weights with the workload's own metrics.
    moved = json.dumps({"model": str(user_dir / "tiny-roberta"), "data": str(mm_data), "num_labels": 3})
    r = run(
        [
            sys.executable,
            "-m",
            "shardtrain",
            "export",
            str(tmp_path / "run"),
            str(tmp_path / "export2"),
            "--workload",
            "my_tasks:Sentiment",
            "--workload-args",
            moved,
            "--eval",
            "--int8",
        ],
        cwd=user_dir,
    )
    evaluated = json.loads((tmp_path / "export2" / "shardtrain_export.json").read_text())["eval_fp32"]
    assert evaluated["n_examples"] == 64 and "validation: accuracy" in r.output, r.tail()
    # The size line of --int8, as for the built-ins (it was left out for a user's workload).
    assert "int8 (torchao: Linear and embedding weights; CPU inference only):" in r.output and "% smaller" in r.output
    assert abs(evaluated["accuracy"] - summary["eval"]["accuracy"]) < 1e-9, (evaluated, summary["eval"])

    # report --workload reads the run: it shows the workload and its metrics, and refuses another workload.
    from shardtrain import cli as shardtrain_cli

    assert shardtrain_cli.main(["report", str(tmp_path / "run"), "--workload", "my_tasks:Sentiment"]) == 0
    html = (tmp_path / "run" / "report.html").read_text()
    assert "<h2>workload</h2>" in html and "my_tasks:Sentiment" in html and "macro_f1" in html
    assert shardtrain_cli.main(["report", str(tmp_path / "run"), "--workload", "my_tasks:Other"]) == 2
    assert f"report: {tmp_path / 'run'} trained my_tasks:Sentiment with args" in capsys.readouterr().err


def test_fit_from_a_plain_script_relaunches_with_nproc(mm_data, tmp_path):
    """The workload class lives in the script itself: the relaunched ranks import it by the script's name.
    Its validation set is one example: fewer validation batches than ranks must neither hang ZeRO-3 nor
    count anything twice."""
    script = tmp_path / "my_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        import torch
        from torch import nn
        import shardtrain
        from shardtrain import Workload

        class Bag(Workload):
            # Bag-of-characters classifier over the records' text: no tokenizer, no download.
            def build_model(self):
                return nn.Sequential(nn.Linear(128, 16), nn.ReLU(), nn.Linear(16, 3))

            def forward(self, model, batch):
                return model(batch["x"])

            def datasets(self):
                def read(split):
                    rows = [json.loads(l) for l in open(f"{mm_data}/{{split}}.jsonl") if l.strip()]
                    return [{{"x": torch.bincount(torch.tensor([min(ord(c), 127) for c in r["text"]]),
                                                  minlength=128).float(), "labels": r["label"]}} for r in rows]
                return read("train"), read("validation")[:1]  # 1 validation batch for 2 ranks

        if __name__ == "__main__":
            summary = shardtrain.fit(Bag, strategy=sys.argv[1], nproc=2, device="cpu", max_steps=4,
                                     per_device_batch_size=8, num_workers=0, output_dir=sys.argv[2],
                                     resume="none", predict_memory=False, report=False, save_final=False)
            print("SUMMARY", json.dumps({{"steps": summary["final_step"], "world": summary["world_size"],
                                         "n": summary["eval"]["n_examples"]}}))
    """)
    )
    r = run([sys.executable, str(script), "zero3", str(tmp_path / "out")], cwd=tmp_path, timeout=300)
    line = next(x for x in r.output.splitlines() if x.startswith("SUMMARY"))
    # One validation example for two ranks: ZeRO-3's rank without one still joins the forward, counts nothing.
    assert json.loads(line.split(" ", 1)[1]) == {"steps": 4, "world": 2, "n": 1}, r.tail()


PITFALLS = '''
import torch
import torch.nn.functional as F
from torch import nn
from shardtrain import Workload


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(400, 400)  # 160k weights: above ZeRO-3's persistence threshold, so partitioned

    def forward(self, x):
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 400)
        self.blocks = nn.Sequential(Wide(), Wide())
        self.head = nn.Linear(400, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


class Rows(Workload):
    def build_model(self):
        self.model = Net()  # the last one built is the one trained (ZeRO-3 builds a partitioned copy last)
        return self.model

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        rows = [{"x": torch.randn(8, generator=g), "labels": i % 3} for i in range(64)]
        return rows, rows[:16]

    def block_classes(self):
        return (Wide,)


class WeightDecayInLoss(Rows):
    """An L2 term on a block's weight, read in the loss, outside forward."""
    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch["labels"]) + 1e-4 * self.model.blocks[0].lin.weight.pow(2).sum()


class NanLoss(Rows):
    """A loss that is not finite from the first step (a log of a negative number)."""
    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch["labels"]) + torch.log(outputs.sum() * 0 - 1)


class MetricsFail(Rows):
    """Metrics that raise, on every rank alike (after the all-reduce): the run's final evaluation fails."""
    def metrics(self, sums):
        raise ValueError("a bug in the user's metrics")
'''


def test_pitfalls_a_weight_read_in_the_loss_and_a_non_finite_first_loss(tmp_path):
    """What users see, in one launch of 2 ranks. A loss reading a block's weight trains under DDP
    (the weight is whole there) and is one line naming the loss and the parameter under FSDP2 (a DTensor shard
    after the block's forward; unguarded: "aten.nll_loss_backward.default got mixed torch.Tensor and DTensor")
    and ZeRO-3 (shape [0]; unguarded: "PowBackward0 returned an invalid gradient ... got [0]"). And a
    loss that is NaN on a fresh run's first step names the loss at once (unguarded, --nan-policy skip skipped
    every step, and after 5 blamed the learning rate)."""
    from launch import run_plan, strategy_variants

    (tmp_path / "pitfall_tasks.py").write_text(PITFALLS)
    variants = strategy_variants()
    plan = []
    for name, target, strategy, expect_error in (
        ("l2/ddp", "WeightDecayInLoss", "ddp", False),
        ("nan/ddp", "NanLoss", "ddp", True),
        ("l2/fsdp", "WeightDecayInLoss", "fsdp", True),
        ("l2/zero3", "WeightDecayInLoss", "zero3", True),
        ("metrics/ddp", "MetricsFail", "ddp", True),
    ):
        (tmp_path / f"{target}.yaml").write_text(f"workload: pitfall_tasks:{target}\n")
        plan.append(
            {
                "name": name,
                "expect_error": expect_error,
                "args": [
                    "--config",
                    str(tmp_path / f"{target}.yaml"),
                    *variants[strategy],
                    "--device",
                    "cpu",
                    "--output-dir",
                    str(tmp_path / name),
                    "--resume",
                    "none",
                    "--max-steps",
                    "2",
                    "--per-device-batch-size",
                    "8",
                    "--num-workers",
                    "0",
                    "--save-final",
                    "true" if target == "MetricsFail" else "false",
                    "--predict-memory",
                    "false",
                    "--report",
                    "false",
                ],
            }
        )
    _, results = run_plan(plan, tmp_path, timeout=300)
    # A final evaluation that fails keeps the trained model: its checkpoint was saved first (it had been lost).
    assert "a bug in the user's metrics" in results["metrics/ddp"]["error"], results["metrics/ddp"]
    assert [p.name for p in committed_steps(tmp_path / "metrics" / "ddp" / "checkpoints")] == ["step-000002"]
    assert results["l2/ddp"]["ok"] and len(results["l2/ddp"]["losses"]) == 2, results["l2/ddp"]
    assert results["nan/ddp"]["error"].startswith(
        "ConfigError: step 1: NanLoss.loss returned a non-finite loss (nan) on rank 0, 1 before any update"
    ), results
    for s in ("fsdp", "zero3"):
        assert results[f"l2/{s}"]["error"].startswith(
            f"ConfigError: WeightDecayInLoss.loss reads blocks.0.lin.weight outside the model's forward, where {s} "
            f"holds only this rank's shard of it: read parameters inside forward"
        ), (s, results[f"l2/{s}"])
