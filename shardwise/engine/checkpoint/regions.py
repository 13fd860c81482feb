"""Which elements of each saved tensor a rank reads, and building a tensor from just those.

A rank needs, of a parameter's global tensor, its tensor-parallel slice and, where ZeRO
keeps only its flat shard of that (the parameters at stage 3, the optimizer state at every
stage), only the part of the slice inside the shard: ``wanted_boxes`` says which, as boxes
of the global tensor. A store (a checkpoint's records, safetensors files, a DCP directory)
reads the parts of its stored boxes that meet them (``assemble``), into a tensor of the
global shape whose other elements are NaN (for floats: if a cut downstream ever used an
element nobody read, the values would show it, and the tests compare bitwise). The cuts
that follow (``TensorSplit.local``, ``FlatSharding``) are the same as for whole tensors, so
a partial load lays out state exactly as ``step.init`` does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ..layout.state_layout import StateLayout
from .cut import Box, boxes, flat_start
from .errors import CheckpointError

# Reads the given pieces (boxes in a stored box's own coordinates) of one stored box.
ReadPieces = Callable[[list[Box]], list[torch.Tensor]]


def wanted_boxes(
    layout: StateLayout, mesh: Mesh | None, layer: str, name: str, *, shard: bool
) -> list[Box]:
    """The boxes of parameter ``(layer, name)``'s global tensor this rank reads: its
    tensor-parallel slice, cut to its ZeRO shard when ``shard`` (what it keeps at rest)."""
    spec = layout.leaves[(layer, name)]
    local = spec.local_shape
    start, stop = 0, math.prod(local)
    sharding = layout.sharding
    unit = None if sharding is None or not shard else sharding.units.get(layer)
    if unit is not None and name in unit.names:
        assert sharding is not None and mesh is not None
        i = unit.names.index(name)
        if tuple(unit.shapes[i]) == tuple(local):  # else read it whole: a superset is still right
            offset = sum(unit.numels[:i])
            dp = mesh.axis_index(sharding.axis)
            low, high = dp * unit.shard_numel, (dp + 1) * unit.shard_numel
            start, stop = max(low, offset) - offset, max(min(high, offset + stop), offset) - offset
    local_boxes = boxes(local, start, stop)
    if spec.split is None:
        return local_boxes
    assert mesh is not None
    index = mesh.axis_index(spec.split.axis)
    out: list[Box] = []
    for offsets, sizes in local_boxes:
        for at, piece in spec.split.to_global(
            offsets, torch.empty(sizes, device="meta"), index, spec.shape
        ):
            out.append((at, tuple(piece.shape)))
    return out


def whole(shape: Sequence[int]) -> list[Box]:
    return [((0,) * len(shape), tuple(shape))]


def intersect(a: Box, b: Box) -> Box | None:
    """The box both cover, or None."""
    lows = [max(x, y) for x, y in zip(a[0], b[0], strict=True)]
    highs = [min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True)]
    if any(h <= lo for lo, h in zip(lows, highs, strict=True)):
        return None
    return tuple(lows), tuple(h - lo for lo, h in zip(lows, highs, strict=True))


def runs(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """The contiguous runs (flat start, length) of a row-major tensor of ``shape`` that ``box``
    covers, in row-major order: their elements, one after another, are the box's, flattened."""
    offsets, sizes = box
    k = len(shape)
    while k > 0 and sizes[k - 1] == shape[k - 1]:
        k -= 1  # dims the box spans whole join into one run
    if k == 0:
        return [(0, math.prod(shape))] if math.prod(sizes) else []
    length = math.prod(sizes[k - 1 :])
    out = []
    for outer in itertools.product(
        *(range(o, o + s) for o, s in zip(offsets[: k - 1], sizes[: k - 1], strict=True))
    ):
        first = (*outer, offsets[k - 1], *(0,) * (len(shape) - k))
        out.append((flat_start(tuple(shape), first), length))
    return out


def poisoned(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor for a partial read: NaN where it can be (shows an element nobody read), else 0."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(tuple(shape), float("nan"), dtype=dtype)
    return torch.zeros(tuple(shape), dtype=dtype)


def assemble(
    where: str,
    key: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    wants: list[Box],
    stored: Iterable[tuple[Box, ReadPieces]],
) -> torch.Tensor:
    """Tensor ``key`` of ``shape`` with the elements of ``wants`` read from the ``stored`` boxes
    (each with how to read pieces of it) that meet them; refused unless they cover ``wants``."""
    out = poisoned(shape, dtype)
    covered = 0
    for (offsets, sizes), read in stored:
        if len(offsets) != len(shape) or any(
            o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)
        ):
            raise CheckpointError(
                f"{where}: a stored box {list(offsets)}+{list(sizes)} lies outside "
                f"{key} {list(shape)}"
            )
        found = [m for w in wants if (m := intersect((offsets, sizes), w)) is not None]
        if not found:
            continue
        pieces = [
            (tuple(a - o for a, o in zip(at, offsets, strict=True)), size) for at, size in found
        ]
        for (at, size), value in zip(found, read(pieces), strict=True):
            out[tuple(slice(a, a + s) for a, s in zip(at, size, strict=True))].copy_(
                value.reshape(size)
            )
            covered += math.prod(size)
    needed = sum(math.prod(s) for _, s in wants)
    if covered != needed:
        raise CheckpointError(
            f"{where}: its stored boxes hold {covered} of the {needed} elements of "
            f"{key} {list(shape)} "
            "this rank reads; a file or an index is missing boxes (or holds some twice)"
        )
    return out


def from_bytes(data: Any, dtype: torch.dtype) -> torch.Tensor:
    """Elements of ``dtype`` from raw little-endian bytes (a copy the tensor owns)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
