"""The C column steps of the trainckpt metadata decoder (`native_columns.c`) decide exactly as
the Python steps do: the install built them; they take a real record whole; and crafted
records, seeded at random over every field of both record kinds and over the chunk table,
end in the same metadata (the same values, the same sharing of stored pieces) or the same
refusal, word for word, with them and without them."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from trainckpt import CorruptCheckpointError
from trainckpt.format import native_metadata
from trainckpt.format.native_metadata import _PREFIX, MAGIC, decode, encode


def _metadata(lazy: bool = False) -> Metadata:
    """Tensors of 1 and 3 chunks (and with `lazy` one of `LAZY_CHUNKS` + 1, which the C steps
    leave to Python), of 0 to 3 dimensions, and byte values, some stored at one place (as the
    writer stores equal hyperparameters)."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    at = 0
    tensors = [((4, 4), 1), ((6,), 3), ((), 1), ((2, 2, 2), 1)]
    if lazy:
        tensors.append(((65, 2), native_metadata.LAZY_CHUNKS + 1))
    for t, (shape, chunks) in enumerate(tensors):
        fqn = f"model.{t}.weight"
        rows = shape[0] // chunks if shape else 1
        pieces = []
        for c in range(chunks):
            offsets = torch.Size([c * rows, *[0] * (len(shape) - 1)] if shape else [])
            sizes = torch.Size([rows, *shape[1:]] if shape else [])
            pieces.append(ChunkStorageMetadata(offsets, sizes))
            storage[MetadataIndex(fqn, offsets, c)] = _StorageInfo(f"__{c % 2}_0.distcp", at, 64)
            at += 64
        dtype = (torch.float32, torch.bfloat16, torch.int64)[t % 3]
        props = TensorProperties(dtype=dtype, requires_grad=t == 1, pin_memory=t == 2)
        entries[fqn] = TensorStorageMetadata(props, torch.Size(shape), pieces)
    for v in range(12):
        fqn = f"optim.param_groups.{v}.lr"
        entries[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn, None, v if v % 2 else None)] = _StorageInfo(
            "__0_0.distcp", at + 16 * (v % 3), 16
        )
    return Metadata(entries, planner_data={k: (k,) for k in entries}, storage_data=storage)


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    head_len = int.from_bytes(data[len(MAGIC) : _PREFIX], "little")
    return json.loads(data[_PREFIX : _PREFIX + head_len]), data[_PREFIX + head_len :]


def _join(header: dict[str, Any], rest: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + len(head).to_bytes(8, "little") + head + rest


def _outcome(data: bytes) -> tuple[str, Any]:
    """What decoding `data` ends in: its metadata, as plain values (with which entries share a
    stored piece), or its refusal's message."""
    try:
        md = decode(data, "crafted")
    except CorruptCheckpointError as e:
        return "refused", str(e)
    pieces = getattr(md, "pieces", None) or {}
    distinct = {id(p): p for p in pieces.values()}.values()
    sharing = sorted(sorted(n for n in pieces if pieces[n] is p) for p in distinct)
    return "read", (md.state_dict_metadata, dict(md.storage_data.items()), pieces, sharing)


def _both(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    got = _outcome(data)
    with monkeypatch.context() as m:
        m.setattr(native_metadata, "compiled", None)
        assert _outcome(data) == got
    return got


def test_the_install_built_the_c_steps() -> None:
    """scripts/setup.sh builds them (a C compiler is on every machine CI runs on): without
    them every load would take the Python steps, correct but slower, and this would be a
    differential test of nothing."""
    assert native_metadata.compiled is not None, (
        "trainckpt.format.native_columns was not built: install a C compiler and Python's "
        "headers (Debian: gcc python3-dev), then rerun scripts/setup.sh"
    )


def test_the_c_steps_take_a_real_record_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of up to `LAZY_CHUNKS` chunks and byte values never reach the Python steps."""
    md = _metadata()
    md.planner_data = None
    data = encode(md)
    assert data is not None

    def not_here(*args: Any) -> bool:
        raise AssertionError("the Python column steps ran")

    monkeypatch.setattr(native_metadata, "_fast_tensors", not_here)
    monkeypatch.setattr(native_metadata, "_fast_byte_values", not_here)
    decoded = decode(data, "real")
    assert decoded == md and dict(decoded.storage_data.items()) == md.storage_data


@pytest.mark.parametrize("lazy", [False, True], ids=["few chunks", "a many-chunk tensor"])
def test_a_real_record_reads_alike(lazy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    md = _metadata(lazy)
    data = encode(md)
    assert data is not None
    kind, got = _both(data, monkeypatch)
    assert kind == "read"
    assert got[0] == md.state_dict_metadata and got[1] == md.storage_data


_ODD_VALUES: list[Any] = [
    True, False, -1, 2**63, 2**70, 1.5, "1", None, [], {}, [1], ["float32"], 3, 0, "float32",
    "no_such_dtype", [2**64], [-1], [True], [0] * 65, [[4]],
]  # fmt: skip


def _crafted(header: dict[str, Any], rest: bytes, rng: random.Random) -> bytes:
    """One field of one record (or a record's length, a repeated name, a number of the chunk
    table, or the table's length) changed at random."""
    header = json.loads(json.dumps(header))
    kind = rng.choice(("tensors", "bytes", "table", "longer"))
    if kind == "longer":  # more numbers than the records' chunks, or fewer
        ints, cut = header["ints"], 8 * header["ints"]
        header["ints"] = ints + rng.choice((-2, -1, 1, 2, 6))
        table = rest[:cut] + bytes(48)
        return _join(header, table[: 8 * header["ints"]] + rest[cut:])
    records = header[kind if kind != "table" else "tensors"]
    if kind == "table":
        table = bytearray(rest[: 8 * header["ints"]])
        at = rng.randrange(header["ints"])
        table[8 * at : 8 * at + 8] = rng.choice((0, 1, 2, 3, 64, 2**40)).to_bytes(8, "little")
        return _join(header, bytes(table) + rest[8 * header["ints"] :])
    rec = rng.choice(records)
    roll = rng.random()
    if roll < 0.1:
        rec.append(rng.choice(_ODD_VALUES))
    elif roll < 0.2:
        rec.pop(rng.randrange(len(rec)))
    elif roll < 0.3:
        rec[0] = rng.choice(records)[0]  # a name given twice (or its own)
    elif roll < 0.35:
        records[records.index(rec)] = tuple(rec) if rng.random() < 0.5 else {"0": rec[0]}
    else:
        rec[rng.randrange(len(rec))] = rng.choice(_ODD_VALUES)
    return _join(header, rest)


@pytest.mark.parametrize("lazy", [False, True], ids=["few chunks", "a many-chunk tensor"])
def test_crafted_records_end_alike(lazy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """400 seeded crafted records: the same metadata or the same refusal either way; both
    ends are reached many times, so that neither side is untested."""
    data = encode(_metadata(lazy))
    assert data is not None
    header, rest = _split(data)
    rng = random.Random(25)
    ends = {"read": 0, "refused": 0}
    for _ in range(400):
        kind, _ = _both(_crafted(header, rest, rng), monkeypatch)
        ends[kind] += 1
    assert ends["read"] >= 25 and ends["refused"] >= 200, ends


def test_an_unaligned_table_and_empty_columns_read_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table starts wherever the header ends (any byte), and a record may hold no tensor
    or no byte value."""
    md = _metadata()
    data = encode(md)
    assert data is not None
    header, rest = _split(data)
    for pad in range(8):  # JSON allows spaces after the header's object
        head = json.dumps(header, separators=(",", ":")).encode() + b" " * pad
        padded = MAGIC + len(head).to_bytes(8, "little") + head + rest
        assert _both(padded, monkeypatch)[0] == "read"
    empty = Metadata({}, planner_data={}, storage_data={})
    encoded = encode(empty)
    assert encoded is not None
    assert _both(encoded, monkeypatch) == ("read", ({}, {}, {}, []))
