"""The records of a Weights & Biases offline run (`run-<id>.wandb`), read back for the tests of
spec.tracking.wandb. wandb 0.31 writes them from its Go core and ships no Python reader (its old `datastore` module
is gone, and `wandb sync` only uploads), so the framing is read here: the file header (":W&B", magic 0xBEE1,
version 0: 7 bytes), then LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte header: CRC-32C,
length, type FULL/FIRST/MIDDLE/LAST). Each record is decoded by wandb's own protobuf (wandb_internal_pb2.Record)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER, FILE_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    out, pending, pos = [], b"", FILE_HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def run(path: Path) -> dict[str, Any]:
    """One offline run: its id, project, config, and its history rows ({series: value}, in order)."""
    rows, run_id, project, config = [], None, None, {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id, project = r.run.run_id, r.run.project
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update if i.key != "_wandb"}
        elif kind == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return {"id": run_id, "project": project, "config": config, "history": rows}
