"""Reading part of a saved record, with the part's bytes checked.

A record is one box saved by ``torch.save`` (so DCP's reader reads it): a zip archive
whose tensor data is stored uncompressed, as raw row-major bytes, at a fixed place in it.
The save notes that place (``data_offset``, from the zip's own header) and a crc32 of every
``CHUNK_BYTES`` of the raw data. A load reads, of each record, only the chunks that hold
the elements it needs, checks each chunk against its crc32, and never parses the archive.

Why per-chunk crc32s rather than the record's one crc32 alone: that one covers the whole
record, so checking it means reading the whole record, which is what a rank that holds a
quarter of it must not do. A chunk of 64 KiB bounds what a read adds for checking (under a
chunk at each end of each contiguous range), and keeps the index small (4 bytes of crc per
64 KiB of data). The record's crc32 is still written: a record saved without chunk crc32s
(before them) is read whole and checked against it.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from .cut import Box
from .errors import CheckpointError
from .regions import from_bytes, runs

CHUNK_BYTES = 1 << 16
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header


@dataclass(frozen=True)
class RawData:
    """Where a record's raw tensor bytes are in it, and their chunks' crc32s."""

    offset: int
    crc32s: tuple[int, ...]


def contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as torch.save should store it for ranged reads: row-major, owning exactly its
    elements (a view would save its whole storage)."""
    if (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and (tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
    ):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def raw_data(record: memoryview, tensor: torch.Tensor) -> RawData | None:
    """Where ``torch.save(tensor)``'s bytes ``record`` hold the tensor's raw data (None for an
    empty tensor: nothing to read). Refused if they do not hold it as the raw bytes: then this
    torch writes another format, and a ranged read would be wrong."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return None
    with zipfile.ZipFile(io.BytesIO(record)) as archive:
        members = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    if (
        len(members) != 1
        or members[0].compress_type != zipfile.ZIP_STORED
        or members[0].file_size != nbytes
    ):
        raise CheckpointError(
            f"torch.save wrote a record this shardwise cannot read in part ({members}); "
            "save with the torch version this shardwise supports"
        )
    header = _LOCAL_HEADER.unpack_from(record, members[0].header_offset)
    start = members[0].header_offset + _LOCAL_HEADER.size + header[9] + header[10]
    raw = record[start : start + nbytes]
    if raw != tensor.reshape(-1).view(torch.uint8).numpy().tobytes():
        raise CheckpointError(
            "torch.save's record does not hold the tensor's raw bytes where its zip "
            "header says; save with the torch version this shardwise supports"
        )
    crcs = tuple(zlib.crc32(raw[i : i + CHUNK_BYTES]) for i in range(0, nbytes, CHUNK_BYTES))
    return RawData(start, crcs)


def read_pieces(
    f: BinaryIO,
    where: str,
    offset: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    raw: RawData,
    pieces: list[Box],
) -> list[torch.Tensor]:
    """The ``pieces`` (boxes in the record's box of ``sizes``) of the record at byte ``offset``
    of ``f``, reading only the chunks that hold them, each checked against its crc32."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(sizes) * itemsize
    if len(raw.crc32s) != -(-nbytes // CHUNK_BYTES):
        raise CheckpointError(
            f"{where}: the index lists {len(raw.crc32s)} chunk crc32s for {nbytes} bytes"
        )
    per_piece = [runs(sizes, piece) for piece in pieces]
    chunks = sorted(
        {
            c
            for rs in per_piece
            for s, n in rs
            for c in range(s * itemsize // CHUNK_BYTES, -(-(s + n) * itemsize // CHUNK_BYTES))
        }
    )
    data: dict[int, bytes] = {}
    for first, last in _spans(chunks):
        f.seek(offset + raw.offset + first * CHUNK_BYTES)
        block = f.read(min((last + 1) * CHUNK_BYTES, nbytes) - first * CHUNK_BYTES)
        for c in range(first, last + 1):
            chunk = block[(c - first) * CHUNK_BYTES : (c - first + 1) * CHUNK_BYTES]
            if (
                len(chunk) != min(CHUNK_BYTES, nbytes - c * CHUNK_BYTES)
                or zlib.crc32(chunk) != raw.crc32s[c]
            ):
                raise CheckpointError(
                    f"{where}: bytes {c * CHUNK_BYTES}.. of the record's data are truncated "
                    "or corrupt (their chunk's crc32 does not match)"
                )
            data[c] = chunk
    return [
        from_bytes(b"".join(_run_bytes(data, s * itemsize, n * itemsize) for s, n in rs), dtype)
        for rs in per_piece
    ]


def _spans(chunks: list[int]) -> list[tuple[int, int]]:
    """Sorted chunk numbers as (first, last) runs of consecutive ones: one read each."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        if out and out[-1][1] == c - 1:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out


def _run_bytes(data: dict[int, bytes], start: int, length: int) -> Any:
    parts = []
    while length:
        c, at = divmod(start, CHUNK_BYTES)
        take = min(length, CHUNK_BYTES - at)
        parts.append(data[c][at : at + take])
        start, length = start + take, length - take
    return b"".join(parts)
