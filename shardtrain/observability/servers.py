"""The tracking servers `--report-to` names, checked before launch.

A client retries a server that does not answer for minutes, inside rank 0's start-up, after every process has
started and said nothing (measured: MLflow 4 min 10 s against a refused port, W&B with an API key and no network
91 s). One bounded request first, as runtime/hub.py does for the Hugging Face hub: no answer is one line now.
Only a server is probed: MLflow's file or database stores, and W&B offline or disabled, send nothing anywhere.
The servers are the ones the clients' own variables name (MLFLOW_TRACKING_URI, WANDB_BASE_URL).
"""

from __future__ import annotations

import configparser
import os
import threading
from pathlib import Path
from typing import Mapping

from shardtrain.config.settings import ConfigError, where

PROBE_SECONDS = 3.0
WANDB_DEFAULT_BASE = "https://api.wandb.ai"


def check_tracking_servers(report_to: list[str], env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    uri = env.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in report_to and uri.startswith(("http://", "https://")):
        why = probe(uri)
        if why:
            raise ConfigError(
                f"{where('report_to')} mlflow: MLFLOW_TRACKING_URI {uri} does not answer ({why}): start the server "
                f"or point MLFLOW_TRACKING_URI at one, or drop mlflow from --report-to to train without it"
            )
    if "mlflow" in report_to and uri and _mlflow_refuses_file_store(uri, env):
        raise ConfigError(
            f"{where('report_to')} mlflow: MLFLOW_TRACKING_URI {uri} is a file store, which MLflow 3 refuses unless "
            f"MLFLOW_ALLOW_FILE_STORE=true: set that, or point MLFLOW_TRACKING_URI at a tracking server, or "
            f"unset it for the run folder's own store (OUT/mlruns)"
        )
    if "wandb" in report_to and _wandb_online(env):
        base = env.get("WANDB_BASE_URL") or WANDB_DEFAULT_BASE
        why = probe(base)
        if why:
            raise ConfigError(
                f"{where('report_to')} wandb: {base} does not answer ({why}): WANDB_MODE=offline logs the run "
                f"here for `wandb sync` later, or drop wandb from --report-to"
            )


def _mlflow_refuses_file_store(uri: str, env: Mapping[str, str]) -> bool:
    """A `file:` URI or a plain path is MLflow's file store, which MLflow 3 refuses without MLFLOW_ALLOW_FILE_STORE
    (its tracking FileStore): the run trained on with `mlflow off` and one warning."""
    from urllib.parse import urlparse

    file_store = urlparse(uri).scheme in ("", "file")
    return file_store and env.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1")


def _wandb_online(env: Mapping[str, str]) -> bool:
    """Whether W&B would talk to its server: a key to talk with (without one it stops at once, saying so) and no
    offline or disabled mode, from WANDB_MODE or the settings file `wandb offline` writes."""
    if env.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes") or not env.get("WANDB_API_KEY"):
        return False
    mode = env.get("WANDB_MODE")
    if mode is None:
        config_dir = Path(env.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
        for settings in (Path("wandb") / "settings", config_dir / "settings"):  # the project's file first
            parser = configparser.ConfigParser()
            try:
                parser.read(settings)
            except configparser.Error:
                continue
            mode = parser.get("default", "mode", fallback=None)
            if mode:
                break
    return (mode or "online") not in ("offline", "disabled", "dryrun")


def probe(url: str, seconds: float = PROBE_SECONDS) -> str | None:
    """None if `url` answered at all within `seconds` (any HTTP status: a server is there), else why not. The
    clients' own library (requests), so the same proxies; in a daemon thread, as name resolution has no timeout
    of its own."""
    result: list[str] = []

    def ask():
        import requests

        try:
            requests.head(url, timeout=2 * seconds, allow_redirects=False)
            result.append("")
        except Exception as e:  # noqa: BLE001 - refused, unknown host, timeout, TLS: all "does not answer"
            text = str(e).strip()
            result.append(_reason(text) if text else type(e).__name__)

    thread = threading.Thread(target=ask, name="shardtrain-tracking-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    if not result:
        return f"no answer within {seconds:g} s"
    return result[0] or None


def _reason(text: str) -> str:
    """The cause inside requests' long message: `Connection refused`, `Name or service not known`, ..."""
    for known in ("Connection refused", "Name or service not known", "timed out", "No route to host"):
        if known in text:
            return known.lower() if known == "timed out" else known
    return text.splitlines()[0][:120]
