"""Ranged reads of a stored box into a rank's tensors, against plain slicing of the whole box.

The chunk and read sizes are made small (64 and 256 bytes) so that small boxes cross many
chunks and several reads: runs that start and end inside chunks, pieces read straight into a
contiguous view and pieces copied through the buffer into strided views, in row blocks.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.engine.checkpoint import record_io
from shardwise.engine.checkpoint.errors import CheckpointError

CHUNK, READ = 64, 256
PREFIX = 13  # the box's data starts at an odd byte of its file, as in a record


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_io, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(record_io, "READ_BYTES", READ)


def _stored(path: Path, box: torch.Tensor) -> tuple[int, ...]:
    raw = box.reshape(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(b"x" * PREFIX + raw)
    return tuple(zlib.crc32(raw[i : i + CHUNK]) for i in range(0, len(raw), CHUNK))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], tuple[int, ...], bool]]]:
    sizes = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int16]))
    pieces = []
    for _ in range(draw(st.integers(1, 3))):
        at = tuple(draw(st.integers(0, n - 1)) for n in sizes)
        size = tuple(draw(st.integers(1, n - a)) for a, n in zip(at, sizes, strict=True))
        pieces.append((at, size, draw(st.booleans())))  # into a contiguous tensor, or a strided view
    return sizes, dtype, pieces


@settings(max_examples=60, deadline=None)
@given(case=_cases())
def test_pieces_read_into_views_equal_slices_of_the_whole_box(
    case: tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], tuple[int, ...], bool]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    sizes, dtype, drawn = case
    whole = torch.arange(math.prod(sizes), dtype=torch.float64).reshape(sizes).to(dtype)
    path = tmp_path_factory.mktemp("box") / "data"
    crcs = _stored(path, whole)
    pieces, wanted = [], []
    for at, size, contiguous in drawn:
        if contiguous:
            view = torch.full(size, -1, dtype=dtype)
        else:  # every other element of a larger tensor's last dim: a strided view
            view = torch.full((*size[:-1], 2 * size[-1]), -1, dtype=dtype)[..., ::2]
        pieces.append(((at, size), view))
        wanted.append(whole[tuple(slice(a, a + s) for a, s in zip(at, size, strict=True))])
    for crc32s in (crcs, None):  # checked (a checkpoint's records) and not (safetensors)
        for _, view in pieces:
            view.fill_(-1)
        with open(path, "rb") as f:
            record_io.read_box_into(f, "box", PREFIX, sizes, dtype, pieces, crc32s, record_io.ReadBuffer())
        for (_, view), want in zip(pieces, wanted, strict=True):
            assert torch.equal(view, want)


def test_a_corrupt_byte_in_a_chunk_a_piece_only_touches_is_refused(tmp_path: Path) -> None:
    whole = torch.arange(64, dtype=torch.float32)  # 256 bytes: four chunks
    path = tmp_path / "data"
    crcs = _stored(path, whole)
    raw = bytearray(path.read_bytes())
    raw[PREFIX + CHUNK + 1] ^= 0xFF  # in chunk 1, before the piece's first element (byte 80)
    path.write_bytes(bytes(raw))
    into = torch.empty(10)
    with open(path, "rb") as f, pytest.raises(CheckpointError, match=r"bytes 64\.\. .*crc32 does not match"):
        record_io.read_box_into(f, "box", PREFIX, (64,), torch.float32, [(((20,), (10,)), into)], crcs,
                                record_io.ReadBuffer())
    with open(path, "rb") as f:  # a piece outside that chunk reads on
        record_io.read_box_into(f, "box", PREFIX, (64,), torch.float32, [(((40,), (10,)), into)], crcs,
                                record_io.ReadBuffer())
    assert torch.equal(into, whole[40:50])


def test_a_file_that_ends_before_the_box_is_refused_as_truncated(tmp_path: Path) -> None:
    whole = torch.arange(64, dtype=torch.float32)
    path = tmp_path / "data"
    crcs = _stored(path, whole)
    path.write_bytes(path.read_bytes()[:-8])
    with open(path, "rb") as f, pytest.raises(CheckpointError, match="truncated"):
        record_io.read_box_into(f, "box", PREFIX, (64,), torch.float32, [(((0,), (64,)), torch.empty(64))], crcs,
                                record_io.ReadBuffer())
