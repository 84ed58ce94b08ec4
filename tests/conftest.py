"""Session-wide fixtures: the synthetic datasets are made once and shared (read-only) by every test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hosts as namespace_hosts_module  # noqa: E402
import launch  # noqa: E402
from local_slurm import local_slurm  # noqa: E402,F401 - the session's Slurm cluster, stopped at its end


@pytest.fixture
def namespace_hosts():
    """`make(count=2)` builds network-namespace hosts node1..nodeN (tests/hosts.py); all are torn down when the
    test ends, pass or fail. Skipped where they cannot exist (not root, no `ip`), unless SHARDTRAIN_REQUIRE_NETNS=1
    (CI, which is root) makes that a failure: there the multi-node tests must run."""
    reason = namespace_hosts_module.unavailable()
    if reason:
        if os.environ.get("SHARDTRAIN_REQUIRE_NETNS") == "1":
            pytest.fail(f"SHARDTRAIN_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)
    built: list = []

    def make(count: int = 2):
        hosts = namespace_hosts_module.Hosts(count, tag=str(len(built)))
        built.append(hosts)
        return hosts.__enter__()

    try:
        yield make
    finally:
        for hosts in built:
            hosts.teardown()


@pytest.fixture(scope="session", autouse=True)
def driver_service():
    """This worker's serving launch of tests/dist/matrix_driver.py (tests/launch.py: DriverService), if a plan
    started one, ends with the session."""
    yield
    launch.DriverService.stop_current()


@pytest.fixture(scope="session", autouse=True)
def datasets_cache(tmp_path_factory) -> Path:
    """`datasets`' cache (the tokenised splits among it) in the session's temporary folder, not the user's home;
    launched runs inherit it through the environment."""
    path = tmp_path_factory.mktemp("hf_datasets_cache")
    os.environ["HF_DATASETS_CACHE"] = str(path)
    import datasets.config  # read the variable when first imported: maybe before this fixture ran

    datasets.config.HF_DATASETS_CACHE = path
    return path


@pytest.fixture(scope="session")
def mm_data(tmp_path_factory) -> Path:
    from shardtrain.data import make_data

    return make_data("multimodal", tmp_path_factory.mktemp("data") / "multimodal", n_train=256, n_val=64, seed=0)


@pytest.fixture(scope="session")
def ld_data(tmp_path_factory) -> Path:
    from shardtrain.data import make_data

    return make_data(
        "longdoc",
        tmp_path_factory.mktemp("data") / "longdoc",
        n_train=128,
        n_val=32,
        seed=0,
        min_words=60,
        max_words=300,
    )


@pytest.fixture(scope="session")
def data_dirs(mm_data, ld_data) -> dict:
    return {"multimodal": mm_data, "longformer": ld_data}


# `make test` runs the suite on two xdist workers, a test file at a time: a module's fixture (many runs in one
# launch) is then set up once, not once per worker. The files that build machine-wide things are one unit, run one
# test at a time on one worker: the network-namespace hosts (node1.. and their bridge), the local Slurm cluster
# (its daemons and /tmp/shardtrain-slurm), and tests/sm_compose.py's emulated SageMaker containers. (xdist's own
# `--dist loadgroup` would do this from marks, but with pytest 9 its groups are lost: it writes them into
# item._nodeid, which pytest no longer reads.)
MACHINE_WIDE_FILES = {
    f"tests/dist/{name}.py"
    for name in (
        "test_elastic",
        "test_hosts",
        "test_local_slurm_cluster",
        "test_multi_node",
        "test_sagemaker_container",
        "test_slurm",
        "test_slurm_multi_host",
        "test_slurm_teardown",
    )
}
MACHINE_WIDE_FIXTURES = {"namespace_hosts", "local_slurm"}


def _unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "machine_wide" if path in MACHINE_WIDE_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The first assignment comes right after the whole queue was built (xdist: by number of tests).
            if not self.ordered:
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: _expected_length(*unit))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return ByFile(config, log)


def _expected_length(unit: str, nodeids) -> tuple:
    """Longest units first, so that no worker is left with a long one at the end while the other idles: the
    machine-wide unit (eight files in series, about a third of a worker's time), then the files that launch
    processes, then the in-process unit tests; by number of tests within each. Simulated with the per-test times
    of five fresh-clone runs (SHARDTRAIN_TEST_CPU_LOG), this ends 10 to 50 s sooner than xdist's order by count."""
    kind = 0 if unit == "machine_wide" else 1 if unit.startswith("tests/dist/") else 2
    return kind, -len(nodeids)


def pytest_collection_modifyitems(items):
    for item in items:
        uses = MACHINE_WIDE_FIXTURES & set(getattr(item, "fixturenames", ()))
        if (uses or item.get_closest_marker("slurm")) and _unit_of(item.nodeid) != "machine_wide":
            raise pytest.UsageError(
                f"{item.nodeid} builds machine-wide things ({', '.join(uses) or 'slurm'}): add its file to "
                f"MACHINE_WIDE_FILES in tests/conftest.py"
            )


# SHARDTRAIN_TEST_CPU_LOG=FILE: one JSON line per test with its wall seconds and the CPU seconds it spent (its
# setup, a module fixture's included, and teardown), its own and that of every process it started and waited for
# (torchrun's ranks roll up into the launcher's): on a CPU-bound suite, the CPU is what a test costs the others.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("SHARDTRAIN_TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + launch.SERVED_CPU[0]

    start_cpu, start = cpu(), time.monotonic()
    yield
    line = {"test": item.nodeid, "wall_s": time.monotonic() - start, "cpu_s": cpu() - start_cpu}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
