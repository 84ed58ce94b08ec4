"""Hugging Face hub names, checked before launch.

A model or tokenizer given by hub name needs the hub or the local HF cache. Unchecked, an unreachable hub cost
~52 s of huggingface_hub retries (measured, connection refused) inside the tokenizer load, whose error then named
--tokenizer even when the user had only set --text-model. So one bounded probe of the endpoint first:
answered -> carry on; unreachable with every name cached -> offline by itself (HF_HUB_OFFLINE=1, inherited by
the launched workers); unreachable otherwise -> one line naming the model and its flag.
HF_HUB_OFFLINE and HF_ENDPOINT are the user's: offline means no probe, only the cache is looked at.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from shardtrain.config.settings import Config, ConfigError, hub_fields, where, without_download

# DNS, connect and the answer together. The hub answers a HEAD in well under a second; a proxy or a
# firewall that drops packets never does.
PROBE_SECONDS = 3.0


def hub_names(cfg: Config, fields: tuple[str, ...] | None = None) -> dict[str, str]:
    """repo id -> the config field that names it (the first one, so a tokenizer defaulted from the model
    is blamed on the model's flag). Local folders and what is never loaded (random init) are left out.
    `fields`: only these of the config's hub names (config/settings.py hub_fields)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    wanted = hub_fields(cfg)
    names: dict[str, str] = {}
    for field in wanted if fields is None else fields:
        name = wanted[field]
        if not name or Path(name).is_dir() or name in names:
            continue
        try:
            validate_repo_id(name)
        except HFValidationError:
            continue  # not a hub name at all: the loader's own error says why
        names[name] = field
    return names


def in_local_cache(repo_id: str) -> bool:
    """A snapshot of the main revision holds the file every load reads first."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in ("config.json", "tokenizer_config.json"))


def probe(url: str, seconds: float = PROBE_SECONDS) -> str | None:
    """None if the endpoint answered within `seconds`, else why not. Runs in a daemon thread because name
    resolution has no timeout of its own; a thread still waiting is abandoned (it holds nothing)."""
    from huggingface_hub.utils import get_session

    result: list[str | None] = []

    def ask():
        try:
            # huggingface_hub's own client: the same proxies and certificates as the downloads it stands for.
            # Its timeout is longer than the join below, so that the join alone bounds the wait: with equal
            # ones, a loaded machine raced the two and a silent hub was reported as "timed out".
            status = get_session().head(url, timeout=2 * seconds, follow_redirects=False).status_code
            # 5xx is what huggingface_hub retries with back-off: as good as no answer for a run about to start.
            result.append(f"it answered HTTP {status}" if status >= 500 else None)
        except Exception as e:  # noqa: BLE001 - connection refused, unknown host, timeout, TLS: all "unreachable"
            result.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)

    thread = threading.Thread(target=ask, name="shardtrain-hub-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else f"no answer within {seconds:g} s"


def check_hub_names(cfg: Config, fields: tuple[str, ...] | None = None) -> str | None:
    """Raise a ConfigError now rather than retry for a minute; returns a line to print when the run goes
    offline by itself, else None."""
    names = hub_names(cfg, fields)
    if not names:
        return None
    from huggingface_hub import constants

    missing = [n for n in names if not in_local_cache(n)]
    if constants.HF_HUB_OFFLINE:
        if missing:
            name = missing[0]
            raise ConfigError(
                f"{where(names[name])} {name}: not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids downloading it; download it "
                f"once with network (HF_HUB_OFFLINE=0) or give a local folder{without_download(cfg, names[name])}"
            )
        return None
    first = next(iter(names))
    why = probe(f"{constants.ENDPOINT}/{first}/resolve/main/config.json")  # the first file a load asks for
    if why is None:
        return None
    if missing:
        name = missing[0]
        raise ConfigError(
            f"{where(names[name])} {name}: the Hugging Face hub {constants.ENDPOINT} is unreachable "
            f"({why}) and {name} is not in the local cache ({constants.HF_HUB_CACHE}); download it "
            f"where there is network, or give a local folder{without_download(cfg, names[name])}"
        )
    # Every name is cached: go offline, in this process (huggingface_hub read the variable at import) and in
    # the workers launched from it.
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    return (
        f"the Hugging Face hub {constants.ENDPOINT} is unreachable ({why}); {', '.join(names)} "
        f"{'is' if len(names) == 1 else 'are'} in the local cache: running offline (HF_HUB_OFFLINE=1)"
    )
