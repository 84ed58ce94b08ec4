"""The tracking servers --report-to names, checked before launch: a server that does not answer was minutes of
the client's own retries after every process had started (MLflow: 4 min 10 s against a refused port; W&B with
an API key and no network: 91 s), with nothing said until then."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from shardtrain.config.settings import ConfigError
from shardtrain.observability.servers import check_tracking_servers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


@pytest.fixture
def answering_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_mlflow_server_that_does_not_answer_is_one_line_in_seconds(answering_server):
    uri = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_tracking_servers(["mlflow"], {"MLFLOW_TRACKING_URI": uri})
    assert time.monotonic() - start < 5
    line = str(e.value)
    assert line.startswith(f"--report-to (log.report_to) mlflow: MLFLOW_TRACKING_URI {uri} does not answer (")
    assert "drop mlflow from --report-to" in line and "\n" not in line
    check_tracking_servers(["mlflow"], {"MLFLOW_TRACKING_URI": answering_server})  # answers: nothing to say
    allowed = {"MLFLOW_TRACKING_URI": "file:///tmp/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}
    check_tracking_servers(["mlflow"], allowed)  # a store, not a server
    check_tracking_servers(["mlflow"], {})  # unset: a file store in the run folder


def test_a_file_store_mlflow_3_refuses_is_one_line_before_launch():
    """MLFLOW_TRACKING_URI=file:... without MLFLOW_ALLOW_FILE_STORE passed --check-only, then the run trained with
    MLflow off and one warning: MLflow 3 refuses its file store unless that is set."""
    for uri in ("file:///tmp/mlruns", "/tmp/mlruns", "mlruns"):
        with pytest.raises(ConfigError) as e:
            check_tracking_servers(["mlflow"], {"MLFLOW_TRACKING_URI": uri})
        assert str(e.value) == (
            f"--report-to (log.report_to) mlflow: MLFLOW_TRACKING_URI {uri} is a file store, which MLflow 3 "
            "refuses unless MLFLOW_ALLOW_FILE_STORE=true: set that, or point MLFLOW_TRACKING_URI at a tracking "
            "server, or unset it for the run folder's own store (OUT/mlruns)"
        )
        check_tracking_servers(["mlflow"], {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "1"})
        check_tracking_servers(["tensorboard"], {"MLFLOW_TRACKING_URI": uri})
    check_tracking_servers(["mlflow"], {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"})


def test_wandb_online_with_no_answer_says_how_to_log_offline(answering_server):
    base = f"http://127.0.0.1:{closed_port()}"
    online = {"WANDB_MODE": "online", "WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": base}
    with pytest.raises(ConfigError, match=rf"wandb: {base} does not answer \(.*\): WANDB_MODE=offline logs"):
        check_tracking_servers(["wandb"], online)
    check_tracking_servers(["wandb"], {**online, "WANDB_BASE_URL": answering_server})
    for quiet in ({"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}, {"WANDB_DISABLED": "true"}):
        check_tracking_servers(["wandb"], {**online, **quiet})  # nothing leaves the machine: no probe
    check_tracking_servers(["tensorboard"], online)


def test_train_refuses_before_any_process_starts(tmp_path, capsys, monkeypatch):
    from shardtrain import cli
    from shardtrain.commands import train

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    from shardtrain.data import make_data

    data = make_data("longdoc", tmp_path / "ld", n_train=16, n_val=4, min_words=5, max_words=9)  # a batch of 8 per rank
    out = tmp_path / "run"
    tiny = ["--config", "configs/longformer_tiny.yaml", "--data-dir", str(data), "--nproc", "2"]
    argv = [*tiny, "--report-to", "mlflow", "--output-dir", str(out)]
    assert cli.run_guarded(train.main, argv) == 2
    captured = capsys.readouterr()
    assert "does not answer" in captured.err and "starting 2 processes" not in captured.out and not out.exists()
