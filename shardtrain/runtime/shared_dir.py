"""The output dir must be one folder that every host sees.

Across hosts, `--output-dir runs/x` is a path on each host. If it is not on a shared filesystem, rank 0 writes
checkpoints that the other hosts never see: their --resume auto finds nothing, and a resume mixes steps. So at
start-up rank 0 writes a marker holding a fresh nonce, every rank reads it back, and a rank that cannot is named
(with its host) in one ConfigError on every rank, before any model or data work. The marker is removed again.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch.distributed as dist

from shardtrain.config.settings import ConfigError, where
from shardtrain.runtime.distributed import broadcast_object

# A shared filesystem can show another host's new file late (NFS caches a "no such file" answer for a few
# seconds): a rank that does not see the marker looks again for this long before it counts as not seeing it.
VISIBLE_WITHIN_S = 5.0


def _sees(marker: Path, nonce: str) -> bool:
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while True:
        try:
            if marker.read_text() == nonce:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        try:
            list(marker.parent.iterdir())  # a directory read refreshes an NFS client's cached listing
        except OSError:
            pass
        time.sleep(0.2)


def require_shared_output_dir(out: Path, rank: int, hosts: list[str]) -> None:
    """Every rank: raise one ConfigError line naming --output-dir and the hosts that cannot see rank 0's marker.
    `hosts`: each rank's host, by rank (the gathered rank table's). A no-op for a single process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    nonce, failed = (secrets.token_hex(16), None) if rank == 0 else (None, None)
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / f".shardtrain-shared-{nonce}").write_text(nonce)
        except OSError as e:  # said on every rank: the others would otherwise wait for a marker never written
            failed = f"{where('output_dir')} {out}: rank 0 on {hosts[0]} cannot write there: {e.strerror or e}"
    nonce, failed = broadcast_object((nonce, failed))  # after the write: every rank looks for rank 0's file
    if failed:
        raise ConfigError(failed)
    marker = out / f".shardtrain-shared-{nonce}"
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, _sees(marker, nonce))  # also the point after which rank 0 may remove it
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = sorted({hosts[r] for r, ok in enumerate(seen) if not ok})
    if blind:
        ranks = [r for r, ok in enumerate(seen) if not ok]
        raise ConfigError(
            f"{where('output_dir')} {out} is not shared: {', '.join(blind)} (rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}) cannot see the file rank "
            f"0 wrote there on {hosts[0]}; every host must see the same folder (a shared filesystem "
            f"such as NFS or Lustre mounted at the same path)"
        )
