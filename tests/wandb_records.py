"""Read a W&B offline run file (run-*.wandb) with W&B's own protobuf schema.

wandb 0.31 no longer ships its Python datastore reader; the container is still LevelDB's log format
(32 KiB blocks of crc32 / length / type-framed chunks) after a 7-byte ':W&B' header.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # a block tail too short for a chunk header is zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:
            break


def read_run(path: Path) -> dict:
    """{'run_id', 'run' {project, entity, run_group, display_name, notes, tags}, 'config' {key: value},
    'history' [ {name: value} ], 'artifacts' [ {name, type, aliases} ], 'kinds' {record type: count}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = {"run_id": None, "run": {}, "config": {}, "history": [], "artifacts": [], "kinds": {}}
    for payload in _payloads(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        out["kinds"][kind] = out["kinds"].get(kind, 0) + 1
        if kind == "run":
            out["run_id"] = rec.run.run_id
            out["run"] = {
                "project": rec.run.project,
                "entity": rec.run.entity,
                "run_group": rec.run.run_group,
                "display_name": rec.run.display_name,
                "notes": rec.run.notes,
                "tags": list(rec.run.tags),
            }
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "artifact":
            out["artifacts"].append(
                {
                    "name": rec.artifact.name,
                    "type": rec.artifact.type,
                    "aliases": list(rec.artifact.aliases),
                    "files": sorted(e.path for e in rec.artifact.manifest.contents),
                }
            )
        elif kind == "history":
            out["history"].append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            )
    return out
