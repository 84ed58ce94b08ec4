"""The first way into LoRA: a user's own workload whose build_model returns a PeftModel, written
as users write theirs (get_peft_model on a from_pretrained model), in a file beside its config. Its base stays
frozen, its checkpoints hold only the adapters, the head and their optimizer state, and a ZeRO-3 resume of its
DDP checkpoint goes on exactly; export writes peft's adapter format."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from launch import REPO, cli, predicted_metrics, run_plan, test_env
from test_examples import as_base_name, bert_tokenizer, pretrained_base

USER_CODE = """
import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from shardtrain import Workload


class MyLoraClassifier(Workload):
    def __init__(self, cfg, base, data_dir):
        super().__init__(cfg, base=base, data_dir=data_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(base)

    def build_model(self):
        if self.loads_weights:
            model = AutoModelForSequenceClassification.from_pretrained(self.args["base"], num_labels=3)
        else:  # a copy that gets rank 0's weights (ZeRO-3's zero.Init): its shapes only
            config = AutoConfig.from_pretrained(self.args["base"], num_labels=3)
            model = AutoModelForSequenceClassification.from_config(config)
        lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
        return get_peft_model(model, lora)

    def datasets(self):
        def read(split):
            with open(f"{self.args['data_dir']}/{split}.jsonl") as f:
                return [json.loads(line) for line in f if line.strip()]

        return read("train"), read("validation")

    def collate(self, samples):
        batch = self.tokenizer(
            [s["text"] for s in samples], padding=True, truncation=True, max_length=32, return_tensors="pt"
        )
        return {**batch, "labels": torch.tensor([s["label"] for s in samples])}


class EveryBuildFromPretrained(MyLoraClassifier):
    def build_model(self):  # the mistake: from_pretrained inside ZeRO-3's zero.Init too
        model = AutoModelForSequenceClassification.from_pretrained(self.args["base"], num_labels=3)
        return get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"]))
"""


def test_a_users_peft_model_saves_only_its_adapters_and_resumes_under_zero3(mm_data, tmp_path):
    from shardtrain.checkpointing.portable import read_portable

    hf_text = {
        "num_labels": 3,
        "model_config": {
            "model_type": "bert",
            "vocab_size": 0,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
    }
    tok = bert_tokenizer(mm_data, tmp_path / "tokenizer")
    from transformers import AutoTokenizer

    hf_text["model_config"]["vocab_size"] = len(AutoTokenizer.from_pretrained(str(tok)))
    base = pretrained_base(hf_text, tmp_path)
    AutoTokenizer.from_pretrained(str(tok)).save_pretrained(base)  # a hub folder has its tokenizer beside it
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_lora.py").write_text(USER_CODE)
    (user / "config.yaml").write_text(
        textwrap.dedent(f"""\
        workload:
          target: my_lora:MyLoraClassifier
          args: {{base: {base}, data_dir: {mm_data}}}
        train: {{max_steps: 6, per_device_batch_size: 8, lr: 1.0e-2, warmup_steps: 0, log_every: 1}}
        data: {{num_workers: 0}}
        """)
    )
    common = [
        "--config",
        str(user / "config.yaml"),
        "--device",
        "cpu",
        "--predict-memory",
        "false",
        "--report",
        "false",
    ]
    plan = [
        {
            "name": "ddp",
            "args": [*common, "--strategy", "ddp", "--output-dir", str(tmp_path / "ddp"), "--save-every", "3"],
        },
        {
            "name": "zero3",
            "args": [
                *common,
                *("--strategy", "zero3", "--output-dir", str(tmp_path / "zero3")),
                *("--resume", str(tmp_path / "ddp" / "checkpoints" / "step-000003")),
            ],
        },
    ]
    plan.append(  # a probe, last: a failed launch is not trusted after it
        {
            "name": "mistake",
            "expect_error": True,
            "args": [
                *common,
                *("--workload", "my_lora:EveryBuildFromPretrained", "--strategy", "zero3"),
                *("--output-dir", str(tmp_path / "mistake")),
            ],
        }
    )
    (tmp_path / "plan").mkdir()
    _, results = run_plan(plan, tmp_path / "plan", timeout=900)
    ddp, zero3 = results["ddp"], results["zero3"]
    assert results["mistake"]["error"].startswith(
        "ConfigError: EveryBuildFromPretrained.build_model() loaded pretrained weights inside ZeRO-3's zero.Init"
    ), results["mistake"]
    assert ddp["describe"]["params_frozen"] > 10 * ddp["describe"]["params_trainable"] > 0, ddp["describe"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(zero3["losses"], ddp["losses"][3:]))
    assert len(zero3["losses"]) == 3 and worst <= 1e-4, (zero3["losses"], ddp["losses"])

    saved = read_portable(tmp_path / "ddp" / "checkpoints" / "step-000003")["model"]
    params = [k for k in saved if not k.endswith(("position_ids", "token_type_ids"))]
    assert params and all(".lora_" in k or ".modules_to_save." in k for k in params), params[:4]
    assert not any(as_base_name(k).endswith("attention.self.query.weight") for k in saved)  # the base's own

    # Mistakes, refused by `shardtrain train --nproc 2` in one line before any process starts (no run folder made):
    # --peft lora on a model that has adapters already, and a target module the model does not have.
    example = ["--config", str(REPO / "examples" / "hf_text_classifier" / "config.yaml")]
    example += ["--workload-args", json.dumps({"model": str(base), "data_dir": str(mm_data), "num_labels": 3})]
    for flags, line in (
        (["--config", str(user / "config.yaml")], "--peft (peft.method): MyLoraClassifier.build_model() returns a "),
        ([*example, "--target-modules", "qkv"], "--target-modules (peft.target_modules): qkv matches no Linear "),
    ):
        out = tmp_path / "refused"
        bad = cli(["train", "--nproc", "2", *flags, "--peft", "lora", "--output-dir", str(out)], check=False)
        errors = [x for x in bad.output.splitlines() if x.startswith("shardtrain: error:")]
        assert bad.returncode == 2 and len(errors) == 1 and line in errors[0], bad.tail()
        assert not out.exists() and "Traceback" not in bad.output, bad.tail()

    # From a folder that is not the workload's, its folder on no path: the run recorded where it imported it from.
    env = test_env(PYTHONPATH=str(REPO))
    cli(["export", str(tmp_path / "zero3"), str(tmp_path / "export")], env=env)
    adapter = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["base_model_name_or_path"]) == (4, str(base)), adapter
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "export" / "adapter_model.safetensors"))
    final = read_portable(tmp_path / "zero3" / "checkpoints" / "step-000006")["model"]
    for name, value in exported.items():  # peft's names lack the adapter's ("default")
        ours = next(k for k in final if k.replace(".default.", ".").replace(".modules_to_save.", ".") == name)
        assert torch.equal(value, final[ours]), name
    # predict from the export (the base from build_model, the adapters from peft's files) scores the run's eval
    run = cli(["predict", str(tmp_path / "export"), "--output", str(tmp_path / "preds.jsonl")], env=env)
    assert predicted_metrics(run) == pytest.approx(zero3["eval"], rel=1e-9), run.tail()
    # Its INT8 copy is of the merged model: quantized unmerged, it held peft's names (the base and its adapters side
    # by side), which the documented load into build_model()'s architecture refused, and its size was set against
    # the adapters' 0.03 MB ("640.6% larger").
    int8 = cli(["export", str(tmp_path / "zero3"), str(tmp_path / "int8"), "--int8"], env=env)
    assert "smaller than the merged fp32 model (" in int8.output, int8.output
    from transformers import AutoModelForSequenceClassification

    from shardtrain.checkpointing.export import load_int8_weights

    architecture = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=3)
    load_int8_weights(architecture, tmp_path / "int8" / "model_int8.pt")  # strict
    quantized = cli(["predict", str(tmp_path / "int8"), "--int8", "--output", str(tmp_path / "int8.jsonl")], env=env)
    assert predicted_metrics(quantized)["accuracy"] == pytest.approx(zero3["eval"]["accuracy"], abs=0.05)
    # A merged export over it replaces it whole: no adapter file of the old export is left for transformers to apply.
    cli(["export", str(tmp_path / "zero3"), str(tmp_path / "export"), "--merge"], env=env)
    left = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert "model.safetensors" in left and not [n for n in left if n.startswith("adapter_")], left
    # The default Workload.export of the merged transformers model: config.json and the workload's tokenizer
    # beside the weights, so plain transformers loads it; shardtrain predict reads it too.
    from plain_transformers import fresh

    merged = cli(["predict", str(tmp_path / "export"), "--output", str(tmp_path / "merged.jsonl")], env=env)
    assert predicted_metrics(merged) == pytest.approx(zero3["eval"], rel=1e-9), merged.tail()
    texts = [json.loads(x)["text"] for x in (mm_data / "validation.jsonl").read_text().splitlines() if x.strip()]
    plain = fresh(tmp_path / "export", texts, tmp_path / "plain.json")
    predicted = [json.loads(x) for x in (tmp_path / "merged.jsonl").read_text().splitlines()]
    gap = max(abs(p["probs"][str(i)] - plain["probs"][p["row"]][i]) for p in predicted for i in range(3))
    assert gap <= 1e-5, gap
