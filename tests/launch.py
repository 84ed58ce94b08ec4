"""The one way tests start shardtrain: real processes through the entry points users run.

Nothing is retried: a failed launch fails the test with the tail of its output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "shardtrain" / "main.py"
BIN = Path(sys.executable).parent
DEFAULT_TIMEOUT = 240
# Its sitecustomize makes every Python process print its stacks on SIGUSR2: see dump_stacks.
STACK_DUMPS = Path(__file__).resolve().parent / "stack_dumps"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline",
            # MLflow sends usage data from every process that imports it; nothing here may call out.
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # DeepSpeed's JIT-built ops (shm_comm, cpu_adam) are cached once beside the venv.
            "TORCH_EXTENSIONS_DIR": env.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")),
            "PYTHONPATH": os.pathsep.join((str(REPO), str(STACK_DUMPS), env.get("PYTHONPATH", ""))),
            # As if the venv were activated: DeepSpeed's JIT builds use the venv's ninja. Debian's ninja 1.11 and
            # the venv's 1.13 hash build commands differently and rebuilt the shared op cache for each other.
            "PATH": str(BIN) + os.pathsep + env.get("PATH", ""),
        }
    )
    env.pop("RANK", None)
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


test_env.__test__ = False  # a helper, not a test, wherever it is imported


@dataclass
class Run:
    cmd: list[str]
    returncode: int
    output: str
    output_dir: Path | None

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])

    def check(self) -> "Run":
        assert self.returncode == 0, f"exit {self.returncode}: {' '.join(self.cmd)}\n{self.tail()}"
        return self

    @property
    def summary(self) -> dict:
        return json.loads((self.output_dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        lines = (self.output_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def _output_dir(args: list[str]) -> Path | None:
    if "--output-dir" in args:
        return Path(args[args.index("--output-dir") + 1])
    return None


def run(
    cmd: list[str], timeout: float = DEFAULT_TIMEOUT, env: dict | None = None, cwd: Path = REPO, check: bool = True
) -> Run:
    started = _launch_clock()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or test_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        result = Run(cmd, proc.returncode, stdout + stderr, _output_dir(cmd))
    except subprocess.TimeoutExpired:
        dump_stacks(proc.pid)
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        out = stdout + stderr
        raise AssertionError(f"timed out after {timeout}s (a hang?): {' '.join(cmd)}\n{out[-30000:]}") from None
    except BaseException:
        kill_tree(proc.pid)
        raise
    _log_launch(cmd, started)
    return result.check() if check else result


def _launch_clock() -> tuple[float, float] | None:
    if not os.environ.get("SHARDTRAIN_TEST_CPU_LOG"):
        return None
    import resource
    import time

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), children.ru_utime + children.ru_stime


def _log_launch(cmd: list[str], started: tuple[float, float] | None) -> None:
    """With SHARDTRAIN_TEST_CPU_LOG (tests/conftest.py), one more line per launch: which test made it, the command
    and what it cost, so that the suite's launches can be counted and compared, not only its tests."""
    if started is None:
        return
    import resource
    import time

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = {
        "launch": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "cmd": [Path(c).name if os.sep in c and Path(c).is_absolute() else c for c in cmd],
        "wall_s": time.monotonic() - started[0],
        "cpu_s": children.ru_utime + children.ru_stime - started[1],
    }
    with open(os.environ["SHARDTRAIN_TEST_CPU_LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


def dump_stacks(pid: int, wait: float = 3.0) -> None:
    """Every thread's stack of the process and its descendants, into their own stderr (tests/stack_dumps/), so
    that a hang's failure says where each process waited. Only for a launch about to be killed: a process
    without that handler (not Python) dies of the signal."""
    import signal
    import time

    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGUSR2)
        except psutil.NoSuchProcess:
            pass
    time.sleep(wait)


def kill_tree(pid: int) -> None:
    """The process and all its descendants. `shardtrain train --nproc 2` runs torchrun, which starts each
    worker in a session of its own: killing the first process (or its group) would leave workers behind."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def torchrun(
    args: list[str],
    nproc: int = 2,
    check: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    extra_launcher_args: list[str] = (),
    script: Path = MAIN,
) -> Run:
    # `script`: a test driver that calls shardtrain.loop.train.Trainer(cfg).train() for several configs in one
    # process group (one launch instead of many); everything else goes through MAIN, the file users run.
    return run(torchrun_cmd(args, nproc, extra_launcher_args, script), timeout=timeout, env=env, check=check)


def torchrun_cmd(
    args: list[str], nproc: int = 2, extra_launcher_args: list[str] = (), script: Path = MAIN
) -> list[str]:
    return [
        str(BIN / "torchrun"),
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *extra_launcher_args,
        str(script),
        *args,
    ]


DRIVER = REPO / "tests" / "dist" / "matrix_driver.py"


def run_plan(
    plan: list[dict],
    root: Path,
    timeout: float,
    tail: int = 40,
    env: dict | None = None,
    extra_launcher_args: list[str] = (),
    fresh: bool = False,
) -> tuple[Run, dict]:
    """Many configurations through tests/dist/matrix_driver.py: (the launch, or this plan's part of it, and the
    results by run name). Fails with the output's tail when the plan did not finish or a planned run is missing
    from the results. A plan with the tests' own environment and launcher runs in this pytest worker's serving
    launch (DriverService), after the plans that ran there before it; one with `env` or `extra_launcher_args`
    gets a launch of its own, and so does a `fresh` one: a reference compared bit for bit with runs in processes
    of their own, which whatever a library leaves behind in a process would move first. (Served after other
    files' plans, the kill tests' FSDP and ZeRO-2 references once differed from their killed runs in the seventh
    digit: an earlier ZeRO-3 run had left DeepSpeed's linear in torch's place, which shardtrain now gives back.)
    Under `--max-restarts N` a restarted driver runs the plan again from its first run."""
    (root / "plan.json").write_text(json.dumps(plan))
    if env is None and not extra_launcher_args and not fresh:
        run = DriverService.current().run(root / "plan.json", root, timeout)
    else:
        run = torchrun(
            [str(root / "plan.json"), str(root)],
            script=DRIVER,
            timeout=timeout,
            check=False,
            env=env,
            extra_launcher_args=extra_launcher_args,
        )
    results_file = root / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    missing = [p["name"] for p in plan if p["name"] not in results]
    assert run.returncode == 0 and not missing, f"exit {run.returncode}, did not run: {missing}\n{run.tail(tail)}"
    return run, results


# CPU seconds the serving launches spent on jobs, not yet in RUSAGE_CHILDREN (tests/conftest.py's CPU log).
SERVED_CPU = [0.0]


def _log_served(plan: Path, cpu_s: float) -> None:
    if not os.environ.get("SHARDTRAIN_TEST_CPU_LOG"):
        return
    line = {"launch": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "served": str(plan), "cpu_s": cpu_s}
    with open(os.environ["SHARDTRAIN_TEST_CPU_LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


class DriverService:
    """One launch of tests/dist/matrix_driver.py --serve per pytest worker, which runs the plans of every test
    file that worker gets: the launch's start (torchrun's agent, each rank's imports, DeepSpeed's first engine;
    about 11 CPU-s on the dev machine) is paid once per worker instead of once per file. Started at the first
    plan; a plan that ended the launch (a failure, a probe) leaves the next one a new launch. tests/conftest.py
    stops it at the end of the session."""

    _current: "DriverService | None" = None

    def __init__(self):
        import tempfile

        self.queue = Path(tempfile.mkdtemp(prefix="shardtrain-driver-"))
        self.log_path = self.queue / "output.log"
        self.cmd = torchrun_cmd(["--serve", str(self.queue), str(os.getpid())], script=DRIVER)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=test_env(), stdout=self.log, stderr=subprocess.STDOUT)
        self.jobs = 0

    @classmethod
    def current(cls) -> "DriverService":
        if cls._current is None or cls._current.proc.poll() is not None:
            cls._current = cls()
        return cls._current

    @classmethod
    def stop_current(cls) -> None:
        if cls._current is not None:
            cls._current.stop()
            cls._current = None

    def run(self, plan: Path, out: Path, timeout: float) -> Run:
        import time

        job, self.jobs = self.jobs, self.jobs + 1
        start, cpu = self.log_path.stat().st_size, self._cpu()
        request = self.queue / f"job-{job}.json"
        request.with_suffix(".tmp").write_text(json.dumps({"plan": str(plan), "out": str(out)}))
        request.with_suffix(".tmp").rename(request)
        done, deadline = self.queue / f"done-{job}.json", time.monotonic() + timeout
        while not done.exists() and self.proc.poll() is None:
            if time.monotonic() > deadline:
                dump_stacks(self.proc.pid)
                output = self._output(start)
                self._end(kill=True)
                raise AssertionError(f"timed out after {timeout}s (a hang?): {plan}\n{output[-30000:]}")
            time.sleep(0.05)
        finished = done.exists()
        spent, output = self._cpu() - cpu, self._output(start)
        SERVED_CPU[0] += spent
        if not finished or json.loads(done.read_text())["retire"]:
            self._end()
        _log_served(plan, spent)
        return Run(self.cmd, 0 if finished else (self.proc.returncode or 1), output, None)

    def stop(self) -> None:
        (self.queue / "stop").touch()
        self._end()

    def _end(self, kill: bool = False) -> None:
        # Reaped, the launch's whole CPU lands in this process's RUSAGE_CHILDREN, where the jobs' share already
        # counted (SERVED_CPU) would count twice.
        SERVED_CPU[0] -= self._cpu()
        try:
            if not kill:
                self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill = True
        if kill:
            kill_tree(self.proc.pid)
            self.proc.wait()
        self.log.close()
        import shutil

        shutil.rmtree(self.queue, ignore_errors=True)
        if DriverService._current is self:
            DriverService._current = None

    def _output(self, start: int) -> str:
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            return f.read()

    def _cpu(self) -> float:
        """CPU seconds of the launch's processes so far (they are reaped only when it ends)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total


def torchrun_nodes_cmd(
    args: list[str],
    nproc: int = 1,
    nnodes: str = "2",
    endpoint: str = "node1:29400",
    extra_launcher_args: list[str] = (),
    script: Path = MAIN,
) -> list[str]:
    """One node's torchrun of a multi-node job, joined through c10d rendezvous at `endpoint` (run it on each
    node of tests/hosts.py's namespace hosts: node.wrap(cmd))."""
    return [
        str(BIN / "torchrun"),
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        *extra_launcher_args,
        str(script),
        *args,
    ]


def run_together(
    cmds: list[list[str]], timeout: float = DEFAULT_TIMEOUT, env: dict | None = None, check: bool = True
) -> list[Run]:
    """Start every command at once (one per node), wait for all; on a timeout every one is killed and the test
    fails with each one's tail. Runs come back in the order given."""
    import tempfile
    import time

    logs = [tempfile.TemporaryFile("w+") for _ in cmds]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env or test_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
        for cmd, log in zip(cmds, logs)
    ]
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.poll() is None for p in procs]
        for proc, hung in zip(procs, timed_out):
            if hung:
                dump_stacks(proc.pid)
        for proc in procs:
            kill_tree(proc.pid)
            proc.wait()
    runs = []
    for cmd, proc, log in zip(cmds, procs, logs):
        log.seek(0)
        runs.append(Run(cmd, proc.returncode, log.read(), _output_dir(cmd)))
        log.close()
    if any(timed_out):
        tails = "\n".join(f"--- {' '.join(r.cmd[-6:])}\n{r.tail(200)}" for r in runs)
        raise AssertionError(f"timed out after {timeout}s (a hang?)\n{tails}")
    if check:
        for r in runs:
            r.check()
    return runs


def torchrun_background(
    args: list[str],
    nproc: int = 2,
    env: dict | None = None,
    log: Path | None = None,
    extra_launcher_args: list[str] = (),
) -> subprocess.Popen:
    """A torchrun launch the test signals or kills while it runs. The agent is proc.pid; torchrun starts each
    worker in a session of its own, so killpg(agent) would not reach them: signal `pgrep -P proc.pid`."""
    cmd = [
        str(BIN / "torchrun"),
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *extra_launcher_args,
        str(MAIN),
        *args,
    ]
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        cmd, cwd=REPO, env=env or test_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def cli_background(args: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """`python -m shardtrain <args>` that the test signals while it runs, in a process group of its own: a
    signal to the group is what a terminal's Ctrl-C sends."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "shardtrain", *args],
        cwd=REPO,
        env=env or test_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def deepspeed_launcher(
    args: list[str], nproc: int = 2, check: bool = True, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None
) -> Run:
    # Without --num_gpus the launcher counts NUMA nodes on a CPU machine and starts one process.
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), str(MAIN), *args]
    return run(cmd, timeout=timeout, env=env, check=check)


def cli(args: list[str], check: bool = True, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None) -> Run:
    """`python -m shardtrain <args>`: the console-script entry."""
    return run([sys.executable, "-m", "shardtrain", *args], timeout=timeout, env=env, check=check)


def predicted_metrics(run: Run, split: str = "validation") -> dict:
    """The metrics `shardtrain predict` printed (its `<split> metrics: {json}` line)."""
    line = next((x for x in run.output.splitlines() if x.startswith(f"{split} metrics: ")), None)
    assert line is not None, f"predict printed no {split} metrics:\n{run.tail()}"
    return json.loads(line.split(": ", 1)[1])


def strategy_variants() -> dict[str, list[str]]:
    """shardtrain parity's strategy-name -> flags map, with the short name the test tables print."""
    from shardtrain.commands.parity import STRATEGIES

    return {("fsdp_sgo" if name == "fsdp_shard_grad_op" else name): flags for name, flags in STRATEGIES.items()}


def tiny_args(workload: str, data_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    """Arguments for a tiny run. The startup memory prediction (seconds per launch) and the end-of-run
    report are off unless a test asks for them in `extra` (the last occurrence of a flag wins)."""
    config = {"multimodal": "configs/multimodal_tiny.yaml", "longformer": "configs/longformer_tiny.yaml"}[workload]
    return [
        "--config",
        str(REPO / config),
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(output_dir),
        "--resume",
        "none",
        "--predict-memory",
        "false",
        "--report",
        "false",
        *extra,
    ]
