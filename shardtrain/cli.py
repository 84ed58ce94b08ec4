"""`python -m shardtrain <command>` and the `shardtrain` console script: parse the command name, dispatch.

Each command is a module in commands/ with `main(argv) -> int`, imported only when asked for, so that
`shardtrain doctor` never pays for importing DeepSpeed. This module owns the one error guard: a ConfigError
becomes one line on stderr and exit code 2, anything else one line and 1 (a traceback with --debug).
"""

from __future__ import annotations

import importlib
import os
import sys

from shardtrain.config.errors import with_where_raised
from shardtrain.config.settings import ConfigError

COMMANDS = {  # name: (module whose main(argv) runs it, help)
    "train": ("shardtrain.commands.train", "train a model (the same entry torchrun/deepspeed run)"),
    "make-data": ("shardtrain.commands.make_data", "write a small synthetic dataset"),
    "check-data": ("shardtrain.commands.check_data", "scan a dataset folder and list every problem"),
    "cache-images": ("shardtrain.commands.cache_images", "decode a dataset's images once, for --image-cache"),
    "plan": ("shardtrain.commands.plan", "predict per-GPU memory for every strategy"),
    "doctor": ("shardtrain.commands.doctor", "check GPUs, libraries and the launcher environment"),
    "export": ("shardtrain.commands.export", "write a consolidated safetensors model from a checkpoint"),
    "report": ("shardtrain.commands.report", "write OUT/report.html with plots"),
    "compare": ("shardtrain.commands.compare", "compare several runs in one table and plot"),
    "parity": ("shardtrain.commands.parity", "run the same steps under several strategies and compare"),
    "predict": ("shardtrain.commands.predict", "predict with a checkpoint or export; write preds.jsonl"),
}
# These take --verbose and quiet the libraries themselves; every other command never wants their chatter.
OWN_VERBOSITY = {"train", "export", "predict"}


def main(argv: list[str] | None = None) -> int:
    from shardtrain.runtime.closed_output import survive_closed_output

    survive_closed_output()  # `shardtrain --help | head` ends quietly; training goes on (see closed_output.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardtrain <command> [options]\n\ncommands:")
        for name, (module, help_text) in COMMANDS.items():
            if _available(module):
                print(f"  {name:<13}{help_text}")
        print("\nshardtrain <command> --help: its options; the guides: README.md and docs/ in the repository")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS or not _available(COMMANDS[name][0]):
        print(f"shardtrain: unknown command '{name}' (see shardtrain --help)", file=sys.stderr)
        return 2
    return run_command(name, rest)


def run_command(name: str, argv: list[str]) -> int:
    """Every command runs here (main.py's torchrun entry too): under the one error guard, and out of a process
    group the abort-free way."""
    from shardtrain.runtime.closed_output import survive_closed_output
    from shardtrain.runtime.startup_gc import defer_collections, restore_collections

    defer_collections()  # the imports ahead cost a fifth less (runtime/startup_gc.py); the loop restores them
    survive_closed_output()  # `shardtrain plan | head` ends quietly; training goes on (see closed_output.py)
    if name not in OWN_VERBOSITY:
        from shardtrain.runtime.chatter import quiet_libraries

        quiet_libraries(verbose=False)
    command = importlib.import_module(COMMANDS[name][0])
    try:
        code = run_guarded(command.main, argv)
    finally:
        restore_collections(freeze=False)  # where the command had no loop to do it (cli.main from Python)
    # Looked up, not imported: a config error must not pay seconds for importing torch just to exit.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from shardtrain.runtime.distributed import teardown_and_exit

        teardown_and_exit(code)  # see distributed.teardown_and_exit
    return code


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_guarded(fn, argv: list[str]) -> int:
    """One line for every failure: exit 2 for problems a user can fix (ConfigError), 1 for the rest
    (e.g. the FloatingPointError of --nan-policy abort); the traceback only with --debug."""
    debug = "--debug" in argv or os.environ.get("SHARDTRAIN_DEBUG") == "1"
    try:
        return fn(argv) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the user gets one line; --debug shows the rest
        if debug:
            raise
        if isinstance(e, ConfigError):
            report_once(str(e), secondary=False)
            return 2
        lost = _lost_peer(e)
        # Across hosts the raw gloo line ("Connection closed by peer") does not say which failure it was.
        if lost:
            from shardtrain.runtime.distributed import lost_peer_line  # torch: imported only on this path
        explained = lost_peer_line(e) if lost else None
        if explained and os.environ.get("LOCAL_RANK", "0") == "0":
            # Said at once by each node's first rank: a node's launcher that lost the store (or the link) stops
            # its workers within ~0.1 s, before a quiet wait would end; so one line per node, not per job.
            _say(f"shardtrain: error: {explained}")
            return 1
        report_once(explained or with_where_raised(e), secondary=lost)
        return 1


# How long a rank that is not the one to speak waits before it speaks anyway. torchrun (and the deepspeed
# launcher) stop every worker within ~0.1 s of the first failed one, so within this delay a rank is only
# still alive if it alone hit the error.
QUIET_SECONDS = 3.0


def report_once(msg: str, secondary: bool) -> None:
    """One line per failed job, not one per rank.

    Config and data errors, and the agreed --nan-policy abort, hit every rank at once: rank 0 says it and
    the launcher stops the others while they wait. An error that only one rank hit (a corrupt image in its
    shard) is still said, by that rank, after the wait. `secondary` errors (a collective failing because
    another rank died) are only ever consequences, so rank 0 waits before saying those too.
    """
    from shardtrain.runtime.launch import launch_rank, launcher_world_size

    # srun's tasks have no RANK until the loop maps SLURM_PROCID: each one took itself for rank 0 and said the
    # same config error, once per task.
    rank = launch_rank()
    preemption = sys.modules.get("shardtrain.runtime.preemption")  # looked up: nothing to import on this path
    if secondary and preemption is not None and preemption.stop_received():
        # A stop signal came first: the launcher stopping the job after another rank said its error (rank 0 was
        # still inside the collective, and its stop handler only set a flag), or a preemption. Not news.
        return
    if launcher_world_size() > 1 and (rank != 0 or secondary):
        import signal
        import time

        # The loop's preemption handler only sets a flag; the launcher's SIGTERM must end us here.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # A consequence waits twice as long: the rank whose error caused it (also waiting, if it is not rank 0)
        # speaks first and exits, and the launcher then stops this rank before it repeats the news.
        time.sleep(QUIET_SECONDS * (2 if secondary else 1))
    where_from = "" if rank == 0 else f" (rank {rank})"
    _say(f"shardtrain: error{where_from}: {msg}", over_other_ranks=rank == 0 and not secondary)


def _say(line: str, over_other_ranks: bool = False) -> None:
    """The one error line: on stderr, and under SageMaker as the job's FailureReason."""
    from shardtrain.config.sagemaker_env import write_failure_reason

    print(line, file=sys.stderr, flush=True)
    write_failure_reason(line, over_other_ranks=over_other_ranks)


def _lost_peer(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    text = str(e).lower()
    return bool(names & {"DistError", "DistBackendError", "DistNetworkError"}) or any(
        s in text
        for s in ("closed by peer", "connection reset", "broken pipe", "connection refused", "timed out waiting")
    )  # gloo's line when a peer or its link went silent


if __name__ == "__main__":
    sys.exit(main())
