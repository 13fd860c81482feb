"""Which elements of each saved tensor a rank reads, and where in the rank's own tensors they go.

A rank needs, of a parameter's global tensor, its tensor-parallel slice and, where ZeRO
keeps only its flat shard of that (the parameters at stage 3, the optimizer state at every
stage), only the part of the slice inside the shard. ``placed_boxes`` says which, as boxes
of the global tensor, each with the view of the rank's destination (the parameter's slice,
or its unit's flat shard) that its elements go to; ``fill`` copies into those views the
parts of a store's stored boxes (a checkpoint's records, safetensors files, a DCP directory)
that meet them, so a load never builds a tensor the rank does not keep. The mapping is the
one a save cuts with (``TensorSplit.to_global``, the units' flat offsets), so a load lays out
state exactly as ``step.init`` does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from ..layout.state_layout import StateLayout
from .cut import Box, boxes, flat_start
from .errors import CheckpointError

# A box of a global tensor and the view (of the box's sizes) of a rank's tensor its elements go to.
Placed = tuple[Box, torch.Tensor]
# Copies the given pieces of one stored box (boxes in the stored box's own coordinates) into
# their views.
ReadInto = Callable[[list[Placed]], None]


def _kept_range(
    layout: StateLayout, coords: Mapping[str, int], layer: str, name: str, shard: bool
) -> tuple[int, int, int | None]:
    """``(start, stop, at)``: the elements ``[start, stop)`` of the flattened tensor-parallel
    slice of ``(layer, name)`` this rank keeps, and where ``start`` sits in its unit's flat
    shard when ``shard`` and ZeRO cuts it (else ``at`` is None: it keeps the whole slice)."""
    spec = layout.leaves[(layer, name)]
    local = spec.local_shape
    sharding = layout.sharding
    unit = None if sharding is None or not shard else sharding.units.get(layer)
    if unit is None or name not in unit.names:
        return 0, math.prod(local), None
    assert sharding is not None
    i = unit.names.index(name)
    if tuple(unit.shapes[i]) != tuple(local):
        raise CheckpointError(
            f"{layer}.{name}: its ZeRO unit holds it as {list(unit.shapes[i])}, its shard spec says "
            f"{list(local)}; the layout is inconsistent (a bug: please report it)"
        )
    offset = sum(unit.numels[:i])
    low = coords[sharding.axis] * unit.shard_numel
    start = min(max(low - offset, 0), math.prod(local))
    stop = max(min(low + unit.shard_numel - offset, math.prod(local)), start)
    return start, stop, offset + start - low


def placed_boxes(
    layout: StateLayout, coords: Mapping[str, int], layer: str, name: str, into: torch.Tensor, *, shard: bool
) -> list[Placed]:
    """The boxes of parameter ``(layer, name)``'s global tensor the rank at ``coords`` (its mesh
    coordinates, ``mesh.coords``) keeps, each with the view of ``into`` its elements go to: ``into``
    is the parameter's tensor-parallel slice (contiguous, of its local shape), or, when ``shard``
    and ZeRO cuts it, its unit's flat shard."""
    spec = layout.leaves[(layer, name)]
    local = spec.local_shape
    start, stop, at = _kept_range(layout, coords, layer, name, shard)
    flat = into.view(-1)
    base = -start if at is None else at - start  # a kept element's place in ``flat``, less its own
    out: list[Placed] = []
    index = None if spec.split is None else coords[spec.split.axis]
    for offsets, sizes in boxes(local, start, stop):
        first = base + flat_start(local, offsets)
        view = flat[first : first + math.prod(sizes)].view(sizes)
        if spec.split is None:
            out.append(((offsets, sizes), view))
            continue
        assert index is not None
        for moved, piece in spec.split.to_global(offsets, view, index, spec.shape):
            out.append(((moved, tuple(piece.shape)), piece))
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


def fill(
    where: str,
    key: str,
    shape: Sequence[int],
    placed: list[Placed],
    stored: Iterable[tuple[Box, ReadInto]],
) -> None:
    """Copy into each view of ``placed`` the elements of its box of tensor ``key`` (of ``shape``)
    from the ``stored`` boxes (each with how to read parts of it) that meet it; refused unless
    they cover every placed box exactly once."""
    covered = 0
    for (offsets, sizes), read_into in stored:
        if len(offsets) != len(shape) or any(
            o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)
        ):
            raise CheckpointError(
                f"{where}: a stored box {list(offsets)}+{list(sizes)} lies outside "
                f"{key} {list(shape)}"
            )
        pieces: list[Placed] = []
        for (box_at, _), view in placed:
            met = intersect((offsets, sizes), (box_at, tuple(view.shape)))
            if met is None:
                continue
            at, size = met
            part = view[tuple(slice(a - b, a - b + s) for a, b, s in zip(at, box_at, size, strict=True))]
            pieces.append(((tuple(a - o for a, o in zip(at, offsets, strict=True)), size), part))
            covered += math.prod(size)
        if pieces:
            read_into(pieces)
    needed = sum(math.prod(view.shape) for _, view in placed)
    if covered != needed:
        raise CheckpointError(
            f"{where}: its stored boxes hold {covered} of the {needed} elements of "
            f"{key} {list(shape)} "
            "this rank reads; a file or an index is missing boxes (or holds some twice)"
        )
