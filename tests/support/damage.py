"""Helpers for the integrity tests: damage a checkpoint on purpose, rewrite its manifest the way
an attacker would, and a pickle that would run a command if anything unpickled it unsafely."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import google_crc32c


class RunsCommand:
    """Unpickling this runs `touch <marker>`: a stand-in for any command a checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch '{self.marker}'",))


def shards(ckpt: Path) -> list[Path]:
    """The DCP shard files of a checkpoint, largest first."""
    return sorted((ckpt / "model_and_optim").glob("*.distcp"), key=lambda p: -p.stat().st_size)


def unshare(path: Path) -> None:
    """Give `path` a file of its own, so that damage to it stays in this one checkpoint: an
    incremental save hard-links unchanged files into the next checkpoint (docs/incremental.md)."""
    if path.stat().st_nlink > 1:
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte in the middle of `path` (the size stays the same)."""
    unshare(path)
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: int | None = None) -> None:
    unshare(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def drop_native_metadata(ckpt: Path) -> None:
    """Remove trainckpt's own metadata record (and its manifest entry), as a careful attacker
    who plants a `.metadata` does: loads then read `.metadata` through the safe unpickler."""
    rel = "model_and_optim/.metadata.trainckpt"
    (ckpt / rel).unlink()
    manifest = read_manifest(ckpt)
    manifest["files"].pop(rel)
    write_manifest(ckpt, manifest)


def split_item_record(shard: Path) -> tuple[bytes, dict]:
    """A shard file's items (DCP's bytes) and its trainckpt item record, parsed here by hand
    from the layout `format/shard_checksums.py` documents: {"file", "save_id", "items":
    [[offset, length, "crc32c in hex"], ...]}."""
    data = shard.read_bytes()
    assert data[-8:] == b"TCKPTIR2", f"{shard} has no item record"
    length = int.from_bytes(data[-16:-8], "little")
    body = data[-16 - length : -16]
    start = 4 + int.from_bytes(body[:4], "little")
    header = json.loads(body[4:start])
    n = header["items"]
    offsets, lengths, crcs = (
        struct.unpack_from(f"<{n}{code}", body, at)
        for code, at in (("Q", start), ("Q", start + 8 * n), ("I", start + 16 * n))
    )
    assert len(body) == start + 20 * n, f"{shard}: {len(body)} bytes for {n} items"
    items = [[o, k, f"{c:08x}"] for o, k, c in zip(offsets, lengths, crcs, strict=True)]
    return data[: -16 - length], dict(header, items=items)


def item_record(record: dict) -> bytes:
    """The bytes of an item record (`split_item_record`'s form), built here by hand."""
    items = record["items"]
    header = json.dumps(dict(record, items=len(items))).encode()
    body = b"".join(
        [
            len(header).to_bytes(4, "little"),
            header,
            struct.pack(f"<{len(items)}Q", *(o for o, _, _ in items)),
            struct.pack(f"<{len(items)}Q", *(n for _, n, _ in items)),
            struct.pack(f"<{len(items)}I", *(int(c, 16) for _, _, c in items)),
        ]
    )
    return body + len(body).to_bytes(8, "little") + b"TCKPTIR2"


def write_item_record(shard: Path, items: bytes, record: dict, spans: list[tuple[int, int]]):
    """Write `shard` as `items` plus an item record (name and save id from `record`) vouching
    for the bytes at `spans` (offset, length), as a careful attacker would."""
    record = dict(
        record, items=[[o, n, f"{google_crc32c.value(items[o : o + n]):08x}"] for o, n in spans]
    )
    shard.write_bytes(items + item_record(record))


def read_manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / ".manifest.json").read_text())


def write_manifest(ckpt: Path, manifest: dict) -> None:
    (ckpt / ".manifest.json").write_text(json.dumps(manifest))


def rerecord(ckpt: Path, rel: str) -> None:
    """Make the manifest agree with the current bytes of `rel`, as a careful attacker would."""
    data = (ckpt / rel).read_bytes()
    manifest = read_manifest(ckpt)
    manifest["files"][rel] = {"size": len(data), "crc32c": f"{google_crc32c.value(data):08x}"}
    write_manifest(ckpt, manifest)
