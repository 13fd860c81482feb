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
from typing import Protocol

import torch

from .cut import Box
from .errors import CheckpointError
from .regions import runs

CHUNK_BYTES = 1 << 16
READ_BYTES = 4 << 20  # the most one read holds (see ReadBuffer)
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


class SeekableReader(Protocol):
    """A file opened for binary reading (what a ranged read needs of it)."""

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class ReadBuffer:
    """The host memory one load reads through, reused from read to read: a load's memory is the
    tensors it fills plus one read (``READ_BYTES``, or one row of a box whose rows are larger)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def get(self, nbytes: int) -> memoryview:
        if len(self._data) < nbytes:
            self._data = bytearray(nbytes)  # a new one: views of the old may still be alive
        return memoryview(self._data)[:nbytes]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, stop)`` spans, sorted and joined where they meet or overlap."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def read_box_into(
    f: SeekableReader,
    where: str,
    data_at: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    pieces: list[tuple[Box, torch.Tensor]],
    crc32s: tuple[int, ...] | None,
    buffer: ReadBuffer,
) -> None:
    """Copy the ``pieces`` (boxes in a stored box of ``sizes``, each with the view it goes to) of
    the raw row-major box at byte ``data_at`` of ``f`` into their views. Only the bytes that hold
    them are read (with ``crc32s``, a crc32 per ``CHUNK_BYTES`` of the box: the whole chunks that
    hold them, each checked). A piece that is one contiguous run of the box going to a contiguous
    view (a flat shard's piece: the usual case) is read into the view itself; the others through
    ``buffer``, at most ``READ_BYTES`` of whole rows at a time, each copied into its view with
    one strided copy."""
    if not sizes:  # a 0-d tensor: one row of one element
        sizes = (1,)
        pieces = [(((0,), (1,)), view.reshape(1)) for _, view in pieces]
    itemsize = dtype.itemsize
    nbytes = math.prod(sizes) * itemsize
    if crc32s is not None and len(crc32s) != -(-nbytes // CHUNK_BYTES):
        raise CheckpointError(f"{where}: the index lists {len(crc32s)} chunk crc32s for {nbytes} bytes")
    strided, direct = [], []
    for box, view in pieces:
        spans = runs(sizes, box)
        if len(spans) == 1 and view.dtype == dtype and view.device.type == "cpu" and view.is_contiguous():
            (start, n), = spans
            direct.append((start * itemsize, (start + n) * itemsize, _bytes_of(view, 0, view.numel() * itemsize)))
        else:
            strided.append((box, view))
    for lo, hi, into in _joined(direct):
        _read_run(f, where, data_at, lo, hi, nbytes, into.numpy().data, crc32s, buffer)
    if strided:
        _read_rows(f, where, data_at, sizes, dtype, strided, crc32s, buffer)


def _joined(runs_: list[tuple[int, int, torch.Tensor]]) -> list[tuple[int, int, torch.Tensor]]:
    """Byte runs of a box with the bytes they go to, runs that follow each other in the box and
    in memory joined into one (the pieces of one flat shard in one record: their chunks at the
    seams are then read once)."""
    out: list[tuple[int, int, torch.Tensor]] = []
    for lo, hi, into in sorted(runs_, key=lambda r: r[0]):
        if out and out[-1][1] == lo and out[-1][2].data_ptr() + out[-1][2].numel() == into.data_ptr():
            first = out[-1][2]
            out[-1] = (out[-1][0], hi, _bytes_of(first, 0, first.numel() + into.numel()))
        else:
            out.append((lo, hi, into))
    return out


def _bytes_of(view: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[start, start + nbytes)`` from the first of a contiguous ``view``'s, as a 1-D uint8
    tensor on its storage (``Tensor.view(torch.uint8)`` refuses a size-1 dim of another stride)."""
    at = view.storage_offset() * view.element_size() + start
    return torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage(), at, (nbytes,), (1,))


def _read_run(
    f: SeekableReader, where: str, data_at: int, lo: int, hi: int, nbytes: int, into: memoryview,
    crc32s: tuple[int, ...] | None, buffer: ReadBuffer,
) -> None:
    """Bytes ``[lo, hi)`` of the box into ``into``: the whole chunks among them straight into it,
    the chunks at its two ends (read whole, for their crc32s) through ``buffer``."""
    if crc32s is None:
        _read_span(f, where, data_at, into, lo, lo, hi, None)
        return
    inner_lo = -(-lo // CHUNK_BYTES) * CHUNK_BYTES
    inner_hi = hi if hi == nbytes else hi // CHUNK_BYTES * CHUNK_BYTES
    if inner_lo >= inner_hi:  # within a chunk or two: read them whole
        inner_lo = inner_hi = hi
    if inner_lo < inner_hi:
        _read_span(f, where, data_at, into[inner_lo - lo : inner_hi - lo], inner_lo, inner_lo, inner_hi, crc32s)
    for a, b in ((lo, inner_lo), (inner_hi, hi)):  # the ends: parts of chunks
        if a < b:
            g_lo, g_hi = a // CHUNK_BYTES * CHUNK_BYTES, min(-(-b // CHUNK_BYTES) * CHUNK_BYTES, nbytes)
            block = buffer.get(g_hi - g_lo)
            _read_span(f, where, data_at, block, g_lo, g_lo, g_hi, crc32s)
            into[a - lo : b - lo] = block[a - g_lo : b - g_lo]


def _read_rows(
    f: SeekableReader,
    where: str,
    data_at: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    pieces: list[tuple[Box, torch.Tensor]],
    crc32s: tuple[int, ...] | None,
    buffer: ReadBuffer,
) -> None:
    """The pieces of the box through ``buffer``, in blocks of whole rows (dim 0) of at most
    ``READ_BYTES`` (or one row), each piece's part of a block copied into its view at once."""
    itemsize = dtype.itemsize
    row_bytes = math.prod(sizes[1:]) * itemsize
    nbytes = sizes[0] * row_bytes
    grain = 1 if crc32s is None else CHUNK_BYTES  # what is read: whole chunks where they are checked
    wanted = _merged([
        (s * itemsize // grain * grain, min(-(-(s + n) * itemsize // grain) * grain, nbytes))
        for box, _ in pieces
        for s, n in runs(sizes, box)
    ])
    rows_per_read = max(1, READ_BYTES // max(row_bytes, 1))
    next_wanted = 0  # the reads go forward through the box: the spans before it are done
    for first_row, end_row in _merged([(box[0][0], box[0][0] + box[1][0]) for box, _ in pieces]):
        for r0 in range(first_row, end_row, rows_per_read):
            r1 = min(r0 + rows_per_read, end_row)
            lo, hi = r0 * row_bytes, r1 * row_bytes
            g_lo, g_hi = lo // grain * grain, min(-(-hi // grain) * grain, nbytes)
            block = buffer.get(g_hi - g_lo)
            while next_wanted < len(wanted) and wanted[next_wanted][1] <= g_lo:
                next_wanted += 1
            for a, b in wanted[next_wanted:]:
                if a >= g_hi:
                    break
                _read_span(f, where, data_at, block, g_lo, max(a, g_lo), min(b, g_hi), crc32s)
            rows = torch.frombuffer(block, dtype=torch.uint8)[lo - g_lo : hi - g_lo]
            rows = rows.view(dtype).view(r1 - r0, *sizes[1:])
            for (at, size), view in pieces:
                q0, q1 = max(at[0], r0), min(at[0] + size[0], r1)
                if q0 < q1:
                    inner = tuple(slice(o, o + s) for o, s in zip(at[1:], size[1:], strict=True))
                    view[q0 - at[0] : q1 - at[0]].copy_(rows[(slice(q0 - r0, q1 - r0), *inner)])


def _read_span(
    f: SeekableReader, where: str, data_at: int, block: memoryview, g_lo: int, a: int, b: int,
    crc32s: tuple[int, ...] | None,
) -> None:
    """Bytes ``[a, b)`` of the box into ``block`` (which starts at byte ``g_lo`` of it), each
    whole chunk checked against its crc32 where ``crc32s`` are given."""
    f.seek(data_at + a)
    if f.readinto(block[a - g_lo : b - g_lo]) != b - a:
        raise CheckpointError(
            f"{where}: bytes {a}..{b} of the record's data are past the end of the file: it is "
            "truncated (their chunk's crc32 does not match)"
        )
    if crc32s is None:
        return
    for c in range(a // CHUNK_BYTES, -(-b // CHUNK_BYTES)):
        start = c * CHUNK_BYTES - g_lo
        if zlib.crc32(block[start : min(start + CHUNK_BYTES, b - g_lo)]) != crc32s[c]:
            raise CheckpointError(
                f"{where}: bytes {c * CHUNK_BYTES}.. of the record's data are truncated "
                "or corrupt (their chunk's crc32 does not match)"
            )
