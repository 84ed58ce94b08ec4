"""Bad input never crashes obscurely and never loses work, through the real CLI.

Every failing case asserts: the exit code (2 for config/data errors, 1 for runtime ones), one
`shardtrain: error` line naming the key/flag/file/line, no "Traceback", and a previous run's output
directory left byte-for-byte as it was (names, mtimes, hashes). Config cases fail before torch is even
imported (~0.3 s each); the cases that need the strategy's files, the model or data run one process;
the numerics and one-rank-only cases run two.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import launch
import pytest
import yaml
from launch import REPO, cli

TINY = REPO / "configs" / "multimodal_tiny.yaml"
# Small enough to train in seconds; steps-per-epoch far above max-steps so no epoch wraps.
# --resume auto: every case points at the previous run's folder (4 steps), where --resume none is itself
# refused; 8 steps make a resumed case train on, so errors met only while loading data still surface.
SHORT = ["--max-steps", "8", "--per-device-batch-size", "4", "--resume", "auto"]


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def train(data: Path, out: Path, *extra: str, config: Path = TINY, nproc: int = 1, **kw):
    return cli(
        [
            "train",
            "--config",
            str(config),
            "--data-dir",
            str(data),
            "--output-dir",
            str(out),
            *SHORT,
            "--nproc",
            str(nproc),
            *extra,
        ],
        check=False,
        **kw,
    )


def error_line(run, code: int) -> str:
    out = run.output
    assert run.returncode == code, f"exit {run.returncode}, wanted {code}:\n{run.tail()}"
    assert "Traceback" not in out, run.tail()
    lines = [line for line in out.splitlines() if line.startswith("shardtrain: error")]
    assert len(lines) == 1, f"wanted one error line, got {len(lines)}:\n{run.tail()}"
    return lines[0]


def write_yaml(path: Path, base: Path = TINY, **sections) -> Path:
    data = yaml.safe_load(base.read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


def copy_data(src: Path, dst: Path, edit=None, images: str = "link") -> Path:
    """A data folder whose jsonl files can be edited; images are linked (shared) unless copied."""
    dst.mkdir(parents=True)
    for name in ("train.jsonl", "validation.jsonl"):
        shutil.copy(src / name, dst / name)
    if images == "link":
        (dst / "images").symlink_to(src / "images")
    else:
        shutil.copytree(src / "images", dst / "images")
    if edit:
        lines = (dst / "train.jsonl").read_text().splitlines()
        (dst / "train.jsonl").write_text("\n".join(edit(lines)) + "\n")
    return dst


def set_line(n: int, text: str):
    return lambda lines: [text if i == n - 1 else line for i, line in enumerate(lines)]


def record(lines, n: int, **change) -> str:
    obj = json.loads(lines[n - 1])
    obj.update(change)
    for k in [k for k, v in change.items() if v is ...]:
        del obj[k]
    return json.dumps(obj)


# ---- a previous, finished run: NaN skipped on one rank, bad samples skipped, a checkpoint saved -----


@pytest.fixture(scope="module")
def previous(tmp_path_factory, mm_data):
    """Its output folder is what every failing case below must leave untouched."""
    tmp = tmp_path_factory.mktemp("bad_input")
    data = copy_data(
        mm_data,
        tmp / "skip_data",
        lambda lines: lines + [record(lines, 1, text="   "), record(lines, 2, image="images/train/missing.png")],
    )
    run = train(
        data,
        tmp / "previous",
        "--strategy",
        "ddp",
        "--skip-bad-samples",
        "--inject-nan-at-steps",
        "2",
        "--save-every",
        "4",
        "--max-steps",
        "4",
        nproc=2,
    ).check()
    return run


def test_skip_policy_skips_on_every_rank_and_counts(previous):
    s, metrics, out = previous.summary, previous.metrics, previous.output
    assert s["nonfinite_steps"] == 1 and s["overflow_steps"] == 0 and s["final_step"] == 4
    # Logged once (rank 0), naming the rank that saw it and the step.
    assert out.count("non-finite loss") == 1 and "step 2: non-finite loss on rank 1" in out
    assert [m["nonfinite_steps"] for m in metrics] == [0, 1, 1, 1]
    # The update was skipped on both ranks alike: the weights stayed finite, so later steps train.
    assert all(m["loss"] == m["loss"] and abs(m["loss"]) < 1e3 for m in metrics[2:])
    assert s["bad_samples_skipped"] == {"train": 2, "validation": 0}
    assert "--skip-bad-samples: skipped 2 bad train records" in out and "empty text" in out


def test_predict_says_which_rows_skip_bad_samples_left_out(previous, tmp_path, capsys):
    """Predicting a split of a --skip-bad-samples run left its bad rows out without a word (a user's trial: 26
    lines for 30 rows). In this process, through the console script's own function: its work is a CPU forward."""
    from shardtrain import cli

    capsys.readouterr()
    code = cli.main(["predict", str(previous.output_dir), "--split", "train", "--output", str(tmp_path / "p.jsonl")])
    out = capsys.readouterr().out
    assert code == 0 and "predict: --skip-bad-samples left 2 rows of the train split out, e.g. " in out, out
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == previous.summary["train_examples"]


def test_predict_names_the_way_to_rows_training_refuses(previous, mm_data, tmp_path, capsys):
    """A split with an unlabelled row stopped predict with training's message alone, and predict --file
    predicted a row with no text without a word. In this process, as above."""
    from shardtrain import cli

    run_dir = str(previous.output_dir)
    data = copy_data(mm_data, tmp_path / "data", lambda lines: [record(lines, 3, label=...), *lines[3:6]])
    capsys.readouterr()
    flags = ["--split", "train", "--data-dir", str(data), "--skip-bad-samples", "false"]
    assert cli.main(["predict", run_dir, *flags, "--output", str(tmp_path / "s.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardtrain: error: {data / 'train.jsonl'}:1: ") and "\n" not in err, err
    assert err.endswith("--file F predicts every row of F, one without a label or a text too)"), err
    lines = (mm_data / "validation.jsonl").read_text().splitlines()[:4]
    (tmp_path / "images").symlink_to(mm_data / "images")
    (tmp_path / "some.jsonl").write_text("\n".join([lines[0], record(lines, 2, text=""), *lines[2:]]) + "\n")
    assert (
        cli.main(["predict", run_dir, "--file", str(tmp_path / "some.jsonl"), "--output", str(tmp_path / "f.jsonl")])
        == 0
    )
    out = capsys.readouterr().out
    assert f"predict: 1 row of {tmp_path / 'some.jsonl'} has no text, e.g. {tmp_path / 'some.jsonl'}:2: " in out, out
    assert len((tmp_path / "f.jsonl").read_text().splitlines()) == 4


# ---- config: all fail before torch is imported (or, for the strategy's own files, before any process group)


def config_cases(tmp: Path, mm: Path) -> list:
    (tmp / "bad.json").write_text('{\n  "zero_optimization": {"stage": 2,}\n}\n')
    (tmp / "binary.json").write_bytes(b"\xff\xfe\x00garbage")

    def ds(name: str, obj: dict) -> str:
        (tmp / name).write_text(json.dumps(obj))
        return str(tmp / name)

    (tmp / "policy_bad.yaml").write_text("wrap_classes: [RobertaLayer\nreshard_after_forward: true\n")
    (tmp / "policy_key.yaml").write_text("wrap_class: [RobertaLayer]\n")
    return [
        (
            "unknown key",
            ["--config", str(write_yaml(tmp / "k.yaml", train={"max_step": 3}))],
            ["unknown key 'train.max_step'", "did you mean 'max_steps'"],
        ),
        ("unknown flag", ["--per-device-batchsize", "4"], ["--per-device-batchsize", "did you mean"]),
        ("wrong type flag", ["--max-steps", "ten"], ["--max-steps", "expected an integer"]),
        (
            "wrong type yaml",
            ["--config", str(write_yaml(tmp / "t.yaml", train={"lr": "fast"}))],
            ["train.lr", "expected a number"],
        ),
        ("zero batch", ["--per-device-batch-size", "0"], ["--per-device-batch-size", "must be positive"]),
        ("negative accum", ["--grad-accum", "-2"], ["--grad-accum (train.grad_accum) must be positive"]),
        ("zero lr", ["--lr", "0"], ["--lr (train.lr) must be positive"]),
        ("negative lr", ["--lr=-1e-3"], ["--lr (train.lr) must be positive"]),
        ("negative lr, argparse", ["--lr", "-1e-3"], ["--lr", "expected one argument", "write it as --flag=-1e-3"]),
        ("unknown precision", ["--precision", "fp8"], ["--precision", "'fp8' is not one of fp32, bf16, fp16"]),
        ("unknown strategy", ["--strategy", "zero9"], ["--strategy", "'zero9' is not one of"]),
        (
            "ds with fsdp",
            ["--strategy", "fsdp", "--ds", str(REPO / "ds_configs/zero2.json")],
            ["selects DeepSpeed, but --strategy is 'fsdp'"],
        ),
        ("ds missing", ["--ds", str(tmp / "nope.json")], ["--ds", "file not found", "nope.json"]),
        ("ds not text", ["--ds", str(tmp / "binary.json")], ["--ds", "binary.json", "UTF-8"]),
        ("ds invalid json", ["--ds", str(tmp / "bad.json")], ["bad.json: invalid JSON at line 2, column"]),
        (
            "ds micro batch",
            ["--ds", ds("mb.json", {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}})],
            ['"train_micro_batch_size_per_gpu": 8 contradicts --per-device-batch-size=4'],
        ),
        (
            "ds global batch",
            ["--ds", ds("gb.json", {"train_batch_size": 64, "zero_optimization": {"stage": 2}})],
            ['"train_batch_size": 64 != per-device batch 4 x grad accum 1 x world size 1 = 4'],
        ),
        (
            "ds stage",
            ["--ds", ds("s4.json", {"zero_optimization": {"stage": 4}})],
            ["zero_optimization.stage=4 is not one of 1, 2, 3"],
        ),
        (
            "ds offload_param stage 2",
            ["--ds", ds("op.json", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})],
            ["offload_param needs stage 3"],
        ),
        (
            "policy invalid yaml",
            ["--strategy", "fsdp", "--fsdp-policy", str(tmp / "policy_bad.yaml")],
            ["policy_bad.yaml: line", "invalid YAML"],
        ),
        (
            "policy unknown key",
            ["--strategy", "fsdp", "--fsdp-policy", str(tmp / "policy_key.yaml")],
            ["unknown key 'wrap_class'", "did you mean 'wrap_classes'"],
        ),
        (
            "policy missing",
            ["--strategy", "fsdp", "--fsdp-policy", str(tmp / "none.yaml")],
            ["--fsdp-policy", "file not found"],
        ),
        (
            "unfreeze beyond max_steps",
            ["--freeze-layers", "1", "--unfreeze-at-step", "100"],
            ["--unfreeze-at-step (model.unfreeze_at_step)=100 is outside 1..max_steps (8)"],
        ),
        ("nan injection not steps", ["--inject-nan-at-steps", "two"], ["--inject-nan-at-steps", "step numbers"]),
        (
            "batch larger than a rank's share",  # was refused by each rank, after the launch, data and model
            ["--nproc", "2", "--max-train-samples", "3", "--per-device-batch-size", "2"],
            [
                "--per-device-batch-size (train.per_device_batch_size)=2 is larger than each rank's share of the "
                "training set (3 examples // world size 2 = 1): an epoch would have no batch"
            ],
        ),
    ]


def test_config_errors(previous, mm_data, tmp_path):
    """One subprocess per case; collected in one test so a failure lists every broken case at once."""
    out = previous.output_dir
    before = snapshot(out)
    failures = []
    for name, args, needles in config_cases(tmp_path, mm_data):
        run = train(mm_data, out, *args)
        try:
            line = error_line(run, 2)
            missing = [n for n in needles if n not in line]
            assert not missing, f"{missing} not in: {line}"
        except AssertionError as e:
            failures.append(f"[{name}] {e}")
    assert snapshot(out) == before
    assert not failures, "\n".join(failures)


def test_output_dir_not_writable(previous, mm_data, tmp_path):
    (tmp_path / "a_file").write_text("x")
    for out, needle in (
        (tmp_path / "a_file" / "run", "a_file is a file, not a folder"),
        (Path("/proc/shardtrain-test/run"), "cannot write in /proc"),
    ):
        line = error_line(train(mm_data, out), 2)
        assert "--output-dir (checkpoint.output_dir)" in line and needle in line


# ---- data: found after the process group, before the model is built --------------------------------


def data_cases(tmp: Path, mm: Path) -> list:
    train_file = lambda d: str(d / "train.jsonl")  # noqa: E731
    no_val = copy_data(mm, tmp / "no_val")
    (no_val / "validation.jsonl").unlink()
    cases = [
        ("missing folder", tmp / "nope", [f"--data-dir (data.data_dir): folder not found: {tmp / 'nope'}"]),
        ("missing split", no_val, ["split file not found", str(no_val / "validation.jsonl")]),
    ]
    for name, edit, needle in (
        ("malformed jsonl", set_line(7, '{"text": "a", "label": '), ":7: invalid JSON"),
        ("missing field", lambda ls: set_line(9, record(ls, 9, label=...))(ls), ":9: missing field 'label'"),
        ("label out of range", lambda ls: set_line(3, record(ls, 3, label=7))(ls), ":3: label 7 is outside 0..2"),
        ("label not int", lambda ls: set_line(4, record(ls, 4, label=1.5))(ls), ":4: label 1.5 is not an integer"),
        ("empty text", lambda ls: set_line(5, record(ls, 5, text=""))(ls), ":5: empty text"),
        (
            "missing image",
            lambda ls: set_line(6, record(ls, 6, image="images/train/gone.png"))(ls),
            ":6: image not found: images/train/gone.png",
        ),
    ):
        d = copy_data(mm, tmp / name.replace(" ", "_"), edit)
        cases.append((name, d, [train_file(d) + needle]))
    # Every training image corrupt, so the first batch finds one whichever records the sampler picks.
    corrupt = copy_data(mm, tmp / "corrupt", images="copy")
    for png in (corrupt / "images" / "train").iterdir():
        png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    cases.append(("corrupt image", corrupt, [train_file(corrupt) + ":", "cannot decode image images/train/"]))
    return cases


def test_data_errors(previous, mm_data, tmp_path):
    out = previous.output_dir
    before = snapshot(out)
    failures = []
    for name, data, needles in data_cases(tmp_path, mm_data):
        line = ""
        try:
            line = error_line(train(data, out), 2)
            missing = [n for n in needles if n not in line]
            assert not missing, f"{missing} not in: {line}"
        except AssertionError as e:
            failures.append(f"[{name}] {e}")
    assert snapshot(out) == before
    assert not failures, "\n".join(failures)


def test_check_data_lists_every_problem(mm_data, tmp_path):
    data = copy_data(
        mm_data,
        tmp_path / "d",
        lambda ls: [ls[0], "not json", record(ls, 3, label=9), record(ls, 4, text=" "), *ls[4:]],
    )
    run = cli(["check-data", str(data)], check=False)
    assert run.returncode == 1 and "Traceback" not in run.output
    for needle in (":2: invalid JSON", ":3: label 9 is outside", ":4: empty text", "3 problem(s)"):
        assert needle in run.output, run.tail()


# ---- strategy checks that need the model ---------------------------------------------------------


def test_fsdp_policy_needing_the_model(previous, mm_data, tmp_path):
    out = previous.output_dir
    before = snapshot(out)
    (tmp_path / "typo.yaml").write_text("wrap_classes: [RobertaLayr]\n")
    (tmp_path / "nothing.yaml").write_text("min_params: 1000000000000\n")
    line = error_line(train(mm_data, out, "--strategy", "fsdp", "--fsdp-policy", str(tmp_path / "typo.yaml")), 2)
    assert "typo.yaml: wrap_classes names unknown class 'RobertaLayr'; did you mean 'RobertaLayer'?" in line
    line = error_line(train(mm_data, out, "--strategy", "fsdp", "--fsdp-policy", str(tmp_path / "nothing.yaml")), 2)
    assert "nothing.yaml wraps nothing in this model" in line
    assert snapshot(out) == before


# ---- environment ----------------------------------------------------------------------------------


def test_master_port_in_use(previous, mm_data):
    """A plain process (or srun task) takes MASTER_PORT from the environment. torchrun --master-port
    binds the port itself and fails in its own code, before shardtrain runs: `shardtrain train --nproc N`
    (torchrun --standalone) picks a free port and cannot hit this."""
    out = previous.output_dir
    before = snapshot(out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = train(mm_data, out, env=launch.test_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    line = error_line(run, 2)
    assert f"master port 127.0.0.1:{port} is in use" in line and "MASTER_PORT" in line
    assert snapshot(out) == before


# ---- numerics and one-rank failures: two processes, bounded time ---------------------------------


@pytest.mark.parametrize(
    "strategy", [["--strategy", "fsdp"], ["--ds", str(REPO / "ds_configs/zero2.json")]], ids=["fsdp", "zero2"]
)
def test_skip_then_abort_after_max_bad_steps(mm_data, tmp_path, strategy):
    run = train(
        mm_data,
        tmp_path / "out",
        *strategy,
        "--inject-nan-at-steps",
        "2,4,5",
        "--max-bad-steps",
        "2",
        "--max-steps",
        "6",
        nproc=2,
    )
    line = error_line(run, 1)
    assert "FloatingPointError" in line and "2 consecutive non-finite steps up to step 5" in line
    assert "step 2: non-finite loss on rank 1" in run.output
    metrics = run.metrics
    # Step 2 skipped on every rank; step 3 trained from finite weights; step 4 skipped again.
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and [m["nonfinite_steps"] for m in metrics] == [0, 1, 1, 2]
    assert metrics[2]["loss"] == metrics[2]["loss"] and metrics[2]["grad_norm"] == metrics[2]["grad_norm"]


def test_abort_policy(previous, mm_data):
    out = previous.output_dir
    before = snapshot(out)
    # Resumed from the previous run's step 4, so step 5 is the first step this run trains.
    line = error_line(train(mm_data, out, "--nan-policy", "abort", "--inject-nan-at-steps", "5"), 1)
    assert "non-finite" in line and "step 5" in line and "--nan-policy abort" in line
    assert snapshot(out) == before


def test_error_on_one_rank_only(previous, mm_data, tmp_path):
    """Rank 1's next batch is all corrupt images; rank 0's is fine and waits in the gradient all-reduce.
    Rank 1 alone says what is wrong; torchrun then stops rank 0; nothing hangs."""
    import torch.utils.data as tud

    data = copy_data(mm_data, tmp_path / "d", images="copy")
    lines = (data / "train.jsonl").read_text().splitlines()
    sampler = tud.DistributedSampler(range(len(lines)), num_replicas=2, rank=1, shuffle=True, seed=42, drop_last=True)
    # The run resumes the previous one at step 4: rank 1 has read 4 batches of 4 and loads samples 16..19 next.
    first = list(sampler)[16:20]
    for i in first:
        (data / json.loads(lines[i])["image"]).write_bytes(b"not an image")
    out = previous.output_dir
    before = snapshot(out)
    line = error_line(train(data, out, "--strategy", "ddp", nproc=2, timeout=180), 2)
    assert line.startswith("shardtrain: error (rank 1): ") and "cannot decode image" in line
    assert f"train.jsonl:{first[0] + 1}:" in line
    assert snapshot(out) == before
