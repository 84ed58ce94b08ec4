"""A user's workload beyond `train`: plan, check-data and parity take --workload (export and report:
tests/dist/test_your_own_model.py); --strategy auto plans it through its memory_model(), and refuses it in one
line without one."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from shardtrain import cli
from shardtrain.commands import parity
from shardtrain.config.settings import parse_cli

TASKS = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import Dataset
    from shardtrain import Workload

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(Block(), Block())
            self.head = nn.Linear(8, 3)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x):
            return self.head(self.blocks(x * self.scale))

    class Rows(Dataset):
        def __init__(self, n, broken_at=None, key="x"):
            self.n, self.broken_at, self.key = n, broken_at, key

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if i == self.broken_at:
                raise FileNotFoundError(f"images/{i}.png")
            return {self.key: torch.full((8,), float(i)), "labels": torch.tensor(i % 3)}

    class Tiny(Workload):
        def __init__(self, cfg, n=16, broken_at=None, key="x"):
            super().__init__(cfg, n=n, broken_at=broken_at, key=key)

        def build_model(self):
            return Net()

        def datasets(self):
            a = self.args
            return Rows(a["n"], a["broken_at"], a["key"]), Rows(4)

        def block_classes(self):
            return ("Block",)

    class Texts(Tiny):
        def collate(self, samples):
            return {"x": torch.stack([s["x"] for s in samples]), "labels": [int(s["labels"]) for s in samples]}

    class NoMeta(Tiny):
        def build_model(self):
            raise OSError("roberta-base is not in the cache")

    class CheckedData(Tiny):
        @classmethod
        def check_before_launch(cls, cfg):
            from shardtrain.config.settings import ConfigError

            raise ConfigError("CheckedData: /data/rows.parquet is not there")

    class Measured(Tiny):
        # A memory_model() of its own: what `plan` needs to predict activations for a model it does not know.

        def memory_model(self):
            workload = self

            class Measure:
                def vocab(self):
                    return None, "none: no text"

                def count(self, persistence_threshold, vocab_size):
                    from shardtrain.memory.planner import ModelCount

                    params = [p.numel() for p in workload.build_model().parameters()]
                    return ModelCount(sum(params), 8 * 8 + 8, sum(params), 4 * 8, layers=2, blocks=2)

                def saved_bytes(self, layers, seq_len, recompute, precision, batch, gathered_16bit):
                    # 4 bytes x 8 features saved per sample and layer (x 1 when checkpointed), and per token
                    return batch * seq_len * 32 * (layers or 2) * (1 if recompute else 3)

                def sample_lengths(self, seq_len):
                    return [4, 6, 8]

                def pad_multiple(self):
                    return None

                def check_offline(self):
                    return None

            return Measure()

    class OfflineTokenizer(Tiny):
        # The README's example: a tokenizer by hub name in __init__, on a machine with neither the hub nor the name
        def __init__(self, cfg, **args):
            super().__init__(cfg, **args)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained("shardtrain-test/never-downloaded")

    class FrozenBlocks(Tiny):
        def build_model(self):
            model = Net()
            for p in model.blocks.parameters():  # a pretrained part, frozen by hand
                p.requires_grad = False
            return model
""")
TINY_PARAMS = 2 * (8 * 8 + 8) + 8 * 3 + 3


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    (tmp_path / "user_tasks.py").write_text(TASKS)
    monkeypatch.chdir(tmp_path)  # the working directory is on the import path, as in training
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("user_tasks", None)
    yield tmp_path
    sys.modules.pop("user_tasks", None)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- plan ------------------------------------------------------------------------------------------------
def test_plan_counts_a_user_model_on_the_meta_device_and_says_what_it_cannot_predict(tasks, capsys):
    code, out, err = run_cli(capsys, "plan", "--workload", "user_tasks:Tiny", "--gpus", "2", "--gpu", "a100", "--json")
    assert code == 0, err
    p = json.loads(out)
    assert (p["workload"], p["model_params"], p["largest_unit_params"]) == ("Tiny", TINY_PARAMS, 8 * 8 + 8)
    rows = {r["variant"]: r["gpu_bytes"] for r in p["rows"]}
    # Model states as every strategy holds them: fp32 weights, grads and Adam's two moments, sharded or not.
    assert (rows["ddp"]["params"], rows["ddp"]["grads"], rows["ddp"]["optimizer"]) == (
        4 * TINY_PARAMS,
        4 * TINY_PARAMS,
        8 * TINY_PARAMS,
    )
    assert rows["fsdp"]["params"] == 4 * TINY_PARAMS / 2 and rows["zero3"]["optimizer"] == 12 * TINY_PARAMS / 2
    assert all(r["activations"] is None for r in rows.values()) and p["recommendation"] is None
    assert "not predicted for Tiny: it has no memory_model()" in p["activations"]
    code, out, _ = run_cli(capsys, "plan", "--workload", "user_tasks:Tiny", "--gpus", "2", "--gpu", "a100")
    assert out.startswith(f"plan: Tiny, {TINY_PARAMS:,} parameters") and "activations: not predicted for Tiny" in out


def test_plan_counts_what_build_model_froze_as_frozen(tasks, capsys):
    """No gradient and no optimizer state for the parameters the user's build_model froze."""
    code, out, err = run_cli(
        capsys, "plan", "--workload", "user_tasks:FrozenBlocks", "--gpus", "2", "--gpu", "a100", "--json"
    )
    assert code == 0, err
    p = json.loads(out)
    trainable = 8 * 3 + 3
    assert (p["model_params"], p["frozen_params"]) == (TINY_PARAMS, TINY_PARAMS - trainable)
    ddp = {r["variant"]: r["gpu_bytes"] for r in p["rows"]}["ddp"]
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4 * TINY_PARAMS, 4 * trainable, 8 * trainable)
    code, out, _ = run_cli(capsys, "plan", "--workload", "user_tasks:FrozenBlocks", "--gpus", "2", "--gpu", "a100")
    assert out.startswith(
        f"plan: FrozenBlocks, {TINY_PARAMS:,} parameters, {TINY_PARAMS - trainable:,} of them frozen"
    ), out


def test_plan_predicts_activations_for_a_workload_that_gives_a_memory_model(tasks, capsys):
    """The planner asks the workload (Workload.memory_model), as it asks the built-ins: a user's model with one
    gets the activation rows and a recommendation, not only its model states."""
    code, out, err = run_cli(
        capsys, "plan", "--workload", "user_tasks:Measured", "--gpus", "2", "--gpu", "a100", "--json"
    )
    assert code == 0, err
    p = json.loads(out)
    assert p["model_params"] == TINY_PARAMS and p["recommendation"] is not None
    ddp = next(r for r in p["rows"] if r["variant"] == "ddp" and not r["activation_checkpointing"])
    # Per sample and token 32 bytes x 3 x 2 layers, measured at lengths 4, 6, 8 and fitted; at max_length 128.
    micro = p["micro_batch_size"]
    assert ddp["gpu_bytes"]["activations"] == pytest.approx(micro * p["seq_len"] * 32 * 3 * 2, rel=1e-6)


def test_train_runs_a_workloads_own_check_before_any_process_starts(tasks, capsys):
    out = tasks / "run"
    code, _, err = run_cli(capsys, "train", "--workload", "user_tasks:CheckedData", "--output-dir", str(out))
    assert code == 2 and err.strip() == "shardtrain: error: CheckedData: /data/rows.parquet is not there", err
    assert not out.exists()


def test_train_constructs_the_workload_before_any_process_starts_and_names_what_it_loads(tasks, capsys, monkeypatch):
    """The README's example offline: --check-only passed, then every rank failed after the launch with
    transformers' line, which names no model (exit 1). Now the parent constructs the workload as the ranks will,
    and its __init__'s failure is one line, exit 2, naming the name it loaded, the method and the YAML line."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tasks / "run.yaml").write_text("workload:\n  target: user_tasks:OfflineTokenizer\n")
    out = tasks / "run"
    argv = ["train", "--config", "run.yaml", "--nproc", "2", "--output-dir", str(out)]
    for extra in (["--check-only"], []):
        code, printed, err = run_cli(capsys, *argv, *extra)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(
            "shardtrain: error: run.yaml:2: workload.target: constructing OfflineTokenizer: OSError: "
        )
        assert "(loading 'shardtrain-test/never-downloaded'; raised in OfflineTokenizer.__init__, user_tasks.py:" in err
        assert "starting 2 processes" not in printed and not out.exists()


def test_a_workload_named_in_yaml_is_refused_with_its_file_and_line(tasks, capsys):
    (tasks / "run.yaml").write_text("train:\n  max_steps: 3\nworkload:\n  target: user_tasks:Tinny\n")
    code, _, err = run_cli(capsys, "train", "--config", "run.yaml", "--check-only")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("shardtrain: error: run.yaml:4: workload.target: user_tasks has no Workload subclass named")


def test_plan_names_the_workload_method_that_fails(tasks, capsys):
    code, _, err = run_cli(capsys, "plan", "--workload", "user_tasks:NoMeta", "--gpus", "2", "--gpu", "a100")
    assert code == 2 and err.count("\n") == 1, err
    assert "plan: NoMeta.build_model() failed on the meta device" in err and "not in the cache" in err
    code, _, err = run_cli(capsys, "plan", "--gpus", "2", "--gpu", "a100")
    assert code == 2 and "plan: give --config FILE or --workload" in err


# ---- check-data ------------------------------------------------------------------------------------------
def test_check_data_batches_a_few_samples_with_the_workloads_collate(tasks, capsys):
    code, out, err = run_cli(capsys, "check-data", "--workload", "user_tasks:Tiny")
    assert code == 0, out + err
    assert "train: 16 samples; 4 batched by Tiny.collate into x (4, 8), labels (4,)" in out
    assert out.rstrip().endswith("Tiny: datasets() and collate give batches its model takes; no problems found")

    # A data setting that its datasets() never reads: train warns of it, and check-data said "no problems found".
    code, out, err = run_cli(capsys, "check-data", "--workload", "user_tasks:Tiny", "--train-file", "t.csv")
    assert code == 0, out + err
    assert "note: --train-file (data.train_file) names training data, but the workload's datasets() did not" in out


@pytest.mark.parametrize(
    "target, args, problem",
    [
        ("Tiny", {"broken_at": 2}, "Tiny.datasets() train item 2: FileNotFoundError: images/2.png"),
        ("Tiny", {"key": "pixels"}, "Tiny.collate gives keys labels, pixels, but Net.forward needs x"),
        (
            "Texts",
            {},
            "Texts.collate gives 'labels' as a list, and the default Workload.loss needs a tensor of class ids",
        ),
        ("Tiny", {"n": 0}, "Tiny.datasets() train is empty"),
    ],
)
def test_check_data_names_the_workload_method_of_each_problem(tasks, capsys, target, args, problem):
    code, out, err = run_cli(
        capsys, "check-data", "--workload", f"user_tasks:{target}", "--workload-args", json.dumps(args)
    )
    assert code == 1 and problem in out, out + err
    assert out.rstrip().endswith(f"problem(s) in {target}'s data")


def test_check_data_says_how_many_samples_it_read_and_all_reads_every_one(tasks, capsys):
    """It read 4 samples per split and said "no problems found": a missing image at row 11 then stopped the
    run. The clean line now says how much was read, and --samples all reads every item (batching a few)."""
    args = ["check-data", "--workload", "user_tasks:Tiny", "--workload-args", json.dumps({"broken_at": 11})]
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and "read 4 of 16 train samples and 4 of 4 validation: --samples all reads every one" in out
    code, out, err = run_cli(capsys, *args, "--samples", "all")
    assert code == 1 and "Tiny.datasets() train item 11: FileNotFoundError: images/11.png" in out, out + err
    assert "train: 16 samples; 4 batched by Tiny.collate" in out, out
    code, _, err = run_cli(capsys, *args, "--samples", "some")
    assert code == 2 and "check-data: --samples must be a positive number or all, got some" in err, err


def test_check_data_with_a_workload_takes_no_folder(tasks, capsys):
    code, _, err = run_cli(capsys, "check-data", "data/x", "--workload", "user_tasks:Tiny")
    assert code == 2 and err.count("\n") == 1, err
    assert "check-data: user_tasks:Tiny reads its own data in datasets(); drop the folder data/x" in err


def test_check_data_says_what_was_meant_when_the_arguments_mix_its_two_forms(tmp_path, capsys):
    """A new user's first tries (each used to be an error about something else): a folder after --config, --kind
    beside training flags, and a data kind given as --workload."""
    from shardtrain.config.settings import REPO
    from shardtrain.data import make_data

    data = make_data("longdoc", tmp_path / "ld", n_train=4, n_val=2, min_words=5, max_words=9)
    config = str(REPO / "configs" / "longformer_tiny.yaml")
    code, _, err = run_cli(capsys, "check-data", "--config", config, str(data))
    assert code == 2 and f"a folder goes first (check-data {data} --config ...) or as --data-dir {data}" in err, err
    code, _, err = run_cli(capsys, "check-data", "--config", config, "--kind", "longdoc", "--data-dir", str(data))
    assert code == 2 and "--kind is for a folder on its own (check-data DIR --kind KIND)" in err, err
    code, _, err = run_cli(capsys, "check-data", "--workload", "longdoc", str(data))
    assert code == 2 and "longdoc is a kind of records, not a workload: check-data DIR --kind longdoc" in err, err
    code, out, _ = run_cli(capsys, "check-data", str(data), "--config", config)
    assert code == 0 and out.strip().endswith("no problems found"), out


def test_check_data_without_arguments_asks_for_a_folder_and_a_missing_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """With no argument it used to check the default data.data_dir, data/multimodal, without saying so, and a
    missing folder was reported once per split."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "check-data")
    assert code == 2 and "check-data: give a dataset folder" in err and "data/multimodal" not in out + err, out + err
    code, out, err = run_cli(capsys, "check-data", "--data-dir", "nowhere", "--config", "x.yaml")
    assert code == 2 and "--config: file not found: x.yaml" in err, err
    (tmp_path / "c.yaml").write_text("model: {name: longformer}\n")
    code, out, err = run_cli(capsys, "check-data", "--config", "c.yaml", "--data-dir", "nowhere")
    lines = [line for line in out.splitlines() if "nowhere" in line]
    assert code == 1 and len(lines) == 2 and "folder not found: nowhere" in lines[0], out
    assert lines[1] == "1 problem(s) in nowhere", out


# ---- parity ----------------------------------------------------------------------------------------------
def test_parity_passes_the_workload_to_every_run(tasks, capsys, monkeypatch):
    launched = []

    def fake_run(cmd, cwd, env, stdout, stderr):
        launched.append((cmd, env))
        return type("Done", (), {"returncode": 1})()  # the first run "fails": parity stops there with exit 3

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    args = json.dumps({"n": 8})
    code = cli.main(
        [
            "parity",
            "--workload",
            "user_tasks:Tiny",
            "--workload-args",
            args,
            "--strategies",
            "ddp,fsdp",
            "--out",
            str(tasks / "p"),
        ]
    )
    cmd, env = launched[0]
    assert code == 3 and "--config" not in cmd, cmd
    assert cmd[cmd.index("--workload") + 1] == "user_tasks:Tiny" and cmd[cmd.index("--workload-args") + 1] == args
    assert str(tasks) in env["PYTHONPATH"].split(":")  # a script's folder, not the working directory, is on sys.path
    launched.clear()
    code = cli.main(["parity", "--workload", "user_tasks:Nope", "--strategies", "ddp,fsdp"])
    assert code == 2 and not launched  # one line, before any run
    assert "user_tasks has no Workload subclass named Nope" in capsys.readouterr().err


# ---- --strategy auto -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, instead",
    [
        (["--strategy", "auto"], "choose --strategy ddp, fsdp, zero2 or zero3"),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "4"], "use true, or every-N"),
    ],
)
def test_auto_settings_refuse_a_workload_without_a_memory_model_in_one_line(tasks, capsys, flags, instead):
    """They choose from predicted activations, which only the workload's memory_model() can give: one line, before
    any process starts, naming the setting and what to use instead."""
    out = tasks / "o"
    code, _, err = run_cli(capsys, "train", "--workload", "user_tasks:Tiny", *flags, "--output-dir", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert "=auto chooses from predicted activation memory, which needs a memory_model() that user_tasks:Tiny" in err
    assert instead in err and not out.exists()


def test_strategy_auto_plans_a_workload_that_gives_a_memory_model(tasks):
    """As it plans the built-ins: the planner measures the user's model through its memory_model() and the run
    gets a concrete strategy and batch geometry (a budget that fits DDP's model states and activations)."""
    import torch

    from shardtrain.memory.autoplan import resolve_auto_strategy
    from shardtrain.runtime.distributed import DistInfo
    from shardtrain.workloads.base import check_planned_settings, workload_class

    argv = ["--workload", "user_tasks:Measured", "--strategy", "auto", "--memory-budget-gb", "1"]
    cfg = parse_cli([*argv, "--output-dir", str(tasks / "o")])
    check_planned_settings(cfg, workload_class(cfg))
    one_rank = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    resolved, geometry, line = resolve_auto_strategy(cfg, one_rank)
    assert resolved.parallel.strategy == "ddp" and geometry.world == 1
    assert line.startswith("--strategy auto: ddp, activation checkpointing off"), line


@pytest.mark.parametrize("lengths", ["[seq_len]", "[8, 8]", "[0, 8]"])
def test_a_memory_model_whose_sample_lengths_cannot_be_fitted_is_named(tasks, capsys, lengths):
    """Two lengths fit a line, three a quadratic: one length, or the same twice, failed deep in the fit
    (ValueError: not enough values to unpack; ZeroDivisionError) without naming the method."""
    (tasks / "user_tasks.py").write_text(
        TASKS
        + textwrap.dedent(f"""
        class BadLengths(Measured):
            def memory_model(self):
                measure = super().memory_model()
                measure.sample_lengths = lambda seq_len: {lengths}
                return measure
        """)
    )
    code, _, err = run_cli(
        capsys, "plan", "--workload", "user_tasks:BadLengths", "--gpus", "2", "--gpu", "a100", "--json"
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "Measure.sample_lengths(128) gave" in err and "2 distinct positive lengths" in err, err


def test_train_refuses_workload_args_the_constructor_does_not_take_before_any_process_starts(tasks, capsys):
    """The constructor's signature, checked without constructing: with --nproc 2 a wrong key failed in every
    rank, after `starting 2 processes`."""
    out = tasks / "run"
    argv = ["train", "--workload", "user_tasks:Tiny", "--workload-args", '{"size": 8}', "--nproc", "2"]
    code, printed, err = run_cli(capsys, *argv, "--output-dir", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert "--workload-args (workload.args): Tiny(size): " in err and "unexpected keyword argument 'size'" in err
    assert "starting 2 processes" not in printed and not out.exists()
    # A near miss is named with the argument meant, as a YAML key's typo is; the accepted ones are listed.
    argv[4] = '{"brokenat": 3}'
    code, _, err = run_cli(capsys, *argv, "--output-dir", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert "unexpected keyword argument 'brokenat'; did you mean 'broken_at'? (Tiny takes n, broken_at, key)" in err
