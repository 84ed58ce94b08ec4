"""`compare` and `parity --runs` on finished runs, the report's formatting, and the
library warnings that only --verbose shows."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from launch import REPO
from launch import test_env as launch_env

from shardtrain import cli
from shardtrain.config.settings import Config
from shardtrain.observability.report import write_compare, write_report
from shardtrain.observability.runlog import load_run

MIB = 2**20


def config(**over) -> dict:
    """A resolved config as summary.json records it; over: {"data.max_length": 256, ...}."""
    cfg = Config().to_dict()
    cfg["data"]["data_dir"] = "data/multimodal"
    for key, value in over.items():
        section, field = key.split(".")
        cfg[section][field] = value
    return cfg


def write_run(
    path: Path,
    cfg: dict,
    losses=(1.0, 0.9, 0.8),
    grad_norms=None,
    rate: float = 50.0,
    memory: dict | None = None,
    run_over: dict | None = None,
) -> Path:
    path.mkdir(parents=True)
    grad_norms = grad_norms or [2.0] * len(losses)
    with open(path / "metrics.jsonl", "w") as f:
        for i, (loss, gn) in enumerate(zip(losses, grad_norms), 1):
            f.write(json.dumps({"step": i, "loss": loss, "grad_norm": gn, "lr": 1e-3, "samples_per_sec": rate}) + "\n")
    t = cfg["train"]
    run = {
        "strategy": "ddp",
        "offload": False,
        "world_size": 2,
        "precision": t["precision"],
        "micro_batch_size": t["per_device_batch_size"],
        "grad_accum": t["grad_accum"],
        "global_batch_size": 2 * t["per_device_batch_size"] * t["grad_accum"],
        "train_examples": 256,
        "eval_examples": 64,
        "max_steps": t["max_steps"],
        **(run_over or {}),
    }
    summary = {
        **run,
        "run": run,
        "config": copy.deepcopy(cfg),
        "samples_per_sec": rate,
        "eval": {"accuracy": 0.5, "macro_f1": 0.4},
    }
    if memory:
        summary["memory"] = {"step": 2, "per_rank": memory}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


# ---- compare --------------------------------------------------------------------------------------------
def test_compare_warns_per_difference_and_crowns_nothing_across_models(tmp_path):
    a = write_run(tmp_path / "ddp", config(), rate=80.0)
    b = write_run(tmp_path / "z3", config(), rate=40.0)
    lf = write_run(
        tmp_path / "lf",
        config(**{"model.name": "longformer", "data.max_length": 256, "data.data_dir": "data/longdoc"}),
        rate=120.0,
    )
    _, text = write_compare([str(a), str(b), str(lf)], tmp_path / "cmp")
    lines = text.splitlines()
    assert "warning: runs differ in model (--name): multimodal (ddp, z3) vs longformer (lf)" in lines
    assert "warning: runs differ in sequence length (--max-length): 128 (ddp, z3) vs 256 (lf)" in lines
    assert ("warning: runs differ in data: data_dir data/multimodal (ddp, z3) vs data_dir data/longdoc (lf)") in lines
    assert not any(line.startswith(("fastest", "least memory", "final losses")) for line in lines), text
    assert any(
        line.startswith(
            "no fastest or leanest run: these runs are not comparable, they differ in model, data, sequence length"
        )
        for line in lines
    ), text
    assert "warning: runs differ in model" in (tmp_path / "cmp" / "compare.html").read_text()


def test_compare_ranks_same_model_runs_and_names_training_differences(tmp_path):
    a = write_run(tmp_path / "ddp", config(), rate=80.0)
    b = write_run(tmp_path / "zero2", config(**{"train.lr": 2e-3, "train.precision": "bf16"}), rate=40.0)
    _, text = write_compare([str(a), str(b)], tmp_path / "cmp")
    assert "fastest: ddp (ddp, 80.0 samples/s)" in text
    assert "warning: runs differ in learning rate (--lr): 3e-05 (ddp) vs 0.002 (zero2)" in text
    assert "warning: runs differ in precision: fp32 (ddp) vs bf16 (zero2)" in text
    assert "final losses not compared: the runs differ in precision, learning rate" in text
    # Same settings: no warnings and the loss line as before.
    c = write_run(tmp_path / "fsdp", config(), rate=70.0)
    _, text = write_compare([str(a), str(c)], tmp_path / "cmp2")
    assert "warning" not in text and "final losses differ by at most" in text


def test_memory_figure_counts_the_zero3_comm_buffer_like_every_part(tmp_path):
    """ZeRO-3's reduce bucket (memory/accounting.py's `comm`) is held on every rank beside the model state."""
    part = {"params": 4 * MIB, "grads": 4 * MIB, "optimizer": 8 * MIB, "activations": 2 * MIB}
    ddp = write_run(tmp_path / "ddp", config(), memory={"0": {**part, "comm": 0}, "1": {**part, "comm": 0}})
    z3 = write_run(
        tmp_path / "z3",
        config(),
        memory={
            "0": {
                "params": 2 * MIB,
                "grads": 2 * MIB,
                "optimizer": 4 * MIB,
                "activations": 2 * MIB,
                "comm": 190 * MIB,
                "buffers": MIB,
            }
        },
    )
    assert load_run(ddp).memory_per_rank_mib() == 18.0
    assert load_run(z3).memory_per_rank_mib() == 200.0
    _, text = write_compare([str(ddp), str(z3)], tmp_path / "cmp")
    assert "least memory per rank: ddp (ddp, 18.0 MiB)" in text
    html = write_report(z3, tmp_path / "rep").read_text()
    assert "<th>comm</th>" in html and "190.00" in html


def data_source(train: str, validation: str, **extra) -> dict:
    return {
        "run_over": {
            "data_source": {
                "source": "train_file",
                "train": "docs.csv, the other 90%",
                "content_sha256": {"train": train, "validation": validation},
                **extra,
            }
        }
    }


def test_compare_and_parity_judge_the_data_by_what_was_read_not_the_unused_data_dir(tmp_path, capsys):
    """Two --train-file runs on the same rows are comparable, whatever data_dir default each
    config carried; the same path with other rows is not."""
    same = data_source("a" * 64, "b" * 64)
    a = write_run(tmp_path / "ld", config(**{"data.data_dir": "data/longdoc", "data.train_file": "docs.csv"}), **same)
    b = write_run(
        tmp_path / "mm", config(**{"data.data_dir": "data/multimodal", "data.train_file": "/abs/docs.csv"}), **same
    )
    _, text = write_compare([str(a), str(b)], tmp_path / "cmp")
    assert "warning" not in text and "fastest: ld" in text, text
    assert cli.main(["parity", "--runs", f"{a},{b}", "--out", str(tmp_path / "p")]) == 0
    assert "parity: OK" in capsys.readouterr().out
    other = write_run(
        tmp_path / "other",
        config(**{"data.data_dir": "data/longdoc", "data.train_file": "docs.csv"}),
        **data_source("c" * 64, "b" * 64),
    )
    _, text = write_compare([str(a), str(other)], tmp_path / "cmp2")
    assert (
        "warning: runs differ in data: content sha256 train aaaaaaaaaaaa, validation "
        "bbbbbbbbbbbb (ld) vs content sha256 train cccccccccccc, validation bbbbbbbbbbbb (other)"
    ) in text, text
    assert cli.main(["parity", "--runs", f"{a},{other}"]) == 2
    assert "not comparable step by step: runs differ in data" in capsys.readouterr().err


# ---- parity --runs ----------------------------------------------------------------------------------------
def test_parity_compares_finished_runs_without_training(tmp_path, capsys):
    a = write_run(tmp_path / "ddp", config(), losses=[1.0, 0.9, 0.8])
    b = write_run(tmp_path / "fsdp", config(), losses=[1.0, 0.90000001, 0.8])
    assert cli.main(["parity", "--runs", f"{a},{b}", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "relative differences from ddp" in out and "parity: OK, ddp, fsdp agree over 3 steps" in out
    assert [r["step"] for r in json.loads((tmp_path / "p" / "parity.json").read_text())["steps"]] == [1, 2, 3]

    off = write_run(tmp_path / "zero3", config(), losses=[1.0, 0.9, 0.8], grad_norms=[2.0, 2.0, 4.0])
    assert cli.main(["parity", "--runs", f"{a},{off}"]) == 1
    assert "DIVERGED at step 3: zero3 vs ddp" in capsys.readouterr().out

    # A learning rate may differ (as --args-for can make it): a note, then the comparison.
    lr = write_run(tmp_path / "lr", config(**{"train.lr": 1e-3}))
    assert cli.main(["parity", "--runs", f"{a},{lr}"]) == 0
    assert "parity: note: runs differ in learning rate (--lr): 3e-05 (ddp) vs 0.001 (lr)" in capsys.readouterr().out


def test_parity_refuses_runs_that_cannot_agree_in_one_line(tmp_path, capsys):
    a = write_run(tmp_path / "ddp", config())
    cases = {
        "seed": (config(**{"train.seed": 7}), "runs differ in seed (--seed): 42 (ddp) vs 7 (other)"),
        "model": (config(**{"model.name": "longformer"}), "runs differ in model (--name)"),
        "batch": (
            config(**{"train.grad_accum": 2}),
            "runs differ in batch geometry (micro x accum x world): 32 x 1 x 2 (ddp) vs 32 x 2 x 2 (other)",
        ),
    }
    for name, (cfg, message) in cases.items():
        other = write_run(tmp_path / name / "other", cfg)
        assert cli.main(["parity", "--runs", f"{a},{other}"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shardtrain: error: --runs: not comparable step by step: ")
        assert message in err[0], err[0]
    assert cli.main(["parity", "--runs", f"{a},{a}"]) == 2
    assert cli.main(["parity", "--runs", f"{a},{tmp_path / 'fsdp'}", "--data-dir", "x"]) == 2
    assert "--runs compares finished runs and trains nothing: drop --data-dir" in capsys.readouterr().err


# ---- report.html ----------------------------------------------------------------------------------------------
def test_report_html_shows_formatted_values_not_python_dicts(tmp_path):
    run = write_run(
        tmp_path / "r",
        config(),
        run_over={
            "memory_prediction": {"variant": "zero2", "params_gib": 0.009512430056929588, "host_gib": 1.5},
            "bad_samples_skipped": {"train": 0, "validation": 2},
            "params_total": 5078403,
            "image_cache": None,
            "ds_config": {"zero_optimization": {"stage": 3, "reduce_bucket_size": 50000000}},
            "offload": False,
        },
    )
    html = write_report(run).read_text()
    assert "{'" not in html and "{&#x27;" not in html and "0.009512430056929588" not in html
    # The unit is the value's (`params_gib 0.3 MiB` read as a contradiction), not the key's.
    assert "<th>params</th><td>9.7 MiB</td>" in html and "<th>host</th><td>1.50 GiB</td>" in html
    assert "params_gib" not in html
    assert "<th>validation</th><td>2</td>" in html and "<td>5,078,403</td>" in html
    assert "<th>reduce_bucket_size</th><td>50,000,000</td>" in html


def test_a_workload_without_accuracy_gets_its_report_with_its_own_metrics(tmp_path, capsys):
    """examples/causal_lm evaluates perplexity only: its report failed with KeyError: 'accuracy' at the end of the
    run, and so did `shardtrain report RUN`. Now its own first two numbers are plotted and tabulated."""
    run = write_run(tmp_path / "lm", config())
    summary = json.loads((run / "summary.json").read_text())
    summary["eval"] = {"perplexity": 772.15, "loss": 6.649, "n_examples": 64}
    (run / "summary.json").write_text(json.dumps(summary))
    evals = [{"step": 2, "perplexity": 901.2, "loss": 6.8, "n_examples": 64}, {"step": 3, **summary["eval"]}]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    html = write_report(run).read_text()
    assert "<th>perplexity</th><th>loss</th>" in html and "<td>772.1500</td><td>6.6490</td>" in html, html[:3000]
    assert (run / "curves.png").stat().st_size > 0
    assert cli.main(["report", str(run)]) == 0, capsys.readouterr().err


# ---- library warnings ----------------------------------------------------------------------------------------
NOISY = """
import sys, tempfile, warnings
import torch, torch.distributed as dist, transformers
from shardtrain.runtime.chatter import quiet_libraries
quiet_libraries(verbose=sys.argv[1] == "verbose")
tmp = tempfile.mkdtemp()

# ZeRO-3's gradient reduce-scatter, as deepspeed/comm/torch.py calls it
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))
dist.destroy_process_group()

# export: the portable checkpoint read in one process, and --int8 (torchao: a pytree deprecation at import)
import torch.distributed.checkpoint as dcp
from torch import nn
dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp + "/dcp", no_dist=True)
dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp + "/dcp", no_dist=True)
from shardtrain.checkpointing.export import quantize
quantize(nn.Sequential(nn.Linear(8, 8)))

# a pretrained text model whose pooler the multimodal model leaves out
from shardtrain.config.settings import parse_cli, replace_fields
from shardtrain.builtin_workloads.networks import build_model
cfg = parse_cli(["--config", "configs/multimodal_tiny.yaml"])
text = build_model(cfg.model, cfg.data, vocab_size=1000, load_weights=False).text
transformers.RobertaModel(text.config).save_pretrained(tmp + "/text")  # with its pooler
cfg = replace_fields(cfg, text_model=tmp + "/text", pretrained=True)
build_model(cfg.model, cfg.data, vocab_size=1000)
print("routine done", file=sys.stderr, flush=True)

# a checkpoint without the model's second layer: that report is not routine and stays
text.config.num_hidden_layers = 1
transformers.RobertaModel(text.config).save_pretrained(tmp + "/short")
cfg = replace_fields(cfg, text_model=tmp + "/short")
build_model(cfg.model, cfg.data, vocab_size=1000)
"""
SOURCES = (
    "reduce_scatter_tensor",
    "assuming the intent is to",
    "is an Enum subclass",
    "LOAD REPORT",
    "Loading weights",
)


def test_library_warnings_are_hidden_unless_verbose():
    from launch import free_port

    for mode in ("quiet", "verbose"):
        proc = subprocess.run(
            [sys.executable, "-c", NOISY, mode, str(free_port())],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=launch_env(),
            timeout=240,
        )
        routine, done, problem = proc.stderr.partition("routine done")
        assert proc.returncode == 0 and done, proc.stderr[-3000:]
        shown = [s for s in SOURCES if s in proc.stdout + routine]
        assert shown == ([] if mode == "quiet" else list(SOURCES)), (mode, proc.stderr[-3000:])
        # Weights the model needs that were not loaded: the report stays, quiet or not.
        assert "encoder.layer.1" in problem and proc.stderr.count("LOAD REPORT") == (1 if mode == "quiet" else 2)


def test_a_users_workload_runs_are_not_told_apart_by_the_builtins_own_settings(tmp_path, capsys):
    """A user's workload never reads the built-ins' dropout or text model (the new-user trial's two runs with identical
    losses were refused by parity); the framework's settings still count."""
    mine = {"workload.workload": "my_module:MyWorkload"}
    a = write_run(tmp_path / "a", config(**mine))
    b = write_run(tmp_path / "b", config(**mine, **{"model.dropout": 0.3, "model.text_model": "roberta-large"}))
    _, text = write_compare([str(a), str(b)], tmp_path / "cmp")
    assert "warning" not in text and "final losses differ by at most" in text
    assert cli.main(["parity", "--runs", f"{a},{b}"]) == 0
    c = write_run(tmp_path / "c", config(**mine, **{"train.seed": 7}))
    _, text = write_compare([str(a), str(c)], tmp_path / "cmp2")
    assert "runs differ in seed (--seed)" in text
    # the same settings still tell two built-in runs apart
    d = write_run(tmp_path / "d", config(**{"model.dropout": 0.3}))
    _, text = write_compare([str(write_run(tmp_path / "e", config())), str(d)], tmp_path / "cmp3")
    assert "warning: runs differ in dropout (--dropout): 0.1 (e) vs 0.3 (d)" in text


def test_parity_compares_finished_runs_of_other_lengths_on_the_steps_they_share(tmp_path, capsys):
    """A max_steps difference is a note (docs/observability.md), not a failure shown as a Python dict whose meaning
    flipped with the order of the runs."""
    a = write_run(tmp_path / "four", config(**{"train.max_steps": 4}), losses=(1.0, 0.9, 0.8, 0.7))
    b = write_run(tmp_path / "three", config(**{"train.max_steps": 3}), losses=(1.0, 0.9, 0.8))
    for runs in (f"{a},{b}", f"{b},{a}"):
        assert cli.main(["parity", "--runs", runs]) == 0
        out = capsys.readouterr().out
        assert "parity: note: compared the 3 steps every run logged (three has no step 4)" in out, out
    assert "{" not in out


def test_a_new_heads_load_report_is_routine_whichever_row_comes_first():
    """transformers 5's report of a fresh classifier head, as `export` of a trial's own BERT workload printed it: its
    first row ran on from the table's rule line, so `classifier.weight` was not read as the key and it stayed."""
    from shardtrain.runtime.chatter import _routine_load_report

    report = (
        "\x1b[1mBertForSequenceClassification LOAD REPORT\x1b[0m from: /tmp/base\nKey               | Status  | \n"
        "------------------+---------+-\nclassifier.weight | MISSING | \nclassifier.bias   | MISSING | \n\nNotes:\n"
        "- MISSING:\tthose params were newly initialized because missing from the checkpoint."
    )
    assert _routine_load_report(report)
    assert not _routine_load_report(report.replace("classifier.bias  ", "encoder.layer.1.x"))


def test_peft_reading_a_deprecated_transformers_property_is_not_shown_unless_verbose():
    """Every `--peft lora` command (train, export, predict) printed transformers 5's FutureWarning for peft's read of
    `is_gradient_checkpointing`, a trial found: the libraries' business, not the user's."""
    probe = (
        "import sys, warnings\nfrom shardtrain.runtime.chatter import quiet_libraries\n"
        "quiet_libraries(sys.argv[1] == 'verbose')\n"
        "warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6.', FutureWarning)\n"
    )
    for mode, shown in (("quiet", False), ("verbose", True)):
        proc = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0 and ("is_gradient_checkpointing" in proc.stderr) == shown, (mode, proc.stderr)
