"""A command's process ends without the interpreter's teardown (shardtrain/runtime/process_exit.py), and
loses nothing on the way: its exit code, its buffered output, later exit handlers, non-daemon threads."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import launch

REPO = launch.REPO
TEARDOWN = "[interpreter teardown]"

# First on PYTHONPATH: an object that lives until the interpreter clears the modules at its teardown.
SITECUSTOMIZE = """
import os


class _Teardown:
    def __del__(self, write=os.write):
        write(2, b"[interpreter teardown]\\n")


_alive_until_teardown = _Teardown()
"""


def run_python(args: list[str], tmp_path):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = launch.test_env()
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
    return launch.run([sys.executable, *args], timeout=120, env=env, check=False)


def console_script_target() -> str:
    """pyproject.toml's `shardtrain = "module:function"` script (tomllib is 3.11's; we allow 3.10)."""
    return re.search(r'^shardtrain = "([\w.]+:\w+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]


def test_every_entry_point_ends_without_the_teardown_and_keeps_its_exit_code(tmp_path):
    module, function = console_script_target().split(":")
    entry = f"importlib.import_module({module!r}).{function}()"
    console = "import importlib, sys; sys.argv = ['shardtrain', '--help']; " + entry
    for args, code, said in (
        (["-m", "shardtrain", "--help"], 0, "predict with a checkpoint"),
        (["-m", "shardtrain", "no-such-command"], 2, "shardtrain: unknown command 'no-such-command'"),
        ([str(REPO / "shardtrain" / "main.py"), "--no-such-flag"], 2, "unknown argument '--no-such-flag'"),
        (["-c", console], 0, "predict with a checkpoint"),
    ):
        run = run_python(args, tmp_path)
        assert (run.returncode, said in run.output, TEARDOWN in run.output) == (code, True, False), run.output


def test_what_the_process_still_does_at_its_end(tmp_path):
    script = textwrap.dedent(
        """
        import atexit, threading, time
        from shardtrain.runtime.process_exit import end_without_teardown_at_exit, exit_with

        end_without_teardown_at_exit()
        atexit.register(lambda: print("a later exit handler ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), print("the thread finished"))).start()
        print("buffered", end="")  # stdout is a pipe here: block-buffered, unflushed at exit_with
        exit_with(3)
        """
    )
    run = run_python(["-c", script], tmp_path)
    assert run.returncode == 3, run.output
    assert "buffered" in run.output and "the thread finished" in run.output and "a later exit handler ran" in run.output
    assert TEARDOWN not in run.output


def test_an_exception_leaves_by_pythons_own_exit(tmp_path):
    # exit_with never called: the traceback, exit 1 and the teardown, as without shardtrain.
    script = (
        "from shardtrain.runtime.process_exit import end_without_teardown_at_exit\n"
        "end_without_teardown_at_exit()\n"
        "raise RuntimeError('from the command')\n"
    )
    run = run_python(["-c", script], tmp_path)
    assert run.returncode == 1 and "RuntimeError: from the command" in run.output and TEARDOWN in run.output
