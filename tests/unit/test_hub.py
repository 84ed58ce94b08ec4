"""The pre-launch check of hub names (shardtrain/runtime/hub.py) against endpoints on 127.0.0.1 only: a port that
refuses, a socket that listens and never answers, and a tiny HTTP server. Never the real hub."""

import http.server
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from shardtrain.config.settings import ConfigError, parse_cli
from shardtrain.runtime import hub

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """Online mode with an empty cache; huggingface_hub read both at import, so its constants are patched."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # restored after the test, like the constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def at(endpoint: str):
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)

    return at


@pytest.fixture
def refused():
    with socket.socket() as s:  # bound, not listening: connecting is refused at once
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def silent():
    with socket.socket() as s:  # the kernel completes the handshake; nobody ever reads or answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def config(tmp_path, *flags):
    return parse_cli(
        ["--config", str(REPO / "configs/multimodal_tiny.yaml"), "--output-dir", str(tmp_path / "o"), *flags]
    )


def cache(tmp_path, repo_id: str) -> None:
    """The layout huggingface_hub writes: refs/main -> snapshots/<commit>/config.json."""
    folder = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("a" * 40)
    (folder / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (folder / "snapshots" / ("a" * 40) / "config.json").write_text("{}")


def test_refused_hub_names_the_model_and_its_flag(tmp_path, hub_env, refused):
    hub_env(refused)
    cfg = config(tmp_path, "--pretrained", "true", "--text-model", "some-org/some-model")
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        hub.check_hub_names(cfg)
    assert time.monotonic() - start < 2.0
    # The tokenizer defaults to the model's: the line names the flag the user set, --text-model.
    assert str(e.value).startswith(
        f"--text-model (model.text_model) some-org/some-model: the Hugging Face hub {refused} is unreachable ("
    )
    assert "not in the local cache" in str(e.value) and "--tokenizer" not in str(e.value)


def test_silent_hub_is_given_up_on_in_bounded_time(tmp_path, hub_env, silent):
    hub_env(silent)
    cfg = config(tmp_path, "--pretrained", "true", "--text-model", "some-org/some-model")
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"unreachable \(no answer within {hub.PROBE_SECONDS:g} s\)"):
        hub.check_hub_names(cfg)
    assert time.monotonic() - start < hub.PROBE_SECONDS + 1.5


def test_a_hub_tokenizer_is_named_by_its_own_flag(tmp_path, hub_env, refused):
    hub_env(refused)
    cfg = config(tmp_path, "--tokenizer", "some-org/some-tokenizer")  # random-init model, hub tokenizer
    with pytest.raises(ConfigError, match=r"^--tokenizer \(data.tokenizer\) some-org/some-tokenizer: "):
        hub.check_hub_names(cfg)


def test_cached_names_go_offline_by_themselves(tmp_path, hub_env, refused):
    hub_env(refused)
    cache(tmp_path, "some-org/some-model")
    cfg = config(tmp_path, "--pretrained", "true", "--text-model", "some-org/some-model")
    note = hub.check_hub_names(cfg)
    assert note.startswith(f"the Hugging Face hub {refused} is unreachable (") and note.endswith(
        "some-org/some-model is in the local cache: running offline (HF_HUB_OFFLINE=1)"
    )
    # This process (huggingface_hub's constant) and the workers it launches (the environment).
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"


def test_offline_looks_at_the_cache_only(tmp_path, hub_env, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "probe", lambda *a, **k: pytest.fail("probed the hub in offline mode"))
    cfg = config(tmp_path, "--pretrained", "true", "--text-model", "some-org/some-model")
    with pytest.raises(
        ConfigError,
        match=r"^--text-model \(model.text_model\) some-org/some-model: not in the local "
        r"Hugging Face cache .* HF_HUB_OFFLINE=1 forbids downloading it",
    ):
        hub.check_hub_names(cfg)
    cache(tmp_path, "some-org/some-model")
    assert hub.check_hub_names(cfg) is None


def test_an_answering_hub_lets_the_run_download(tmp_path, hub_env):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - any answer means the hub is there
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub_env(f"http://127.0.0.1:{server.server_port}")
        cfg = config(tmp_path, "--pretrained", "true", "--text-model", "some-org/some-model")
        assert hub.check_hub_names(cfg) is None
        assert "HF_HUB_OFFLINE" not in os.environ and not constants.HF_HUB_OFFLINE
    finally:
        server.shutdown()
        server.server_close()


def test_local_folders_and_random_init_need_no_hub(tmp_path):
    assert hub.hub_names(config(tmp_path)) == {}  # the tiny config: random init, tokenizer trained locally
    cfg = config(tmp_path, "--pretrained", "true", "--text-model", str(tmp_path))
    assert hub.hub_names(cfg) == {}


def test_offline_error_says_how_to_train_with_nothing_downloaded(tmp_path, hub_env, monkeypatch):
    """A new user offline is told the way that needs no download, not only "download it"."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = config(tmp_path, "--pretrained", "true", "--text-model", "some-org/some-model")
    with pytest.raises(ConfigError) as e:
        hub.check_hub_names(cfg)
    assert str(e.value).endswith(
        "; or train without downloading: --pretrained false (the same architecture, randomly "
        "initialised, with a tokenizer trained on your data), or --config "
        "configs/multimodal_tiny.yaml"
    ), str(e.value)
