"""Error reporting in one process: run_guarded's one line and exit codes, the checks no CPU run can reach
(bf16 on an old GPU), the output-dir probe, and metrics.jsonl left alone until a run really writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtrain import cli
from shardtrain.config.settings import ConfigError, check_output_dir, parse_cli
from shardtrain.observability.tracking import MetricsLog
from shardtrain.strategies.base import check_precision_supported

REPO = Path(__file__).resolve().parents[2]


def fail_with(exc):
    def fn(argv):
        raise exc

    return fn


def test_config_error_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert cli.run_guarded(fail_with(ConfigError("--lr (train.lr) must be positive, got 0.0")), []) == 2
    err = capsys.readouterr().err
    assert err == "shardtrain: error: --lr (train.lr) must be positive, got 0.0\n"


def test_runtime_error_is_one_line_exit_1(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert cli.run_guarded(fail_with(FloatingPointError("non-finite at step 3\nmore")), []) == 1
    err = capsys.readouterr().err
    # Raised in this file, which is user code to the guard, so the line also says where.
    line = fail_with.__code__.co_firstlineno + 2  # fn's raise
    assert err == (
        f"shardtrain: error: FloatingPointError: non-finite at step 3 (raised in fn, tests/unit/test_errors.py:{line}; "
        "--debug shows the traceback)\n"
    )


def test_debug_shows_the_traceback():
    with pytest.raises(FloatingPointError):
        cli.run_guarded(fail_with(FloatingPointError("x")), ["--debug"])


def test_other_ranks_speak_only_if_still_alive(capsys, monkeypatch):
    """Rank 1 waits (the launcher normally stops it in that time) and then names itself."""
    import signal

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "QUIET_SECONDS", 0.0)
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.run_guarded(fail_with(ConfigError("data/train.jsonl:7: empty text")), []) == 2
    finally:
        signal.signal(signal.SIGTERM, old)
    assert capsys.readouterr().err == "shardtrain: error (rank 1): data/train.jsonl:7: empty text\n"


@pytest.mark.parametrize("procid", ["0", "1"])
def test_under_plain_srun_one_task_says_a_config_error(capsys, monkeypatch, procid):
    """`srun python shardtrain/main.py` (main.py's docstring): srun sets SLURM_PROCID and SLURM_NTASKS, no RANK
    until the loop maps them. Every task took itself for rank 0 and said the error at once: one line per task."""
    import signal

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", procid)
    waited = []
    monkeypatch.setattr("time.sleep", waited.append)  # srun --kill-on-bad-exit stops task 1 in that time
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.run_guarded(fail_with(ConfigError("data/train.jsonl:7: empty text")), []) == 2
    finally:
        signal.signal(signal.SIGTERM, old)
    said = capsys.readouterr().err
    if procid == "0":
        assert waited == [] and said == "shardtrain: error: data/train.jsonl:7: empty text\n", said
    else:
        assert waited == [cli.QUIET_SECONDS], waited
        assert said == "shardtrain: error (rank 1): data/train.jsonl:7: empty text\n", said


def test_lost_peer_errors_are_secondary():
    assert cli._lost_peer(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]"))
    assert not cli._lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_bf16_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(
        ConfigError,
        match=r"--precision \(train.precision\)=bf16: Tesla V100-SXM2-32GB has no "
        r"bf16 support .*use --precision fp16",
    ):
        check_precision_supported("bf16", torch.device("cuda", 0))
    check_precision_supported("fp16", torch.device("cuda", 0))
    check_precision_supported("bf16", torch.device("cpu"))


def test_output_dir_probe(tmp_path):
    check_output_dir(str(tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists()  # the probe creates nothing
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"--output-dir \(checkpoint.output_dir\) .* is a file, not a folder"):
        check_output_dir(str(tmp_path / "f" / "run"))


def test_inject_nan_steps_flag(tmp_path):
    cfg = parse_cli(["--inject-nan-at-steps", "4,2", "--output-dir", str(tmp_path)])
    assert cfg.train.inject_nan_at_steps == [2, 4]
    with pytest.raises(ConfigError, match=r"--inject-nan-at-steps \(train.inject_nan_at_steps\)"):
        parse_cli(["--inject-nan-at-steps", "2,x", "--output-dir", str(tmp_path)])


def test_metrics_untouched_until_the_first_record(tmp_path):
    old = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(old)
    log = MetricsLog(tmp_path, rank=0, resume_step=0)
    log.close()  # a run that failed before its first step
    assert (tmp_path / "metrics.jsonl").read_text() == old
    log = MetricsLog(tmp_path, rank=0, resume_step=2)
    log.write({"step": 3, "loss": 0.5})
    log.close()
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1.0,
        1.0,
        0.5,
    ]


def users_module(tmp_path, monkeypatch, name: str, code: str):
    """`code` as the user's own module `name`, imported from the working directory (tmp_path), rank 0."""
    import importlib

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def test_an_error_in_the_users_own_code_names_the_method_file_and_line(tmp_path, capsys, monkeypatch):
    """A workload's build_model, datasets, forward or loss that raised said only `ValueError: ...`, and a loss
    reading batch["label"] said `KeyError: 'label'`, which pointed at the data; the line names the method now."""
    code = (
        "class MyTask:\n"
        "    def loss(self, outputs, batch):\n"
        "        return outputs - batch['label']\n"
        "def helper():\n"
        "    raise ValueError('bad width')\n"
    )
    tasks = users_module(tmp_path, monkeypatch, "my_tasks", code)
    assert cli.run_guarded(lambda argv: tasks.MyTask().loss(1, {"labels": 1}), []) == 1
    assert capsys.readouterr().err == (
        "shardtrain: error: KeyError: 'label' (raised in MyTask.loss, my_tasks.py:3; --debug shows the traceback)\n"
    )
    assert cli.run_guarded(lambda argv: tasks.helper(), []) == 1
    assert "ValueError: bad width (raised in helper, my_tasks.py:5;" in capsys.readouterr().err


def test_a_dataloader_workers_error_is_its_own_line_not_torchs_wrapper(tmp_path, capsys, monkeypatch):
    """With num_workers > 0 torch re-raises a worker's error as `Caught FileNotFoundError in DataLoader worker
    process 0.`: the path that was missing was lost from the one line."""
    from torch.utils.data import DataLoader, Dataset

    code = (
        "from torch.utils.data import Dataset\n"
        "class Images(Dataset):\n"
        "    def __len__(self):\n"
        "        return 2\n"
        "    def __getitem__(self, i):\n"
        "        return open(f'images/{i}.png', 'rb').read()\n"
    )
    images = users_module(tmp_path, monkeypatch, "my_data", code).Images()
    assert isinstance(images, Dataset)
    assert cli.run_guarded(lambda argv: next(iter(DataLoader(images, num_workers=1))), []) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "shardtrain: error: FileNotFoundError: [Errno 2] No such file or directory: 'images/0.png' (raised in "
        "__getitem__, my_data.py:6, in DataLoader worker process 0;"
    ), err
    assert err.count("\n") == 1


def test_a_consequence_waits_longer_than_the_error_that_caused_it(capsys, monkeypatch):
    """Rank 1's own error (a missing image in its shard) and rank 0's consequence of it (gloo: `Connection closed
    by peer`) both waited QUIET_SECONDS, so both were printed: the consequence must wait longer, and be stopped
    by the launcher once rank 1 has spoken and exited."""
    import signal
    import time

    waits = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    old = signal.getsignal(signal.SIGTERM)
    try:
        for rank, error in (
            ("1", FileNotFoundError("images/31.png")),
            ("0", RuntimeError("Connection closed by peer")),
        ):
            monkeypatch.setenv("RANK", rank)
            monkeypatch.setattr(time, "sleep", lambda s, rank=rank: waits.__setitem__(rank, s))
            cli.run_guarded(fail_with(error), [])
    finally:
        signal.signal(signal.SIGTERM, old)
    assert waits["0"] >= waits["1"] + 2.0, waits


def test_library_chatter_is_quieted_before_a_users_workload_module_is_imported(tmp_path, monkeypatch):
    """A user's tasks.py that imports transformers (and so torchao) at the top was imported before `train`
    quieted the libraries: two torch pytree deprecation lines per process, in every run of a user's workload."""
    import sys

    from shardtrain.runtime import chatter

    order = []
    monkeypatch.setattr(chatter, "quiet_libraries", lambda verbose: order.append("quiet"))
    (tmp_path / "noisy_tasks.py").write_text(
        "import builtins\nbuiltins._shardtrain_test_order.append('imported')\n"
        "from shardtrain import Workload\nclass Noisy(Workload):\n"
        "    def __init__(self, cfg):\n        super().__init__(cfg)\n"
    )
    monkeypatch.setattr("builtins._shardtrain_test_order", order, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noisy_tasks", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--workload", "noisy_tasks:Noisy", "--workload-args", '{"nope": 1}', "--output-dir", str(tmp_path / "o")]
    from shardtrain.commands import train

    assert cli.run_guarded(train.main, argv) == 2  # refused at its args, after the import
    assert order[:2] == ["quiet", "imported"], order


def test_transformers_imported_by_a_users_workload_module_shows_no_loading_bar(tmp_path):
    """The module imports transformers at its top, after the command quieted the libraries; transformers reads its
    progress-bar setting when imported, so `export` of such a run drew the "Loading weights" bar."""
    (tmp_path / "hf_tasks.py").write_text(
        "import transformers\nfrom shardtrain import Workload\nclass Hf(Workload):\n    pass\n"
    )
    code = (
        "import sys\n"
        "from shardtrain.runtime.chatter import quiet_libraries\n"
        "from shardtrain.config.settings import parse_cli\n"
        "from shardtrain.workloads.base import workload_class\n"
        "quiet_libraries(verbose=False)\n"
        "assert 'transformers' not in sys.modules\n"
        "workload_class(parse_cli(['--workload', 'hf_tasks:Hf']))\n"
        "from transformers.utils import logging\n"
        "print('bar', logging.is_progress_bar_enabled())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "bar False" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_consequence_after_the_launcher_began_stopping_the_job_says_nothing(capsys, monkeypatch):
    """Rank 1 said its error and exited; torchrun then SIGTERMs rank 0, which was still inside the collective
    and took the signal as a stop (the handler only sets a flag), and 6 s later said `Connection closed by peer`
    anyway: a second line for one failure. A lost peer after a stop signal is that stop's consequence."""
    import signal
    import time

    from shardtrain.runtime import preemption

    monkeypatch.setattr(preemption, "_stop_received", False)  # and back after the test: a process-wide record
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(time, "sleep", lambda s: None)
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        preemption.StopFlag()
        signal.raise_signal(signal.SIGTERM)  # the launcher's
        assert cli.run_guarded(fail_with(RuntimeError("Connection closed by peer [127.0.0.1]:1")), []) == 1
        assert capsys.readouterr().err == ""
        assert cli.run_guarded(fail_with(FloatingPointError("non-finite")), []) == 1  # its own error: said
        assert "FloatingPointError: non-finite" in capsys.readouterr().err
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
