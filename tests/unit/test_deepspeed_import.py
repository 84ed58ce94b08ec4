"""DeepSpeed is imported without the MLflow client its autotuner imports (shardtrain/strategies/deepspeed_import.py),
and a later `import mlflow` still works."""

from __future__ import annotations

import sys

import launch
import pytest

from shardtrain.strategies.deepspeed_import import import_deepspeed

# What deepspeed/autotuning/autotuner.py does at its top, in a package of the same name.
FAKE_DEEPSPEED = """
try:
    import mlflow
    has_mlflow = True
except Exception:
    has_mlflow = False
"""


@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    """A fake deepspeed and mlflow first on sys.path, neither imported; this process's own entries (the real
    libraries, where earlier tests imported them) are put back afterwards, and the fakes dropped."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text(FAKE_DEEPSPEED)
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {name: sys.modules.pop(name) for name in ("deepspeed", "mlflow") if name in sys.modules}
    yield
    for name in ("deepspeed", "mlflow"):
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def test_deepspeed_does_not_see_mlflow_and_mlflow_imports_afterwards(tmp_path, fake_deepspeed):
    ds = import_deepspeed()
    assert ds.has_mlflow is False and "mlflow" not in sys.modules
    import mlflow

    assert mlflow.__file__.startswith(str(tmp_path))
    assert import_deepspeed() is ds  # imported once


def test_an_mlflow_imported_before_is_left_as_it_is(fake_deepspeed):
    import mlflow

    assert import_deepspeed().has_mlflow is True and sys.modules["mlflow"] is mlflow


def test_the_pinned_deepspeed_imports_without_mlflow():
    """The real libraries, in a fresh process: nothing else in DeepSpeed needs the client at import."""
    code = (
        "import sys\n"
        "from shardtrain.strategies.deepspeed_import import import_deepspeed\n"
        "import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('imported:', autotuner.has_mlflow, 'mlflow' in sys.modules, end=' ')\n"
        "import mlflow\n"
        "print(hasattr(mlflow, 'start_run'))\n"
    )
    run = launch.run([sys.executable, "-c", code], timeout=120)  # exit 0, or the test fails with its output
    line = next((x for x in run.output.splitlines() if x.startswith("imported: ")), run.tail())
    assert line.split()[1:] == ["False", "False", "True"], line
