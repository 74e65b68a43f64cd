"""A stored file's size and CRC32C, the one checksum every layer uses: CRC32C in 8 lowercase hex
digits (what the manifest records), and GCS's base64 form of it."""

from __future__ import annotations

import base64
import functools
from pathlib import Path

import google_crc32c
from pydantic import BaseModel, ConfigDict, Field

_CHUNK = 8 * 1024 * 1024


class FileEntry(BaseModel):
    """Size and CRC32C (8 lowercase hex digits) of one file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    crc32c: str = Field(pattern=r"^[0-9a-f]{8}$")


def crc32c_bytes(data: bytes) -> str:
    """CRC32C of `data` as 8 lowercase hex digits."""
    return f"{google_crc32c.value(data):08x}"


def crc32c_file(path: str | Path) -> FileEntry:
    """Size and CRC32C of a local file, read in chunks."""
    crc = google_crc32c.Checksum()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
            size += len(chunk)
    return FileEntry(size=size, crc32c=crc.digest().hex())


def crc32c_from_gcs(b64: str) -> str:
    """GCS reports CRC32C as base64 of 4 big-endian bytes; convert to our hex form."""
    return base64.b64decode(b64).hex()


def crc32c_to_gcs(hex8: str) -> str:
    return base64.b64encode(bytes.fromhex(hex8)).decode()


_CRC32C_POLY = 0x82F63B78
"""The CRC32C polynomial, bit-reflected."""


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of A + B from CRC32C(A), CRC32C(B) and len(B) (zlib's `crc32_combine`: the
    register of A run through `len2` zero bytes, as GF(2) matrix powers, then B's CRC)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zero_bytes(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


@functools.cache
def _zero_bytes(k: int) -> tuple[int, ...]:
    """The GF(2) matrix (32 columns) that runs a CRC32C register through 2**k zero bytes."""
    if k > 0:
        return _square(_zero_bytes(k - 1))
    one_bit = (_CRC32C_POLY, *(1 << n for n in range(31)))
    return _square(_square(_square(one_bit)))


def _times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, column) for column in matrix)
