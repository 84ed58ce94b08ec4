"""tests/launch.py's run_plan: the plans of a pytest worker run in one serving launch of tests/dist/matrix_driver.py,
each with its own results and its own part of the output; a plan with a probe ends that launch, and the next
plan gets a new one. A plan with its own environment (fault injection, debug settings: read at a launch's start)
is never served: tests/dist/test_oom_points.py's and the kill tests' faults would not fire."""

from __future__ import annotations

from launch import DriverService, run_plan, tiny_args


def _plan(ld_data, root, name: str, *extra: str) -> list[dict]:
    args = tiny_args("longformer", ld_data, root / name, "--strategy", "ddp", "--max-steps", "1")
    return [{"name": name, "args": [*args, *extra]}]


def test_plans_share_one_launch_until_a_probe_ends_it(ld_data, tmp_path):
    first_root, second_root = tmp_path / "first", tmp_path / "second"
    first_root.mkdir()
    second_root.mkdir()
    first_run, first = run_plan(_plan(ld_data, first_root, "a"), first_root, timeout=300)
    service = DriverService.current()
    second_run, second = run_plan(_plan(ld_data, second_root, "b"), second_root, timeout=300)
    assert DriverService.current() is service and service.proc.poll() is None
    assert len(first["a"]["losses"]) == 1 and len(second["b"]["losses"]) == 1
    # each plan's output is its own part of the launch's
    assert "[matrix] a: ok" in first_run.output and "[matrix] b" not in first_run.output
    assert "[matrix] b: ok" in second_run.output and "[matrix] a" not in second_run.output

    probe_root = tmp_path / "probe"
    probe_root.mkdir()
    probe = _plan(ld_data, probe_root, "probe", "--strategy", "zero2", "--precision", "fp16")
    probe[0]["expect_error"] = True
    _, results = run_plan(probe, probe_root, timeout=300)
    assert "probe" in results
    assert service.proc.poll() == 0  # ended, cleanly: the process group is not trusted after a probe
    assert DriverService._current is None  # the next plan starts a new launch
